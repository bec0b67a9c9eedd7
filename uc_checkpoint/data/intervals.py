"""The data tracker's arithmetic on sample ranges: pure functions of their arguments, no state.

A dataset is an ordered list of :class:`ShardSpec`; work is a list of :class:`Interval` (half-open
ranges of raw samples of one shard) in *stream order*, the order an epoch reads them. Here:

* :func:`dataset_fingerprint` and :func:`epoch_shard_order`: what identifies a dataset and the shard
  order of an epoch (both hash with fixed domain tags, so they are the same on every interpreter);
* :func:`whole_epoch`, :func:`coalesce`, :func:`drop_prefix`: building and trimming work;
* :func:`slice_sizes`, :func:`assign` and :func:`cut`: cutting work into one contiguous slice per
  consumer;
* :func:`assignment_id`: a short id of one such cut, which ranks compare before merging progress;
* :func:`resume_summary`: what a resume onto such a cut skips and where it seeks.

Saved work carried over to a changed dataset: :mod:`uc_checkpoint.data.dataset_change`.

See :mod:`uc_checkpoint.data.tracker` for the model these serve.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# Domain tags keep these hashes distinct from any other sha256 of similar text. They name the module
# the tracker lived in when they were chosen; changing them would change every saved run's order.
_FINGERPRINT_TAG = b"uc_checkpoint.data_tracker.fingerprint.v1\n"
_ORDER_TAG = "uc_checkpoint.data_tracker.order.v1"
_ASSIGNMENT_TAG = b"uc_checkpoint.data_tracker.assignment.v1\n"


def check_int(value: Any, what: str, *, minimum: int | None = None) -> int:
    """``value`` as an argument named ``what``: an int (not a bool) of at least ``minimum``.

    Raises:
        TypeError: not an int (a bool is refused: True as a sample count is almost certainly a bug).
        ValueError: below ``minimum``.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class ShardSpec:
    """One shard of the dataset: its name, how many raw samples it holds, and a fingerprint of its
    content.

    ``name`` identifies the shard within the dataset, independently of where the dataset is stored:
    the readers use the file's name relative to the dataset's root (``part-0001.jsonl``), so the same
    files copied or synced elsewhere are the same shards. It also keys the shard's exactly-once
    hashes and its within-shard permutation.

    ``fingerprint`` identifies the bytes behind the name, wherever they are stored: the readers
    give ``"size=<bytes>,ends_sha256=<hex>"``
    (:func:`~uc_checkpoint.data.readers.fingerprint.content_fingerprint`: the size and a hash of the
    first and last 64 KiB); ``""`` means unknown, and then only the name
    and the count identify the shard. A known fingerprint enters :func:`dataset_fingerprint`, so that
    a resume onto a shard whose content changed (same name and count) is refused naming the shard
    and both fingerprints.
    """

    name: str
    num_samples: int
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"ShardSpec.name must be a str, got {type(self.name).__name__}")
        check_int(self.num_samples, f"ShardSpec({self.name!r}).num_samples", minimum=0)
        if not isinstance(self.fingerprint, str):
            raise TypeError(
                f"ShardSpec({self.name!r}).fingerprint must be a str, got {type(self.fingerprint).__name__}"
            )


@dataclass(frozen=True)
class Interval:
    """Raw samples ``start .. end - 1`` of shard number ``shard`` (index into the dataset's shard
    list, not a position in the epoch order)."""

    shard: int
    start: int
    end: int

    def __post_init__(self) -> None:
        check_int(self.shard, "Interval.shard", minimum=0)
        check_int(self.start, "Interval.start", minimum=0)
        check_int(self.end, "Interval.end", minimum=0)
        if self.end < self.start:
            raise ValueError(f"Interval end {self.end} < start {self.start}")

    @property
    def size(self) -> int:
        """Number of samples in the interval."""
        return self.end - self.start


def dataset_fingerprint(shards: Sequence[ShardSpec]) -> str:
    """Hex sha256 over the shard names, sample counts and known content fingerprints, in order.

    Reordering, renaming, resizing, adding or removing a shard, or changing a known
    :attr:`ShardSpec.fingerprint`, changes it; a shard whose fingerprint is ``""`` adds only its name
    and count. Names and fingerprints are length-prefixed so that no two different shard lists
    encode to the same bytes.
    """
    h = hashlib.sha256(_FINGERPRINT_TAG)
    h.update(f"{len(shards)}\n".encode())
    for shard in shards:
        # surrogatepass: names decoded from odd file systems may hold lone surrogates.
        name = shard.name.encode("utf-8", "surrogatepass")
        h.update(f"{len(name)}:".encode())
        h.update(name)
        h.update(f":{shard.num_samples}".encode())
        if shard.fingerprint:
            content = shard.fingerprint.encode("utf-8", "surrogatepass")
            h.update(f"|{len(content)}:".encode())
            h.update(content)
        h.update(b"\n")
    return h.hexdigest()


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch ``epoch`` visits shards ``0 .. num_shards - 1``.

    A permutation that depends only on ``(seed, epoch)``: shards are sorted by
    ``sha256("uc_checkpoint.data_tracker.order.v1:{seed}:{epoch}:{index}")``. This is used instead
    of ``random.Random(...).shuffle`` because Python only guarantees ``random()``'s sequence across
    versions, not how ``shuffle`` consumes it, and a resumed run must rebuild the very same order on
    any interpreter. Ties (never seen in practice) fall back to the shard index.
    """
    check_int(num_shards, "num_shards", minimum=0)
    check_int(seed, "seed")
    check_int(epoch, "epoch", minimum=0)
    prefix = f"{_ORDER_TAG}:{seed}:{epoch}:"

    def key(index: int) -> tuple[bytes, int]:
        return hashlib.sha256(f"{prefix}{index}".encode()).digest(), index

    return sorted(range(num_shards), key=key)


def whole_epoch(shards: Sequence[ShardSpec], seed: int, epoch: int) -> list[Interval]:
    """The work of an epoch started afresh: every non-empty shard whole, in :func:`epoch_shard_order`."""
    order = epoch_shard_order(len(shards), seed, epoch)
    return [Interval(i, 0, shards[i].num_samples) for i in order if shards[i].num_samples]


def iter_positions(intervals: Iterable[Interval]) -> Iterator[tuple[int, int]]:
    """``(shard, sample)`` of every sample in ``intervals``, in order: what a reader yields."""
    for iv in intervals:
        for offset in range(iv.start, iv.end):
            yield iv.shard, offset


def total_size(intervals: Iterable[Interval]) -> int:
    """Samples in ``intervals``."""
    return sum(iv.size for iv in intervals)


def coalesce(intervals: Iterable[Interval]) -> list[Interval]:
    """``intervals`` without empty ones and with neighbours that continue each other in the same shard
    merged, so that a state stays one interval per contiguous run however the work was cut before."""
    out: list[Interval] = []
    for iv in intervals:
        if iv.size == 0:
            continue
        if out and out[-1].shard == iv.shard and out[-1].end == iv.start:
            out[-1] = Interval(iv.shard, out[-1].start, iv.end)
        else:
            out.append(iv)
    return out


def drop_prefix(intervals: Sequence[Interval], count: int) -> list[Interval]:
    """``intervals`` without their first ``count`` samples (all of them when ``count`` is larger)."""
    out: list[Interval] = []
    for iv in intervals:
        if count >= iv.size:
            count -= iv.size
            continue
        out.append(Interval(iv.shard, iv.start + count, iv.end))
        count = 0
    return out


def slice_sizes(total: int, num_consumers: int, batch_size: int = 1) -> list[int]:
    """Sizes (in samples) of the slices :func:`assign` cuts ``total`` samples into.

    The work is counted in whole batches of ``batch_size`` samples plus ``partial = total %
    batch_size`` samples: with ``total // batch_size = q * num_consumers + r`` batches, the first
    ``r`` consumers get ``q + 1`` batches, the others ``q``, and the partial batch goes to consumer
    ``r`` (the first one with a batch fewer; consumer 0 when all have as many). So at most one
    consumer's slice is not a whole number of batches, and sizes differ by at most ``batch_size``.
    With ``batch_size=1`` that is: sizes differ by at most one sample, the first consumers getting
    the extra ones.

    Raises:
        TypeError, ValueError: an argument is not an int, or ``num_consumers``/``batch_size`` < 1.
    """
    check_int(total, "total", minimum=0)
    check_int(num_consumers, "num_consumers", minimum=1)
    check_int(batch_size, "batch_size", minimum=1)
    batches, partial = divmod(total, batch_size)
    base, extra = divmod(batches, num_consumers)
    sizes = [(base + (1 if c < extra else 0)) * batch_size for c in range(num_consumers)]
    sizes[extra] += partial  # extra < num_consumers, so there is always such a consumer
    return sizes


def assign(remaining: Sequence[Interval], num_consumers: int, batch_size: int = 1) -> list[list[Interval]]:
    """Cut ``remaining`` (in stream order) into ``num_consumers`` contiguous slices.

    Consumer ``c`` gets the ``c``-th slice, of the size :func:`slice_sizes` gives: with the default
    ``batch_size=1`` sizes differ by at most one sample (with ``total = q * num_consumers + r`` the
    first ``r`` consumers get ``q + 1`` samples, the others ``q``); with a larger ``batch_size``
    every slice but at most one is a whole number of batches. A slice may start or end inside a
    shard and span several shards; slices are empty when there is too little work. Concatenating
    the slices gives back ``remaining`` (neighbouring pieces of one shard merged).
    """
    check_int(num_consumers, "num_consumers", minimum=1)
    for iv in remaining:
        if not isinstance(iv, Interval):
            raise TypeError(f"assign() expects Interval items, got {type(iv).__name__}")
    work = coalesce(remaining)
    return cut(work, slice_sizes(total_size(work), num_consumers, batch_size))


def cut(remaining: Sequence[Interval], sizes: Sequence[int]) -> list[list[Interval]]:
    """Cut ``remaining`` (in stream order) into contiguous slices of ``sizes`` samples, in order:
    the slices :func:`assign` makes, or those a saved cut names.

    Raises:
        ValueError: ``sizes`` do not add up to the samples of ``remaining``, or one is negative.
    """
    work = coalesce(remaining)
    if any(n < 0 for n in sizes) or sum(sizes) != total_size(work):
        raise ValueError(f"cannot cut {total_size(work)} samples into slices of {list(sizes)}")
    slices: list[list[Interval]] = []
    index = 0  # interval of `work` being cut
    cursor = work[0].start if work else 0  # first sample of work[index] not yet handed out
    for want in sizes:
        piece: list[Interval] = []
        while want > 0:
            iv = work[index]
            take = min(want, iv.end - cursor)
            piece.append(Interval(iv.shard, cursor, cursor + take))
            want -= take
            cursor += take
            if cursor == iv.end:
                index += 1
                if index < len(work):
                    cursor = work[index].start
        slices.append(piece)
    return slices


def assignment_id(
    fingerprint: str,
    epoch: int,
    num_consumers: int,
    batch_size: int,
    work: Iterable[Interval],
    shuffle_within_shard: bool = False,
    sizes: Sequence[int] | None = None,
) -> str:
    """Short id (16 hex digits) of one cut of ``work``: the dataset, epoch, consumer count, batch
    size, whether shards are shuffled within, the slice ``sizes`` when the cut is not
    :func:`assign`'s (a saved one, see :func:`cut`), and the work itself. Ranks compare it before
    merging progress, so that a local state taken from another cut (another epoch, another loaded
    checkpoint, other batch sizes or shuffling) is refused."""
    h = hashlib.sha256(_ASSIGNMENT_TAG)
    h.update(f"{fingerprint}:{epoch}:{num_consumers}:{batch_size}:".encode())
    if shuffle_within_shard:
        h.update(b"shuffled:")
    if sizes is not None:
        h.update(f"cut:{','.join(map(str, sizes))}:".encode())
    for iv in work:
        h.update(f"{iv.shard},{iv.start},{iv.end};".encode())
    return h.hexdigest()[:16]


def resume_summary(
    shards: Sequence[ShardSpec],
    workers_per_rank: int,
    epoch: int,
    base: Sequence[Interval],
    slices: Sequence[Sequence[Interval]],
    max_names: int = 8,
) -> dict[str, Any]:
    """What a run resumed onto work ``base`` of ``epoch``, cut into ``slices`` (one per consumer,
    ``workers_per_rank`` consumers per rank), skips and where it seeks (the return value of
    ``DataTracker.resume_summary``, which documents its keys)."""
    left_per_shard = [0] * len(shards)
    for iv in base:
        left_per_shard[iv.shard] += iv.size
    skipped = [s.name for i, s in enumerate(shards) if s.num_samples and left_per_shard[i] == 0]
    partial = [
        [s.name, s.num_samples - left_per_shard[i], s.num_samples]
        for i, s in enumerate(shards)
        if 0 < left_per_shard[i] < s.num_samples
    ]
    seeks = []
    for c, piece in enumerate(slices):
        if piece and piece[0].start > 0:
            rank, worker = divmod(c, workers_per_rank)
            seeks.append([rank, worker, shards[piece[0].shard].name, piece[0].start])
    remaining = sum(left_per_shard)
    return {
        "epoch": epoch,
        "samples_consumed_in_epoch": sum(s.num_samples for s in shards) - remaining,
        "samples_remaining": remaining,
        "skipped_shards": len(skipped),
        "skipped_names": skipped[:max_names],
        "partial_shards": partial,
        "seeks": seeks,
    }


__all__ = [
    "Interval",
    "ShardSpec",
    "assign",
    "assignment_id",
    "check_int",
    "coalesce",
    "cut",
    "dataset_fingerprint",
    "drop_prefix",
    "epoch_shard_order",
    "iter_positions",
    "resume_summary",
    "slice_sizes",
    "total_size",
    "whole_epoch",
]
