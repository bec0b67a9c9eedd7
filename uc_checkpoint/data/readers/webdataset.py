"""WebDataset-style tar shards: a shard is one ``.tar`` file, a sample the consecutive members that
share a key.

Keys follow webdataset's convention (its ``tar_file_iterator``, ``base_plus_ext`` and
``group_by_keys``): a member ``dir/abc.seg.JPG`` has key ``dir/abc`` (the path up to the first dot of
its file name) and field ``seg.jpg`` (the rest, lowercased); consecutive members with the same key
form one sample, ``{"__key__": key, "seg.jpg": bytes, ...}``, and a field twice in one sample is an
error. Members webdataset skips are skipped: directories and other non-regular members, names
without an extension (``LICENSE``, ``dir.d/README``), and metadata members (a top-level
``__name__``, or a path starting ``__name__/``).

Damage: Python's ``tarfile`` (which webdataset reads with) ends an archive silently at a header it
cannot read (cut short, zeroed or garbled) and at the file's end, so a tar cut or damaged inside its
headers would lose whole samples or fields without an error. This reader checks what the format
fixes (POSIX ``ustar``: 512-byte header blocks, member data padded to 512 bytes, two zero blocks
ending the archive): the last member's padded data lies inside the file and is followed by the two
zero blocks; anything else is a :class:`~uc_checkpoint.errors.DataFormatError` naming the file.
Bytes after the two zero blocks are accepted unread, as the format allows (writers pad the archive
to whole records: 10240 bytes for GNU tar and Python's ``tarfile``).

An index of every sample's members (field, data offset, size) is built once by reading the tar
headers (one pass that skips member data) and cached like JSON Lines' (``<file>.uc-index`` beside a
writable local file, else under the staging root; checked against the file's version stamp). A sample
is then one read of exactly its members' bytes (a slice of a local file's memory map, or one
ranged GET), and a
run of consecutive samples one read up to ``max_request_bytes``. Random access.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from uc_checkpoint.data.readers.base import ShardReader, ShardReaderOptions
from uc_checkpoint.volumes import Volume

if TYPE_CHECKING:
    from typing_extensions import Unpack

Sample = dict[str, Any]
#: Per sample ``(key, [(field, data offset, size), ...])``.
Members = list[tuple[str, list[tuple[str, int, int]]]]


_BLOCK = 512  # tar header and data block, bytes
_END_OF_ARCHIVE = 2 * _BLOCK  # two zero blocks
# webdataset's member name rules, the patterns of its ``base_plus_ext`` and ``tar_file_iterator``
# (webdataset/tariterators.py), kept as they are since they define the convention, edge cases included
# (``a/.hidden`` is key ``a/``, field ``hidden``): a key, a dot, an extension without a slash.
_KEY_AND_EXTENSION = re.compile(r"((?:.*/|)[^.]+)[.]([^/]*)")
_META_PATH = re.compile(r"__[^/]*__($|/)")


def split_key(path: str) -> tuple[str, str] | None:
    """``(key, field)`` of a tar member path, webdataset's way, or None for a member webdataset
    skips: ``"a/b.c.JPG" -> ("a/b", "c.jpg")``; ``"LICENSE"``, ``"d.e/f"`` (no extension),
    ``"__meta__"`` and ``"__meta__/x.txt"`` (metadata) -> None."""
    if _META_PATH.match(path) or ("/" not in path and path.startswith("__") and path.endswith("__")):
        return None
    found = _KEY_AND_EXTENSION.fullmatch(path)
    if found is None:
        return None
    return found.group(1), found.group(2).lower()


class WebDatasetReader(ShardReader):
    """Samples of webdataset ``.tar`` shards, as dicts of field to bytes (see the module docs).

    Args:
        location, files, volume_options, index_dir: see :class:`~uc_checkpoint.data.readers.base.ShardReader`.
        max_request_bytes: bytes per read of a run of consecutive samples at most (at least one sample).

    Raises:
        DataFormatError: not a tar file; truncated or damaged (a member's padded data ends past the
            file, or the last member is not followed by the two zero blocks that end an archive); a
            field twice in one sample; a sparse member. The message names the file.
    """

    suffixes = (".tar",)
    random_access = True
    _kind = "webdataset-members-v2"

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        *,
        max_request_bytes: int = 8 << 20,
        **options: Unpack[ShardReaderOptions],
    ) -> None:
        super().__init__(location, **options)
        self.max_request_bytes = max_request_bytes

    def _count(self, name: str, size: int, version: str) -> int:
        return len(self._index(name, size, version)[0])

    def _index(self, name: str, size: int | None = None, version: str | None = None) -> tuple[Members, np.ndarray]:
        """Per sample ``(key, [(field, data offset, size), ...])``, and each sample's byte span
        ``(start, end)`` (first member's data to last member's end) as an int64 array."""
        return self.cached_index(
            name, self._kind, self._scan, lambda index: json.dumps(index[0]).encode(), self._decode, size, version
        )

    def _decode(self, name: str, payload: bytes, size: int) -> tuple[Members, np.ndarray] | None:
        """The index kept as JSON of its members, or None when it is not that or cannot be this
        file's (members not in file order, not at block boundaries, or past its end)."""
        try:
            samples = [(k, [(f, int(o), int(n)) for f, o, n in m]) for k, m in json.loads(payload)]
        except (ValueError, TypeError):
            return None
        end = 0  # where the previous member's data ends
        for _, members in samples:
            for _, offset, n in members:
                if offset % _BLOCK or offset < end + _BLOCK or n < 0:  # a header block before each member's data
                    return None
                end = offset + n
        if end > size:
            return None
        return self._with_spans(name, samples, size)

    def _with_spans(self, name: str, samples: Members, size: int) -> tuple[Members, np.ndarray]:
        spans = np.asarray([(m[0][1], m[-1][1] + m[-1][2]) for _, m in samples], dtype=np.int64).reshape(-1, 2)
        if spans.size and int(spans[:, 1].max()) > size:
            raise self.malformed(name, f"truncated: a member ends past its {size} bytes")
        return samples, spans

    def _scan(self, name: str, size: int) -> tuple[Members, np.ndarray]:
        samples: Members = []
        try:
            with self.open_file(name, size, buffer_size=64 << 10) as f, tarfile.open(fileobj=f, mode="r:") as tar:
                for member in tar:
                    if not member.isreg():
                        continue
                    if member.issparse():
                        raise self.malformed(name, f"member {member.name!r} is a sparse file, which is not read")
                    if member.offset_data + member.size > size:
                        raise self.malformed(name, f"truncated: member {member.name!r} ends past its {size} bytes")
                    parts = split_key(member.name)
                    if parts is None:
                        continue
                    key, field = parts
                    if samples and samples[-1][0] == key:
                        if any(f == field for f, _, _ in samples[-1][1]):
                            raise self.malformed(
                                name, f"member {member.name!r} appears twice: sample {key!r} has two {field!r} fields"
                            )
                        samples[-1][1].append((field, member.offset_data, member.size))
                    else:
                        samples.append((key, [(field, member.offset_data, member.size)]))
                end = tar.offset  # where tarfile stopped: the block after the last member's padded data
        except tarfile.TarError as exc:
            raise self.malformed(name, f"not a readable tar file: {exc}") from None
        self._check_end(name, size, end)
        return self._with_spans(name, samples, size)

    def _check_end(self, name: str, size: int, end: int) -> None:
        """Refuse a tar whose members are not followed by the end-of-archive marker at ``end``."""
        if end + _END_OF_ARCHIVE > size:
            raise self.malformed(
                name,
                f"truncated: its {size} bytes end inside a tar header or the end-of-archive marker "
                f"(two zero blocks at byte {end}); members after byte {end} are lost",
            )
        if any(self.read_bytes(name, end, end + _END_OF_ARCHIVE)):
            raise self.malformed(
                name,
                f"damaged: the block at byte {end} is neither a tar header nor the end-of-archive marker "
                "(two zero blocks); members from there on cannot be read",
            )

    def _read_range(self, name: str, start: int, end: int) -> Iterator[Sample]:
        samples, spans = self._index(name)
        if end > len(samples):
            raise self.malformed(name, f"has {len(samples)} samples, {end} asked")
        i = start
        while i < end:
            first = int(spans[i, 0])
            last = max(i + 1, int(np.searchsorted(spans[i:end, 1], first + self.max_request_bytes, side="right")) + i)
            block = self.read_block(name, first, int(spans[last - 1, 1]))
            for j in range(i, last):
                key, members = samples[j]
                sample: Sample = {"__key__": key}
                for field, offset, n in members:
                    sample[field] = bytes(block[offset - first : offset - first + n])
                yield sample
            i = last


__all__ = ["WebDatasetReader", "split_key"]
