"""The compression benchmark (benchmarks/compression.py) runs and its figures hang together: in
the benchmarks' quick tests (``./scripts/test.sh benchmarks``) once at 8 MiB, so the harness cannot rot;
``python -m benchmarks.compression --size-mb N`` measures at size."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.compression import describe, measure

QUICK = bool(os.environ.get("UC_BENCH_QUICK"))
MB = 8 if QUICK else int(os.environ.get("UC_BENCH_MB", "64"))


def test_compression_saves_bytes_and_costs_cpu(tmp_path: Path) -> None:
    result = measure("gpt", MB, 1, tmp_path)
    plain, zstd = result["plain"], result["zstd"]
    assert plain["stored_bytes"] > result["state_bytes"]  # archives around every tensor
    assert zstd["stored_bytes"] < plain["stored_bytes"]  # exponents of random floats compress
    assert all(r[k] > 0 for r in (plain, zstd) for k in ("save_s", "save_cpu_s", "load_s", "load_cpu_s"))
    assert "zstd/plain" in describe(result)
    assert not any(tmp_path.glob("*-0"))  # every checkpoint measured was removed
