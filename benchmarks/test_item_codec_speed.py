"""Per-item cost of DCP's tensor item format: ``torch.save`` / ``torch.load`` per tensor (what DCP's
stock writer and reader do) against :class:`~uc_checkpoint.dcp.item_codec.ItemCodec`'s templates, for
16 KiB float32 tensors (the benchmark's "small" shape).

Run: ``./scripts/test.sh benchmarks/test_item_codec_speed.py --benchmark-enable --benchmark-only``
(``UC_BENCH_ITEMS`` sets the tensors per round, default 4096). Measured here (2 cores): ~130 us per
``torch.save`` and ~170 us per ``torch.load``, against ~20-40 us and ~25-50 us through templates.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from uc_checkpoint.dcp.item_codec import ItemCodec

ITEMS = 64 if os.environ.get("UC_BENCH_QUICK") else int(os.environ.get("UC_BENCH_ITEMS", "4096"))
TENSORS = [torch.randn(512, 8, generator=torch.Generator().manual_seed(i)) for i in range(ITEMS)]


def _archives(write) -> list[bytes]:
    out = []
    for t in TENSORS:
        buf = io.BytesIO()
        write(t, buf)
        out.append(buf.getvalue())
    return out


@pytest.mark.parametrize("how", ["torch.save", "template"])
def test_write_items(benchmark, how: str) -> None:
    write = torch.save if how == "torch.save" else ItemCodec().write
    archives = benchmark.pedantic(_archives, args=(write,), rounds=3, iterations=1)
    # Either way, what stock DCP would read back is the tensor itself.
    for t, raw in zip(TENSORS[:16], archives):
        assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), t)


@pytest.mark.parametrize("how", ["torch.load", "template"])
def test_read_items(benchmark, how: str) -> None:
    archives = [memoryview(bytearray(a)) for a in _archives(ItemCodec().write)]
    codec = ItemCodec()

    def read() -> list[torch.Tensor]:
        if how == "torch.load":
            return [torch.load(io.BytesIO(a), weights_only=True) for a in archives]
        return [codec.decode(a, torch.float32, (512, 8)) for a in archives]

    tensors = benchmark.pedantic(read, rounds=3, iterations=1)
    assert all(t is not None and torch.equal(t, src) for t, src in zip(tensors, TENSORS))
