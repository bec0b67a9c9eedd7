"""The data tracker's checkpoint state: :class:`TrackerState` owns the saved dict's format and every
check a loaded one goes through; :func:`merge_local_states` checks the per-rank progress gathered for
a save.

The saved dict (format 3, written by :meth:`TrackerState.to_dict`; the JSON text a checkpoint holds
is this dict, so its keys, their order and their values must not change within a format)::

    {"format": 3,
     "fingerprint": str,                   # dataset_fingerprint() of the dataset
     "seed": int, "epoch": int,            # shard-order seed, current epoch
     "shuffle_within_shard": bool,         # positions map to samples through ShardPermutation
     "remaining": [[shard, start, end], ...],   # positions, stream order; [] when the epoch is finished
     "samples_consumed_in_epoch": int,
     "num_shards": int,
     "digest": [[shard, count, hex], ...] | None,   # SampleDigest of what the epoch consumed; None: unchecked
     "shards": [[name, num_samples, fingerprint], ...],   # optional
     "consumers": {...}}                   # optional: ConsumerLayout.to_dict(), absent when even

Shard names are relative to the dataset's root and fingerprints describe content (see
:class:`~uc_checkpoint.data.intervals.ShardSpec`); format 2, whose reader-made names were URLs and
fingerprints mtimes or ETags, is refused naming both formats.

``consumers`` is the one topology-bound part: how the remaining work was cut among the saving run's
consumers and which worker of each rank was next (:mod:`uc_checkpoint.data.layout`), so that a run
of the same topology resumes batch for batch; other topologies ignore it.

Every value is a plain bool, int, string, list or None (JSON-serialisable). A malformed state raises
:class:`~uc_checkpoint.errors.TrackerStateError` (a ``ValueError`` too), whose message names the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from uc_checkpoint.data.digest import DigestReport, SampleDigest, ShardHasher, check_digest
from uc_checkpoint.data.intervals import Interval, ShardSpec, check_int, dataset_fingerprint, total_size
from uc_checkpoint.data.layout import ConsumerLayout
from uc_checkpoint.data.shuffle import ShardPermutation
from uc_checkpoint.errors import TrackerStateError

#: Version of the dict :meth:`TrackerState.to_dict` writes (and ``DataTracker.global_state`` returns).
STATE_FORMAT = 3

#: Keys every saved state has (``shards`` and ``consumers`` are optional).
STATE_KEYS = frozenset(
    {
        "format",
        "fingerprint",
        "seed",
        "epoch",
        "shuffle_within_shard",
        "remaining",
        "samples_consumed_in_epoch",
        "num_shards",
        "digest",
    }
)

#: A saved shard: ``(name, num_samples, fingerprint)``.
SavedShard = tuple[str, int, str]


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
    """One saved data-tracker state (see the module docs for its dict): topology-free but for the
    optional ``consumers`` layout, which only a run of the saving topology uses.

    ``remaining`` is the epoch's unconsumed work in stream order (positions; with
    ``shuffle_within_shard`` they map to sample indices through
    :class:`~uc_checkpoint.data.shuffle.ShardPermutation`); ``shards`` the dataset's
    ``(name, num_samples, fingerprint)`` list when it was saved with it, else None; ``digest`` the
    :class:`~uc_checkpoint.data.digest.SampleDigest` of the samples the epoch consumed, or None when
    the epoch cannot be checked; ``consumers`` the saving run's
    :class:`~uc_checkpoint.data.layout.ConsumerLayout` when it is not the even cut, else None.
    :meth:`from_dict` checks the state on its own; :meth:`check_fits` checks it against the dataset
    its fingerprint names.
    """

    fingerprint: str
    seed: int
    epoch: int
    remaining: tuple[Interval, ...]
    samples_consumed_in_epoch: int
    num_shards: int
    shards: tuple[SavedShard, ...] | None = None
    shuffle_within_shard: bool = False
    digest: SampleDigest | None = None
    consumers: ConsumerLayout | None = None

    def to_dict(self) -> dict[str, Any]:
        """The saved form (plain values; key order as the module docs show it)."""
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "epoch": self.epoch,
            "shuffle_within_shard": self.shuffle_within_shard,
            "remaining": [[iv.shard, iv.start, iv.end] for iv in self.remaining],
            "samples_consumed_in_epoch": self.samples_consumed_in_epoch,
            "num_shards": self.num_shards,
            "digest": None if self.digest is None else self.digest.to_list(),
        }
        if self.shards is not None:
            state["shards"] = [[name, n, fp] for name, n, fp in self.shards]
        if self.consumers is not None:
            state["consumers"] = self.consumers.to_dict()
        return state

    @classmethod
    def from_dict(cls, state: Any) -> TrackerState:
        """Parse and check a saved state on its own (not yet against a dataset).

        Raises:
            TrackerStateError: ``state`` is not a dict, has another ``format``, a missing or unknown
                key, a field of the wrong type or out of range, a shard list that does not match
                ``num_shards``, remaining work that overlaps, is out of stream order, names a shard
                that does not exist or exceeds its shard, or a digest that is malformed or does not
                count ``samples_consumed_in_epoch`` samples. The message names the field.
        """
        if not isinstance(state, dict):
            raise TrackerStateError(f"data tracker state must be a dict, got {type(state).__name__}")
        fmt = state.get("format")
        if type(fmt) is not int or fmt != STATE_FORMAT:  # not True or 3.0, which compare equal to ints
            hint = (
                " (format 2 named reader-made shards by URL and fingerprinted them by mtime or ETag: resume it "
                "with the version that saved it, or start the epoch afresh)"
                if fmt == 2
                else ""
            )
            raise TrackerStateError(
                f"unsupported data tracker state format {fmt!r}: this version reads format {STATE_FORMAT} only{hint}"
            )
        missing = STATE_KEYS - state.keys()
        if missing:
            raise TrackerStateError(f"data tracker state lacks {sorted(missing)}")
        # A key this format does not define means the state was written (or edited) by something
        # else; ignoring it could silently drop what it meant.
        unknown = state.keys() - STATE_KEYS - {"shards", "consumers"}
        if unknown:
            raise TrackerStateError(
                f"data tracker state has unknown keys {sorted(map(repr, unknown))}: format {STATE_FORMAT} "
                f"has {sorted(STATE_KEYS | {'shards', 'consumers'})}"
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
        shuffle = state["shuffle_within_shard"]
        if not isinstance(shuffle, bool):
            raise TrackerStateError(
                f"data tracker state: shuffle_within_shard must be a bool, got {type(shuffle).__name__} {shuffle!r}"
            )
        shards = _parse_shard_list(state.get("shards"), num_shards)
        remaining = _parse_remaining(state["remaining"], num_shards, shards)
        digest = None
        if state["digest"] is not None:
            digest = SampleDigest.from_list(state["digest"], num_shards, "digest")
            if digest.count() != consumed:
                raise TrackerStateError(
                    f"data tracker state is inconsistent: its digest counts {digest.count()} samples but "
                    f"samples_consumed_in_epoch is {consumed}"
                )
        consumers = None
        if "consumers" in state:
            consumers = ConsumerLayout.from_dict(state["consumers"], total_size(remaining))
        return cls(fingerprint, seed, epoch, tuple(remaining), consumed, num_shards, shards, shuffle, digest, consumers)

    def same_dataset(self, shards: Sequence[ShardSpec]) -> bool:
        """Whether the state was saved for ``shards``: the same fingerprint, or (with the shard list)
        the same names and counts in the same order and the same content fingerprint wherever both
        sides know one (``""`` is unknown)."""
        if self.fingerprint == dataset_fingerprint(shards):
            return True
        return self.shards is not None and _first_difference(self.shards, shards) is None

    def check_fits(self, shards: Sequence[ShardSpec]) -> None:
        """Check a state saved for ``shards`` (:meth:`same_dataset`) against them: its own
        description of the dataset must agree, or the state is corrupt.

        Raises:
            TrackerStateError: ``num_shards`` or the shard list disagree with ``shards``, remaining
                work exceeds its shard, or consumed plus remaining samples are not the dataset's.
        """
        if self.num_shards != len(shards):
            raise TrackerStateError(
                f"data tracker state is corrupt: num_shards is {self.num_shards} but its fingerprint "
                f"is that of this dataset of {len(shards)} shards"
            )
        if self.shards is not None and _first_difference(self.shards, shards) is not None:
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
        the shard counts, the first differing shard (when the state has the shard list; with both
        content fingerprints when only the content changed) and both dataset fingerprints
        (abbreviated)."""
        now = len(shards)
        parts = []
        if self.num_shards != now:
            parts.append(f"number of shards: checkpoint {self.num_shards}, now {now}")
        if self.shards is not None:
            diff = _first_difference(self.shards, shards)
            if diff is not None:
                i, old, new = diff
                if old is not None and new is not None and old[:2] == new[:2]:
                    parts.append(
                        f"shard {i} {old[0]!r} ({old[1]} samples) changed content: checkpoint fingerprint "
                        f"{old[2]!r}, now {new[2]!r}"
                    )
                else:
                    parts.append(f"first difference at shard {i}: checkpoint had {_show(old)}, now {_show(new)}")
        elif self.num_shards == now:
            parts.append(
                f"same number of shards ({now}) but different names, sizes, contents or order (the state "
                "has no shard list to say which)"
            )
        parts.append(f"fingerprint {self.fingerprint[:12]}... vs {dataset_fingerprint(shards)[:12]}...")
        return "; ".join(parts)

    def remaining_indices(self, shards: Sequence[tuple[str, int]]) -> dict[int, list[np.ndarray]]:
        """Per shard, the sample indices the remaining work reads (its positions mapped through the
        epoch's :class:`~uc_checkpoint.data.shuffle.ShardPermutation` when shuffled); ``shards``
        gives ``(name, num_samples)`` of every shard."""
        out: dict[int, list[np.ndarray]] = {}
        for iv in self.remaining:
            name, size = shards[iv.shard][0], shards[iv.shard][1]
            if self.shuffle_within_shard:
                part = ShardPermutation(self.seed, self.epoch, name, size).indices(iv.start, iv.end)
            else:
                part = np.arange(iv.start, iv.end, dtype=np.int64)
            out.setdefault(iv.shard, []).append(part)
        return out

    def check_digest(self) -> DigestReport | None:
        """Whether the digest checks out so far: every sample the state counts as consumed was
        consumed exactly once (hashes the whole dataset once, ``O(samples)``). None when the state has
        no digest or no shard list (whose names the hashes are keyed by)."""
        if self.digest is None or self.shards is None:
            return None
        hasher = ShardHasher([name for name, _n, _fp in self.shards])
        sizes = [n for _name, n, _fp in self.shards]
        return check_digest(hasher, sizes, self.digest, self.remaining_indices([(n, k) for n, k, _fp in self.shards]))


def _first_difference(
    saved: Sequence[SavedShard], shards: Sequence[ShardSpec]
) -> tuple[int, SavedShard | None, SavedShard | None] | None:
    """``(index, saved entry, current entry)`` of the first shard that differs (names, counts, or
    content fingerprints both sides know), or None."""
    current = [(s.name, s.num_samples, s.fingerprint) for s in shards]
    for i in range(max(len(saved), len(current))):
        old = saved[i] if i < len(saved) else None
        new = current[i] if i < len(current) else None
        if old is None or new is None or old[:2] != new[:2] or (old[2] and new[2] and old[2] != new[2]):
            return i, old, new
    return None


def _show(entry: SavedShard | None) -> str:
    if entry is None:
        return "no shard"
    return f"{entry[0]!r} ({entry[1]} samples{f', fingerprint {entry[2]!r}' if entry[2] else ''})"


def _parse_shard_list(raw: Any, num_shards: int) -> tuple[SavedShard, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != num_shards:
        raise TrackerStateError(
            f"data tracker state: 'shards' must list num_shards={num_shards} [name, num_samples, fingerprint] "
            f"triples, got {type(raw).__name__}{f' of {len(raw)}' if isinstance(raw, list) else ''}"
        )
    out: list[SavedShard] = []
    for i, item in enumerate(raw):
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 3
            or not isinstance(item[0], str)
            or not isinstance(item[2], str)
        ):
            raise TrackerStateError(
                f"data tracker state: shards[{i}] is {item!r}, not [name, num_samples, fingerprint]"
            )
        out.append((item[0], state_int(item[1], f"shards[{i}] ({item[0]!r}) num_samples", minimum=0), item[2]))
    return tuple(out)


def _parse_remaining(raw: Any, num_shards: int, saved_shards: Sequence[SavedShard] | None) -> list[Interval]:
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
    num_shards: int,
) -> tuple[list[int], SampleDigest | None]:
    """The consumed counts of all ``world_size * workers_per_rank`` consumers, in consumer order, and
    the sum of the ranks' digests (None when a rank sent none), from every rank's
    ``DataTracker.local_state()`` (``{"rank", "consumed", "epoch", "assignment", "digest"}``), checked
    against the merging rank's ``epoch``, ``assignment`` id, ``slice_sizes`` and ``num_shards``.

    Raises:
        TrackerStateError: a local state is malformed, missing, doubled, describes another epoch or
            assignment, counts more samples than its consumer's slice holds, or has a malformed
            digest or one that does not count the rank's consumed samples.
    """
    if len(local_states) != world_size:
        raise TrackerStateError(
            f"global_state() needs the local state of all {world_size} ranks, got {len(local_states)}"
        )
    per_rank: dict[int, list[int]] = {}
    digest: SampleDigest | None = SampleDigest()
    for st in local_states:
        if not isinstance(st, dict) or not {"rank", "consumed", "epoch", "assignment", "digest"} <= st.keys():
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
                "num_workers, batch_size and shuffle_within_shard) before the states are gathered"
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
        if st["digest"] is None:
            digest = None
        else:
            part = SampleDigest.from_list(st["digest"], num_shards, f"rank {r} digest")
            if part.count() != sum(consumed):
                raise TrackerStateError(
                    f"rank {r}'s local digest counts {part.count()} samples but its workers consumed {sum(consumed)}"
                )
            if digest is not None:
                digest.merge(part)
        per_rank[r] = consumed
    return [k for r in range(world_size) for k in per_rank[r]], digest


__all__ = ["STATE_FORMAT", "STATE_KEYS", "SavedShard", "TrackerState", "merge_local_states", "state_int"]
