"""One contract, every backend: LocalVolume, MemoryVolume, FsspecVolume over ``memory://`` and
S3Volume on the moto server answer the same calls the same way (listing, sizes and times, whether
the location exists, the checksummed copies with their size checks, ranged reads, the refusing
``publish_bytes(overwrite=False)``, deletion, child locations). Where the backends differ by design
(object stores have no directories), the expectation says so through the backend's ``dirs`` flag."""

from __future__ import annotations

import pickle
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from uc_checkpoint.errors import CheckpointExistsError, CorruptCheckpointError, VolumeError
from uc_checkpoint.volumes import Entry, FsspecVolume, LocalVolume, MemoryVolume, S3Volume, Volume


@dataclass
class Backend:
    """A fresh root of one backend, and what it is known to do differently."""

    root: Volume
    dirs: bool  # the store has real directories: a location must be created, and can be missing
    put_raw: Callable[[str, bytes], None]  # write a file at the root behind the volume's back


BACKENDS = ["local", "memory", "fsspec-memory", "s3"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    kind = request.param
    if kind == "local":
        root = LocalVolume(tmp_path / "root")
        yield Backend(root, True, lambda name, data: (tmp_path / "root" / name).write_bytes(data))
    elif kind == "memory":
        mem = MemoryVolume("root")
        yield Backend(mem, True, lambda name, data: mem.store.files.__setitem__(f"root/{name}", (data, time.time())))
    elif kind == "fsspec-memory":
        fsv = FsspecVolume(f"memory://uc-contract-{uuid.uuid4().hex[:12]}")
        yield Backend(fsv, False, lambda name, data: fsv.fs.pipe_file(f"{fsv.root}/{name}", data))
        if fsv.fs.exists(fsv.root):
            fsv.fs.rm(fsv.root, recursive=True)
    else:
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        s3v = S3Volume(f"s3://{bucket}/root", endpoint_url=server, max_attempts=4)
        yield Backend(s3v, False, lambda name, data: s3v.client.put_object(Bucket=bucket, Key=s3v.key(name), Body=data))
        s3v.close()


def _local_file(tmp_path: Path, size: int, seed: int = 0) -> Path:
    path = tmp_path / f"src-{seed}-{size}"
    path.write_bytes(bytes((i * 7 + seed) % 251 for i in range(size)))
    return path


def _s3_calls(volume: Volume) -> list[str]:
    """The S3 operations the volume's client sends from now on (names, in order)."""
    calls: list[str] = []
    assert isinstance(volume, S3Volume)
    volume.client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    return calls


def test_listing_sizes_times_and_exists(backend: Backend, tmp_path: Path) -> None:
    loc = backend.root.child("loc")
    assert loc.list_files() == {} and loc.list_mtimes() == {} and loc.list_entries() == []
    assert loc.size("a") is None
    assert loc.exists() is (not backend.dirs)  # a never-created directory is missing; a prefix is not
    loc.prepare_for_write()
    assert loc.exists() is True
    before = time.time() - 2  # S3 keeps seconds only
    loc.publish_bytes("a", b"12345")
    loc.upload_file(_local_file(tmp_path, 3000), "b")
    sub = loc.child("sub")
    sub.prepare_for_write()
    sub.publish_bytes("x", b"x")
    after = time.time() + 2
    assert loc.list_files() == {"a": 5, "b": 3000, "sub/": -1}
    entries = {e.name: e for e in loc.list_entries()}
    assert set(entries) == {"a", "b", "sub/"}
    assert entries["sub/"] == Entry("sub/", -1, None) and entries["sub/"].is_dir and not entries["a"].is_dir
    assert entries["a"].size == 5 and entries["b"].size == 3000
    mtimes = loc.list_mtimes()
    assert set(mtimes) == {"a", "b"}  # sub-locations have none
    assert all(before <= t <= after for t in mtimes.values()), mtimes
    assert mtimes == {n: e.mtime for n, e in entries.items() if not e.is_dir}
    assert loc.size("a") == 5 and loc.size("b") == 3000 and loc.size("nope") is None


def test_s3_derived_methods_send_no_extra_requests(s3_server: str, s3_bucket: str) -> None:
    volume = S3Volume(f"s3://{s3_bucket}/counted", endpoint_url=s3_server, max_attempts=4)
    volume.publish_bytes("a", b"abc")
    calls = _s3_calls(volume)
    assert volume.list_files() == {"a": 3}
    assert calls == ["ListObjectsV2"]
    assert set(volume.list_mtimes()) == {"a"} and len(volume.list_entries()) == 1
    assert calls == ["ListObjectsV2"] * 3
    assert volume.exists() and calls == ["ListObjectsV2"] * 3  # a prefix always exists: no request
    assert volume.size("a") == 3 and calls[-1] == "HeadObject" and len(calls) == 4  # one HEAD, not a listing


def test_upload_download_and_size_checks(backend: Backend, tmp_path: Path) -> None:
    loc = backend.root.child("data")
    loc.prepare_for_write()
    src = _local_file(tmp_path, 300_000, seed=3)
    content = src.read_bytes()
    up = loc.upload_file(src, "f")
    assert up.name == "f" and up.size == len(content) and up.crc32 == f"{zlib.crc32(content):08x}"
    assert up.block_crc32  # block checksums for ranged reads

    dest = tmp_path / "down"
    down = loc.download_file("f", dest, expected_size=len(content))
    assert dest.read_bytes() == content and down == up
    assert loc.download_file("f", tmp_path / "down2") == up  # no expectation: the whole file

    # A file without a manifest record: only the bytes the items need are copied.
    part = loc.download_file("f", tmp_path / "part", min_size=1000)
    assert (tmp_path / "part").read_bytes() == content[:1000] and part.size == 1000

    where = loc.url_of("f")
    with pytest.raises(CorruptCheckpointError, match="recorded 300001") as ei:
        loc.download_file("f", tmp_path / "x", expected_size=len(content) + 1)
    assert where in str(ei.value) and "has 300000 bytes" in str(ei.value)
    with pytest.raises(CorruptCheckpointError, match="needs at least 300001") as ei:
        loc.download_file("f", tmp_path / "x", min_size=len(content) + 1)
    assert where in str(ei.value)
    with pytest.raises(CorruptCheckpointError, match="is missing") as ei:
        loc.download_file("nope", tmp_path / "x", expected_size=1)
    assert loc.url_of("nope") in str(ei.value)


def test_read_range_and_its_errors(backend: Backend) -> None:
    loc = backend.root.child("ranges")
    loc.prepare_for_write()
    loc.publish_bytes("f", bytes(range(100)))
    assert loc.read_range("f", 10, 20) == bytes(range(10, 20))
    assert loc.read_range("f", 0, 100) == bytes(range(100))
    with pytest.raises(CorruptCheckpointError, match="is truncated") as ei:
        loc.read_range("f", 90, 110)
    assert loc.url_of("f") in str(ei.value) and "bytes 90-109 needed, got 10" in str(ei.value)
    with pytest.raises(CorruptCheckpointError, match="is truncated"):
        loc.read_range("f", 150, 160)  # wholly past the end (S3: 416)
    with pytest.raises(CorruptCheckpointError, match="is missing") as ei:
        loc.read_range("nope", 0, 1)
    assert loc.url_of("nope") in str(ei.value)


def test_publish_read_and_delete(backend: Backend) -> None:
    loc = backend.root.child("pub")
    loc.prepare_for_write()
    assert loc.read_bytes("m") is None
    loc.publish_bytes("m", b"first", overwrite=False)
    with pytest.raises(CheckpointExistsError, match="already exists and overwrite=False") as ei:
        loc.publish_bytes("m", b"second", overwrite=False)
    assert loc.url_of("m") in str(ei.value)
    assert loc.read_bytes("m") == b"first"  # the refused write changed nothing
    loc.publish_bytes("m", b"third!")
    assert loc.read_bytes("m") == b"third!" and loc.size("m") == 6
    loc.delete("m")
    assert loc.read_bytes("m") is None and loc.size("m") is None and "m" not in loc.list_files()
    loc.delete("m")  # a missing file is not an error
    loc.publish_bytes("m", b"again", overwrite=False)  # and the name is free again
    assert loc.read_bytes("m") == b"again"


def test_child_locations(backend: Backend) -> None:
    root = backend.root
    child = root.child("step_1")
    assert child.url == f"{root.url}/step_1" and type(child) is type(root)
    assert child.url_of("f") == f"{root.url}/step_1/f"
    assert root.child("a//b/").url == f"{root.url}/a/b"  # one spelling per place
    child.prepare_for_write()
    child.publish_bytes("f", b"abc")
    assert root.child("step_1").read_bytes("f") == b"abc"  # another child object, the same place
    assert root.list_files() == {"step_1/": -1}
    grand = child.child("deeper")
    grand.prepare_for_write()
    grand.publish_bytes("g", b"g")
    assert child.list_files() == {"f": 3, "deeper/": -1}
    assert root.child("step_1/deeper").read_bytes("g") == b"g"
    if isinstance(root, LocalVolume):
        assert root.child("../x").url == str(Path(root.url).parent / "x")  # a path: '..' resolves
    else:
        with pytest.raises(VolumeError, match="'..' path segment"):
            root.child("../x")  # a key: '..' would be a literal part of it


def test_list_tree_lists_every_file_below_a_prefix(backend: Backend) -> None:
    root = backend.root
    assert root.list_tree() == []  # nothing there yet (a missing location on stores with directories)
    for where, name, data in (
        ("step_1", ".metadata", b"m"),
        ("step_1/3a", "__0_ab_0.distcp", b"abc"),
        ("step_1/3a/deeper", "x", b"xy"),
        ("step_2", "__0_cd_0.distcp", b"abcd"),
        ("other", "y", b"y"),
        ("", "step_top", b"t"),
    ):
        location = root.child(where) if where else root
        location.prepare_for_write()
        location.publish_bytes(name, data)
    tree = root.list_tree("step_")
    files = {e.name: e.size for e in tree if not e.is_dir}
    assert files == {
        "step_1/.metadata": 1,
        "step_1/3a/__0_ab_0.distcp": 3,
        "step_1/3a/deeper/x": 2,
        "step_2/__0_cd_0.distcp": 4,
        "step_top": 1,
    }
    assert all(e.mtime is not None for e in tree if not e.is_dir)
    dirs = {e.name for e in tree if e.is_dir}
    # The walk reports the directories on its way; S3's one listing has none to report.
    expected = {"step_1/", "step_1/3a/", "step_1/3a/deeper/", "step_2/"}
    assert dirs == (set() if isinstance(root, S3Volume) else expected), dirs
    assert {e.name for e in root.list_tree() if not e.is_dir} == {*files, "other/y"}


def test_location_that_is_a_file(backend: Backend) -> None:
    if isinstance(backend.root, S3Volume):
        pytest.skip("an S3 key and a prefix of the same name coexist: no location is ever a file")
    backend.root.prepare_for_write()
    backend.put_raw("plain", b"not a directory")
    loc = backend.root.child("plain")
    with pytest.raises(VolumeError, match="is a file, not a directory"):
        loc.exists()
    with pytest.raises(VolumeError, match="is a file"):
        loc.prepare_for_write()
    if backend.dirs:
        with pytest.raises(VolumeError, match="is a file, not a directory"):
            loc.list_files()
        with pytest.raises(VolumeError, match="is a file, not a directory"):
            loc.list_mtimes()  # LocalVolume returned {} here before: the listings now agree
    else:
        assert loc.list_files() == {} and loc.list_mtimes() == {}  # fsspec's ls of a file: itself, skipped


def test_remove_if_empty(backend: Backend) -> None:
    loc = backend.root.child("empty")
    loc.prepare_for_write()
    full = backend.root.child("full")
    full.prepare_for_write()
    full.publish_bytes("f", b"1")
    loc.remove_if_empty()
    full.remove_if_empty()
    assert full.read_bytes("f") == b"1"  # not empty: left alone
    assert "full/" in backend.root.list_files()
    if backend.dirs:
        assert not loc.exists() and "empty/" not in backend.root.list_files()


def test_s3_child_shares_client_and_retry_count(s3_server: str, s3_bucket: str) -> None:
    from tests.support.s3_fixtures import s3_client

    parent = S3Volume(f"s3://{s3_bucket}/p", endpoint_url=s3_server, max_attempts=3, part_size=5 << 20)
    early = parent.child("a")  # made before any client exists
    assert parent._client is None and early.max_attempts == 3 and early.part_size == 5 << 20
    assert early.client is parent.client and parent.child("b").client is parent.client
    parent._shared.add_retries(2)  # what the client's after-call hook does
    assert early.retries == 2 and parent.child("c").retries == 2
    clone = pickle.loads(pickle.dumps(early))
    assert clone.url == early.url and clone._client is None and clone.retries == 2
    given = S3Volume(f"s3://{s3_bucket}/g", client=s3_client(s3_server))
    with pytest.raises(VolumeError, match="client_factory"):
        pickle.dumps(given.child("x"))  # a child of a volume holding a client holds it too
