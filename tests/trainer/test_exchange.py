"""The pieces of the split that need no processes: roles from the torchrun environment, the
batch ↔ data-position mapping, and the payload packing (a round trip loses nothing)."""

from __future__ import annotations

import pytest
import torch

from trainer.data.dataset import DataPosition
from trainer.run.target_worker import Features
from trainer.split.exchange import Header, header_for, pack_ints, payload, unpack
from trainer.split.roles import DistributedSetupError, roles_from_env
from trainer.split.segments import batch_index, position_of


def test_roles_targets_first() -> None:
    assert roles_from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert roles_from_env({}) is None
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "5", "DFLASH_TARGET_GPUS": "5"}
    r = roles_from_env(env)
    assert (r.role, r.index, r.num_drafters) == ("drafter", 0, 3)
    assert r.target_ranks == [0, 1, 2, 3, 4] and r.drafter_ranks == [5, 6, 7]
    assert r.describe() == "rank 5 (drafter 0 of 3)" and r.describe(4) == "rank 4 (target 4 of 5)"
    r = roles_from_env({"WORLD_SIZE": "3", "RANK": "0"})  # no model given: ⌊W/2⌋ targets
    assert (r.role, r.num_targets) == ("target", 1)
    for bad in ("0", "3", "x"):
        with pytest.raises(DistributedSetupError, match="DFLASH_TARGET_GPUS"):
            roles_from_env({"WORLD_SIZE": "3", "RANK": "0", "DFLASH_TARGET_GPUS": bad})


@pytest.mark.parametrize("per_epoch,bsz", [(5, 4), (1, 2), (7, 1)])
def test_batch_index_and_position_are_inverse(per_epoch: int, bsz: int) -> None:
    for g in range(40):
        pos = position_of(g, per_epoch=per_epoch, batch_size=bsz)
        assert pos.index + bsz <= per_epoch * bsz
        assert batch_index(pos, per_epoch=per_epoch, batch_size=bsz) == g
    # a colocated stream that just drew the last batch of an epoch sits at (e, per_epoch·bsz)
    end = DataPosition(2, per_epoch * bsz)
    assert batch_index(end, per_epoch=per_epoch, batch_size=bsz) == 3 * per_epoch


@pytest.mark.parametrize("has_last", [True, False])
def test_payload_round_trip(has_last: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    b, s, n, k, h = 2, 12, 3, 4, 5
    f = Features(
        hidden=torch.randn(b, s, 3 * h, generator=gen),
        last_hidden=torch.randn(b, s, h, generator=gen),
        input_ids=torch.randint(0, 100, (b, s), generator=gen),
        anchors=torch.randint(0, s, (b, n), generator=gen),
        valid=torch.rand(b, n, generator=gen) > 0.3,
        labels=torch.randint(-100, 100, (b, n, k), generator=gen),
        num_tokens=17,
    )
    head = Header.decode(header_for(f, target=1, seq=4, index=9, has_last=has_last).encode())
    tensors = payload(f, has_last=has_last)
    assert len(tensors) == (3 if has_last else 2)
    assert pack_ints(f).numel() == head.ints_numel
    g = unpack(head, tensors[0], tensors[1] if has_last else None, tensors[-1])
    for name in ("hidden", "input_ids", "anchors", "valid", "labels"):
        assert torch.equal(getattr(g, name), getattr(f, name)), name
    assert g.valid.dtype == torch.bool and g.num_tokens == 17
    if has_last:
        assert torch.equal(g.last_hidden, f.last_hidden)
    assert (head.target, head.seq, head.index, head.dtype) == (1, 4, 9, "float32")
