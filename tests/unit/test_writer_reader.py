"""Single-process round trips, overwrite safety, bad input and damaged checkpoints."""

from __future__ import annotations

import errno
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import assert_state_dict_equal, cause, empty_like_state_dict, make_state_dict, staging_files
from uc_checkpoint import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LocationNotEmptyError,
    StagingError,
    TransferError,
    UCVolumeReader,
    UCVolumeWriter,
    VolumeError,
)
from uc_checkpoint.dcp.options import ReaderOptions, WriterOptions
from uc_checkpoint.volumes import FileRecord, LocalVolume, MemoryVolume

warnings.filterwarnings("ignore", category=UserWarning)


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".distcp"))


def test_round_trip_loads_with_stock_and_our_reader(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(1)
    dest = tmp_path / "vol" / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest))
    assert (dest / ".metadata").is_file()
    assert len(data_files(dest)) == 2  # the small items' file, then one of the large tensors

    stock = empty_like_state_dict(sd)
    dcp.load(stock, storage_reader=FileSystemReader(dest))
    assert_state_dict_equal(stock, sd)

    ours = empty_like_state_dict(sd)
    dcp.load(ours, storage_reader=UCVolumeReader(dest))
    assert_state_dict_equal(ours, sd)
    assert staging_files(staging) == []


def test_many_files_and_threads(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(2, n=6)
    dest = tmp_path / "ckpt"
    dcp.save(
        sd,
        storage_writer=UCVolumeWriter(
            dest, thread_count=2, options=WriterOptions(file_size_bytes=100_000, upload_workers=3)
        ),
    )
    assert len(data_files(dest)) >= 4
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=UCVolumeReader(dest, options=ReaderOptions(download_workers=3)))
    assert_state_dict_equal(out, sd)
    # the manifest inside .metadata lists exactly the data files, with their sizes
    meta = pickle.loads((dest / ".metadata").read_bytes())
    files = meta.uc_manifest["files"]
    assert sorted(files) == data_files(dest)
    for name, rec in files.items():
        assert rec["size"] == (dest / name).stat().st_size


def test_async_save_thread_mode(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(3)
    dest = tmp_path / "ckpt"
    fut = dcp.async_save(sd, storage_writer=UCVolumeWriter(dest))
    fut.result(timeout=120)
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert_state_dict_equal(out, sd)


def test_checkpoint_id_replaces_path_and_writer_pickles(tmp_path: Path, staging: Path) -> None:
    writer = UCVolumeWriter(tmp_path / "unused")
    dcp.save(make_state_dict(4), checkpoint_id=tmp_path / "a", storage_writer=writer)
    assert (tmp_path / "a" / ".metadata").is_file()
    assert not (tmp_path / "unused").exists()
    clone = pickle.loads(pickle.dumps(writer))  # PROCESS mode pickles the writer
    assert clone.checkpoint_id == str(tmp_path / "a")
    reader = pickle.loads(pickle.dumps(UCVolumeReader(tmp_path / "a")))
    out = empty_like_state_dict(make_state_dict(4))
    dcp.load(out, storage_reader=reader)
    assert_state_dict_equal(out, make_state_dict(4))


def test_checkpoint_id_may_be_a_volume_and_anything_else_is_named(tmp_path: Path, staging: Path) -> None:
    writer = UCVolumeWriter(tmp_path / "unused")
    there = LocalVolume(tmp_path / "v")
    dcp.save(make_state_dict(4), checkpoint_id=there, storage_writer=writer)
    assert (tmp_path / "v" / ".metadata").is_file() and not (tmp_path / "unused").exists()
    out = empty_like_state_dict(make_state_dict(4))
    dcp.load(out, checkpoint_id=there, storage_reader=UCVolumeReader(tmp_path / "unused"))
    assert_state_dict_equal(out, make_state_dict(4))
    # A mem:// URL on a writer built from a MemoryVolume is a location in that volume's store (no
    # other volume can open it).
    mem = MemoryVolume("root")
    dcp.save(make_state_dict(4), checkpoint_id="mem://other/ck", storage_writer=UCVolumeWriter(mem))
    assert ".metadata" in MemoryVolume("other/ck", store=mem.store).list_files()
    with pytest.raises(TypeError, match="checkpoint_id must be a path, a URL or a uc_checkpoint Volume, got int: 42"):
        writer.reset(42)  # type: ignore[arg-type]
    for falsy in ({}, 0, b""):  # not taken for "no checkpoint_id" (only None and "" are)
        with pytest.raises(TypeError, match=f"got {type(falsy).__name__}"):
            writer.reset(falsy)  # type: ignore[arg-type]

    class BytesPath:  # os.PathLike may give bytes: the path they spell, never the text "b'...'"
        def __init__(self, path: Path) -> None:
            self.path = path

        def __fspath__(self) -> bytes:
            return os.fsencode(self.path)

    dcp.save(make_state_dict(4), checkpoint_id=BytesPath(tmp_path / "b"), storage_writer=writer)  # type: ignore[arg-type]
    assert (tmp_path / "b" / ".metadata").is_file()
    assert UCVolumeWriter(BytesPath(tmp_path / "c")).checkpoint_id == str(tmp_path / "c")  # type: ignore[arg-type]


@pytest.mark.parametrize("option", ["download_workers", "max_inflight_bytes", "range_chunk_bytes", "range_gap_bytes"])
@pytest.mark.parametrize("value", [1.5, True, "4"])
def test_reader_size_options_must_be_ints(tmp_path: Path, option: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"{option} must be an int, got {type(value).__name__}"):
        ReaderOptions(**{option: value})
    with pytest.raises(TypeError, match="options must be a ReaderOptions, got dict"):
        UCVolumeReader(tmp_path, options={option: value})  # type: ignore[arg-type]


def test_overwrite_replaces_atomically_and_removes_old_files(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    writer = UCVolumeWriter(dest)
    dcp.save(make_state_dict(5), storage_writer=writer)
    first = data_files(dest)
    dcp.save(make_state_dict(6), storage_writer=writer)  # same writer object, same location
    second = data_files(dest)
    assert set(first).isdisjoint(second), "a new save must never reuse the names of published files"
    out = empty_like_state_dict(make_state_dict(6))
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert_state_dict_equal(out, make_state_dict(6))


def test_overwrite_deletes_only_the_replaced_checkpoints_files(tmp_path: Path, staging: Path) -> None:
    """Files no published .metadata references may belong to another job's save in progress here:
    a publish must not delete them (that save could then publish over missing files)."""
    dest = tmp_path / "ckpt"
    dcp.save(make_state_dict(5), storage_writer=UCVolumeWriter(dest))
    first = set(data_files(dest))
    other = dest / "__0_0123456789ab_0.distcp"  # another save's file, not referenced by any .metadata
    other.write_bytes(b"in progress")
    dcp.save(make_state_dict(6), storage_writer=UCVolumeWriter(dest))
    assert other.read_bytes() == b"in progress"
    assert not first & set(data_files(dest))  # the replaced checkpoint's files are gone


def test_overwrite_false_keeps_existing_checkpoint(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(make_state_dict(7), storage_writer=UCVolumeWriter(dest))
    before = sorted(os.listdir(dest))
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(8), storage_writer=UCVolumeWriter(dest, overwrite=False))
    assert isinstance(cause(ei), CheckpointExistsError)
    assert str(dest / ".metadata") in str(cause(ei))
    assert sorted(os.listdir(dest)) == before
    out = empty_like_state_dict(make_state_dict(7))
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert_state_dict_equal(out, make_state_dict(7))


def test_location_with_foreign_files_is_refused(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(), storage_writer=UCVolumeWriter(dest))
    err = cause(ei)
    assert isinstance(err, LocationNotEmptyError)
    assert "notes.txt" in str(err) and str(dest) in str(err)
    assert sorted(os.listdir(dest)) == ["notes.txt"]


def test_location_that_is_a_file(tmp_path: Path, staging: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(), storage_writer=UCVolumeWriter(target))
    assert isinstance(cause(ei), VolumeError) and str(target) in str(cause(ei))
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(), storage_writer=UCVolumeWriter(target / "sub"))
    assert isinstance(cause(ei), VolumeError) and str(target) in str(cause(ei))
    assert target.read_text() == "x"
    # A plan that failed leaves no staging directory (this user's "uc-checkpoint-<uid>" may stay).
    assert [p.name for p in staging.rglob("*")] in ([], [f"uc-checkpoint-{os.geteuid()}"])
    with pytest.raises(CheckpointException) as ei:
        dcp.load(make_state_dict(), storage_reader=UCVolumeReader(target))
    assert isinstance(cause(ei), VolumeError) and f"{target} is a file" in str(cause(ei))


def test_missing_parent_without_create_parents(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "no" / "such" / "ckpt"
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(), storage_writer=UCVolumeWriter(dest, options=WriterOptions(create_parents=False)))
    assert isinstance(cause(ei), VolumeError) and str(dest.parent) in str(cause(ei))
    assert not (tmp_path / "no").exists()


def test_unusable_staging_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "staging-is-a-file"
    blocker.write_text("x")
    dest = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(), storage_writer=UCVolumeWriter(dest, staging_dir=blocker))
    assert isinstance(cause(ei), StagingError) and str(blocker) in str(cause(ei))
    assert not (dest / ".metadata").exists()


class FailingVolume(LocalVolume):
    """A local volume whose n-th upload fails, as a dropped network mount would."""

    def __init__(self, path: Path, fail_on: int) -> None:
        super().__init__(path)
        self.fail_on = fail_on
        self.calls = 0

    def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
        self.calls += 1
        if self.calls == self.fail_on:
            raise TransferError(f"copying {local_path} to {self.url_of(name)} failed: injected EIO")
        return super().upload_file(local_path, name, sync=sync)


def test_failed_upload_publishes_nothing_and_keeps_previous(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(make_state_dict(9), storage_writer=UCVolumeWriter(dest))
    with pytest.raises(CheckpointException) as ei:
        dcp.save(
            make_state_dict(10, n=6),
            storage_writer=UCVolumeWriter(FailingVolume(dest, 2), options=WriterOptions(file_size_bytes=50_000)),
        )
    assert isinstance(cause(ei), TransferError) and "injected" in str(cause(ei))
    out = empty_like_state_dict(make_state_dict(9))
    dcp.load(out, storage_reader=UCVolumeReader(dest))  # the previous checkpoint is intact
    assert_state_dict_equal(out, make_state_dict(9))
    assert staging_files(staging) == []


def test_publish_without_rename(tmp_path: Path, staging: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # FUSE mounts of object stores refuse rename(2); we cannot mount one that does in a unit test,
    # so os.replace is made to fail the way such a mount fails it.
    def refuse(src: object, dst: object) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented", str(src))

    monkeypatch.setattr(os, "replace", refuse)
    dest = tmp_path / "ckpt"
    sd = make_state_dict(11)
    dcp.save(sd, storage_writer=UCVolumeWriter(dest))
    # no temp file left behind: the checkpoint and the location's claim
    assert sorted(p.name for p in dest.iterdir() if not p.name.endswith(".distcp")) == [".metadata", ".uc-claim"]
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=FileSystemReader(dest))
    assert_state_dict_equal(out, sd)


# ---- reader errors -----------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path, staging: Path) -> tuple[Path, dict]:
    sd = make_state_dict(12, n=6)
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=100_000)))
    return dest, sd


def load_error(dest: Path, sd: dict, **kwargs: object) -> BaseException:
    with pytest.raises(CheckpointException) as ei:
        dcp.load(empty_like_state_dict(sd), storage_reader=UCVolumeReader(dest, options=ReaderOptions(**kwargs)))
    return cause(ei)


def test_no_metadata(tmp_path: Path, staging: Path) -> None:
    err = load_error(tmp_path / "nothing", make_state_dict())
    assert isinstance(err, CheckpointNotFoundError)
    assert str(tmp_path / "nothing" / ".metadata") in str(err)


def test_missing_data_file(saved: tuple[Path, dict]) -> None:
    dest, sd = saved
    victim = data_files(dest)[1]
    (dest / victim).unlink()
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError) and victim in str(err)


def test_truncated_data_file(saved: tuple[Path, dict]) -> None:
    dest, sd = saved
    victim = dest / data_files(dest)[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError) and victim.name in str(err)


def test_flipped_byte_fails_checksum(saved: tuple[Path, dict]) -> None:
    dest, sd = saved
    victim = dest / data_files(dest)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError) and "checksum" in str(err) and victim.name in str(err)


def test_corrupt_metadata(saved: tuple[Path, dict]) -> None:
    dest, sd = saved
    meta = dest / ".metadata"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError) and str(meta) in str(err)


@pytest.mark.parametrize("prefetch_files", [False, True], ids=["ranges", "whole-files"])
def test_a_load_fetches_the_largest_ranges_first(tmp_path: Path, staging: Path, prefetch_files: bool) -> None:
    """Largest first (LPT): the long transfers start first and the short ones fill in around them.
    With one worker the reads run in the order the reader queues them."""
    reads: list[str] = []

    class RecordingVolume(LocalVolume):
        def read_range_into(self, name: str, start: int, out: Any, **kwargs: Any) -> None:
            reads.append(name)
            super().read_range_into(name, start, out, **kwargs)

        def download_file(self, name: str, local_path: Path, **kwargs: Any) -> FileRecord:
            reads.append(name)
            return super().download_file(name, local_path, **kwargs)

    # Names in the opposite order to the sizes: DCP plans items by name.
    sd = {"a_small": torch.randn(1 << 8), "b_mid": torch.randn(1 << 17), "c_big": torch.randn(1 << 20)}
    dcp.save(sd, storage_writer=UCVolumeWriter(tmp_path / "ckpt", staging_dir=staging, thread_count=3), no_dist=True)
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").glob("*.distcp")}
    assert len(sizes) == 3  # one tensor per file

    target = empty_like_state_dict(sd)
    reader = UCVolumeReader(
        RecordingVolume(str(tmp_path / "ckpt")),
        staging_dir=staging,
        options=ReaderOptions(download_workers=1, prefetch_files=prefetch_files),
    )
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_state_dict_equal(target, sd)
    assert list(dict.fromkeys(reads)) == sorted(sizes, key=lambda name: sizes[name], reverse=True)


def test_partial_load_fetches_only_needed_files(saved: tuple[Path, dict]) -> None:
    dest, sd = saved
    meta = pickle.loads((dest / ".metadata").read_bytes())
    needed = {info.relative_path for idx, info in meta.storage_data.items() if idx.fqn == "w0"}
    for name in set(data_files(dest)) - needed:
        (dest / name).unlink()  # files the plan does not need may even be gone
    out = {"w0": torch.zeros_like(sd["w0"])}
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert torch.equal(out["w0"], sd["w0"])
