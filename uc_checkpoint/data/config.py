"""The settings of a :class:`~uc_checkpoint.data.tracker.DataTracker`: :class:`TrackerConfig`,
checked once when the tracker is built (and replaced, with the checkpoint's seed and shuffling, by a
load)."""

from __future__ import annotations

from dataclasses import dataclass, field

from uc_checkpoint.data.digest import EXACTLY_ONCE_MODES
from uc_checkpoint.data.intervals import ShardSpec, check_int, dataset_fingerprint


@dataclass(frozen=True)
class TrackerConfig:
    """The settings of a :class:`~uc_checkpoint.data.tracker.DataTracker` (see its Args), checked once; ``fingerprint``
    (:func:`dataset_fingerprint` of ``shards``) and ``total_samples`` (samples in one epoch) are
    derived from ``shards``. ``shards`` may be given as any sequence and is stored as a tuple. After
    a load, the tracker's config carries the checkpoint's ``seed``.

    Raises:
        TypeError, ValueError: a setting has the wrong type or is out of range.
    """

    shards: tuple[ShardSpec, ...]
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0
    allow_dataset_change: bool = False
    batch_size: int = 1
    shuffle_within_shard: bool = False
    exactly_once: str = "raise"
    drop_unmapped: bool = False
    fingerprint: str = field(init=False, repr=False, compare=False)
    total_samples: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shards = tuple(self.shards)
        if not shards:
            raise ValueError("DataTracker needs at least one shard")
        for shard in shards:
            if not isinstance(shard, ShardSpec):
                raise TypeError(f"shards must be ShardSpec items, got {type(shard).__name__}")
        check_int(self.seed, "seed")
        check_int(self.world_size, "world_size", minimum=1)
        check_int(self.rank, "rank", minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is out of range for world_size {self.world_size}")
        check_int(self.num_workers, "num_workers", minimum=0)
        check_int(self.batch_size, "batch_size", minimum=1)
        if self.exactly_once not in EXACTLY_ONCE_MODES:
            raise ValueError(f"exactly_once must be one of {EXACTLY_ONCE_MODES}, got {self.exactly_once!r}")
        if self.drop_unmapped and not self.allow_dataset_change:
            raise ValueError(
                "drop_unmapped=True applies to a load onto a changed dataset: it needs allow_dataset_change=True"
            )
        object.__setattr__(self, "shards", shards)
        object.__setattr__(self, "shuffle_within_shard", bool(self.shuffle_within_shard))
        object.__setattr__(self, "allow_dataset_change", bool(self.allow_dataset_change))
        object.__setattr__(self, "drop_unmapped", bool(self.drop_unmapped))
        object.__setattr__(self, "fingerprint", dataset_fingerprint(shards))
        object.__setattr__(self, "total_samples", sum(s.num_samples for s in shards))

    @property
    def workers_per_rank(self) -> int:
        """Consumers per rank: ``max(1, num_workers)``."""
        return max(1, self.num_workers)

    @property
    def num_consumers(self) -> int:
        """Consumers across all ranks: ``world_size * workers_per_rank``."""
        return self.world_size * self.workers_per_rank


__all__ = ["TrackerConfig"]
