"""Where each data consumer stands in a saved epoch: the part of a data-tracker state that only a run
with the same ranks, workers and batch size can use, so that it resumes batch for batch.

A ``DataLoader`` with ``N`` workers takes batches from them in turn: worker 0, 1, ..., ``N - 1``,
0, ... (skipping workers that have finished). Stopped after a number of batches that is not a
multiple of ``N``, the workers have consumed different amounts: their remaining slices differ in
size, and the next batch is due from worker ``k``, not from worker 0. Cutting the remaining work
evenly again and starting at worker 0, as a run on another topology must, would hand every later
step other samples than the uninterrupted run.

:class:`ConsumerLayout` records both: the samples each consumer has left (in consumer order, which
is the order of the state's ``remaining`` work, so consumer ``c`` continues exactly where it
stopped), and each rank's next worker. A run with the same world size, workers per rank and batch
size cuts the remaining work at these sizes and starts each rank's turn at its next worker
(:class:`~uc_checkpoint.data.loading.TrackedDataLoader` lets its DataLoader worker ``i`` read
tracker worker ``(i + k) % N``), so its batches are those the uninterrupted run would have had.
Any other topology ignores it: the remaining work is cut evenly, each rank's worker 0 first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from uc_checkpoint.data.config import TrackerConfig
from uc_checkpoint.data.intervals import check_int, slice_sizes
from uc_checkpoint.errors import TrackerStateError

logger = logging.getLogger(__name__)

#: The keys of a saved layout (the ``consumers`` entry of a tracker state).
LAYOUT_KEYS = ("world_size", "workers_per_rank", "batch_size", "remaining", "next_worker")


def _field(value: Any, field: str, minimum: int = 0) -> int:
    try:
        return check_int(value, f"consumers.{field}", minimum=minimum)
    except (TypeError, ValueError) as exc:
        raise TrackerStateError(f"data tracker state: {exc}") from None


@dataclass(frozen=True)
class ConsumerLayout:
    """The cut of an epoch's remaining work among the consumers of one topology, and each rank's next
    worker (see the module docs).

    ``remaining[c]`` is the number of samples consumer ``c = rank * workers_per_rank + worker`` has
    left; ``next_worker[r]`` is the worker of rank ``r`` whose batch comes next.
    """

    world_size: int
    workers_per_rank: int
    batch_size: int
    remaining: tuple[int, ...]
    next_worker: tuple[int, ...]

    def fits(self, world_size: int, workers_per_rank: int, batch_size: int) -> bool:
        """Whether a run of this topology and tracker batch size can use the layout."""
        return (self.world_size, self.workers_per_rank, self.batch_size) == (world_size, workers_per_rank, batch_size)

    def is_even(self) -> bool:
        """Whether the layout is what a fresh cut of its work gives: slices of
        :func:`~uc_checkpoint.data.intervals.slice_sizes` and worker 0 next on every rank (then a
        state need not carry it)."""
        even = slice_sizes(sum(self.remaining), self.world_size * self.workers_per_rank, self.batch_size)
        return list(self.remaining) == even and not any(self.next_worker)

    def to_dict(self) -> dict[str, Any]:
        """The saved form: ``{"world_size", "workers_per_rank", "batch_size", "remaining": [per
        consumer], "next_worker": [per rank]}`` (plain ints and lists)."""
        return {
            "world_size": self.world_size,
            "workers_per_rank": self.workers_per_rank,
            "batch_size": self.batch_size,
            "remaining": list(self.remaining),
            "next_worker": list(self.next_worker),
        }

    @classmethod
    def from_dict(cls, raw: Any, remaining_samples: int) -> ConsumerLayout:
        """Parse a saved layout and check it against the state's ``remaining_samples``.

        Raises:
            TrackerStateError: not a dict of exactly :data:`LAYOUT_KEYS`, a field of the wrong type
                or out of range, a list of the wrong length, or per-consumer counts that do not add
                up to the state's remaining samples. The message names the field.
        """
        if not isinstance(raw, dict) or set(raw) != set(LAYOUT_KEYS):
            raise TrackerStateError(
                f"data tracker state: 'consumers' must be a dict with keys {list(LAYOUT_KEYS)}, got {raw!r:.200}"
            )
        world = _field(raw["world_size"], "world_size", 1)
        per_rank = _field(raw["workers_per_rank"], "workers_per_rank", 1)
        batch = _field(raw["batch_size"], "batch_size", 1)
        counts, nexts = raw["remaining"], raw["next_worker"]
        if not isinstance(counts, list) or len(counts) != world * per_rank:
            raise TrackerStateError(
                f"data tracker state: consumers.remaining must list {world * per_rank} counts (one per "
                f"consumer), got {counts!r:.200}"
            )
        if not isinstance(nexts, list) or len(nexts) != world:
            raise TrackerStateError(
                f"data tracker state: consumers.next_worker must list {world} workers (one per rank), got {nexts!r:.200}"
            )
        remaining = tuple(_field(n, f"remaining[{c}]") for c, n in enumerate(counts))
        next_worker = tuple(_field(w, f"next_worker[{r}]") for r, w in enumerate(nexts))
        if sum(remaining) != remaining_samples:
            raise TrackerStateError(
                f"data tracker state is inconsistent: consumers.remaining adds up to {sum(remaining)} "
                f"samples but 'remaining' holds {remaining_samples}"
            )
        for r, w in enumerate(next_worker):
            if w >= per_rank:
                raise TrackerStateError(
                    f"data tracker state: consumers.next_worker[{r}] is {w}, but ranks have {per_rank} workers"
                )
        return cls(world, per_rank, batch, remaining, next_worker)


def usable_layout(layout: ConsumerLayout | None, config: TrackerConfig) -> ConsumerLayout | None:
    """A loaded state's ``layout`` if a tracker with ``config`` can use it: None when there is none or
    the topology differs (logged: the remaining work is then cut evenly, each rank's worker 0 first)."""
    if layout is None or layout.fits(config.world_size, config.workers_per_rank, config.batch_size):
        return layout
    logger.info(
        "data tracker: the checkpoint was saved by %d ranks x %d workers (batch_size %d), this run has %d x %d "
        "(batch_size %d): its remaining work is cut evenly, each rank's worker 0 first",
        layout.world_size,
        layout.workers_per_rank,
        layout.batch_size,
        config.world_size,
        config.workers_per_rank,
        config.batch_size,
    )
    return None


def gathered_next_workers(local_states: Sequence[dict[str, Any]], workers_per_rank: int) -> tuple[int, ...]:
    """Each rank's ``next_worker`` from the gathered ``DataTracker.local_state()`` of all ranks,
    in rank order (the states were checked by ``merge_local_states``: one per rank).

    Raises:
        TrackerStateError: a local state lacks ``next_worker`` or names a worker out of range.
    """
    out = [0] * len(local_states)
    for st in local_states:
        r = st["rank"]
        try:
            w = check_int(st.get("next_worker"), f"rank {r}'s local state next_worker", minimum=0)
        except (TypeError, ValueError) as exc:
            raise TrackerStateError(f"data tracker: {exc}") from None
        if w >= workers_per_rank:
            raise TrackerStateError(
                f"data tracker: rank {r}'s local state names next_worker {w} of {workers_per_rank} workers"
            )
        out[r] = w
    return tuple(out)


__all__ = ["LAYOUT_KEYS", "ConsumerLayout", "gathered_next_workers", "usable_layout"]
