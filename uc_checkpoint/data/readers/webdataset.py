"""WebDataset-style tar shards: a shard is one ``.tar`` file, a sample the consecutive members that
share a key.

Keys follow webdataset's convention: a member ``dir/abc.seg.jpg`` has key ``dir/abc`` (the path up to
the first dot of its file name) and field ``seg.jpg`` (the rest); consecutive members with the same
key form one sample, ``{"__key__": key, "seg.jpg": bytes, ...}``. Directories and other non-file
members are skipped.

An index of every sample's members (field, data offset, size) is built once by reading the tar
headers (one pass that skips member data) and cached like JSON Lines' (``<file>.uc-index`` beside a
writable local file, else under the staging root; checked against the file's fingerprint). A sample
is then one read of exactly its members' bytes (a slice of a local file's memory map, or one
ranged GET), and a
run of consecutive samples one read up to ``max_request_bytes``. Random access.
"""

from __future__ import annotations

import json
import os
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


def split_key(path: str) -> tuple[str, str]:
    """``(key, field)`` of a member path, webdataset's way: ``"a/b.c.d" -> ("a/b", "c.d")``."""
    folder, _, base = path.rpartition("/")
    stem, _, field = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), field


class WebDatasetReader(ShardReader):
    """Samples of webdataset ``.tar`` shards, as dicts of field to bytes (see the module docs).

    Args:
        location, files, volume_options, index_dir: see :class:`~uc_checkpoint.data.readers.base.ShardReader`.
        max_request_bytes: bytes per read of a run of consecutive samples at most (at least one sample).

    Raises:
        DataFormatError: not a tar file, or truncated (a member's data ends past the file); the
            message names the file.
    """

    suffixes = (".tar",)
    random_access = True
    _kind = "webdataset-members-v1"

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        *,
        max_request_bytes: int = 8 << 20,
        **options: Unpack[ShardReaderOptions],
    ) -> None:
        super().__init__(location, **options)
        self.max_request_bytes = max_request_bytes

    def _count(self, name: str, size: int, fingerprint: str) -> int:
        return len(self._index(name, size, fingerprint)[0])

    def _index(self, name: str, size: int | None = None, fingerprint: str | None = None) -> tuple[Members, np.ndarray]:
        """Per sample ``(key, [(field, data offset, size), ...])``, and each sample's byte span
        ``(start, end)`` (first member's data to last member's end) as an int64 array."""
        return self.cached_index(
            name, self._kind, self._scan, lambda index: json.dumps(index[0]).encode(), self._decode, size, fingerprint
        )

    def _decode(self, name: str, payload: bytes, size: int) -> tuple[Members, np.ndarray] | None:
        """The index kept as JSON of its members, or None when it is not that."""
        try:
            samples = [(k, [(f, int(o), int(n)) for f, o, n in m]) for k, m in json.loads(payload)]
        except (ValueError, TypeError):
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
                    if not member.isfile():
                        continue
                    if member.offset_data + member.size > size:
                        raise self.malformed(name, f"truncated: member {member.name!r} ends past its {size} bytes")
                    key, field = split_key(member.name)
                    if samples and samples[-1][0] == key:
                        if any(f == field for f, _, _ in samples[-1][1]):
                            raise self.malformed(
                                name, f"member {member.name!r} appears twice: sample {key!r} has two {field!r} fields"
                            )
                        samples[-1][1].append((field, member.offset_data, member.size))
                    else:
                        samples.append((key, [(field, member.offset_data, member.size)]))
        except tarfile.TarError as exc:
            raise self.malformed(name, f"not a readable tar file: {exc}") from None
        return self._with_spans(name, samples, size)

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
