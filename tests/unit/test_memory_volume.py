"""MemoryVolume, the in-process test double: what the contract suite (test_volume_contract.py) does not
cover: one store shared by children and only by them, a clock for file times, atomic refusing
publishes under threads, the refusal to be pickled, no ``mem://`` URL, the base class's copy loop
and derived size, and whole DCP saves, loads and a manager's retention on it."""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch.distributed.checkpoint as dcp

from tests.conftest import assert_state_dict_equal, empty_like_state_dict, make_state_dict
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.errors import CheckpointExistsError, TransferError, VolumeError
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.volumes import FsspecVolume, MemoryStore, MemoryVolume, Volume, open_volume


def test_children_share_the_store_and_separate_volumes_do_not() -> None:
    root = MemoryVolume("run")
    root.prepare_for_write()
    root.child("step_1").prepare_for_write()
    root.child("step_1").publish_bytes("f", b"abc")
    assert root.child("step_1").store is root.store and root.list_files() == {"step_1/": -1}
    assert MemoryVolume("run").list_files() == {}  # a new store: nothing of the first one
    assert MemoryVolume("run/step_1", store=root.store).read_bytes("f") == b"abc"  # unless passed
    assert MemoryVolume("/run//step_1/", store=root.store).url == "mem://run/step_1"


def test_file_times_come_from_the_store_clock() -> None:
    now = [1000.0]
    volume = MemoryVolume("t", store=MemoryStore(clock=lambda: now[0]))
    volume.prepare_for_write()
    volume.publish_bytes("a", b"1")
    now[0] = 2000.0
    volume.publish_bytes("b", b"2")
    assert volume.list_mtimes() == {"a": 1000.0, "b": 2000.0}
    volume.publish_bytes("a", b"11")  # rewritten: a new time
    assert volume.list_mtimes()["a"] == 2000.0


def test_refusing_publish_has_exactly_one_winner_under_threads() -> None:
    volume = MemoryVolume("race")
    volume.prepare_for_write()
    barrier = threading.Barrier(8)
    won: list[int] = []
    lost: list[int] = []

    def publish(i: int) -> None:
        barrier.wait()
        try:
            volume.publish_bytes("latest", str(i).encode(), overwrite=False)
            won.append(i)
        except CheckpointExistsError:
            lost.append(i)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7
    assert volume.read_bytes("latest") == str(won[0]).encode()


def test_writes_need_a_created_location() -> None:
    volume = MemoryVolume("never/made")
    with pytest.raises(TransferError, match="publishing mem://never/made/f failed"):
        volume.publish_bytes("f", b"x")
    with pytest.raises(VolumeError, match="parent directory mem://never does not exist"):
        volume.prepare_for_write(create_parents=False)
    volume.prepare_for_write()
    assert MemoryVolume("never", store=volume.store).exists()


def test_not_picklable_and_no_url_scheme() -> None:
    with pytest.raises(VolumeError, match="cannot be sent to another one"):
        pickle.dumps(MemoryVolume("p"))
    with pytest.raises(VolumeError, match="no filesystem for 'mem://x'"):
        open_volume("mem://x")  # not a scheme: a URL would need a process-wide registry
    assert isinstance(open_volume("memory://x"), FsspecVolume)  # fsspec's memory filesystem, as before
    volume = MemoryVolume("p")
    assert open_volume(volume) is volume


class _Lossy(MemoryVolume):
    """Drops the last byte of every upload: the base class's copy loop must notice."""

    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        with super().open_write(name, sync=sync) as buffer:
            yield buffer
            buffer.truncate(max(0, buffer.tell() - 1))


class _ListedSizes(MemoryVolume):
    """Uses the base class's size(), derived from one listing."""

    size = Volume.size


def test_base_copy_loop_checks_what_landed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"0123456789")
    lossy = _Lossy("l")
    lossy.prepare_for_write()
    with pytest.raises(TransferError, match=r"mem://l/f landed with 9 bytes, expected 10"):
        lossy.upload_file(src, "f")
    with pytest.raises(TransferError, match=f"uploading {tmp_path / 'nope'} to mem://l/g failed"):
        lossy.upload_file(tmp_path / "nope", "g")
    listed = _ListedSizes("s")
    listed.prepare_for_write()
    listed.child("sub").prepare_for_write()
    assert listed.upload_file(src, "f").size == 10
    assert listed.size("f") == 10 and listed.size("nope") is None and listed.size("sub") is None


def test_dcp_save_load_and_manager_on_memory(staging: Path) -> None:
    volume = MemoryVolume("ckpt")
    sd = make_state_dict(1)
    dcp.save(sd, storage_writer=UCVolumeWriter(volume))
    assert ".metadata" in volume.list_files()
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=UCVolumeReader(volume))
    assert_state_dict_equal(sd, out)

    root = MemoryVolume("managed")
    manager = CheckpointManager(root, keep_last=2, staging=Staging(mode="sync"))
    for step in (1, 2, 3):
        manager.save(step, make_state_dict(step, n=1)).result()
    assert [info.step for info in manager.list()] == [2, 3] and manager.latest() == 3
    out = empty_like_state_dict(make_state_dict(3, n=1))
    assert manager.load(out) == 3
    assert_state_dict_equal(make_state_dict(3, n=1), out)
