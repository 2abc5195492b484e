"""`dflash checkpoints prune`: which archived runs go and why, decided before anything is deleted.

1. List `archive/` at the place: the runs, sized with `du`; any other entry is only reported.
2. Ask the trainer at the place which folders hold a verified checkpoint: `checkpoints.VERIFY`,
   run by the job's python in the current release with the `[job] env`, over the live folder and
   every run, in one command (it reads each folder's newest checkpoint and checks its sha256, as
   a resume does).
3. `checkpoints.choose` gives each run its verdict (the CLI shows them all and asks).
4. `client.delete_runs`: one deletion per doomed run, each proven at the place to be a run.
"""

from __future__ import annotations

from dflash_ops.commands.workspace import Workspace
from dflash_ops.errors import CheckpointsUnverified
from dflash_ops.remote import client
from dflash_ops.remote.checkpoints import (
    VERIFY,
    PrunePlan,
    PruneReport,
    Run,
    choose,
    parse_verified,
)
from dflash_ops.remote.launch import in_release

VERIFY_TIMEOUT = 1800.0  # each folder's newest state.pt is read whole for its checksum


def plan(ws: Workspace, *, keep: int) -> PrunePlan:
    """Every archived run with its verdict for `--keep keep` (nothing changes at the place)."""
    checkpoints = ws.checkpoints()
    entries, skipped = checkpoints.archived()
    if not entries:
        return PrunePlan(verdicts=[], live=None, skipped=skipped)
    paths = {entry.name: checkpoints.run_path(entry.name) for entry in entries}
    verified = newest_verified(ws, [checkpoints.path, *paths.values()])
    runs = [Run(stamp=e.name, size=e.size, checkpoint=verified[paths[e.name]]) for e in entries]
    live = verified[checkpoints.path]
    return PrunePlan(verdicts=choose(runs, keep=keep, live=live), live=live, skipped=skipped)


def newest_verified(ws: Workspace, folders: list[str]) -> dict[str, str | None]:
    """{folder: its newest verified checkpoint, or None}, as the trainer of the current release
    finds it at the place."""
    ws.releases().require_current()  # ReleaseError: "Deploy first"
    argv = in_release(
        f"{ws.target.root}/current",
        ws.config.job.env,
        [ws.target.python, "-c", VERIFY, *folders],
        name="dflash-verify",
    )
    result = ws.place.run(argv, check=False, timeout=VERIFY_TIMEOUT)
    found = parse_verified(result.stdout_text)
    if result.exit_code != 0 or not set(folders) <= set(found):
        said = (result.stderr_text.strip().splitlines() or ["no error output"])[-1]
        raise CheckpointsUnverified(
            f"Could not verify the checkpoints at {ws.target.describe()} with "
            f"{ws.target.python} in the current release (exit {result.exit_code}): {said}"
        )
    return found


def execute(ws: Workspace, chosen: PrunePlan) -> PruneReport:
    """Delete the doomed runs of `chosen`, each proven at the place to be an archived run."""
    return client.delete_runs(ws.checkpoints(), [run.stamp for run in chosen.doomed])
