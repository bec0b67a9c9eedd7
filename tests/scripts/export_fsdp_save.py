"""Run under ``torchrun --nproc_per_node=2``: train a small model sharded with FSDP2 (``fully_shard``
on a CPU mesh, gloo) for two steps, then save with UCVolumeWriter, as a training job does:

- ``model``: the model's state dict (DTensors, each rank holding its dim-0 shard; some dims do not
  split evenly, so chunks differ in size);
- ``optim``: AdamW's state (DTensors too) and its param groups (floats, ints, lists);
- ``ddp``: the same model tensors under ``module.``-prefixed names (a DDP-wrapped model's names);
- ``step`` and ``note``: plain Python items.

Rank 0 also writes the model's full state dict, gathered by DCP's ``get_model_state_dict`` with
``full_state_dict=True``, with ``torch.save`` to FULL (an independent reference for the export).
Prints ``RANK <r> save OK``.

Usage: export_fsdp_save.py CHECKPOINT FULL
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from uc_checkpoint import UCVolumeWriter

warnings.filterwarnings("ignore")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class Net(nn.Module):
    """Embedding (13 rows: uneven over 2 ranks), 12 blocks, a head of 7 rows (uneven too)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 24)
        self.blocks = nn.ModuleList(Block(24) for _ in range(12))
        self.head = nn.Linear(24, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    checkpoint, full_path = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        loss = model(torch.randint(0, 13, (4, 5), generator=g)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "ddp": {f"module.{k}": v for k, v in model_sd.items()},
        "step": 2,
        "note": "two steps",
    }
    dcp.save(state, storage_writer=UCVolumeWriter(checkpoint))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, full_path)
    dist.barrier()
    print(f"RANK {rank} save OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
