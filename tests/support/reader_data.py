"""Data shards written by each format's own library (numpy, pyarrow, json/gzip, tarfile, datasets),
with the samples each library reads back, for the shard-reader tests.

``FORMATS[name]`` is a :class:`Format`: ``write(root, sizes)`` writes one shard per entry of ``sizes``
(that many samples) into the directory ``root`` and returns the samples of every shard, as the
format's own library reads them (a full read), in shard order; ``reader(location, **options)`` builds
the uc_checkpoint reader. ``plain(sample)`` makes samples comparable (arrays to lists).
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from uc_checkpoint.data.readers import (
    GzipJsonlReader,
    HfDatasetReader,
    JsonlReader,
    ParquetReader,
    ShardReader,
    TokenReader,
    WebDatasetReader,
)

SEQ_LEN = 15  # windows of 16 tokens


def plain(sample: Any) -> Any:
    """A sample as plain Python values (token windows to lists)."""
    return sample.tolist() if isinstance(sample, np.ndarray) else sample


def _write_npy(root: Path, sizes: Sequence[int]) -> list[list[Any]]:
    out = []
    for i, n in enumerate(sizes):
        tokens = (np.arange(n * (SEQ_LEN + 1) + 5, dtype=np.int64) * 7 + i * 1000) % 60000  # +5: an unused tail
        np.save(root / f"tokens-{i:03d}.npy", tokens.astype(np.uint16))
        full = np.load(root / f"tokens-{i:03d}.npy")
        out.append([full[k * (SEQ_LEN + 1) : (k + 1) * (SEQ_LEN + 1)].astype(np.int64).tolist() for k in range(n)])
    return out


def _write_bin(root: Path, sizes: Sequence[int]) -> list[list[Any]]:
    out = []
    for i, n in enumerate(sizes):
        tokens = (np.arange(n * (SEQ_LEN + 1), dtype=np.int64) * 13 + i) % (1 << 31)
        tokens.astype(np.uint32).tofile(root / f"tokens-{i:03d}.bin")
        full = np.fromfile(root / f"tokens-{i:03d}.bin", dtype=np.uint32)
        out.append([full[k * (SEQ_LEN + 1) : (k + 1) * (SEQ_LEN + 1)].astype(np.int64).tolist() for k in range(n)])
    return out


def _rows(i: int, n: int) -> list[dict[str, Any]]:
    return [{"shard": i, "row": k, "text": "w" * (k % 11) + f"-{i}-{k}"} for k in range(n)]


def _write_parquet(root: Path, sizes: Sequence[int]) -> list[list[Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    for i, n in enumerate(sizes):
        pq.write_table(
            pa.Table.from_pylist(_rows(i, n)), root / f"part-{i:03d}.parquet", row_group_size=max(32, n // 20)
        )
        out.append(pq.read_table(root / f"part-{i:03d}.parquet").to_pylist())
    return out


def _write_jsonl(root: Path, sizes: Sequence[int]) -> list[list[Any]]:
    out = []
    for i, n in enumerate(sizes):
        with open(root / f"part-{i:03d}.jsonl", "w") as f:
            for row in _rows(i, n):
                f.write(json.dumps(row) + "\n")
        with open(root / f"part-{i:03d}.jsonl") as f:
            out.append([json.loads(line) for line in f if line.strip()])
    return out


def _write_jsonl_gz(root: Path, sizes: Sequence[int]) -> list[list[Any]]:
    """Shards of many gzip members (one per 32 lines), so they can be seeked."""
    out = []
    for i, n in enumerate(sizes):
        rows = _rows(i, n)
        with open(root / f"part-{i:03d}.jsonl.gz", "wb") as f:
            for k in range(0, max(n, 1), 32):
                f.write(gzip.compress("".join(json.dumps(r) + "\n" for r in rows[k : k + 32]).encode(), mtime=0))
        with gzip.open(root / f"part-{i:03d}.jsonl.gz", "rt") as g:
            out.append([json.loads(line) for line in g if line.strip()])
    return out


def _write_tar(root: Path, sizes: Sequence[int]) -> list[list[Any]]:
    out = []
    for i, n in enumerate(sizes):
        path = root / f"shard-{i:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for k in range(n):
                for field, data in (("txt", f"text {i} {k} ".encode() * (k % 5 + 1)), ("cls", str(k % 3).encode())):
                    info = tarfile.TarInfo(f"s{i}/{k:06d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        samples: list[dict[str, Any]] = []
        with tarfile.open(path) as tar:  # grouped by key, as webdataset does
            for member in tar:
                key, field = member.name.split(".", 1)
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                if samples and samples[-1]["__key__"] == key:
                    samples[-1][field] = data
                else:
                    samples.append({"__key__": key, field: data})
        out.append(samples)
    return out


def _write_hf(root: Path, sizes: Sequence[int]) -> list[list[Any]]:
    """One save_to_disk dataset whose shards have the given sizes (``num_shards`` splits evenly,
    so equal sizes are asked for; ``sizes`` must all be equal)."""
    import datasets

    assert len(set(sizes)) == 1, "save_to_disk splits evenly: give equal sizes"
    rows = [r for i, n in enumerate(sizes) for r in _rows(i, n)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(root), num_shards=len(sizes), max_shard_size=None)
    back = datasets.load_from_disk(str(root)).to_list()
    out, pos = [], 0
    for n in sizes:
        out.append(back[pos : pos + n])
        pos += n
    return out


@dataclass(frozen=True)
class Format:
    write: Callable[[Path, Sequence[int]], list[list[Any]]]
    reader: Callable[..., ShardReader]
    equal_sizes: bool = False


FORMATS: dict[str, Format] = {
    "npy": Format(_write_npy, lambda loc, **kw: TokenReader(loc, SEQ_LEN, **kw)),
    "bin": Format(_write_bin, lambda loc, **kw: TokenReader(loc, SEQ_LEN, dtype="uint32", **kw)),
    "parquet": Format(_write_parquet, lambda loc, **kw: ParquetReader(loc, **kw)),
    "jsonl": Format(_write_jsonl, lambda loc, **kw: JsonlReader(loc, **kw)),
    "jsonl.gz": Format(_write_jsonl_gz, lambda loc, **kw: GzipJsonlReader(loc, **kw)),
    "tar": Format(_write_tar, lambda loc, **kw: WebDatasetReader(loc, **kw)),
    "hf": Format(_write_hf, lambda loc, **kw: HfDatasetReader(loc, **kw), equal_sizes=True),
}
