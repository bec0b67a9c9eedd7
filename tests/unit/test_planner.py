"""Where replicated items are saved (uc_checkpoint.dcp.planner) and how a rank's items are cut into
files (serialize.file_queue): small items end up together, on the lowest rank holding them."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from uc_checkpoint import UCSavePlanner, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.compat import _StoragePrefix
from uc_checkpoint.dcp.options import ReaderOptions
from uc_checkpoint.dcp.planner import SMALL_ITEM_BYTES, is_small, place_replicated
from uc_checkpoint.dcp.serialize import file_queue
from uc_checkpoint.format.integrity import VERIFY_BLOCK_SIZE


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


def _step_scalars_and_weights(fill: float | None = None) -> dict:
    """A step and replicated scalars (small) beside 8 MiB of weights (large): one file's worth."""

    def value(x: float) -> float:
        return x if fill is None else fill

    return {
        "step": 9 if fill is None else -1,
        **{f"opt.s{i}": torch.tensor(value(float(i))) for i in range(20)},
        **{f"model.w{j}": torch.full((1 << 20,), value(float(j))) for j in range(2)},  # 4 MiB each
    }


def test_small_items_get_their_own_file_even_when_the_share_fits_in_one(tmp_path: Path) -> None:
    plan = dataclasses.replace(_plan(_step_scalars_and_weights()), storage_data=_StoragePrefix("__0_tok_"))
    # The automatic file size for an 8 MiB share is 16 MiB: everything would fit in one file.
    jobs = file_queue(plan, tmp_path, file_size_bytes=None, threads=1)
    files = [jobs.get_nowait() for _ in range(jobs.qsize())]
    assert [name for _p, name, _items in files] == ["__0_tok_0.distcp", "__0_tok_1.distcp"]
    assert all(is_small(i) for i in files[0][2]) and len(files[0][2]) == 21  # step and 20 scalars
    assert all(not is_small(i) for i in files[1][2]) and len(files[1][2]) == 2
    # Every serialising thread still gets a file of large items.
    jobs = file_queue(plan, tmp_path, file_size_bytes=None, threads=2)
    assert jobs.qsize() == 1 + 2


@pytest.mark.parametrize("prefetch_files", [False, True])
def test_loading_only_the_small_items_reads_less_than_one_checksum_block(
    tmp_path: Path, staging: Path, prefetch_files: bool
) -> None:
    """What every rank but the lowest does at a load: read the replicated small items saved beside
    a large share that fits in one file. In that file they cost a whole 4 MiB checksum block (ranged
    reads) or the whole file (whole-file reads); in their own file, that small file only."""
    dest = tmp_path / "ckpt"
    dcp.save(_step_scalars_and_weights(), storage_writer=UCVolumeWriter(dest), planner=UCSavePlanner())
    sizes = {p.name: p.stat().st_size for p in dest.glob("*.distcp")}
    (small_file,) = [name for name in sizes if name.endswith("_0.distcp")]
    assert len(sizes) == 2 and sizes[small_file] < VERIFY_BLOCK_SIZE, sizes
    assert max(sizes.values()) > 2 * VERIFY_BLOCK_SIZE, sizes

    # No weights: those are another rank's own share.
    back = {k: v for k, v in _step_scalars_and_weights(fill=0.0).items() if not k.startswith("model.")}
    reader = UCVolumeReader(dest, options=ReaderOptions(prefetch_files=prefetch_files))
    dcp.load(back, storage_reader=reader)
    want = _step_scalars_and_weights()
    assert back["step"] == want["step"]
    assert all(torch.equal(back[k], want[k]) for k in back if k.startswith("opt."))
    record = reader.last_record
    assert record is not None and record.files == 1
    assert record.bytes <= sizes[small_file], (record, sizes)  # under one block (checked above)
