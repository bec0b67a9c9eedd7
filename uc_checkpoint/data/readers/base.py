"""What every shard reader shares: discovery, fingerprints, byte access and cached indexes.

A reader (one class per format, :class:`ShardReader` subclasses) turns a location (a local directory,
an ``s3://`` prefix or any fsspec URL, opened with :func:`uc_checkpoint.volumes.open_volume`) into
the tracker's shard list (:meth:`ShardReader.shards`) and reads samples ``start .. end - 1`` of a
shard by seeking (:meth:`ShardReader.__call__`, the ``read_shard`` of
:class:`~uc_checkpoint.data.loading.TrackedShardDataset`), or any samples in a given order
(:meth:`ShardReader.read_indices`, for formats with random access). Readers pickle without their
open files and caches: DataLoader workers open what they need themselves.

A shard is named relative to the location and fingerprinted by its content
(:func:`~uc_checkpoint.data.readers.fingerprint.content_fingerprint`), so a dataset keeps its
identity when it is copied or synced elsewhere; the store's version stamp of a file
(:func:`~uc_checkpoint.data.readers.fingerprint.version_of`: mtime or ETag) only keys what is kept
per place and tells a worker that a file changed since :meth:`ShardReader.shards`.

Formats whose sample boundaries are not in the file's own metadata (JSON Lines, tar) keep an index
built once per file version (:class:`IndexCache`): beside the file where that directory is
writable, else under the staging root; it records the file's version stamp and is rebuilt, never
trusted, when the file changed.

The shape (a reader object whose call reads one shard's range) follows the tracker's
``read_shard`` contract (docs/data-tracker.md, "Readers"); the index cache beside the data follows
Megatron-LM's ``.idx`` files next to its ``.bin`` token files and webdataset's ``wids`` index of tar
members.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import io
import json
import logging
import mmap
import os
import stat
import tempfile
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypedDict, TypeVar, cast

import numpy as np

from uc_checkpoint.data.intervals import ShardSpec
from uc_checkpoint.data.readers.fingerprint import content_fingerprint, version_of
from uc_checkpoint.engine.staging_dir import default_staging_root
from uc_checkpoint.errors import CorruptCheckpointError, DataFormatError, DataLoadingError, DatasetMismatchError
from uc_checkpoint.volumes import FileStat, LocalVolume, Volume, open_volume
from uc_checkpoint.volumes.process_local import ProcessLocal
from uc_checkpoint.volumes.ranged import RangedStream

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Suffix of a cached index file written beside its data file.
INDEX_SUFFIX = ".uc-index"
_INDEX_MAGIC = b"UCIDX1\n"


def require(module: str, extra: str) -> ModuleType:
    """Import an optional dependency, or fail with one line naming the extra that installs it.

    Raises:
        ImportError: ``module`` is not installed; the message says ``pip install 'uc-checkpoint[extra]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"this reader needs {module.split('.')[0]}: pip install 'uc-checkpoint[{extra}]'") from None


def contiguous_runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """``indices`` (1-D int64) cut into runs of consecutive ascending values, in order, as half-open
    ``(start, end)`` ranges: ``[4, 5, 6, 1, 2, 9] -> [(4, 7), (1, 3), (9, 10)]``."""
    if indices.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [indices.size]))
    return [(int(indices[s]), int(indices[e - 1]) + 1) for s, e in zip(starts, ends)]


def rows_of_groups(starts: Sequence[int], group: Callable[[int], Sequence[T]], start: int, end: int) -> Iterator[T]:
    """Rows ``start .. end - 1`` of a file stored in groups of rows (Parquet row groups, Arrow record
    batches), each group read once: ``starts`` is the first row of each group, then the total;
    ``group(g)`` gives the rows of group ``g``."""
    row = start
    while row < end:
        g = bisect.bisect_right(starts, row) - 1
        rows = group(g)
        stop = min(end, starts[g + 1])
        yield from rows[row - starts[g] : stop - starts[g]]
        row = stop


def picks_of_groups(starts: Sequence[int], group: Callable[[int], Sequence[T]], indices: np.ndarray) -> Iterator[T]:
    """Rows ``indices`` (1-D int64, any order) of a file stored in groups of rows (as
    :func:`rows_of_groups`), in that order; the groups they touch are read once each."""
    groups = np.searchsorted(np.asarray(starts), indices, side="right") - 1
    needed = {int(g): group(int(g)) for g in np.unique(groups)}
    for i, g in zip(indices.tolist(), groups.tolist()):
        yield needed[g][i - int(starts[g])]


class IndexCache:
    """Indexes of data files (line offsets, tar members, record batches), built once per file
    content and kept as ``<file>.uc-index`` beside a local file whose directory is writable, else as
    ``<index_dir>/<hash of the URL>-<file name>.uc-index`` (``index_dir`` defaults to
    ``<staging root>/uc-checkpoint-data-index-<uid>``; remote and read-only data). Each index records the
    kind, the data file's URL and version stamp (:func:`version_of`); one that does not match the
    file as it is now (the file changed, or it is a copy of the index made with the data elsewhere)
    or is damaged (its length or SHA-256 checksum, recorded with it, does not match: bit rot, a
    truncated write, edited entries) is rebuilt, never used.

    Args:
        index_dir: where indexes of files that cannot have one beside them go.
    """

    def __init__(self, index_dir: str | os.PathLike[str] | None = None) -> None:
        self.index_dir = Path(index_dir) if index_dir is not None else None
        self._checked: dict[Path, bool] = {}  # default index directory -> whether it is private

    def path_for(self, volume: Volume, name: str) -> Path | None:
        """Where the index of ``name`` is kept (see the class docs); None when the default
        directory is not this user's own (:meth:`_private`): no index is then kept or read."""
        if isinstance(volume, LocalVolume):
            data = volume.root / name
            if os.access(data.parent, os.W_OK | os.X_OK):
                return data.with_name(data.name + INDEX_SUFFIX)
        root = self.index_dir
        if root is None:
            root = default_staging_root() / f"uc-checkpoint-data-index-{os.geteuid()}"
            if not self._private(root):
                return None
        url = volume.url_of(name)
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        return root / f"{digest}-{name.rsplit('/', 1)[-1]}{INDEX_SUFFIX}"

    def _private(self, root: Path) -> bool:
        """Whether the default index directory ``root`` is this user's alone (created mode 0700
        when missing). One that is a symbolic link, belongs to another user or is writable by
        others is not used: whoever can write there could hand this process an index that skips
        samples (its checksum is no secret). Logged once per cache."""
        if root in self._checked:
            return self._checked[root]
        why = None
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.lstat(root)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                why = "it is not a plain directory"
            elif st.st_uid != os.geteuid():
                why = f"it belongs to uid {st.st_uid}"
            elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                why = f"others can write to it (mode {stat.S_IMODE(st.st_mode):04o})"
        except OSError as exc:
            why = str(exc)
        if why is not None:
            logger.warning(
                "not keeping data indexes in %s: %s; indexes are rebuilt at every start (pass index_dir= "
                "to the reader, or set UC_CHECKPOINT_STAGING_DIR, to keep them elsewhere)",
                root,
                why,
            )
        self._checked[root] = why is None
        return why is None

    def load(self, volume: Volume, name: str, kind: str, version: str) -> bytes | None:
        """The cached index payload of ``name`` when it was built for this version of the file
        (:func:`version_of`), else None."""
        if not version:
            return None
        path = self.path_for(volume, name)
        if path is None:
            return None
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("cannot read data index %s (%s); rebuilding it", path, exc)
            return None
        head, sep, payload = raw[len(_INDEX_MAGIC) :].partition(b"\n")
        try:
            meta = json.loads(head) if raw.startswith(_INDEX_MAGIC) and sep else None
        except (ValueError, RecursionError):
            meta = None
        if (
            not isinstance(meta, dict)
            or meta.get("payload_bytes") != len(payload)
            or meta.get("payload_sha256") != hashlib.sha256(payload).hexdigest()
        ):
            logger.warning("data index %s is damaged (its checksum does not match); rebuilding it", path)
            return None
        if (meta.get("kind"), meta.get("source"), meta.get("version")) != (kind, volume.url_of(name), version):
            logger.info("data index %s is stale (%s changed); rebuilding it", path, volume.url_of(name))
            return None
        return payload

    def store(self, volume: Volume, name: str, kind: str, version: str, payload: bytes) -> None:
        """Keep ``payload`` as the index of ``name`` at ``version`` (atomically: temp file and
        rename). A failure to write is logged, not raised: the index is rebuilt next time."""
        if not version:
            return
        path = self.path_for(volume, name)
        if path is None:
            return
        meta = {
            "kind": kind,
            "source": volume.url_of(name),
            "version": version,
            "payload_bytes": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),  # a damaged index is seen, not used
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_INDEX_MAGIC + json.dumps(meta).encode() + b"\n" + payload)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            logger.warning("cannot write data index %s (%s); it will be rebuilt next time", path, exc)


class ShardReaderOptions(TypedDict, total=False):
    """The keyword arguments every reader takes (those of :class:`ShardReader`), so that a format's
    reader names only its own: ``def __init__(self, location, *, columns=None, **options:
    Unpack[ShardReaderOptions])``."""

    files: Sequence[str] | None
    volume_options: dict[str, Any] | None
    index_dir: str | os.PathLike[str] | None


class ShardReader(ABC):
    """Base of the format readers: one shard per data file under a location.

    Args:
        location: a directory (local path), an ``s3://bucket/prefix`` or any fsspec URL, or a
            :class:`Volume`; its files with the reader's suffixes, at any depth, sorted by name,
            are the shards (``files`` overrides).
        files: names of the shard files relative to ``location``, in shard order.
        volume_options: for :func:`~uc_checkpoint.volumes.open_volume` (S3: ``endpoint_url``,
            ``addressing_style``, ...; the same options checkpoint volumes take).
        index_dir: where indexes of remote or read-only files are kept (see :class:`IndexCache`).

    A shard's ``name`` is its file's name relative to ``location`` (``part-0001.jsonl``,
    ``train/data-00000-of-00004.arrow``) and its ``fingerprint`` the file's
    :func:`content_fingerprint`: neither depends on where the dataset is stored, so a state saved
    while reading it from one place resumes on the same files copied or synced to another. Reading a
    shard first checks, once per process (each DataLoader worker, forked or spawned, checks again),
    that the file is still the one the shard describes: its version stamp (:func:`version_of`) is
    still the one :meth:`shards` saw, or, for a shard this reader did not list (or listed at another
    version), its content fingerprint is the shard's.

    Raises (from the constructor):
        VolumeError: ``location`` cannot be opened with ``volume_options``.
    """

    #: Whether :meth:`read_indices` can read any samples in any order without reading others.
    random_access: ClassVar[bool] = True
    #: File name endings of this format's shards.
    suffixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        *,
        files: Sequence[str] | None = None,
        volume_options: dict[str, Any] | None = None,
        index_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.volume = open_volume(location, **(volume_options or {}))
        self.files = None if files is None else [str(f) for f in files]
        self.index_cache = IndexCache(index_dir)
        self._cache: ProcessLocal[dict[Any, Any]] = ProcessLocal()  # open files, parsed indexes, checks
        # name -> (version stamp, content fingerprint) as shards() saw them; travels to workers
        self._listed: dict[str, tuple[str, str]] = {}

    @property
    def cache(self) -> dict[Any, Any]:
        """This process's open files, parsed indexes and shard checks: a forked worker starts with an
        empty one (no file position or client shared with its parent, every shard checked again), as
        does a pickled copy (a spawned worker)."""
        return self._cache.get(dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.volume.url!r})"

    # ---- discovery --------------------------------------------------------------------------------
    def shard_files(self) -> list[str]:
        """Names (relative to the location) of the shard files, in shard order.

        Raises:
            DataLoadingError: no file with the reader's suffixes was found.
        """
        if self.files is not None:
            return list(self.files)
        names = sorted(
            e.name
            for e in self.volume.list_tree()
            if not e.is_dir and e.name.endswith(self.suffixes) and not e.name.rsplit("/", 1)[-1].startswith(".")
        )
        if not names:
            raise DataLoadingError(f"no {'/'.join(self.suffixes)} files under {self.volume.url}")
        return names

    def shards(self) -> list[ShardSpec]:
        """One :class:`ShardSpec` per shard file: its name relative to the location, sample count
        (from the format's metadata or a cached index) and :func:`content_fingerprint`. Per file: one
        ``stat`` (a HEAD on S3), one or two ranged reads of 64 KiB for the fingerprint, and what
        counting needs.

        Raises:
            DataFormatError: a file is not of this format (the message names it).
            DataLoadingError: no shard files.
        """
        out = []
        for name in self.shard_files():
            stat = self.volume.stat(name)
            if stat is None:
                raise DataFormatError(f"data shard {self.volume.url_of(name)} does not exist")
            version = version_of(stat)
            fingerprint = content_fingerprint(self.volume, name, stat.size)
            count = self._count(name, stat.size, version)
            out.append(ShardSpec(name, count, fingerprint))
            self._listed[name] = (version, fingerprint)
        return out

    def file_stat(self, name: str) -> FileStat:
        """Size and version of file ``name`` (one ``stat`` locally, one HEAD on S3).

        Raises:
            DataFormatError: the file does not exist (the message names it).
        """
        stat = self.volume.stat(name)
        if stat is None:
            raise self.malformed(name, "the file does not exist")
        return stat

    def cached_index(
        self,
        name: str,
        kind: str,
        scan: Callable[[str, int], T],
        encode: Callable[[T], bytes],
        decode: Callable[[str, bytes, int], T | None],
        size: int | None = None,
        version: str | None = None,
    ) -> T:
        """The index of file ``name``, built once per file content: this process's copy, else the
        :attr:`index_cache` entry made for the file as it is now (when ``decode`` accepts it), else
        ``scan`` (then kept in the index cache).

        Args:
            name: the file, relative to the location.
            kind: the index format and its version (recorded with the entry; another kind's is not used).
            scan: ``scan(name, size)``: the index built by reading the file of ``size`` bytes.
            encode: the index as the bytes kept in the index cache.
            decode: ``decode(name, payload, size)``: the index from cached bytes, or None when they
                are not one (then it is rebuilt).
            size, version: the file's size in bytes and version stamp (:func:`version_of`) where
                the caller has them; else one :meth:`file_stat`.

        Raises:
            DataFormatError: the file does not exist, or ``scan`` / ``decode`` found it malformed.
        """
        key = ("index", kind, name)
        found = self.cache.get(key)
        if found is not None:
            return cast(T, found)
        if size is None or version is None:
            stat = self.file_stat(name)
            size, version = stat.size, version_of(stat)
        payload = self.index_cache.load(self.volume, name, kind, version)
        index = None if payload is None else decode(name, payload, size)
        if index is None:
            index = scan(name, size)
            self.index_cache.store(self.volume, name, kind, version, encode(index))
        self.cache[key] = index
        return index

    def cached_table(
        self,
        name: str,
        kind: str,
        dtype: str,
        columns: int,
        scan: Callable[[str, int], np.ndarray],
        size: int | None = None,
        version: str | None = None,
        *,
        min_rows: int = 0,
        fits: Callable[[np.ndarray, int], bool] | None = None,
    ) -> np.ndarray:
        """An index that is a ``(rows, columns)`` table of 8-byte integers (``dtype`` ``"<u8"`` or
        ``"<i8"``), cached as its raw bytes (:meth:`cached_index`). A cached table is used when it
        has whole rows, ``min_rows`` at least, and ``fits(table, size)`` (when given) holds.

        Raises:
            DataFormatError: as :meth:`cached_index`.
        """
        row_bytes = np.dtype(dtype).itemsize * columns

        def decode(_: str, payload: bytes, size: int) -> np.ndarray | None:
            if len(payload) % row_bytes or len(payload) < row_bytes * min_rows:
                return None
            table = np.frombuffer(payload, dtype=dtype).reshape(-1, columns)
            return table if fits is None or fits(table, size) else None

        return self.cached_index(name, kind, scan, lambda table: table.astype(dtype).tobytes(), decode, size, version)

    @abstractmethod
    def _count(self, name: str, size: int, version: str) -> int:
        """Samples in file ``name`` of ``size`` bytes and version stamp ``version``
        (:func:`version_of`), from metadata or an index (never all data)."""

    # ---- reading ----------------------------------------------------------------------------------
    def __call__(self, shard: ShardSpec, start: int, end: int) -> Iterator[Any]:
        """Samples ``start .. end - 1`` of ``shard``, in order, seeking to ``start``.

        Raises:
            DataLoadingError: ``shard``'s name is not relative to this reader's location (an
                absolute path or URL), or the range is outside the shard.
            DatasetMismatchError: the file is not the one ``shard`` describes: it changed since
                :meth:`shards`, or its content fingerprint differs from the shard's.
            DataFormatError: the file is missing, truncated or malformed.
        """
        name = self._open(shard)
        if not 0 <= start <= end <= shard.num_samples:
            raise DataLoadingError(f"samples {start}..{end} are outside {shard.name} ({shard.num_samples} samples)")
        return self._read_range(name, start, end)

    def read_indices(self, shard: ShardSpec, indices: Sequence[int] | np.ndarray) -> Iterator[Any]:
        """Samples ``indices`` of ``shard``, in that order (each read without reading others).

        Raises:
            TypeError: the format has no random access (``random_access`` is False).
            DataLoadingError / DatasetMismatchError / DataFormatError: as :meth:`__call__`.
        """
        if not self.random_access:
            raise TypeError(f"{type(self).__name__} reads shards sequentially: it has no read_indices")
        name = self._open(shard)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= shard.num_samples):
            raise DataLoadingError(
                f"sample indices {int(idx.min())}..{int(idx.max())} are outside {shard.name} "
                f"({shard.num_samples} samples)"
            )
        return self._read_indices(name, idx)

    @abstractmethod
    def _read_range(self, name: str, start: int, end: int) -> Iterator[Any]:
        """Samples ``start .. end - 1`` of file ``name`` (range checked)."""

    def _read_indices(self, name: str, indices: np.ndarray) -> Iterator[Any]:
        """Samples ``indices`` of file ``name`` in order; by default, one range read per run of
        consecutive indices."""
        for start, end in contiguous_runs(indices):
            yield from self._read_range(name, start, end)

    def _open(self, shard: ShardSpec) -> str:
        """The file name of ``shard`` relative to the location, after checking (once per process and
        shard) that the file is the one the shard describes (see the class docs)."""
        name = shard.name
        if name.startswith("/") or "://" in name or ".." in name.split("/"):
            raise DataLoadingError(
                f"shard {name!r} is not a name relative to {type(self).__name__}'s location {self.volume.url} "
                "(ShardSpec names are relative to the dataset's root: use the reader's shards())"
            )
        checked: set[str] = self.cache.setdefault("checked", set())
        if shard.fingerprint and name not in checked:
            stat = self.file_stat(name)
            listed = self._listed.get(name)
            if listed is not None and listed[1] == shard.fingerprint:
                version = version_of(stat)
                if version != listed[0]:
                    raise DatasetMismatchError(
                        f"data shard {self.volume.url_of(name)} changed since its shard list was made: version "
                        f"{version}, the shard list was made at {listed[0]}"
                    )
            else:
                now = content_fingerprint(self.volume, name, stat.size)
                if now != shard.fingerprint:
                    raise DatasetMismatchError(
                        f"data shard {self.volume.url_of(name)} is not the shard {name!r} of the shard list: "
                        f"content fingerprint {now}, the shard list has {shard.fingerprint}"
                    )
            checked.add(name)
        return name

    def recent(self, kind: str, key: Any, limit: int, load: Callable[[], T]) -> T:
        """``load()``, kept among this process's ``limit`` most recently used values of ``kind``
        (decoded row groups or batches): a value still kept is returned without loading it again."""
        kept: OrderedDict[Any, Any] = self.cache.setdefault(kind, OrderedDict())
        if key in kept:
            kept.move_to_end(key)
            return cast(T, kept[key])
        value = load()
        kept[key] = value
        while len(kept) > limit:
            kept.popitem(last=False)
        return value

    # ---- bytes ------------------------------------------------------------------------------------
    def local_path(self, name: str) -> Path | None:
        """The path of ``name`` on this machine's file system (memory-mapped reads), or None."""
        return self.volume.root / name if isinstance(self.volume, LocalVolume) else None

    def mapped(self, name: str) -> mmap.mmap | bytes:
        """The local file ``name`` memory-mapped read-only (once per process; ``b""`` when empty)."""
        key = ("mmap", name)
        found = self.cache.get(key)
        if found is None:
            path = self.local_path(name)
            if path is None:
                raise ValueError(f"{self.volume.url_of(name)} is not a local file")
            with open(path, "rb") as f:
                found = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
            self.cache[key] = found
        return found

    def read_block(self, name: str, start: int, end: int) -> bytes | memoryview:
        """Bytes ``[start, end)`` of ``name``: a view of its memory map (local files) or one ranged
        read (:meth:`read_bytes`).

        Raises:
            DataFormatError: the file ends before ``end``.
        """
        if self.local_path(name) is None:
            return self.read_bytes(name, start, end)
        data = self.mapped(name)
        if end > len(data):
            raise self.malformed(name, f"ends at byte {len(data)}, byte {end - 1} needed (truncated since indexed?)")
        return memoryview(data)[start:end]

    def read_bytes(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of file ``name``: one ranged read.

        Raises:
            DataFormatError: the file is missing or ends before ``end``.
            TransferError: the store failed otherwise.
        """
        if end <= start:
            return b""
        try:
            return self.volume.read_range(name, start, end)
        except CorruptCheckpointError as exc:
            raise DataFormatError(
                f"data shard {self.volume.url_of(name)}: cannot read bytes {start}-{end - 1}: the file is "
                "missing or shorter (truncated, or changed since its shard list was made)"
            ) from exc

    def open_file(self, name: str, size: int, buffer_size: int = 1 << 20) -> io.BufferedReader:
        """``name`` as a buffered, seekable binary file: the local file itself, or ranged reads of
        ``buffer_size`` bytes at least (a :class:`~uc_checkpoint.volumes.ranged.RangedStream` of
        :meth:`read_bytes`)."""
        path = self.local_path(name)
        if path is not None:
            return open(path, "rb")  # noqa: SIM115 - the caller closes it
        stream = RangedStream(lambda start, end: self.read_bytes(name, start, end), size)
        return io.BufferedReader(stream, buffer_size=buffer_size)

    def malformed(self, name: str, what: str) -> DataFormatError:
        """The error for file ``name`` that is not what this reader reads."""
        return DataFormatError(f"data shard {self.volume.url_of(name)}: {what}")


__all__ = [
    "INDEX_SUFFIX",
    "IndexCache",
    "ShardReaderOptions",
    "ShardReader",
    "contiguous_runs",
    "picks_of_groups",
    "require",
    "rows_of_groups",
]
