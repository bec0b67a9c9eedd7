"""The transfer pool's bounds and failure handling, checkpoint naming, and the location checks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from uc_checkpoint import TransferError, VolumeError
from uc_checkpoint.engine.transfer import TransferGroup, TransferPool
from uc_checkpoint.format.layout import checkpoint_name, is_checkpoint_file
from uc_checkpoint.ops.catalog import latest, list_steps
from uc_checkpoint.volumes import LocalVolume, open_volume


def test_pool_never_runs_or_queues_more_than_its_bounds() -> None:
    running = 0
    peak = 0
    lock = threading.Lock()
    release = threading.Event()

    def task() -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(5)
        with lock:
            running -= 1
        return 1

    pool = TransferPool(max_workers=2, max_pending=1)
    submitted = []
    producer = threading.Thread(target=lambda: [submitted.append(pool.submit(task)) for _ in range(6)])
    producer.start()
    time.sleep(0.3)
    # 2 running + 1 queued: the producer is blocked on the 4th submit.
    assert len(submitted) == 3 and producer.is_alive()
    release.set()
    producer.join(10)
    assert [f.result(5) for f in submitted] == [1] * 6
    assert peak == 2
    pool.shutdown()


def test_group_reports_first_failure_and_cancels_the_rest() -> None:
    started: list[int] = []

    def task(i: int) -> int:
        started.append(i)
        if i == 1:
            raise TransferError(f"file {i} failed")
        time.sleep(0.05)
        return i

    with TransferPool(max_workers=1, max_pending=100) as pool:
        group: TransferGroup[int] = TransferGroup(pool, "test")
        for i in range(20):
            group.submit(task, i)
        with pytest.raises(TransferError, match="file 1 failed"):
            group.results()
    assert len(started) < 20  # queued transfers were cancelled


def test_group_wraps_foreign_errors() -> None:
    def boom() -> None:
        raise OSError("disk on fire")

    with TransferPool(max_workers=2) as pool:
        group: TransferGroup[None] = TransferGroup(pool, "upload to X")
        group.submit(boom)
        with pytest.raises(TransferError, match="upload to X: disk on fire"):
            group.results()


def test_checkpoint_names_and_latest(tmp_path: Path) -> None:
    assert checkpoint_name(42) == "step_00000042"
    with pytest.raises(ValueError):
        checkpoint_name(-1)
    root = LocalVolume(tmp_path)
    assert latest(root, intact=False) is None
    for step, published in ((10, True), (20, True), (30, False)):
        d = tmp_path / checkpoint_name(step)
        d.mkdir()
        (d / "__0_abc_0.distcp").write_bytes(b"x")
        if published:
            (d / ".metadata").write_bytes(b"m")
    (tmp_path / "notes").mkdir()
    assert [(i.step, i.name, i.published) for i in list_steps(root)] == [
        (10, "step_00000010", True),
        (20, "step_00000020", True),
        (30, "step_00000030", False),
    ]
    found = latest(root, intact=False)  # the newest published: nothing read (b"m" is no .metadata)
    assert found is not None and (found.step, found.name) == (20, "step_00000020")


def test_checkpoint_file_names() -> None:
    for ok in (
        ".metadata",
        "__3.metadata",
        "__0_1a2b3c4d_0.distcp",
        "__0_0.distcp",
        ".metadata.tmp",
        ".metadata.0123456789ab.tmp",
    ):
        assert is_checkpoint_file(ok), ok
    for bad in ("notes.txt", "metadata", "model.pt", ".metadata.bak"):
        assert not is_checkpoint_file(bad), bad


def test_open_volume_schemes(tmp_path: Path) -> None:
    assert isinstance(open_volume(tmp_path), LocalVolume)
    assert open_volume(f"file://{tmp_path}").url == str(tmp_path)
    with pytest.raises(VolumeError, match="gopher"):
        open_volume("gopher://host/x")


def test_auto_file_size_cuts_a_rank_share_into_about_16_files_within_bounds(tmp_path, staging) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from uc_checkpoint import UCVolumeWriter
    from uc_checkpoint.dcp.serialize import MAX_AUTO_FILE_SIZE, MIN_AUTO_FILE_SIZE, auto_file_size

    assert auto_file_size(0) == MIN_AUTO_FILE_SIZE == 16 << 20
    assert auto_file_size(1 << 30) == 64 << 20  # 1 GiB -> 16 files of 64 MiB
    assert auto_file_size(100 << 30) == MAX_AUTO_FILE_SIZE == 256 << 20
    # A real save of 40 MiB in 10 tensors: 16 MiB files -> 3 data files (DCP balances items over them).
    sd = {f"t{i}": torch.zeros(1 << 20) for i in range(10)}
    dcp.save(sd, storage_writer=UCVolumeWriter(tmp_path / "ckpt"))
    assert len(list((tmp_path / "ckpt").glob("*.distcp"))) == 3


def test_data_files_per_rank_follow_the_ranks_own_share(tmp_path) -> None:
    # 16 shards of 4 MiB on this rank, each of a tensor twice as large globally (2 ranks): the rank
    # writes 64 MiB, so the automatic size (share / 16, at least 16 MiB) gives 4 files, not 8.
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from uc_checkpoint import UCVolumeWriter
    from uc_checkpoint.dcp.compat import _StoragePrefix

    def shard(i: int, world: int) -> WriteItem:
        local = 1 << 20  # float32 elements: 4 MiB
        return WriteItem(
            index=MetadataIndex(f"w{i}", torch.Size([0])),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([local])),
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([local * world]),
            ),
        )

    writer = UCVolumeWriter(tmp_path / "ckpt")
    for world in (1, 2, 4, 8):
        plan = SavePlan([shard(i, world) for i in range(16)], storage_data=_StoragePrefix("__0_t_"))
        assert writer._file_queue(plan, tmp_path).qsize() == 4, world
