"""Staging buffers kept between async saves (uc_checkpoint.dcp.buffers), in cpu_snapshot and in
UCVolumeWriter / CheckpointManager saves to a local volume."""

from __future__ import annotations

import copy
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from uc_checkpoint import CheckpointManager, StagingBuffers, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.dcp.stager import cpu_snapshot

BIG = 1 << 16  # elements: above the threaded copy's threshold


def _state(scale: float = 1.0) -> dict[str, Any]:
    tied = torch.full((4, 8), scale)
    return {
        "model": {
            "big": torch.arange(BIG, dtype=torch.float32) * scale,
            "big16": (torch.arange(BIG) * scale).to(torch.bfloat16),
            "small": torch.full((16,), scale),
            "emb": tied,
            "head": tied,
            "t": (torch.arange(40.0) * scale).reshape(5, 8).t(),  # not contiguous
            "param": torch.nn.Parameter(torch.full((3, 3), scale)),
        },
        "optim": [torch.full((BIG,), 2 * scale, dtype=torch.float64), {"step": int(scale)}],
        "step": int(scale),
    }


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _assert_snapshot_of(snap: Any, sd: Any) -> None:
    for out, src in zip(_tensors(snap), _tensors(sd), strict=True):
        assert type(out) is torch.Tensor and out.dtype == src.dtype and out.shape == src.shape
        assert torch.equal(out, src.detach()) and out.is_contiguous() and not out.requires_grad
        assert out.data_ptr() != src.data_ptr()


def test_the_next_snapshot_copies_into_the_last_ones_tensors() -> None:
    pool = StagingBuffers()
    first = pool.lease()
    sd = _state(1.0)
    snap1 = cpu_snapshot(sd, first)
    _assert_snapshot_of(snap1, sd)
    assert first.reused == 0 and pool.nbytes == 0  # lent out until released
    first.release()
    kept = {t.data_ptr() for t in _tensors(snap1)}
    assert pool.nbytes == sum(t.numel() * t.element_size() for t in {id(t): t for t in _tensors(snap1)}.values())

    with torch.no_grad():  # training goes on
        for t in _tensors(sd):
            t.mul_(3)
    second = pool.lease()
    snap2 = cpu_snapshot(_state(3.0), second)
    _assert_snapshot_of(snap2, _state(3.0))
    assert {t.data_ptr() for t in _tensors(snap2)} == kept  # every tensor, big and small, reused
    assert second.reused == 7  # tied weights once
    assert snap2["model"]["emb"] is snap2["model"]["head"]
    release_and_again = pool.lease()
    assert release_and_again.reused == 0 and pool.nbytes == 0  # the set is still lent to `second`
    release_and_again.release()  # nothing used: gives back an empty set...
    second.release()  # ...and the later release is the kept one
    assert pool.nbytes > 0


def test_a_changed_tensor_gets_new_memory_and_the_rest_is_reused() -> None:
    pool = StagingBuffers()
    lease = pool.lease()
    before = cpu_snapshot(_state(1.0), lease)
    lease.release()
    ptrs = [t.data_ptr() for t in _tensors(before)]
    changed = _state(2.0)
    changed["model"]["big"] = torch.zeros(BIG + 1)  # another shape
    changed["model"]["small"] = torch.zeros(16, dtype=torch.int64)  # another dtype
    lease = pool.lease()
    after = cpu_snapshot(changed, lease)
    _assert_snapshot_of(after, changed)
    now = [t.data_ptr() for t in _tensors(after)]
    assert now[0] != ptrs[0] and now[2] != ptrs[2]
    assert now[1] == ptrs[1] and now[3:] == ptrs[3:]
    lease.release()
    third = pool.lease()
    again = cpu_snapshot(changed, third)  # the new tensors were kept in their place
    assert [t.data_ptr() for t in _tensors(again)] == now and third.reused == 7


def test_an_empty_lease_never_drops_a_set_given_back_meanwhile() -> None:
    pool = StagingBuffers()
    first = pool.lease()
    cpu_snapshot(_state(), first)
    first.release()
    holder = pool.lease()  # takes the kept set
    cpu_snapshot(_state(), holder)
    latecomer = pool.lease()  # offered nothing: the set is lent
    holder.release()
    held = pool.nbytes
    latecomer.cancel()  # its snapshot failed: it had nothing to give back
    assert held > 0 and pool.nbytes == held


def test_a_failed_snapshot_gives_its_offered_set_back() -> None:
    class Unpicklable:
        def __deepcopy__(self, memo: dict) -> Any:
            raise RuntimeError("cannot copy this")

    pool = StagingBuffers()
    lease = pool.lease()
    cpu_snapshot(_state(), lease)
    lease.release()
    held = pool.nbytes
    broken = _state()
    broken["extra"] = Unpicklable()
    lease = pool.lease()
    with pytest.raises(RuntimeError, match="cannot copy this"):
        cpu_snapshot(broken, lease)
    lease.cancel()
    assert pool.nbytes == held


def test_buffers_never_cross_a_pickle_and_clear_frees_them() -> None:
    pool = StagingBuffers()
    lease = pool.lease()
    cpu_snapshot(_state(), lease)
    lease.release()
    assert pool.nbytes > 0
    for other in (pickle.loads(pickle.dumps(pool)), copy.deepcopy(pool)):
        assert other.nbytes == 0 and other.lease().reused == 0
    writer = UCVolumeWriter("/tmp/unused", staging_buffers=pool)
    assert pickle.loads(pickle.dumps(writer)).staging_buffers.nbytes == 0
    pool.clear()
    assert pool.nbytes == 0


def test_the_writer_takes_only_staging_buffers() -> None:
    with pytest.raises(TypeError, match="staging_buffers must be a StagingBuffers or None, got bool"):
        UCVolumeWriter("/tmp/unused", staging_buffers=True)  # type: ignore[arg-type]


def _load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(like)
    with torch.no_grad():
        for t in _tensors(out):
            t.zero_()
    dcp.load(out, storage_reader=UCVolumeReader(path))
    return out


def test_async_saves_with_kept_buffers_save_each_steps_values(tmp_path: Path, staging: Path) -> None:
    pool = StagingBuffers()
    sd = {"w": torch.arange(BIG, dtype=torch.float32), "b": torch.ones(16)}
    for step in range(3):
        fut = dcp.async_save(sd, storage_writer=UCVolumeWriter(tmp_path / f"s{step}", staging_buffers=pool))
        with torch.no_grad():  # the next optimizer step, while the save uploads
            for t in sd.values():
                t.add_(1)
        fut.result()
        assert pool.nbytes == (BIG + 16) * 4
    for step in range(3):
        out = _load(tmp_path / f"s{step}", sd)
        assert torch.equal(out["w"], torch.arange(BIG, dtype=torch.float32) + step)
        assert torch.equal(out["b"], torch.ones(16) + step)


class SlowToSerialise:
    """A state value whose pickling (in the save's serialiser) waits for ``gate``."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def __deepcopy__(self, memo: dict) -> SlowToSerialise:
        return self  # staged as it is: the test holds the gate

    def __getstate__(self) -> dict:
        assert self.gate.wait(30)
        return {}

    def __setstate__(self, state: dict) -> None:
        self.gate = threading.Event()


def test_a_save_still_serialising_keeps_its_buffers(tmp_path: Path, staging: Path) -> None:
    # The second save starts while the first still reads its snapshot: it must get new memory,
    # or the first checkpoint would hold the second step's values.
    pool = StagingBuffers()
    warm = dcp.async_save({"w": torch.zeros(BIG)}, storage_writer=UCVolumeWriter(tmp_path / "w", staging_buffers=pool))
    warm.result()  # the pool holds a set that fits
    gate = threading.Event()
    sd: dict[str, Any] = {"w": torch.full((BIG,), 1.0), "x": SlowToSerialise(gate)}
    first = dcp.async_save(sd, storage_writer=UCVolumeWriter(tmp_path / "a", staging_buffers=pool))
    time.sleep(0.3)  # the first save is in its serialiser, blocked on the gate
    assert not first.done()
    with torch.no_grad():
        sd["w"].fill_(2.0)
    second = dcp.async_save({"w": sd["w"]}, storage_writer=UCVolumeWriter(tmp_path / "b", staging_buffers=pool))
    second.result()
    gate.set()
    first.result()
    assert torch.equal(_load(tmp_path / "a", {"w": torch.zeros(BIG)})["w"], torch.full((BIG,), 1.0))
    assert torch.equal(_load(tmp_path / "b", {"w": torch.zeros(BIG)})["w"], torch.full((BIG,), 2.0))


def test_the_manager_keeps_buffers_when_asked(tmp_path: Path, staging: Path) -> None:
    for bad in ({"mode": "sync"}, {"background_copy": True}, {"mode": "process"}):
        with pytest.raises(ValueError, match="reuse_buffers=True needs mode='thread' and background_copy=False"):
            Staging(reuse_buffers=True, **bad)  # type: ignore[arg-type]
    manager = CheckpointManager(str(tmp_path / "run"), staging=Staging(reuse_buffers=True))
    sd = {"w": torch.arange(BIG, dtype=torch.float32)}
    for step in (1, 2):
        manager.save(step, sd)
        with torch.no_grad():
            sd["w"].add_(10)
    manager.wait()
    assert manager._staging_buffers is not None and manager._staging_buffers.nbytes == BIG * 4
    out = {"w": torch.zeros(BIG)}
    manager.load(out, step=1)
    assert torch.equal(out["w"], torch.arange(BIG, dtype=torch.float32))
    manager.load(out, step=2)
    assert torch.equal(out["w"], torch.arange(BIG, dtype=torch.float32) + 10)
