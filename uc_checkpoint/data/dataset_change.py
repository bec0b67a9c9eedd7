"""A saved epoch's remaining work carried over to a dataset that changed since the save
(``DataTracker(..., allow_dataset_change=True)``): :func:`carry_over` maps it shard by shard and
returns a :class:`DatasetChange` that names every unread sample it could not map;
:func:`carry_over_state` applies the tracker's settings (raise, or drop what cannot be mapped).

Shards are matched by name (the ``k``-th copy of a name to the ``k``-th copy, for datasets that list
a shard twice) when the saved state has its shard list, else by position in the list. A remaining
interval is carried over to its shard's match as the same positions, clipped to the match's size.
Unread samples are unmapped where the shard is gone (removed or renamed), where the match is too
short to hold them, and, with ``shuffle_within_shard``, where the match has another number of
samples (a position then names another sample: the shard's permutation depends on its size).
Without the shard list the saved sizes are unknown, and positions are carried over as they are
(clipped to the shard), shuffled or not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from uc_checkpoint.data.config import TrackerConfig
from uc_checkpoint.data.intervals import Interval, ShardSpec
from uc_checkpoint.data.state import SavedShard, TrackerState
from uc_checkpoint.errors import DatasetMismatchError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnmappedShard:
    """Unread samples of one saved shard that cannot be carried over: the shard's saved ``name`` (or
    ``#<index>`` when the state has no shard list), how many ``samples`` and why (``reason``)."""

    name: str
    samples: int
    reason: str

    def describe(self) -> str:
        """``'b.jsonl': 12 unread samples (the shard is gone)``."""
        return f"{self.name!r}: {self.samples} unread samples ({self.reason})"


@dataclass(frozen=True)
class DatasetChange:
    """What a load onto a changed dataset did with the saved epoch's remaining work.

    Attributes:
        difference: how the datasets differ (the first difference, as a mismatch error says it).
        carried: unread samples carried over to this dataset (read in the rest of the epoch).
        unmapped: per saved shard, the unread samples that could not be carried over.
        changed_content: names of shards carried over whose content fingerprint changed (their
            positions are read from the new content).
        added: names of shards of this dataset that no saved shard maps to, and of matched shards
            that grew (``name (+k samples)``): read from the next epoch on.
    """

    difference: str
    carried: int
    unmapped: tuple[UnmappedShard, ...]
    changed_content: tuple[str, ...]
    added: tuple[str, ...]

    @property
    def dropped(self) -> int:
        """Unread samples of the saved epoch that are not read (the sum of :attr:`unmapped`)."""
        return sum(u.samples for u in self.unmapped)

    def describe(self, limit: int = 8) -> str:
        """One line for a log or an error: the difference, what was carried and what was not (the
        first ``limit`` shards of each list)."""
        parts = [self.difference, f"{self.carried} unread samples carried over"]
        if self.unmapped:
            parts.append(f"{self.dropped} unread samples cannot be carried over: {_listed(self.unmapped, limit)}")
        if self.changed_content:
            parts.append(f"content changed in {_listed(self.changed_content, limit)}")
        if self.added:
            parts.append(f"added, read from the next epoch on: {_listed(self.added, limit)}")
        return "; ".join(parts)


def _listed(items: Sequence[UnmappedShard] | Sequence[str], limit: int) -> str:
    shown = [i.describe() if isinstance(i, UnmappedShard) else repr(i) for i in items[:limit]]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def carry_over(
    remaining: Sequence[Interval],
    saved_shards: Sequence[SavedShard] | None,
    shards: Sequence[ShardSpec],
    *,
    shuffled: bool,
    difference: str,
) -> tuple[list[Interval], DatasetChange]:
    """The saved ``remaining`` work translated to ``shards`` (see the module docs).

    Args:
        remaining: the saved epoch's remaining work, in stream order.
        saved_shards: the saved ``(name, num_samples, fingerprint)`` list, or None when the state
            has none (shards are then matched by position and their saved sizes are unknown).
        shards: the dataset now.
        shuffled: whether the positions map to samples through the shard's permutation.
        difference: how the datasets differ, for the report.

    Returns:
        The work that could be carried over (stream order kept) and the report.
    """
    if saved_shards is not None:
        index_of: dict[tuple[str, int], int] = {}
        seen: dict[str, int] = {}
        for i, s in enumerate(shards):
            index_of[(s.name, seen.get(s.name, 0))] = i
            seen[s.name] = seen.get(s.name, 0) + 1
        seen.clear()
        target: list[int | None] = []
        for name, *_ in saved_shards:
            target.append(index_of.get((name, seen.get(name, 0))))
            seen[name] = seen.get(name, 0) + 1
        names = [name for name, *_ in saved_shards]
    else:
        count = max((iv.shard for iv in remaining), default=-1) + 1
        target = [i if i < len(shards) else None for i in range(count)]
        names = [f"#{i}" for i in range(count)]
    kept: list[Interval] = []
    lost: dict[int, int] = {}  # saved shard -> unread samples that cannot be carried over
    why: dict[int, str] = {}

    def lose(shard: int, samples: int, reason: str) -> None:
        lost[shard] = lost.get(shard, 0) + samples
        why.setdefault(shard, reason)

    for iv in remaining:
        new = target[iv.shard]
        if new is None:
            lose(iv.shard, iv.size, "the shard is gone: removed or renamed")
            continue
        size = shards[new].num_samples
        if shuffled and saved_shards is not None and saved_shards[iv.shard][1] != size:
            lose(
                iv.shard,
                iv.size,
                f"{saved_shards[iv.shard][1]} -> {size} samples with shuffle_within_shard: its positions name other "
                "samples now",
            )
            continue
        end = min(iv.end, size)
        if end < iv.end:
            lose(iv.shard, iv.end - max(end, iv.start), f"the shard has {size} samples now")
        if end > iv.start:
            kept.append(Interval(new, iv.start, end))
    changed: list[str] = []
    added: list[str] = []
    matched = set()
    if saved_shards is not None:
        for i, new in enumerate(target):
            if new is None:
                continue
            matched.add(new)
            old_name, old_size, old_fp = saved_shards[i]
            now = shards[new]
            if old_fp and now.fingerprint and old_fp != now.fingerprint:
                changed.append(old_name)
            if now.num_samples > old_size:
                added.append(f"{now.name} (+{now.num_samples - old_size} samples)")
    else:
        matched = {t for t in target if t is not None}
    added[:0] = [s.name for i, s in enumerate(shards) if i not in matched]
    unmapped = tuple(UnmappedShard(names[s], n, why[s]) for s, n in sorted(lost.items()))
    carried = sum(iv.size for iv in kept)
    return kept, DatasetChange(difference, carried, unmapped, tuple(changed), tuple(added))


def carry_over_state(loaded: TrackerState, config: TrackerConfig) -> tuple[list[Interval], DatasetChange]:
    """The remaining work of ``loaded``, a state saved for another dataset than ``config.shards``,
    carried over to it as ``config`` allows (``allow_dataset_change``, ``drop_unmapped``), with its
    report (also logged as a warning).

    Raises:
        DatasetMismatchError: ``allow_dataset_change`` is False (the message says how the datasets
            differ); or unread samples cannot be carried over and ``drop_unmapped`` is False (the
            message names each such shard, its unread samples and why).
    """
    diff = loaded.describe_difference(config.shards)
    if not config.allow_dataset_change:
        raise DatasetMismatchError(
            f"the data state was saved for a different dataset: {diff}. Pass "
            "allow_dataset_change=True to carry its unread samples over shard by shard."
        )
    remaining, change = carry_over(
        loaded.remaining, loaded.shards, config.shards, shuffled=loaded.shuffle_within_shard, difference=diff
    )
    if change.unmapped and not config.drop_unmapped:
        raise DatasetMismatchError(
            f"allow_dataset_change: {change.dropped} unread samples of epoch {loaded.epoch} cannot be carried "
            f"over to this dataset: {_listed(change.unmapped, 20)}. Restore those shards "
            f"under their names, or pass drop_unmapped=True to drop these samples ({diff})"
        )
    logger.warning("data tracker: dataset changed since the checkpoint; epoch %d: %s", loaded.epoch, change.describe())
    return remaining, change


__all__ = ["DatasetChange", "UnmappedShard", "carry_over", "carry_over_state"]
