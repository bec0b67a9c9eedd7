"""Where replicated items are saved (uc_checkpoint.dcp.planner) and how a rank's items are cut into
files (serialize.file_queue): small items end up together, on the lowest rank holding them."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from uc_checkpoint import UCSavePlanner
from uc_checkpoint.dcp.compat import _StoragePrefix
from uc_checkpoint.dcp.planner import SMALL_ITEM_BYTES, is_small, place_replicated
from uc_checkpoint.dcp.serialize import file_queue


def _plan(state: dict) -> SavePlan:
    return create_default_local_save_plan(state, is_coordinator=False)


def _names(plan: SavePlan) -> set[str]:
    return {item.index.fqn for item in plan.items}


def test_small_replicated_items_go_to_the_lowest_rank_large_ones_are_balanced() -> None:
    # Four ranks holding the same state (DDP-like): a step, tiny scalars, and large weights.
    state = {
        "step": 7,
        **{f"opt.{i}.step": torch.tensor(float(i)) for i in range(20)},
        **{f"w{i}": torch.zeros(1 << 16) for i in range(8)},  # 256 KiB each: large
    }
    plans = [_plan(state) for _ in range(4)]
    placed = place_replicated(plans)
    small = {n for n in _names(plans[0]) if n == "step" or n.startswith("opt.")}
    assert _names(placed[0]) >= small  # every small item on rank 0
    assert all(not (_names(p) & small) for p in placed[1:])
    large_per_rank = [len(_names(p) - small) for p in placed]
    assert large_per_rank == [2, 2, 2, 2]  # the large ones spread evenly
    assert set().union(*map(_names, placed)) == _names(plans[0])  # each item kept exactly once
    assert sum(len(p.items) for p in placed) == len(plans[0].items)

    # DCP's own rule scatters the small items over the ranks (what made loads read every rank's files).
    dcp_placed = DefaultSavePlanner()._dedup_save_plans(plans)
    assert sum(1 for p in dcp_placed if _names(p) & small) > 1


def test_items_held_by_one_rank_stay_there() -> None:
    plans = [_plan({f"r{r}.w": torch.zeros(4), f"r{r}.big": torch.zeros(1 << 16)}) for r in range(3)]
    placed = place_replicated(plans)
    assert [_names(p) for p in placed] == [_names(p) for p in plans]


def test_the_planner_hook_exists_in_this_torch() -> None:
    # UCSavePlanner overrides DefaultSavePlanner._dedup_save_plans (a private method): a torch that
    # renames it would silently fall back to DCP's placement, so fail here instead.
    assert "_dedup_save_plans" in vars(DefaultSavePlanner)
    assert UCSavePlanner._dedup_save_plans is not DefaultSavePlanner._dedup_save_plans


def test_a_ranks_small_items_share_one_file_of_their_own(tmp_path: Path) -> None:
    state = {
        "step": 3,
        "extra": io.BytesIO(b"x" * 100),
        **{f"s{i}": torch.zeros(16) for i in range(30)},
        **{f"w{i}": torch.zeros(1 << 20) for i in range(6)},  # 4 MiB each
    }
    plan = dataclasses.replace(_plan(state), storage_data=_StoragePrefix("__0_tok_"))
    jobs = file_queue(plan, tmp_path, file_size_bytes=8 << 20, threads=1)
    files = [jobs.get_nowait() for _ in range(jobs.qsize())]
    first_items = files[0][2]
    assert all(is_small(i) for i in first_items) and len(first_items) == 32  # step, extra, 30 scalars
    assert all(not is_small(i) for _p, _n, items in files[1:] for i in items)
    assert len(files) == 1 + 3  # the small file, and 24 MiB of tensors in files of ~8 MiB
    assert files[0][1] == "__0_tok_0.distcp"
    assert any(i.type == WriteItemType.BYTE_IO for i in first_items)
    assert SMALL_ITEM_BYTES >= 16 * 4


def test_dcps_lowest_rank_rule_still_applies_when_asked_for() -> None:
    state = {"step": 1, **{f"w{i}": torch.zeros(1 << 16) for i in range(4)}}
    plans = [_plan(state) for _ in range(2)]
    everything_on_0 = UCSavePlanner(dedup_save_to_lowest_rank=True)._dedup_save_plans(plans)
    assert _names(everything_on_0[0]) == _names(plans[0]) and not everything_on_0[1].items
    balanced = UCSavePlanner()._dedup_save_plans(plans)
    assert "step" in _names(balanced[0]) and len(_names(balanced[1])) == 2  # two of the four weights
