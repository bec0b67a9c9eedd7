"""State dicts for the benchmarks: one builder (:func:`build`) of every state they measure, float32
tensors (values uniform in [0, 1), seeded per tensor and rank) in the nesting a training job's
``{"model": ..., "optim": ...}`` has.

Kinds (``kind``, all ``size_bytes`` in all ranks together, within a tensor's rounding):

``gpt``     a GPT-style decoder's parameters (token embedding, per block: fused QKV, attention
            projection, MLP up/down, two LayerNorms) plus AdamW's ``exp_avg`` / ``exp_avg_sq`` for
            each and a ``step`` scalar, so the parameters are a third of the bytes. The width is the
            widest of 256, 512, 1024 and 2048 that leaves room for at least 4 blocks, the vocabulary
            about a tenth of the parameters, and the depth is chosen to reach the size (within a
            block). The checkpoint benchmark's, the scale benchmark's and the compression figures'.
``small``   the same bytes as many 16 KiB tensors under one ``"model"`` key (as
            ``{"model": model.state_dict()}`` nests them), the shape that stresses per-item overhead.
            Nested, not flat: DCP's ``async_save`` spends time per *top-level* key in its logging
            wrapper before staging, a cost of the caller's layout that every storage writer pays alike.
``equal``   ``tensors`` tensors of equal size under ``"model"`` (the scale benchmark's tensor sweep).
``blocks``  tensors of 16, 4 and 1 MiB, 8 + 24 + 32 of them per 256 MiB, under ``"model"``, each
            with an optimizer ``step`` scalar under ``"optim"`` (the staging benchmark's ``gpt``).
``layers``  tensors of 4, 16 and 64 KiB in turn, ten per ``"model"`` layer, one tensor per
            :data:`LAYERS_MEAN_BYTES` (the staging benchmark's ``small``).
``flat``    tensors of 16, 4 and 1 MiB in turn, in one flat dict (the CPU profile's).

With a 1-D device mesh of ``world_size`` ranks every tensor is a DTensor sharded on dim 0 (FSDP's
layout), and each rank generates only its own shard, so memory use per rank is its share of the
checkpoint. Scalars stay plain tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

SMALL_TENSOR_BYTES = 16 << 10
#: The mean size of a ``layers`` tensor (4, 16 and 64 KiB in turn).
LAYERS_MEAN_BYTES = (4 + 16 + 64) * 1024 // 3
KINDS = ("gpt", "small", "equal", "blocks", "layers", "flat")
_MIB = 1 << 20
_BLOCKS = {16: 8, 4: 24, 1: 32}  # MiB -> tensors per 256 MiB


def build(kind: str, size_bytes: int, mesh: Any = None, *, zeros: bool = False, tensors: int = 0) -> dict[str, Any]:
    """The state dict of ``kind`` (see the module docstring) of ``size_bytes`` bytes; ``zeros``
    gives a load target of the same structure. ``mesh``: shard every tensor over it (None: plain
    tensors, one rank). ``tensors``: the number of tensors of kind ``equal``.

    Raises:
        ValueError: an unknown ``kind``, or kind ``equal`` without ``tensors``.
    """
    rank = 0 if mesh is None else mesh.get_local_rank()
    world = 1 if mesh is None else mesh.size()

    def tensor(name: str, shape: tuple[int, ...]) -> Any:
        return _wrap(_local(name, shape, rank, world, zeros), shape, mesh)

    step = -1 if zeros else 1000
    if kind == "gpt":
        model = {}
        optim: dict[str, Any] = {}
        for name, shape in _shapes_gpt(size_bytes):
            model[name] = tensor(name, shape)
            optim[name] = {
                "step": torch.tensor(0.0 if zeros else 1000.0),
                "exp_avg": tensor(name + ".m", shape),
                "exp_avg_sq": tensor(name + ".v", shape),
            }
        return {"model": model, "optim": {"state": optim}, "step": step}
    if kind == "small":
        shape = (SMALL_TENSOR_BYTES // 4 // 8, 8)
        n = max(1, size_bytes // SMALL_TENSOR_BYTES)
        return {"model": {f"t{i:06d}": tensor(f"t{i}", shape) for i in range(n)}, "step": step}
    if kind == "equal":
        if tensors < 1:
            raise ValueError("kind 'equal' needs tensors >= 1")
        numel = max(1, size_bytes // 4 // tensors)
        return {"model": {f"t{i:06d}": tensor(f"t{i}", (numel,)) for i in range(tensors)}, "step": step}
    if kind == "blocks":
        model, optim = {}, {}
        for mib, per_256 in _BLOCKS.items():
            for i in range(max(1, round(per_256 * size_bytes / (256 * _MIB)))):
                name = f"w{mib}m_{i}"
                model[name] = tensor(name, ((mib * _MIB) // 4,))
                optim[name] = {"step": torch.tensor(0.0 if zeros else 1000.0)}
        return {"model": model, "optim": {"state": optim}, "step": step}
    if kind == "layers":
        layers: dict[str, Any] = {}
        for i in range(max(10, round(size_bytes / LAYERS_MEAN_BYTES))):
            numel = (4 << (2 * (i % 3))) * 1024 // 4  # 4, 16, 64 KiB
            layers.setdefault(f"layer{i // 10}", {})[f"t{i % 10}"] = tensor(f"t{i}", (numel,))
        return {"model": layers, "step": step}
    if kind == "flat":
        flat, left, i = {}, size_bytes // 4, 0
        while left > 0:
            numel = min((16 * _MIB // 4, 4 * _MIB // 4, _MIB // 4)[i % 3], left)
            flat[f"layer{i}.weight"] = tensor(f"layer{i}", (numel,))
            left -= numel
            i += 1
        return flat
    raise ValueError(f"unknown state kind {kind!r} (one of {', '.join(KINDS)})")


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


def shard(sd: Any, mesh: Any) -> Any:
    """A whole (1-rank) state dict cut into this rank's Shard(0) pieces over ``mesh``, as DTensors
    (torch.chunk's split, as :func:`build` makes), so that any world size saves the same checkpoint
    content; scalars stay plain tensors. ``mesh`` None: a copy."""
    if isinstance(sd, dict):
        return {k: shard(v, mesh) for k, v in sd.items()}
    if not isinstance(sd, torch.Tensor):
        return sd
    if mesh is None or sd.dim() == 0:
        return sd.clone()
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    piece = -(-sd.shape[0] // world)
    lo, hi = min(sd.shape[0], rank * piece), min(sd.shape[0], (rank + 1) * piece)
    return DTensor.from_local(sd[lo:hi].clone(), mesh, [Shard(0)], shape=sd.shape, stride=sd.stride(), run_check=False)


def tensors_of(sd: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a (nested) state dict, in order; this rank's shards of DTensors."""
    if isinstance(sd, dict):
        for v in sd.values():
            yield from tensors_of(v)
    elif isinstance(sd, torch.Tensor):
        yield sd.to_local() if hasattr(sd, "to_local") else sd


def nbytes(sd: Any) -> int:
    """Bytes of tensor data in a (nested) state dict, this rank's shards only."""
    return sum(t.numel() * t.element_size() for t in tensors_of(sd))


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
