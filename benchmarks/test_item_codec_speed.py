"""Per-item cost of DCP's tensor item format: ``torch.save`` / ``torch.load`` per tensor (what DCP's
stock writer and reader do) against :class:`~uc_checkpoint.dcp.item_codec.ItemCodec`'s templates, for
16 KiB float32 tensors (the benchmark's "small" shape). Each benchmarked call writes or reads one
item (the tensors taken in turn), so pytest-benchmark's table is the per-item time, with its rounds
and statistics.

Run: ``./scripts/test.sh benchmarks/test_item_codec_speed.py -n 0 --benchmark-enable --benchmark-only``
(``UC_BENCH_ITEMS`` sets the distinct tensors cycled through, default 4096).
"""

from __future__ import annotations

import io
import itertools
import os

import pytest
import torch

from uc_checkpoint.dcp.item_codec import ItemCodec

ITEMS = 64 if os.environ.get("UC_BENCH_QUICK") else int(os.environ.get("UC_BENCH_ITEMS", "4096"))
TENSORS = [torch.randn(512, 8, generator=torch.Generator().manual_seed(i)) for i in range(ITEMS)]


def _archive(write, t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    write(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize("how", ["torch.save", "template"])
def test_write_one_item(benchmark, how: str) -> None:
    write = torch.save if how == "torch.save" else ItemCodec().write
    tensors = itertools.cycle(TENSORS)
    benchmark(lambda: _archive(write, next(tensors)))
    # Either way, what stock DCP would read back is the tensor itself.
    for t in TENSORS[:16]:
        assert torch.equal(torch.load(io.BytesIO(_archive(write, t)), weights_only=True), t)


@pytest.mark.parametrize("how", ["torch.load", "template"])
def test_read_one_item(benchmark, how: str) -> None:
    codec = ItemCodec()
    archives = [memoryview(bytearray(_archive(codec.write, t))) for t in TENSORS]

    def read(a: memoryview) -> torch.Tensor | None:
        if how == "torch.load":
            return torch.load(io.BytesIO(a), weights_only=True)
        return codec.decode(a, torch.float32, (512, 8))

    pairs = itertools.cycle(zip(archives, TENSORS))
    benchmark(lambda: read(next(pairs)[0]))
    for a, src in zip(archives, TENSORS):
        got = read(a)
        assert got is not None and torch.equal(got, src)
