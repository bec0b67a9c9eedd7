"""The data tracker's checkpoint state: :class:`TrackerState` owns the saved dict's format and every
check a loaded one goes through; :func:`merge_local_states` checks the per-rank progress gathered for
a save.

The saved dict (format 1, written by :meth:`TrackerState.to_dict`; the JSON text a checkpoint holds
is this dict, so its keys, their order and their values must not change within a format)::

    {"format": 1,
     "fingerprint": str,                   # dataset_fingerprint() of the dataset
     "seed": int, "epoch": int,            # shard-order seed, current epoch
     "remaining": [[shard, start, end], ...],   # stream order; [] when the epoch is finished
     "samples_consumed_in_epoch": int,
     "num_shards": int,
     "shards": [[name, num_samples], ...]}      # optional

Every value is a plain int, string or list (JSON-serialisable). A malformed state raises
:class:`~uc_checkpoint.errors.TrackerStateError` (a ``ValueError`` too), whose message names the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from uc_checkpoint.data.intervals import Interval, ShardSpec, check_int, dataset_fingerprint, total_size
from uc_checkpoint.errors import TrackerStateError

#: Version of the dict :meth:`TrackerState.to_dict` writes (and ``DataTracker.global_state`` returns).
STATE_FORMAT = 1

#: Keys every saved state has (``shards`` is optional).
STATE_KEYS = frozenset(
    {"format", "fingerprint", "seed", "epoch", "remaining", "samples_consumed_in_epoch", "num_shards"}
)


def state_int(value: Any, field: str, *, minimum: int | None = None) -> int:
    """``value`` as a field of a saved or gathered state: an int (not a bool) of at least
    ``minimum``, else :class:`TrackerStateError` naming ``field``. (Arguments of the API go through
    :func:`~uc_checkpoint.data.intervals.check_int`, whose TypeError/ValueError suit a caller's
    mistake; a state is data.)"""
    try:
        return check_int(value, field, minimum=minimum)
    except (TypeError, ValueError) as exc:
        raise TrackerStateError(f"data tracker state: {exc}") from None


@dataclass(frozen=True)
class TrackerState:
    """One saved data-tracker state, topology-free (see the module docs for its dict).

    ``remaining`` is the epoch's unconsumed work in stream order; ``shards`` the dataset's
    ``(name, num_samples)`` list when it was saved with it, else None. :meth:`from_dict` checks the
    state on its own; :meth:`check_fits` checks it against the dataset its fingerprint names.
    """

    fingerprint: str
    seed: int
    epoch: int
    remaining: tuple[Interval, ...]
    samples_consumed_in_epoch: int
    num_shards: int
    shards: tuple[tuple[str, int], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The saved form (plain ints, strings and lists; key order as format 1 has always had it)."""
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "epoch": self.epoch,
            "remaining": [[iv.shard, iv.start, iv.end] for iv in self.remaining],
            "samples_consumed_in_epoch": self.samples_consumed_in_epoch,
            "num_shards": self.num_shards,
        }
        if self.shards is not None:
            state["shards"] = [[name, n] for name, n in self.shards]
        return state

    @classmethod
    def from_dict(cls, state: Any) -> TrackerState:
        """Parse and check a saved state on its own (not yet against a dataset).

        Raises:
            TrackerStateError: ``state`` is not a dict, has another ``format``, a missing or unknown
                key, a field of the wrong type or out of range, a shard list that does not match
                ``num_shards``, or remaining work that overlaps, is out of stream order, names a shard
                that does not exist or exceeds its shard. The message names the field.
        """
        if not isinstance(state, dict):
            raise TrackerStateError(f"data tracker state must be a dict, got {type(state).__name__}")
        fmt = state.get("format")
        if type(fmt) is not int or fmt != STATE_FORMAT:  # not True or 1.0, which compare equal to 1
            raise TrackerStateError(
                f"unsupported data tracker state format {fmt!r}: this version reads format {STATE_FORMAT}"
            )
        missing = STATE_KEYS - state.keys()
        if missing:
            raise TrackerStateError(f"data tracker state lacks {sorted(missing)}")
        # A key this format does not define means the state was written (or edited) by something
        # else; ignoring it could silently drop what it meant.
        unknown = state.keys() - STATE_KEYS - {"shards"}
        if unknown:
            raise TrackerStateError(
                f"data tracker state has unknown keys {sorted(map(repr, unknown))}: format {STATE_FORMAT} "
                f"has {sorted(STATE_KEYS | {'shards'})}"
            )
        epoch = state_int(state["epoch"], "epoch", minimum=0)
        seed = state_int(state["seed"], "seed")
        num_shards = state_int(state["num_shards"], "num_shards", minimum=0)
        consumed = state_int(state["samples_consumed_in_epoch"], "samples_consumed_in_epoch", minimum=0)
        fingerprint = state["fingerprint"]
        if not isinstance(fingerprint, str):
            raise TrackerStateError(
                f"data tracker state: fingerprint must be a str, got {type(fingerprint).__name__} {fingerprint!r}"
            )
        shards = _parse_shard_list(state.get("shards"), num_shards)
        remaining = _parse_remaining(state["remaining"], num_shards, shards)
        return cls(fingerprint, seed, epoch, tuple(remaining), consumed, num_shards, shards)

    def check_fits(self, shards: Sequence[ShardSpec]) -> None:
        """Check a state whose fingerprint is that of ``shards`` against them: its own description of
        the dataset must agree, or the state is corrupt.

        Raises:
            TrackerStateError: ``num_shards`` or the shard list disagree with ``shards``, remaining
                work exceeds its shard, or consumed plus remaining samples are not the dataset's.
        """
        if self.num_shards != len(shards):
            raise TrackerStateError(
                f"data tracker state is corrupt: num_shards is {self.num_shards} but its fingerprint "
                f"is that of this dataset of {len(shards)} shards"
            )
        if self.shards is not None and list(self.shards) != [(sh.name, sh.num_samples) for sh in shards]:
            raise TrackerStateError(
                "data tracker state is corrupt: its shards list disagrees with its fingerprint, which "
                "is that of this dataset"
            )
        for iv in self.remaining:
            if iv.end > shards[iv.shard].num_samples:
                raise TrackerStateError(
                    f"data tracker state is corrupt: remaining interval {iv} exceeds shard "
                    f"{shards[iv.shard].name!r} ({shards[iv.shard].num_samples} samples)"
                )
        left = total_size(self.remaining)
        total = sum(s.num_samples for s in shards)
        if self.samples_consumed_in_epoch + left != total:
            raise TrackerStateError(
                f"data tracker state is inconsistent: samples_consumed_in_epoch {self.samples_consumed_in_epoch} "
                f"+ {left} remaining samples != {total} samples in the dataset"
            )

    def describe_difference(self, shards: Sequence[ShardSpec]) -> str:
        """How the dataset the state was saved for differs from ``shards``, for an error or warning:
        the shard counts, the first differing shard (when the state has the shard list) and both
        fingerprints (abbreviated)."""
        now = len(shards)
        parts = []
        if self.num_shards != now:
            parts.append(f"number of shards: checkpoint {self.num_shards}, now {now}")
        if self.shards is not None:
            current = [(s.name, s.num_samples) for s in shards]
            for i in range(max(len(self.shards), len(current))):
                old = self.shards[i] if i < len(self.shards) else None
                new = current[i] if i < len(current) else None
                if old != new:
                    parts.append(f"first difference at shard {i}: checkpoint had {_show(old)}, now {_show(new)}")
                    break
        elif self.num_shards == now:
            parts.append(
                f"same number of shards ({now}) but different names, sizes or order (the state has no "
                "shard list to say which)"
            )
        parts.append(f"fingerprint {self.fingerprint[:12]}... vs {dataset_fingerprint(shards)[:12]}...")
        return "; ".join(parts)


def _show(entry: tuple[str, int] | None) -> str:
    return "no shard" if entry is None else f"{entry[0]!r} ({entry[1]} samples)"


def _parse_shard_list(raw: Any, num_shards: int) -> tuple[tuple[str, int], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != num_shards:
        raise TrackerStateError(
            f"data tracker state: 'shards' must list num_shards={num_shards} [name, num_samples] pairs, "
            f"got {type(raw).__name__}{f' of {len(raw)}' if isinstance(raw, list) else ''}"
        )
    out: list[tuple[str, int]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            raise TrackerStateError(f"data tracker state: shards[{i}] is {item!r}, not [name, num_samples]")
        out.append((item[0], state_int(item[1], f"shards[{i}] ({item[0]!r}) num_samples", minimum=0)))
    return tuple(out)


def _parse_remaining(raw: Any, num_shards: int, saved_shards: Sequence[tuple[str, int]] | None) -> list[Interval]:
    if not isinstance(raw, list):
        raise TrackerStateError(
            f"data tracker state: 'remaining' must be a list of [shard, start, end], got {type(raw).__name__}"
        )
    out: list[Interval] = []
    done: set[int] = set()  # shards whose pieces are behind us in the list
    for i, item in enumerate(raw):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise TrackerStateError(f"data tracker state: bad remaining interval remaining[{i}] = {item!r}")
        shard, start, end = (
            state_int(v, f"remaining[{i}] {name}", minimum=0) for v, name in zip(item, ("shard", "start", "end"))
        )
        if end < start:
            raise TrackerStateError(
                f"data tracker state: bad remaining interval remaining[{i}] = {item!r}: end < start"
            )
        if shard >= num_shards:
            raise TrackerStateError(
                f"data tracker state: remaining[{i}] = {item!r} names shard {shard} of {num_shards}"
            )
        if saved_shards is not None and end > saved_shards[shard][1]:
            raise TrackerStateError(
                f"data tracker state: remaining[{i}] = {item!r} exceeds its shard "
                f"{saved_shards[shard][0]!r} ({saved_shards[shard][1]} samples)"
            )
        iv = Interval(shard, start, end)
        # Stream order reads a shard in one go, ascending: its pieces are neighbours in the list and
        # ascending. Anything else is not a state global_state() wrote, and overlapping pieces
        # would have a sample read twice.
        if out and out[-1].shard == shard:
            if start < out[-1].end:
                raise TrackerStateError(
                    f"data tracker state: remaining intervals {out[-1]} and {iv} (remaining[{i}]) overlap "
                    "or are out of order"
                )
        else:
            if shard in done:
                raise TrackerStateError(
                    f"data tracker state: remaining[{i}] = {item!r} returns to shard {shard} after other "
                    "shards: remaining work must be in stream order (each shard's pieces together, "
                    "ascending)"
                )
            if out:
                done.add(out[-1].shard)
        out.append(iv)
    return out


def merge_local_states(
    local_states: Sequence[dict[str, Any]],
    *,
    world_size: int,
    workers_per_rank: int,
    epoch: int,
    assignment: str,
    slice_sizes: Sequence[int],
) -> list[int]:
    """The consumed counts of all ``world_size * workers_per_rank`` consumers, in consumer order, from
    every rank's ``DataTracker.local_state()`` (``{"rank", "consumed", "epoch", "assignment"}``),
    checked against the merging rank's ``epoch``, ``assignment`` id and ``slice_sizes``.

    Raises:
        TrackerStateError: a local state is malformed, missing, doubled, describes another epoch or
            assignment, or counts more samples than its consumer's slice holds.
    """
    if len(local_states) != world_size:
        raise TrackerStateError(
            f"global_state() needs the local state of all {world_size} ranks, got {len(local_states)}"
        )
    per_rank: dict[int, list[int]] = {}
    for st in local_states:
        if not isinstance(st, dict) or not {"rank", "consumed", "epoch", "assignment"} <= st.keys():
            raise TrackerStateError(f"not a DataTracker.local_state(): {st!r}")
        r = state_int(st["rank"], "local state rank", minimum=0)
        if r >= world_size:
            raise TrackerStateError(f"local state of rank {r} but world_size is {world_size}")
        if r in per_rank:
            raise TrackerStateError(f"two local states for rank {r}")
        if st["epoch"] != epoch or st["assignment"] != assignment:
            raise TrackerStateError(
                f"rank {r}'s local state is from epoch {st['epoch']} / assignment {st['assignment']}, "
                f"this rank is at epoch {epoch} / assignment {assignment}: every rank must "
                "call start_epoch/load_global_state alike (and build its tracker with the same "
                "num_workers and batch_size) before the states are gathered"
            )
        consumed = st["consumed"]
        if not isinstance(consumed, list) or len(consumed) != workers_per_rank:
            raise TrackerStateError(
                f"rank {r}'s local state has {consumed!r} as consumed counts, expected "
                f"{workers_per_rank} ints (one per worker)"
            )
        for w, k in enumerate(consumed):
            size = slice_sizes[r * workers_per_rank + w]
            state_int(k, f"rank {r} worker {w} consumed", minimum=0)
            if k > size:
                raise TrackerStateError(f"rank {r} worker {w} consumed {k} samples of a {size}-sample slice")
        per_rank[r] = consumed
    return [k for r in range(world_size) for k in per_rank[r]]


__all__ = ["STATE_FORMAT", "STATE_KEYS", "TrackerState", "merge_local_states", "state_int"]
