"""Proof of exactly-once: an order-independent digest of the sample identities a run consumed.

A sample's identity is ``(shard, index)``: the shard's number in the dataset and the sample's index
within it. Its two 64-bit hashes ``h1, h2`` are keyed by the shard's name (keys from sha256, so the
same on every interpreter); a :class:`SampleDigest` holds, per shard, the number of samples seen and
the sums of ``h1`` and of ``h2`` modulo 2**64 (a multiset hash in the sense of Clarke et al.,
"Incremental multiset hash functions and their application to memory integrity checking",
ASIACRYPT 2003). Sums commute, so digests of what each worker of each rank consumed, in any order and
across resumes, add up to the digest of everything consumed in the epoch; at the epoch's end that
must equal the digest of every sample of every shard once (:meth:`ShardHasher.expected`, which does
not depend on the order samples were read in and is cached per shard).

Each hash is the splitmix64 finalizer of the index XOR a key of the shard (:func:`sample_hashes`),
vectorised with numpy. :func:`check_digest` compares a digest with what it should be and
:func:`enforce` acts on the result (``exactly_once="raise" | "warn" | "off"``). What the check proves
and its false-pass probability: ``docs/data-tracker.md``, "Exactly-once".
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from uc_checkpoint.data.shuffle import mix64
from uc_checkpoint.errors import ExactlyOnceError, TrackerStateError

logger = logging.getLogger(__name__)

_DIGEST_TAG = b"uc_checkpoint.data_tracker.digest.v1\n"
_MASK = (1 << 64) - 1
_CHUNK = 1 << 18  # indices hashed per vectorised step
_HEX32 = re.compile(r"[0-9a-f]{32}")

#: The values ``DataTracker(exactly_once=...)`` takes.
EXACTLY_ONCE_MODES = ("raise", "warn", "off")


def shard_keys(name: str) -> tuple[int, int]:
    """The two 64-bit keys (one per hash) of the shard called ``name``."""
    raw = name.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(_DIGEST_TAG + f"{len(raw)}:".encode() + raw).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little")


def sample_hashes(keys: tuple[int, int], indices: np.ndarray) -> tuple[int, int]:
    """``(sum of h1, sum of h2)`` modulo 2**64 over ``indices`` (sample indices of one shard, any
    integer array) with the shard's ``keys`` ``(a1, a2)``: ``h_j(i) = mix64(i ^ a_j)``."""
    lanes = np.array(keys, dtype=np.uint64)[:, None]
    s1 = s2 = 0
    flat = np.asarray(indices).reshape(-1)
    for lo in range(0, flat.size, _CHUNK):  # both hashes in one pass over a 2 x chunk array
        sums = mix64(flat[lo : lo + _CHUNK].astype(np.uint64)[None, :] ^ lanes).sum(axis=1, dtype=np.uint64)
        s1 += int(sums[0])
        s2 += int(sums[1])
    return s1 & _MASK, s2 & _MASK


class SampleDigest:
    """Per shard: ``(count, sum of h1, sum of h2)`` of the samples seen (see the module docs).

    Mutable; :meth:`merge` adds another digest. Its saved form (:meth:`to_list`) is
    ``[[shard, count, "<h1 as 16 hex digits><h2 as 16 hex digits>"], ...]`` in ascending shard order,
    shards with no sample left out; its size grows with the shards touched, never with the samples.
    """

    __slots__ = ("_shards",)

    def __init__(self) -> None:
        self._shards: dict[int, tuple[int, int, int]] = {}

    def add(self, shard: int, count: int, s1: int, s2: int) -> None:
        """Add ``count`` samples of ``shard`` whose hash sums are ``s1``, ``s2``."""
        if not count:
            return
        c, a, b = self._shards.get(shard, (0, 0, 0))
        self._shards[shard] = (c + count, (a + s1) & _MASK, (b + s2) & _MASK)

    def merge(self, other: SampleDigest) -> None:
        """Add every sample ``other`` counts."""
        for shard, (c, a, b) in other._shards.items():
            self.add(shard, c, a, b)

    def copy(self) -> SampleDigest:
        """An independent copy."""
        out = SampleDigest()
        out._shards = dict(self._shards)
        return out

    def count(self) -> int:
        """Samples counted, over all shards."""
        return sum(c for c, _a, _b in self._shards.values())

    def entries(self) -> Mapping[int, tuple[int, int, int]]:
        """``{shard: (count, sum of h1, sum of h2)}`` of the shards with samples."""
        return dict(self._shards)

    def to_list(self) -> list[list[Any]]:
        """The saved form (see the class docs): plain ints and strings."""
        return [[s, c, f"{a:016x}{b:016x}"] for s, (c, a, b) in sorted(self._shards.items())]

    @classmethod
    def from_list(cls, raw: Any, num_shards: int, field: str) -> SampleDigest:
        """Parse :meth:`to_list`'s form.

        Raises:
            TrackerStateError: not a list of ``[shard, count, hex]`` with ascending shards below
                ``num_shards``, counts >= 1 and 32 lowercase hex digits; the message names ``field``.
        """
        if not isinstance(raw, list):
            raise TrackerStateError(f"data tracker state: {field!r} must be a list, got {type(raw).__name__}")
        out = cls()
        previous = -1
        for i, item in enumerate(raw):
            ok = (
                isinstance(item, list)
                and len(item) == 3
                and all(type(v) is int for v in item[:2])
                and isinstance(item[2], str)
                and _HEX32.fullmatch(item[2]) is not None
            )
            if not ok or not previous < item[0] < num_shards or item[1] < 1:
                raise TrackerStateError(
                    f"data tracker state: {field}[{i}] = {item!r} is not [shard, count, hash] with a shard "
                    f"above {previous} and below {num_shards}, a count >= 1 and 32 lowercase hex digits"
                )
            sums = int(item[2][:16], 16), int(item[2][16:], 16)
            out._shards[item[0]] = (item[1], *sums)
            previous = item[0]
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleDigest) and other._shards == self._shards

    def __repr__(self) -> str:
        return f"SampleDigest({len(self._shards)} shards, {self.count()} samples)"


class ShardHasher:
    """Hashes sample identities of one dataset, caching each shard's keys and expected digest.

    Args:
        names: the shards' names, in dataset order (``ShardSpec.name``).

    Pickles (it travels to data-loader workers with the tracker and the collate function).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._keys: dict[int, tuple[int, int]] = {}
        self._expected: dict[tuple[int, int], tuple[int, int]] = {}

    def keys(self, shard: int) -> tuple[int, int]:
        """The keys of shard number ``shard``."""
        keys = self._keys.get(shard)
        if keys is None:
            keys = self._keys[shard] = shard_keys(self.names[shard])
        return keys

    def add_indices(self, digest: SampleDigest, shard: int, indices: np.ndarray) -> None:
        """Add the samples ``indices`` (sample indices of shard ``shard``) to ``digest``."""
        if len(indices):
            digest.add(shard, len(indices), *sample_hashes(self.keys(shard), indices))

    def digest_of(self, ids: Sequence[int]) -> SampleDigest:
        """The digest of the samples ``ids`` lists as ``[shard, index, shard, index, ...]`` (what a
        data-loader worker read for one batch)."""
        pairs = np.array(ids, dtype=np.int64).reshape(-1, 2)
        digest = SampleDigest()
        if not len(pairs):
            return digest
        shards = pairs[:, 0]
        first = int(shards[0])
        if (shards == first).all():  # the usual batch: one shard
            self.add_indices(digest, first, pairs[:, 1])
            return digest
        for shard in np.unique(shards).tolist():
            self.add_indices(digest, shard, pairs[shards == shard, 1])
        return digest

    def expected(self, shard: int, num_samples: int) -> tuple[int, int]:
        """The hash sums of samples ``0 .. num_samples - 1`` of ``shard``, each once (cached)."""
        key = (shard, num_samples)
        sums = self._expected.get(key)
        if sums is None:
            sums = self._expected[key] = sample_hashes(self.keys(shard), np.arange(num_samples, dtype=np.int64))
        return sums


class EpochLedger:
    """One rank's part of the exactly-once bookkeeping for the current assignment of work.

    Args:
        workers: consumers of the rank.
        base: the digest of what the epoch consumed before this assignment (from the checkpoint the
            work was loaded from; empty for an epoch started afresh), or None when the epoch cannot be
            checked (the dataset changed under it, or it was saved with the check off).

    ``local`` is what this rank's consumers consumed since. Samples recorded with a digest (the
    data-loader worker's) are added at once; samples recorded without one (a loader of one's own, or
    the samples a loader drops at the end of a pass) are kept as ranges of each consumer's count and
    hashed by :meth:`flush`, so that recording stays a few integer operations.
    """

    def __init__(self, workers: int, base: SampleDigest | None) -> None:
        self.base = base
        self.local = SampleDigest()
        self.pending: list[list[list[int]]] = [[] for _ in range(workers)]
        self.checked = False

    def add(self, worker: int, start: int, count: int, digest: SampleDigest | None) -> None:
        """Consumer ``worker`` consumed samples ``start .. start + count - 1`` of its slice (counted
        from the slice's first sample); ``digest`` is theirs, or None for the tracker to hash.

        Raises:
            ValueError: ``digest`` does not count ``count`` samples.
        """
        if digest is not None:
            if digest.count() != count:
                raise ValueError(f"a digest of {digest.count()} samples was recorded for {count} samples")
            self.local.merge(digest)
            return
        ranges = self.pending[worker]
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = start + count
        elif count:
            ranges.append([start, start + count])

    def flush(self, hasher: ShardHasher, samples: Callable[[int, int, int], Iterable[tuple[int, np.ndarray]]]) -> None:
        """Hash the pending ranges: ``samples(worker, start, end)`` yields ``(shard, sample indices)``
        of those samples of the consumer's slice."""
        for worker, ranges in enumerate(self.pending):
            for start, end in ranges:
                for shard, indices in samples(worker, start, end):
                    hasher.add_indices(self.local, shard, indices)
            ranges.clear()

    def epoch_digest(self, ranks: SampleDigest | None) -> SampleDigest | None:
        """What the whole epoch consumed: the base plus ``ranks`` (the merged local digests of all
        ranks), or None when either is unknown."""
        if self.base is None or ranks is None:
            return None
        total = self.base.copy()
        total.merge(ranks)
        return total


@dataclass(frozen=True)
class ShardDiscrepancy:
    """A shard whose consumed samples are not each expected sample once: ``expected`` and
    ``consumed`` counts, and ``same_count_other_samples`` when the counts agree but the digests
    do not (at least one sample skipped and as many repeated)."""

    shard: int
    name: str
    expected: int
    consumed: int
    same_count_other_samples: bool


@dataclass(frozen=True)
class DigestReport:
    """:func:`check_digest`'s verdict: ``samples_covered`` (samples the digest counts),
    ``shards_complete`` (shards all of whose samples were consumed once, digest included),
    ``shards`` (shards checked) and the ``discrepancies``."""

    samples_covered: int
    shards_complete: int
    shards: int
    discrepancies: tuple[ShardDiscrepancy, ...]

    @property
    def ok(self) -> bool:
        """True when every shard checked out."""
        return not self.discrepancies

    def describe(self, limit: int = 5) -> str:
        """One line: how many samples were skipped or repeated, and in which shards (the first
        ``limit``)."""
        if self.ok:
            return f"all {self.samples_covered} samples of {self.shards} shards consumed exactly once"
        skipped = sum(max(0, d.expected - d.consumed) for d in self.discrepancies)
        repeated = sum(max(0, d.consumed - d.expected) for d in self.discrepancies)
        swapped = sum(d.same_count_other_samples for d in self.discrepancies)
        parts = []
        if skipped or repeated:
            parts.append(f"{skipped} samples skipped and {repeated} repeated (net counts)")
        if swapped:
            parts.append(
                f"{swapped} shard{'s' if swapped > 1 else ''} with the right count but other samples "
                "(k >= 1 skipped and as many repeated)"
            )
        shown = []
        for d in self.discrepancies[:limit]:
            if d.same_count_other_samples:
                what = f"{d.consumed} consumed, k >= 1 skipped and as many repeated"
            elif d.consumed < d.expected:
                what = f"{d.expected - d.consumed} skipped ({d.consumed} of {d.expected} consumed)"
            else:
                what = f"{d.consumed - d.expected} repeated ({d.consumed} consumed of {d.expected})"
            shown.append(f"shard {d.shard} {d.name!r}: {what}")
        more = len(self.discrepancies) - len(shown)
        return "; ".join(parts) + ": " + "; ".join(shown) + (f"; and {more} more shards" if more > 0 else "")


def check_digest(
    hasher: ShardHasher,
    sizes: Sequence[int],
    digest: SampleDigest,
    remaining: Mapping[int, Sequence[np.ndarray]] | None = None,
) -> DigestReport:
    """Check that ``digest`` counts every sample of every shard exactly once, except the samples
    still to be read.

    Args:
        hasher: the dataset's hasher.
        sizes: ``num_samples`` of every shard, in dataset order.
        digest: what was consumed.
        remaining: per shard, arrays of the sample indices not consumed yet (the epoch's remaining
            work mapped through the shard order); None or empty at the epoch's end. Checking a shard
            with remaining samples hashes them (``O(remaining samples)``).

    The check hashes every shard once (the expected digest, cached in ``hasher``).
    """
    remaining = remaining or {}
    entries = digest.entries()
    bad: list[ShardDiscrepancy] = []
    complete = 0
    for shard, size in enumerate(sizes):
        e1, e2 = hasher.expected(shard, size) if size else (0, 0)
        left = 0
        for part in remaining.get(shard, ()):
            r1, r2 = sample_hashes(hasher.keys(shard), part)
            e1, e2, left = (e1 - r1) & _MASK, (e2 - r2) & _MASK, left + len(part)
        count, s1, s2 = entries.get(shard, (0, 0, 0))
        if count == size - left and (s1, s2) == (e1, e2):
            complete += not left
            continue
        bad.append(ShardDiscrepancy(shard, hasher.names[shard], size - left, count, count == size - left))
    return DigestReport(digest.count(), complete, len(sizes), tuple(bad))


def enforce(report: DigestReport, mode: str, epoch: int) -> None:
    """Act on the end-of-epoch check of ``epoch`` per ``mode`` (one of :data:`EXACTLY_ONCE_MODES`).

    Raises:
        ExactlyOnceError: ``mode == "raise"`` and the report names a discrepancy.
    """
    if report.ok:
        logger.info("data tracker: epoch %d exactly-once check passed: %s", epoch, report.describe())
        return
    message = f"exactly-once check of epoch {epoch} failed: {report.describe()}"
    if mode == "raise":
        raise ExactlyOnceError(message)
    if mode == "warn":
        logger.warning("data tracker: %s", message)


__all__ = [
    "EXACTLY_ONCE_MODES",
    "DigestReport",
    "EpochLedger",
    "SampleDigest",
    "ShardDiscrepancy",
    "ShardHasher",
    "check_digest",
    "enforce",
    "sample_hashes",
    "shard_keys",
]
