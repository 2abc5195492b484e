"""The python programs the checks run at the place, and what their answers say.

`PROBE` (doctor's python check): the version, torch and CUDA, and the trainer's modules (its
argv) that cannot be found. `VERSION_PROBE` (deploy's preflight, inside its one command): the
version and the missing modules only, nothing imported, exit 3 on a Python older than
`MIN_PYTHON` and `MISSING` when a module is missing; `version_probe(count_gpus=True)` also
counts the place's GPUs, for a job of `[job] gpus = 0` (`probed_devices` reads them back).
"""

from __future__ import annotations

import json

from dflash_ops.commands import gpus

# Run by the job's python: reports its version, the modules of argv it cannot find, torch and
# CUDA as one JSON line.
PROBE = """\
import json, platform, sys
from importlib.util import find_spec
info = {"python": platform.python_version(), "executable": sys.executable}
info["missing"] = [m for m in sys.argv[1:] if find_spec(m) is None]
try:
    import torch
except Exception as exc:
    info["torch_error"] = f"{type(exc).__name__}: {exc}"
else:
    info["torch"] = torch.__version__
    info["cuda_build"] = torch.version.cuda
    try:
        info["cuda"] = bool(torch.cuda.is_available())
        info["gpus"] = torch.cuda.device_count() if info["cuda"] else 0
        info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(info["gpus"])]
    except Exception as exc:
        info["cuda"], info["gpus"] = False, 0
        info["cuda_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(info))
"""


MIN_PYTHON = (3, 11)
MISSING = 4  # the cheap probe: a module of the trainer's is missing
# The cheap probe: the version and the trainer's modules (argv) that cannot be found, nothing
# imported; it exits 3 on a Python older than MIN_PYTHON and 4 when a module is missing, so that
# `dflash deploy`'s one command stops there before touching anything.
_VERSION = (
    "import json, platform, sys\n"
    "from importlib.util import find_spec\n"
    "missing = [m for m in sys.argv[1:] if find_spec(m) is None]\n"
    'found = {"python": platform.python_version(), "executable": sys.executable, '
    '"missing": missing}\n'
)
_ANSWER = (
    "print(json.dumps(found))\n"
    f"sys.exit(3 if sys.version_info < {MIN_PYTHON} else {MISSING} if missing else 0)\n"
)
VERSION_PROBE = _VERSION + _ANSWER
# Between them, for a job of `[job] gpus = 0`: the place's NVIDIA GPUs (nvidia-smi on the job's
# PATH, and their device files) for deploy's idle-GPU warning; any failure leaves them out, so
# that an old or broken python is still judged by its version.
_COUNT_GPUS = f"""\
try:
    import os, re, shutil, subprocess
    devices = len([d for d in os.listdir("/dev") if re.match("nvidia[0-9]+$", d)])
    smi = shutil.which("nvidia-smi")
    if smi:
        listed = subprocess.run(
            [smi] + {list(gpus.SMI_ARGV[1:])!r}, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, universal_newlines=True, timeout={gpus.TIMEOUT_S:g},
        ).stdout
        devices = max(devices, len([line for line in listed.splitlines() if line.strip()]))
    found["devices"] = devices
except Exception:
    pass
"""


def version_probe(*, count_gpus: bool = False) -> str:
    """`VERSION_PROBE`; with `count_gpus`, its answer also holds the place's GPUs."""
    return _VERSION + _COUNT_GPUS + _ANSWER if count_gpus else VERSION_PROBE


def probed_devices(answer: str | None) -> int:
    """The GPU device files the version probe counted (`python` fact: "STATUS {json}")."""
    try:
        found = json.loads((answer or "").partition(" ")[2])
    except ValueError:
        return 0
    devices = found.get("devices") if isinstance(found, dict) else None
    return devices if isinstance(devices, int) else 0
