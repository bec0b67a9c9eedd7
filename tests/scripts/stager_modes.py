"""Run under ``torchrun --nproc_per_node=N``: ``dcp.async_save`` through UCVolumeWriter with every
stager (the writer's own ``stage()``, DCP's ``DefaultStager`` with synchronous and asynchronous
staging, with and without shared memory) in DCP's THREAD and PROCESS modes, to a local volume; each
checkpoint is loaded back (resharded) and compared with the state at the save call.

Training goes on as soon as it may: right after ``async_save`` returns (synchronous staging) or
right after ``staging_completion`` is done (asynchronous staging), every tensor of the state is
changed in place, so a staged copy that still aliased the training state would be caught.

Then ``CheckpointManager(staging=Staging(background_copy=True))`` in both modes: the loop calls ``wait_until_staged()``
and changes the state; the checkpoint has the values of the save call.

Prints ``RANK <r> <mode> <stager> OK`` per combination (``manager`` for the manager); any mismatch
raises.

Usage: stager_modes.py ROOT
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from uc_checkpoint import CheckpointManager, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import Staging, WriterOptions

warnings.filterwarnings("ignore")

#: name -> (use_shared_memory, use_async_staging); None: the writer stages (its own stage()).
STAGERS: dict[str, tuple[bool, bool] | None] = {
    "writer": None,
    "dcp-sync": (False, False),
    "dcp-async": (False, True),
    "dcp-shm-sync": (True, False),
    "dcp-shm-async": (True, True),
}


def state(mesh: object, rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": distribute_tensor(torch.randn(64, 48, generator=g), mesh, [Shard(0)]),
            **{f"small{i}": torch.randn(100 + i, generator=g) for i in range(20)},
        },
        f"rank{rank}": torch.full((5,), float(rank)),
        "step": seed,
    }


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def round_trip(root: str, mode: str, name: str, mesh: object) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = 7 + len(name) + (100 if mode == "process" else 0)
    sd = state(mesh, rank, seed)
    expected = state(mesh, rank, seed)  # the same values, never touched
    options = STAGERS[name]
    stager = None
    if options is not None:
        stager = DefaultStager(StagingOptions(False, options[0], options[1], False))
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    dest = f"{root}/{mode}-{name}"
    writer = UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=4096, upload_workers=2))
    response = dcp.async_save(sd, storage_writer=writer, async_stager=stager, async_checkpointer_type=kind)
    if isinstance(response, AsyncSaveResponse):
        assert options is not None and options[1], f"{name}: a staging future from synchronous staging"
        response.staging_completion.result(timeout=240)  # the rule: before the next parameter update
        upload = response.upload_completion
    else:
        assert options is None or not options[1], f"{name}: asynchronous staging returned no staging future"
        upload = response
    with torch.no_grad():  # the next optimizer step
        local(sd["model"]["w"]).add_(1000.0)
        for key, t in sd["model"].items():
            if key != "w":
                t.mul_(-3.0)
        sd[f"rank{rank}"].fill_(-1.0)
    sd["step"] = -1
    upload.result(timeout=240)
    if stager is not None:
        stager.close()
    dist.barrier()

    out = {
        "model": {
            "w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)]),  # resharded
            **{f"small{i}": torch.zeros(100 + i) for i in range(20)},
        },
        **{f"rank{r}": torch.zeros(5) for r in range(world)},
        "step": None,
    }
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert torch.equal(out["model"]["w"].full_tensor(), expected["model"]["w"].full_tensor()), f"{mode} {name}: w"
    for key, t in expected["model"].items():
        if key != "w":
            assert torch.equal(out["model"][key], t), f"{mode} {name}: {key}"
    for r in range(world):
        assert torch.equal(out[f"rank{r}"], torch.full((5,), float(r))), f"{mode} {name}: rank{r}"
    assert out["step"] == seed, f"{mode} {name}: step {out['step']}"
    dist.barrier()
    print(f"RANK {rank} {mode} {name} OK", flush=True)


def manager_round_trip(root: str, mode: str, mesh: object) -> None:
    """CheckpointManager(staging=Staging(background_copy=True)): the loop waits for the staging, then steps."""
    rank = dist.get_rank()
    manager = CheckpointManager(f"{root}/manager-{mode}", staging=Staging(background_copy=True, mode=mode))
    sd, expected = state(mesh, rank, 3), state(mesh, rank, 3)
    manager.save(5, sd)
    manager.wait_until_staged()
    with torch.no_grad():
        local(sd["model"]["w"]).add_(1000.0)
        sd["model"]["small0"].zero_()
    manager.wait()
    out = state(mesh, rank, 99)
    assert manager.load(out) == 5
    assert torch.equal(out["model"]["w"].full_tensor(), expected["model"]["w"].full_tensor()), f"manager {mode}: w"
    assert torch.equal(out["model"]["small0"], expected["model"]["small0"]), f"manager {mode}: small0"
    dist.barrier()
    print(f"RANK {rank} {mode} manager OK", flush=True)


def manager_reuse_round_trip(root: str, mode: str, mesh: object) -> None:
    """CheckpointManager(staging=Staging(reuse_buffers=True)): the second save copies into the first's
    buffers, and each checkpoint holds its own step's values (THREAD mode only: the manager refuses
    the option in PROCESS mode, which hands each snapshot to DCP's daemon)."""
    rank = dist.get_rank()
    manager = CheckpointManager(f"{root}/manager-reuse-{mode}", staging=Staging(reuse_buffers=True, mode=mode))
    sd, first = state(mesh, rank, 4), state(mesh, rank, 4)
    manager.save(1, sd)
    with torch.no_grad():  # the next optimizer step, while the save uploads
        local(sd["model"]["w"]).add_(1000.0)
        sd["model"]["small0"].zero_()
    manager.save(2, sd)
    with torch.no_grad():
        local(sd["model"]["w"]).add_(1000.0)
    manager.wait()
    held = manager._staging_buffers.nbytes if manager._staging_buffers is not None else -1
    assert held > 0, f"manager-reuse {mode}: {held} bytes kept"
    out = state(mesh, rank, 99)
    manager.load(out, step=1)
    assert torch.equal(out["model"]["w"].full_tensor(), first["model"]["w"].full_tensor()), f"reuse {mode}: w@1"
    assert torch.equal(out["model"]["small0"], first["model"]["small0"]), f"reuse {mode}: small0@1"
    manager.load(out, step=2)
    want = first["model"]["w"].full_tensor() + 1000.0
    assert torch.equal(out["model"]["w"].full_tensor(), want), f"reuse {mode}: w@2"
    assert not out["model"]["small0"].any(), f"reuse {mode}: small0@2"
    dist.barrier()
    print(f"RANK {rank} {mode} manager-reuse OK", flush=True)


def main() -> None:
    root = sys.argv[1].rstrip("/")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for mode in ("thread", "process"):
        for name in STAGERS:
            round_trip(root, mode, name, mesh)
        manager_round_trip(root, mode, mesh)
        if mode == "thread":
            manager_reuse_round_trip(root, mode, mesh)
    dist.destroy_process_group()


if __name__ == "__main__":  # DCP's PROCESS mode spawns a process that imports this module
    main()
