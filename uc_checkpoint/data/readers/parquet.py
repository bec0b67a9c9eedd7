"""Parquet files (pyarrow): a shard is one file, a sample one row (a dict of column to value).

Damage: what pyarrow refuses (magic bytes, footer, pages), with the page checksums verified that the
writer stored (pyarrow's ``page_checksum_verification``: parquet-java, Spark's writer, stores them by
default, pyarrow with ``write_page_checksum=True``), row counts that disagree (the footer's total,
its row groups', the rows a row group decodes to) and text that is not UTF-8 are a
:class:`~uc_checkpoint.errors.DataFormatError` naming the file.

Counting: the footer's ``num_rows`` (pyarrow reads the footer only: a ranged read of the file's
tail on remote files). Seeking: the footer lists the row groups and their row counts, so row ``i``
is found in its row group, which is read alone (only the asked ``columns``) and sliced; a range or a
list of indices reads only the row groups it touches, each once per call (the last few stay cached
in the process for the next call).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from uc_checkpoint.data.readers.base import ShardReader, ShardReaderOptions, picks_of_groups, require, rows_of_groups
from uc_checkpoint.volumes import Volume

if TYPE_CHECKING:
    from typing_extensions import Unpack


class ParquetReader(ShardReader):
    """Rows of ``.parquet`` files, as dicts (``pyarrow.Table.to_pylist``).

    Args:
        location, files, volume_options, index_dir: see :class:`~uc_checkpoint.data.readers.base.ShardReader`.
        columns: the columns to read (default: all).
        cached_row_groups: decoded row groups kept per process for later calls (memory: that many
            row groups of the asked columns).

    Needs pyarrow (``pip install 'uc-checkpoint[parquet]'``).

    Raises:
        ImportError: pyarrow is missing (one line naming the extra).
        DataFormatError: a file is not Parquet (bad footer, truncated), is damaged (see the module
            docs) or lacks a column; the message names the file.
    """

    suffixes = (".parquet",)
    random_access = True

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        *,
        columns: Sequence[str] | None = None,
        cached_row_groups: int = 2,
        **options: Unpack[ShardReaderOptions],
    ) -> None:
        require("pyarrow.parquet", "parquet")
        super().__init__(location, **options)
        self.columns = None if columns is None else list(columns)
        self.cached_row_groups = max(1, cached_row_groups)

    def _parquet(self, name: str, size: int | None = None) -> tuple[Any, list[int]]:
        """The open ``ParquetFile`` of ``name`` and the first row of each row group (plus the total)."""
        key = ("file", name)
        found = self.cache.get(key)
        if found is None:
            pq = require("pyarrow.parquet", "parquet")
            pa = require("pyarrow", "parquet")
            if size is None:
                size = self.file_stat(name).size
            path = self.local_path(name)
            try:
                source = str(path) if path is not None else self.open_file(name, size, buffer_size=64 << 10)
                pf = pq.ParquetFile(source, memory_map=path is not None, page_checksum_verification=True)
            except (pa.ArrowException, OSError) as exc:
                raise self.malformed(name, f"not a readable Parquet file: {exc}") from None
            meta = pf.metadata
            starts = [0]
            for g in range(meta.num_row_groups):
                starts.append(starts[-1] + meta.row_group(g).num_rows)
            if starts[-1] != meta.num_rows:
                raise self.malformed(
                    name, f"its footer says {meta.num_rows} rows, its row groups hold {starts[-1]} (damaged footer)"
                )
            missing = [c for c in self.columns or () if c not in pf.schema_arrow.names]
            if missing:
                raise self.malformed(name, f"has no column(s) {missing}; it has {pf.schema_arrow.names}")
            found = (pf, starts)
            self.cache[key] = found
        return found

    def _count(self, name: str, size: int, version: str) -> int:
        return self._parquet(name, size)[1][-1]

    def _row_group(self, name: str, group: int) -> list[dict[str, Any]]:
        """The rows of row group ``group``, decoded (the last few kept: ``cached_row_groups``)."""
        return self.recent("groups", (name, group), self.cached_row_groups, lambda: self._decode_group(name, group))

    def _decode_group(self, name: str, group: int) -> list[dict[str, Any]]:
        pf, starts = self._parquet(name)
        pa = require("pyarrow", "parquet")
        try:
            rows: list[dict[str, Any]] = pf.read_row_group(group, columns=self.columns).to_pylist()
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # a damaged string column
            raise self.malformed(name, f"cannot read row group {group}: {exc}") from None
        if len(rows) != starts[group + 1] - starts[group]:
            raise self.malformed(
                name,
                f"row group {group} decoded to {len(rows)} rows, its footer says {starts[group + 1] - starts[group]}",
            )
        return rows

    def _read_range(self, name: str, start: int, end: int) -> Iterator[dict[str, Any]]:
        _, starts = self._parquet(name)
        yield from rows_of_groups(starts, lambda g: self._row_group(name, g), start, end)

    def _read_indices(self, name: str, indices: np.ndarray) -> Iterator[dict[str, Any]]:
        _, starts = self._parquet(name)
        yield from picks_of_groups(starts, lambda g: self._row_group(name, g), indices)


__all__ = ["ParquetReader"]
