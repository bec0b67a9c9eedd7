"""State dicts of realistic shape for the checkpoint benchmarks.

``gpt`` kind (:func:`build`): a GPT-style decoder's parameters (token embedding, per block: fused QKV,
attention projection, MLP up/down, two LayerNorms) plus AdamW's ``exp_avg`` / ``exp_avg_sq`` for each
and a ``step`` scalar, all float32, so the parameters are a third of ``size_bytes``. The width is
the widest of 256, 512, 1024 and 2048 that leaves room for at least 4 blocks, the vocabulary about
a tenth of the parameters, and the depth is chosen to reach the size (within a block).

``small`` kind: the same bytes as many 16 KiB tensors under one ``"model"`` key (as
``{"model": model.state_dict()}`` nests them), the shape that stresses per-item overhead. Nested, not
flat: DCP's ``async_save`` spends ~0.1 ms per *top-level* key in its logging wrapper before staging,
a cost of the caller's layout that every storage writer pays alike.

With a 1-D device mesh of ``world_size`` ranks every tensor is a DTensor sharded on dim 0 (FSDP's
layout), and each rank generates only its own shard (seeded per tensor and rank), so memory use per
rank is its share of the checkpoint.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

SMALL_TENSOR_BYTES = 16 << 10


def _shapes_gpt(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    n_params = max(size_bytes // 12, 1 << 16)  # params + exp_avg + exp_avg_sq, 4 bytes each
    # The widest of 256..2048 that still leaves room for at least 4 blocks; embeddings ~10%.
    d = max([256] + [w for w in (512, 1024, 2048) if 4 * 12 * w * w <= n_params])
    vocab = max(1024, min(50304, n_params // 10 // d)) // 64 * 64  # padded, as real vocabularies are
    n_layer = max(1, round((n_params - vocab * d) / (12 * d * d)))
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (vocab, d))]
    for i in range(n_layer):
        p = f"blocks.{i}."
        shapes += [
            (p + "ln1.weight", (d,)),
            (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.proj.weight", (d, d)),
            (p + "ln2.weight", (d,)),
            (p + "ln2.bias", (d,)),
            (p + "mlp.fc.weight", (4 * d, d)),
            (p + "mlp.proj.weight", (d, 4 * d)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def _seed(name: str, rank: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}/{rank}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _local(name: str, shape: tuple[int, ...], rank: int, world_size: int, zeros: bool) -> torch.Tensor:
    rows = shape[0]
    # torch.chunk's split, which DTensor's Shard(0) assumes (the first ranks get the larger pieces).
    piece = -(-rows // world_size)
    lo, hi = min(rows, rank * piece), min(rows, (rank + 1) * piece)
    local_shape = (hi - lo, *shape[1:])
    if zeros:
        return torch.zeros(local_shape)
    g = torch.Generator().manual_seed(_seed(name, rank))
    return torch.rand(local_shape, generator=g)


def _wrap(t: torch.Tensor, shape: tuple[int, ...], mesh: Any) -> Any:
    if mesh is None:
        return t
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, mesh, [Shard(0)], shape=torch.Size(shape), stride=stride, run_check=False)


def build(kind: str, size_bytes: int, mesh: Any = None, *, zeros: bool = False) -> dict[str, Any]:
    """The benchmark state dict (``kind`` ``"gpt"`` or ``"small"``); ``zeros`` gives a load target
    of the same structure. ``mesh``: shard every tensor over it (None: plain tensors, one rank)."""
    rank = 0 if mesh is None else mesh.get_local_rank()
    world = 1 if mesh is None else mesh.size()
    if kind == "gpt":
        model = {}
        optim: dict[str, Any] = {}
        for name, shape in _shapes_gpt(size_bytes):
            model[name] = _wrap(_local(name, shape, rank, world, zeros), shape, mesh)
            optim[name] = {
                "step": torch.tensor(0.0 if zeros else 1000.0),
                "exp_avg": _wrap(_local(name + ".m", shape, rank, world, zeros), shape, mesh),
                "exp_avg_sq": _wrap(_local(name + ".v", shape, rank, world, zeros), shape, mesh),
            }
        return {"model": model, "optim": {"state": optim}, "step": -1 if zeros else 1000}
    if kind == "small":
        n = max(1, size_bytes // SMALL_TENSOR_BYTES)
        shape = (SMALL_TENSOR_BYTES // 4 // 8, 8)
        return {
            "model": {f"t{i:06d}": _wrap(_local(f"t{i}", shape, rank, world, zeros), shape, mesh) for i in range(n)},
            "step": -1 if zeros else 1000,
        }
    raise ValueError(f"unknown state kind {kind!r} (use 'gpt' or 'small')")


def nbytes(sd: Any) -> int:
    """Bytes of tensor data in a (nested) state dict, this rank's shards only."""
    if isinstance(sd, dict):
        return sum(nbytes(v) for v in sd.values())
    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return local.numel() * local.element_size()
    return 0


def assert_equal(a: Any, b: Any, path: str = "") -> None:
    """Raise AssertionError naming the first key whose value differs (local shards compared)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            assert_equal(a[k], b[k], f"{path}.{k}" if path else str(k))
    elif isinstance(a, torch.Tensor):
        la = a.to_local() if hasattr(a, "to_local") else a
        lb = b.to_local() if hasattr(b, "to_local") else b
        assert torch.equal(la, lb), f"{path}: tensor differs after load"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def cpu_copy(sd: Any) -> Any:
    """A plain in-memory copy (the staging limit: what any async save must at least do)."""
    if isinstance(sd, dict):
        return {k: cpu_copy(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return local.clone()
    return sd
