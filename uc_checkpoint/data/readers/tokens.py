"""Flat token files: ``.npy`` arrays and raw ``.bin`` files of unsigned integer tokens.

A shard is one file holding one long stream of token ids (documents concatenated, as pretraining
pipelines write them: nanoGPT's ``train.bin``, Megatron-LM's ``.bin``). A sample is a window of
``seq_len + 1`` consecutive tokens (input ``window[:-1]``, next-token target ``window[1:]``); the
windows of a file do not overlap (window ``i`` is tokens ``i * (seq_len + 1) .. (i + 1) * (seq_len +
1) - 1``) and a tail shorter than a window is not used, so a file of ``T`` tokens has
``T // (seq_len + 1)`` samples. Every window lies inside one file.

Seeking: window ``i`` is at byte ``offset + i * (seq_len + 1) * itemsize``, so any window is one
slice of a ``np.memmap`` (local files) or one ranged read (remote files); ``.npy`` headers are parsed
for dtype, shape and the data offset (numpy's own header format, ``numpy.lib.format``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from uc_checkpoint.data.readers.base import ShardReader, ShardReaderOptions
from uc_checkpoint.volumes import Volume

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: The dtypes a raw ``.bin`` token file may hold.
BIN_DTYPES = ("uint8", "uint16", "uint32")
_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class _Layout:
    offset: int  # bytes before the first token
    dtype: np.dtype[Any]
    tokens: int


class TokenReader(ShardReader):
    """Windows of ``seq_len + 1`` tokens from ``.npy`` and ``.bin`` token files (see the module docs).

    Args:
        location, files, volume_options, index_dir: see :class:`~uc_checkpoint.data.readers.base.ShardReader`.
        seq_len: tokens per sample's input; a sample holds ``seq_len + 1`` tokens.
        dtype: the token type of ``.bin`` files (``"uint8"``, ``"uint16"`` or ``"uint32"``; required
            for them). For ``.npy`` files, which record their dtype, a given ``dtype`` must match.
        max_request_bytes: bytes per ranged read of a remote file at most (whole windows; at least
            one window).

    Samples are ``np.ndarray`` of shape ``(seq_len + 1,)`` and dtype int64 (ready for an embedding).

    Raises:
        ValueError: ``seq_len < 1`` or a ``dtype`` outside :data:`BIN_DTYPES`.
        DataFormatError (from :meth:`shards` and reads): a ``.bin`` without ``dtype`` or whose size
            is not a whole number of tokens, a ``.npy`` with a bad header, another dtype than given,
            a non-integer dtype, or fewer bytes than its header promises; the message names the file.
    """

    suffixes = (".npy", ".bin")
    random_access = True

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        seq_len: int,
        *,
        dtype: str | None = None,
        max_request_bytes: int = 8 << 20,
        **options: Unpack[ShardReaderOptions],
    ) -> None:
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        if dtype is not None and str(np.dtype(dtype)) not in BIN_DTYPES:
            raise ValueError(f"dtype must be one of {BIN_DTYPES}, got {dtype!r}")
        super().__init__(location, **options)
        self.seq_len = seq_len
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.max_request_bytes = max_request_bytes

    @property
    def window(self) -> int:
        """Tokens per sample: ``seq_len + 1``."""
        return self.seq_len + 1

    def _count(self, name: str, size: int, version: str) -> int:
        return self._layout(name, size).tokens // self.window

    def _layout(self, name: str, size: int | None = None) -> _Layout:
        key = ("layout", name)
        found = self.cache.get(key)
        if found is None:
            if size is None:
                size = self.file_stat(name).size
            found = self._npy_layout(name, size) if name.endswith(".npy") else self._bin_layout(name, size)
            self.cache[key] = found
        return found

    def _bin_layout(self, name: str, size: int) -> _Layout:
        if self.dtype is None:
            raise self.malformed(name, f"a raw .bin token file needs TokenReader(dtype=...), one of {BIN_DTYPES}")
        if size % self.dtype.itemsize:
            raise self.malformed(
                name, f"{size} bytes is not a whole number of {self.dtype} tokens (truncated, or another dtype?)"
            )
        return _Layout(0, self.dtype, size // self.dtype.itemsize)

    def _npy_layout(self, name: str, size: int) -> _Layout:
        head = self.read_bytes(name, 0, min(size, 4096))
        if not head.startswith(_NPY_MAGIC) or len(head) < 10:
            raise self.malformed(name, "not a .npy file (no NUMPY magic)")
        major = head[6]
        length_bytes = 2 if major == 1 else 4
        header_len = int.from_bytes(head[8 : 8 + length_bytes], "little")
        offset = 8 + length_bytes + header_len
        if offset > len(head):
            if offset > size:
                raise self.malformed(name, f"truncated .npy header ({size} bytes, header needs {offset})")
            head = self.read_bytes(name, 0, offset)
        try:
            stream = io.BytesIO(head[:offset])
            version = np.lib.format.read_magic(stream)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
            else:
                raise ValueError(f"format version {version} is not read (1.0 and 2.0 are)")
        except (ValueError, SyntaxError) as exc:
            raise self.malformed(name, f"bad .npy header: {exc}") from None
        if dtype.kind not in "ui":
            raise self.malformed(name, f"dtype {dtype} is not an integer token type")
        if self.dtype is not None and dtype.newbyteorder("=") != self.dtype:
            raise self.malformed(name, f"holds {dtype} tokens, TokenReader(dtype={str(self.dtype)!r}) was asked")
        if fortran and len(shape) > 1:
            raise self.malformed(name, "a Fortran-ordered array: save the tokens as a 1-D array")
        tokens = int(np.prod(shape, dtype=np.int64))
        if size < offset + tokens * dtype.itemsize:
            raise self.malformed(
                name, f"truncated: {size} bytes, its header promises {offset + tokens * dtype.itemsize}"
            )
        return _Layout(offset, dtype, tokens)

    def _tokens(self, name: str, layout: _Layout) -> np.ndarray:
        key = ("memmap", name)
        found = self.cache.get(key)
        if found is None:
            path = self.local_path(name)
            assert path is not None
            found = np.memmap(path, dtype=layout.dtype, mode="r", offset=layout.offset, shape=(layout.tokens,))
            self.cache[key] = found
        return found

    def _read_range(self, name: str, start: int, end: int) -> Iterator[np.ndarray]:
        layout = self._layout(name)
        if end * self.window > layout.tokens:
            raise self.malformed(name, f"window {end - 1} ends past its {layout.tokens} tokens")
        w = self.window
        if start >= end:
            return
        if self.local_path(name) is not None:
            tokens = self._tokens(name, layout)
            for i in range(start, end):
                yield np.asarray(tokens[i * w : (i + 1) * w], dtype=np.int64)
            return
        per_request = max(1, self.max_request_bytes // (w * layout.dtype.itemsize))
        for first in range(start, end, per_request):
            last = min(end, first + per_request)
            data = self.read_bytes(
                name,
                layout.offset + first * w * layout.dtype.itemsize,
                layout.offset + last * w * layout.dtype.itemsize,
            )
            block = np.frombuffer(data, dtype=layout.dtype).reshape(last - first, w)
            for row in block:
                yield row.astype(np.int64)


__all__ = ["BIN_DTYPES", "TokenReader"]
