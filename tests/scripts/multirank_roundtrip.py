"""Run under ``torchrun --nproc_per_node=N``: save a sharded state dict with UCVolumeWriter
(``sync``, ``thread`` or ``process`` async mode), then load it back resharded, partially, and (on
local volumes) with DCP's stock FileSystemReader. Prints ``RANK <r> <mode> OK`` on success; any
mismatch raises.

Mode ``fail`` expects every save to fail (the root points at a store that refuses every request):
each rank must get DCP's CheckpointException with our TransferError/VolumeError inside, none may
hang, and no ``.metadata`` may appear.

Mode ``onefails`` saves a good checkpoint, then a save in which only rank 1 fails (on S3: the
failing endpoint refuses rank 1's data files only; locally: rank 1's staging directory is deleted
mid-write): both ranks must get the error with rank 1's cause inside, nothing may be published over
the good checkpoint, and both ranks then load the good one.

Usage: multirank_roundtrip.py ROOT MODE [ROOT MODE ...]   (each saves to ROOT/MODE; ROOT is a path
or URL; ``s3://`` roots use boto3's configuration from the environment, e.g. AWS_ENDPOINT_URL)
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.errors import StagingError, TransferError, VolumeError
from uc_checkpoint.volumes import LocalVolume, S3Volume, open_volume

warnings.filterwarnings("ignore")


def full_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(300, generator=g), "rep": torch.arange(20.0)}


def main() -> None:
    pairs = sys.argv[1:]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for root, mode in zip(pairs[::2], pairs[1::2]):
        dest = f"{root.rstrip('/')}/{mode}"
        if mode == "fail":
            expect_failure(dest)
        elif mode == "onefails":
            one_rank_fails(dest)
        else:
            round_trip(dest, mode, mesh)
    dist.destroy_process_group()


def expect_failure(dest: str) -> None:
    rank = dist.get_rank()
    volume = open_volume(dest)
    if isinstance(volume, S3Volume):  # the failing endpoint: UC_TEST_FAIL_ENDPOINT
        volume = S3Volume(dest, endpoint_url=os.environ.get("UC_TEST_FAIL_ENDPOINT"), max_attempts=2, read_timeout=5)
    sd = {"x": torch.randn(1000), f"r{rank}": torch.ones(3)}
    try:
        dcp.save(sd, storage_writer=UCVolumeWriter(volume))
    except CheckpointException as exc:
        inner = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        assert inner and all(isinstance(e, (TransferError, VolumeError)) for e in inner), exc.failures
        assert any(volume.url in str(e) or volume.bucket in str(e) for e in inner), exc.failures  # type: ignore[attr-defined]
    else:
        raise AssertionError(f"rank {rank}: the save to {dest} succeeded against a failing store")
    dist.barrier()
    print(f"RANK {rank} fail OK", flush=True)


class StagingVandal:
    """Deletes everything under a staging root when DCP serialises it (mid-write)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __getstate__(self) -> dict:
        import shutil

        for child in os.listdir(self.root):
            shutil.rmtree(os.path.join(self.root, child), ignore_errors=True)
        return {}


def one_rank_fails(dest: str) -> None:
    rank = dist.get_rank()
    staging = os.path.join(os.environ.get("UC_TEST_STAGING_ROOT", "/tmp"), f"onefails-rank{rank}")
    os.makedirs(staging, exist_ok=True)
    good = {"x": torch.arange(1000.0), f"r{rank}": torch.full((3,), float(rank))}
    dcp.save(good, storage_writer=UCVolumeWriter(dest, staging_dir=staging))
    volume = open_volume(dest)
    if isinstance(volume, S3Volume):  # refuses rank 1's data files only: UC_TEST_FAIL_ENDPOINT
        volume = S3Volume(dest, endpoint_url=os.environ.get("UC_TEST_FAIL_ENDPOINT"), max_attempts=2, read_timeout=5)
    bad: dict = {"x": torch.zeros(1000), f"r{rank}": torch.full((3,), -1.0)}
    if rank == 1 and not isinstance(volume, S3Volume):
        bad["vandal"] = StagingVandal(staging)
    try:
        dcp.save(bad, storage_writer=UCVolumeWriter(volume, staging_dir=staging))
    except CheckpointException as exc:
        assert set(exc.failures) == {1}, f"rank {rank}: failures from ranks {sorted(exc.failures)}"
        inner = exc.failures[1][0] if isinstance(exc.failures[1], tuple) else exc.failures[1]
        want = TransferError if isinstance(volume, S3Volume) else StagingError
        assert isinstance(inner, want), f"rank {rank}: {inner!r}"
        assert (volume.url in str(inner)) or ("onefails-rank1" in str(inner)), f"rank {rank}: {inner}"
    else:
        raise AssertionError(f"rank {rank}: the save to {dest} succeeded although rank 1 failed")
    dist.barrier()
    out = {"x": torch.zeros(1000), **{f"r{r}": torch.zeros(3) for r in range(dist.get_world_size())}}
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert torch.equal(out["x"], good["x"]), f"rank {rank}: not the good checkpoint"
    for r in range(dist.get_world_size()):
        assert torch.equal(out[f"r{r}"], torch.full((3,), float(r))), f"rank {rank}: key r{r}"
    dist.barrier()
    print(f"RANK {rank} onefails OK", flush=True)


def round_trip(dest: str, mode: str, mesh: object) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = full_values()
    sd = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        f"rank{rank}": torch.full((5,), float(rank)),
        "meta": {"step": 42, "world": world},
    }
    writer = UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=4096, upload_workers=2))
    if mode == "sync":
        dcp.save(sd, storage_writer=writer)
    elif mode == "thread":
        dcp.async_save(sd, storage_writer=writer).result(timeout=480)
    elif mode == "process":
        fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        fut.result(timeout=480)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()
    volume = open_volume(dest)
    files = volume.list_files()
    assert ".metadata" in files, f"no .metadata after save: {files}"
    names = sorted(n for n in files if n.endswith(".distcp"))
    assert {n.split("_")[2] for n in names} == {str(r) for r in range(world)}, names  # every rank wrote files

    # Resharded: Shard(1) instead of Shard(0), plus every rank's private key.
    out = {
        "w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)]),
        "b": distribute_tensor(torch.zeros(300), mesh, [Replicate()]),
        "rep": distribute_tensor(torch.zeros(20), mesh, [Shard(0)]),
        **{f"rank{r}": torch.zeros(5) for r in range(world)},
        "meta": {"step": None, "world": None},
    }
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert torch.equal(out["w"].full_tensor(), full["w"])
    assert torch.equal(out["b"].full_tensor(), full["b"])
    assert torch.equal(out["rep"].full_tensor(), full["rep"])
    for r in range(world):
        assert torch.equal(out[f"rank{r}"], torch.full((5,), float(r))), r
    assert out["meta"] == {"step": 42, "world": world}

    # Partial: a single key.
    part = {"b": torch.zeros(300)}
    dcp.load(part, storage_reader=UCVolumeReader(dest))
    assert torch.equal(part["b"], full["b"])

    if isinstance(volume, LocalVolume):  # stock reader on the same files
        stock = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(0)])}
        dcp.load(stock, storage_reader=FileSystemReader(dest))
        assert torch.equal(stock["w"].full_tensor(), full["w"])

    dist.barrier()
    print(f"RANK {rank} {mode} OK", flush=True)


if __name__ == "__main__":
    main()
