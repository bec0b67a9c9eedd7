"""Where replicated items are saved, so that a load's requests grow with the ranks, not their square.

DCP's ``DefaultSavePlanner`` deduplicates an item every rank holds (a replicated value: the step, an
optimizer's per-parameter ``step`` scalars, DDP's weights) onto the rank whose plan is smallest so
far, which balances bytes but scatters the many tiny items over every rank's files. Every rank needs
all of them back, so a load of W ranks read a few bytes from every other rank's files: W(W-1) GETs
(80 at 8 ranks for 16 data files; ~10^6 at 1,000 ranks), each widened to a 4 MiB checksum block
(docs/benchmarks-scale.md). :class:`UCSavePlanner` keeps DCP's balancing for large items and puts
byte items and tensors of at most :data:`SMALL_ITEM_BYTES` on the lowest rank that holds them, where
the writer keeps a rank's small items together in one small file
(:func:`uc_checkpoint.dcp.serialize.file_queue`): a load then reads them with one GET per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

#: Byte items, and tensor items up to this many bytes, count as small: saved by the lowest rank
#: holding them (replicated ones) and kept in one file of their own by the writer.
SMALL_ITEM_BYTES = 64 << 10


def item_bytes(item: Any) -> int:
    """Bytes of the part of a tensor item this rank writes (its chunk, not the global tensor);
    0 for a byte item, whose size is unknown before it is pickled. (DCP's ``_item_size`` measures
    the global tensor, which made each rank believe its share was W times larger and cut it into
    W times more files.)"""
    data = item.tensor_data
    if data is None:
        return 0
    n = 1
    for d in data.chunk.sizes:
        n *= d
    return n * data.properties.dtype.itemsize


def is_small(item: Any) -> bool:
    """A byte item, or a tensor item of at most :data:`SMALL_ITEM_BYTES`."""
    return item.type == WriteItemType.BYTE_IO or item_bytes(item) <= SMALL_ITEM_BYTES


def place_replicated(plans: Sequence[SavePlan]) -> list[SavePlan]:
    """Every item kept by exactly one of ``plans`` (one per rank, in rank order): a small item
    (:func:`is_small`) by the lowest rank holding it, a large one by the rank holding it whose
    kept bytes are fewest so far (DCP's ``dedup_save_plans`` rule for every item). Plans are not
    modified; new ones are returned in the same order.
    """
    holders: dict[Any, list[int]] = {}
    items: dict[Any, Any] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            items[item.index] = item
    kept_bytes = [0] * len(plans)
    owner: dict[Any, int] = {}
    for index, ranks in holders.items():
        item = items[index]
        if len(ranks) == 1:
            chosen = ranks[0]
        elif is_small(item):
            chosen = min(ranks)
        else:
            chosen = min(ranks, key=lambda r: kept_bytes[r])
        owner[index] = chosen
        kept_bytes[chosen] += item_bytes(item) or 1
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if owner[item.index] == rank])
        for rank, plan in enumerate(plans)
    ]


class UCSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` with :func:`place_replicated` in place of its deduplication.

    Use it as ``dcp.save(sd, storage_writer=UCVolumeWriter(path), planner=UCSavePlanner())``;
    :class:`~uc_checkpoint.CheckpointManager` does. Checkpoints are DCP's format either way; only
    which rank writes each replicated item changes. Constructor arguments are
    ``DefaultSavePlanner``'s; with ``dedup_save_to_lowest_rank=True`` DCP's own rule applies (every
    replicated item on the lowest rank holding it, large ones too).
    """

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        if self.dedup_save_to_lowest_rank:
            return super()._dedup_save_plans(all_plans)
        return place_replicated(all_plans)
