"""Shard readers for the data tracker: one class per format, each discovering its shards
(:meth:`~uc_checkpoint.data.readers.base.ShardReader.shards`) and reading any range of a shard by
seeking (the ``read_shard`` of :class:`~uc_checkpoint.data.loading.TrackedShardDataset`). pyarrow is
imported only when a Parquet or Hugging Face reader is built. See docs/data-tracker.md, "Readers"."""

from __future__ import annotations

from uc_checkpoint.data.readers.base import ShardReader
from uc_checkpoint.data.readers.fingerprint import file_fingerprint
from uc_checkpoint.data.readers.hf import HfDatasetReader
from uc_checkpoint.data.readers.jsonl import GzipJsonlReader, JsonlReader
from uc_checkpoint.data.readers.parquet import ParquetReader
from uc_checkpoint.data.readers.tokens import TokenReader
from uc_checkpoint.data.readers.webdataset import WebDatasetReader

__all__ = [
    "GzipJsonlReader",
    "HfDatasetReader",
    "JsonlReader",
    "ParquetReader",
    "ShardReader",
    "TokenReader",
    "WebDatasetReader",
    "file_fingerprint",
]
