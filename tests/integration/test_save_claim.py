"""A save claims its location (a listing, the marker's PUT and the claim's PUT: tens of ms on an
object store) in the background while its data files are serialised; it uploads nothing before its
marker is on the volume, and publishes nothing before the whole claim held."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import cause
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.errors import LocationNotEmptyError, TransferError
from uc_checkpoint.format.integrity import FileRecord
from uc_checkpoint.format.layout import parse_save_marker
from uc_checkpoint.volumes import LocalVolume


class SlowListingVolume(LocalVolume):
    """A local volume whose listings take ``delay_s`` (an object store's round trip, exaggerated),
    recording what happens to it, in order."""

    def __init__(self, path: Path, events: list[str], delay_s: float, staging: Path | None = None) -> None:
        super().__init__(path)
        self.events, self.delay_s, self.staging = events, delay_s, staging
        self.staged_at_marker: list[str] = []

    def list_files(self) -> dict[str, int]:
        time.sleep(self.delay_s)
        return super().list_files()

    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        self.events.append("marker" if parse_save_marker(name) else name)
        if parse_save_marker(name) and self.staging is not None:
            self.staged_at_marker = sorted(p.name for p in self.staging.rglob("*.distcp"))
        return super().publish_bytes(name, data, overwrite=overwrite)

    def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
        self.events.append("upload")
        return super().upload_file(local_path, name, sync=sync)


class Serialised:
    """A state-dict value that records when the save serialises it."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __getstate__(self) -> dict:
        self.events.append("serialise")
        return {}

    def __setstate__(self, state: dict) -> None:
        self.events = []


def test_the_claim_overlaps_serialising_and_precedes_every_upload(tmp_path: Path, staging: Path) -> None:
    events: list[str] = []
    sd = {"w": torch.arange(1 << 16, dtype=torch.float32), "x": Serialised(events)}
    volume = SlowListingVolume(tmp_path / "ckpt", events, delay_s=0.3)
    started = time.perf_counter()
    dcp.save(
        sd, storage_writer=UCVolumeWriter(volume, sync_files=False, options=WriterOptions(file_size_bytes=64 << 10))
    )
    assert time.perf_counter() - started >= 0.3
    first_upload = events.index("upload")
    # Serialising began while the location was being listed (before the marker), and nothing
    # reached the volume before the marker did.
    assert events.index("serialise") < events.index("marker") < first_upload, events
    assert events[-1] == ".metadata"
    out = {"w": torch.zeros(1 << 16), "x": None}
    dcp.load(out, storage_reader=UCVolumeReader(tmp_path / "ckpt"))
    assert torch.equal(out["w"], sd["w"])


def test_the_serialiser_does_not_wait_for_the_claim(tmp_path: Path, staging: Path) -> None:
    # The claim gates the uploads only: every data file is staged while the location is listed
    # (the serialiser used to stop after its first file until the claim held).
    events: list[str] = []
    sd = {f"w{i}": torch.full((1 << 14,), float(i)) for i in range(6)}  # 64 KiB each
    volume = SlowListingVolume(tmp_path / "ckpt", events, delay_s=0.5, staging=staging)
    dcp.save(
        sd, storage_writer=UCVolumeWriter(volume, sync_files=False, options=WriterOptions(file_size_bytes=64 << 10))
    )
    published = sorted(p.name for p in (tmp_path / "ckpt").glob("*.distcp"))
    assert len(published) >= 3
    assert volume.staged_at_marker == published, (volume.staged_at_marker, published)
    assert events.index("marker") < events.index("upload")
    out = {k: torch.zeros(1 << 14) for k in sd}
    dcp.load(out, storage_reader=UCVolumeReader(tmp_path / "ckpt"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_a_refused_claim_uploads_nothing(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dest.mkdir()
    (dest / "notes.txt").write_text("not a checkpoint")
    events: list[str] = []
    volume = SlowListingVolume(dest, events, delay_s=0.2)
    with pytest.raises(CheckpointException) as ei:
        dcp.save(
            {"w": torch.ones(1 << 16)},
            storage_writer=UCVolumeWriter(volume, options=WriterOptions(file_size_bytes=64 << 10)),
        )
    assert isinstance(cause(ei), LocationNotEmptyError) and "notes.txt" in str(cause(ei))
    assert "upload" not in events and "marker" not in events, events
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    assert list(staging.rglob("*.distcp")) == []  # the serialised files were removed with staging


class LateClaimVolume(LocalVolume):
    """A local volume whose claim write waits for the save's first upload (at most 10 s), then
    succeeds or, with ``fail``, raises: an object store's claim PUT still in flight, or failing,
    while data files go up."""

    def __init__(self, path: Path, events: list[str], *, fail: bool = False) -> None:
        super().__init__(path)
        self.events, self.fail = events, fail
        self.uploading = threading.Event()
        self.waited_out = False

    def write_tagged(self, name: str, data: bytes) -> str | None:
        self.waited_out = not self.uploading.wait(10)
        self.events.append("claim")
        if self.fail:
            raise TransferError(f"writing {self.url_of(name)} failed: the store went away")
        return super().write_tagged(name, data)

    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        self.events.append("marker" if parse_save_marker(name) else name)
        return super().publish_bytes(name, data, overwrite=overwrite)

    def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
        self.events.append("upload")
        self.uploading.set()
        return super().upload_file(local_path, name, sync=sync)


def test_uploads_wait_for_the_marker_not_for_the_claims_put(tmp_path: Path, staging: Path) -> None:
    events: list[str] = []
    volume = LateClaimVolume(tmp_path / "ckpt", events)
    sd = {f"w{i}": torch.full((1 << 14,), float(i)) for i in range(4)}  # 64 KiB each
    dcp.save(
        sd, storage_writer=UCVolumeWriter(volume, sync_files=False, options=WriterOptions(file_size_bytes=64 << 10))
    )
    assert not volume.waited_out, events
    assert events.index("marker") < events.index("upload") < events.index("claim") < events.index(".metadata"), events
    out = {k: torch.zeros(1 << 14) for k in sd}
    dcp.load(out, storage_reader=UCVolumeReader(tmp_path / "ckpt"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_a_claim_that_fails_after_uploads_began_publishes_nothing_and_keeps_the_old_checkpoint(
    tmp_path: Path, staging: Path
) -> None:
    dest = tmp_path / "ckpt"
    old = {f"w{i}": torch.full((1 << 14,), -1.0 - i) for i in range(4)}
    dcp.save(old, storage_writer=UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=64 << 10)))
    before = {p.name: p.read_bytes() for p in dest.iterdir() if p.name == ".metadata" or p.suffix == ".distcp"}
    events: list[str] = []
    volume = LateClaimVolume(dest, events, fail=True)
    new = {k: torch.full((1 << 14,), float(i)) for i, k in enumerate(old)}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(
            new,
            storage_writer=UCVolumeWriter(volume, sync_files=False, options=WriterOptions(file_size_bytes=64 << 10)),
        )
    assert isinstance(cause(ei), TransferError) and ".uc-claim" in str(cause(ei)), cause(ei)
    assert "upload" in events and ".metadata" not in events, events
    # The checkpoint that was there is whole and still the published one.
    assert {name: (dest / name).read_bytes() for name in before} == before
    out = {k: torch.zeros(1 << 14) for k in old}
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert all(torch.equal(out[k], old[k]) for k in old)


class MeetingChecksVolume(LocalVolume):
    """A local volume that vouches for its uploads and tags its claim, as S3 does, so that the
    publish asks for the claim's tag and the published ``.metadata``'s size (two HEADs on S3)
    instead of listing: the first of each waits (at most 10 s) until the other is asked too."""

    verifies_uploads = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.meeting = threading.Barrier(2, timeout=10)
        self.lock, self.met = threading.Lock(), set[str]()

    def write_tagged(self, name: str, data: bytes) -> str | None:
        super().write_tagged(name, data)
        return "claim-tag"

    def tag_of(self, name: str) -> str | None:
        self._meet(name)
        return "claim-tag" if self._path(name).exists() else None

    def size(self, name: str) -> int | None:
        if name == ".metadata":
            self._meet(name)
        return super().size(name)

    def _meet(self, name: str) -> None:
        with self.lock:
            first = name not in self.met
            self.met.add(name)
        if first:
            self.meeting.wait()


def test_the_publish_asks_for_the_claim_and_the_published_metadata_at_once(tmp_path: Path, staging: Path) -> None:
    volume = MeetingChecksVolume(tmp_path / "ckpt")
    sd = {"w": torch.arange(1 << 14, dtype=torch.float32)}
    dcp.save(sd, storage_writer=UCVolumeWriter(volume, sync_files=False))  # asked one after the other: a broken barrier
    out = {"w": torch.zeros(1 << 14)}
    dcp.load(out, storage_reader=UCVolumeReader(tmp_path / "ckpt"))
    assert torch.equal(out["w"], sd["w"])
