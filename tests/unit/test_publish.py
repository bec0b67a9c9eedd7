"""The location's side of a save (uc_checkpoint.engine.publish), on a local and an in-memory volume,
without DCP: save markers, the start-of-save check, the concurrent-save check, the atomic publish
with its read-back, and deleting what a publish superseded."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from uc_checkpoint.engine import publish
from uc_checkpoint.engine.publish import SaveMarker
from uc_checkpoint.errors import CheckpointExistsError, ConcurrentSaveError, LocationNotEmptyError, TransferError
from uc_checkpoint.volumes import FsspecVolume, LocalVolume, Volume

KINDS = ["local", "memory"]


def _no_manifest(raw: bytes) -> None:
    raise ValueError("not a .metadata")


def _json_manifest(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)


def make_volume(kind: str, tmp_path: Path, memory_root: str, fault: type | None = None) -> Volume:
    """A volume of ``kind`` at a fresh location; ``fault``: a mixin overriding some of its methods."""
    cls: type[Volume] = LocalVolume if kind == "local" else FsspecVolume
    if fault is not None:
        cls = type(f"{fault.__name__}{cls.__name__}", (fault, cls), {})
    if kind == "local":
        return cls(tmp_path / "ckpt")  # type: ignore[call-arg]
    return cls(f"memory://{memory_root}/ckpt")  # type: ignore[call-arg]


@pytest.fixture(params=KINDS)
def volume(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> Volume:
    return make_volume(request.param, tmp_path, memory_root)


def begin(volume: Volume, marker: SaveMarker, **kwargs: Any) -> publish.Claim:
    options: dict[str, Any] = {
        "save_id": "save-1",
        "overwrite": True,
        "create_parents": True,
    }
    options.update(kwargs)
    return publish.begin_save(volume, marker, **options)


# ---- markers ------------------------------------------------------------------------------------


def test_marker_names_parse_back() -> None:
    collective = SaveMarker(None, "0123abcd")
    local = SaveMarker(3, "0123abcd")
    assert collective.name() == ".uc-save-0123abcd"
    assert local.name() == "__3.uc-save-0123abcd"
    assert SaveMarker.parse(collective.name()) == collective
    assert SaveMarker.parse(local.name()) == local
    assert (collective.metadata_name(), local.metadata_name()) == (".metadata", "__3.metadata")
    for other in (".metadata", "__0_0123abcd_0.distcp", ".uc-save-XYZ", "notes.txt"):
        assert SaveMarker.parse(other) is None, other
    with pytest.raises(AttributeError):
        collective.token = "ffffffff"  # type: ignore[misc]  # frozen


def test_begin_save_writes_the_marker_and_reports_no_published_checkpoint(volume: Volume) -> None:
    marker = SaveMarker(None, "0123abcd")
    before = time.time()
    assert begin(volume, marker, save_id="save-42") == publish.Claim(published="", tag=None, abandoned=False)
    after = time.time()
    info = json.loads(volume.read_bytes(marker.name()) or b"")
    assert info["save_id"] == "save-42" and info["pid"] == os.getpid() and info["token"] == "0123abcd"
    assert before - 1 <= info["started"] <= after + 1  # when the save began (Unix seconds), not another time
    assert json.loads(volume.read_bytes(".uc-claim") or b"") == info  # the location's claim: the same
    assert set(volume.list_files()) == {marker.name(), ".uc-claim"}
    marker.remove(volume)
    assert set(volume.list_files()) == {".uc-claim"}  # the claim stays with the location


# ---- the start-of-save check -------------------------------------------------------------------


def test_foreign_files_are_refused_and_nothing_is_written(volume: Volume) -> None:
    volume.prepare_for_write()
    volume.publish_bytes("notes.txt", b"mine")
    volume.publish_bytes("__0_00000000_0.distcp", b"data")
    with pytest.raises(LocationNotEmptyError, match=r"holds files that are not part of a checkpoint: notes\.txt$"):
        begin(volume, SaveMarker(None, "0123abcd"))
    assert set(volume.list_files()) == {"notes.txt", "__0_00000000_0.distcp"}  # no marker


def test_a_published_checkpoint_is_kept_without_overwrite_and_digested_with_it(volume: Volume) -> None:
    volume.prepare_for_write()
    volume.publish_bytes(".metadata", b"old checkpoint")
    with pytest.raises(CheckpointExistsError, match="exists and overwrite=False"):
        begin(volume, SaveMarker(None, "0123abcd"), overwrite=False)
    assert ".uc-save-0123abcd" not in volume.list_files()
    assert begin(volume, SaveMarker(None, "0123abcd")).published == hashlib.sha256(b"old checkpoint").hexdigest()


@pytest.mark.parametrize("kind", KINDS)
def test_stale_uploads_are_looked_for_only_where_a_save_left_its_marker(
    kind: str, tmp_path: Path, memory_root: str
) -> None:
    asked: list[float | None] = []
    kept: list[bool] = []

    class RecordsAborts:
        def abort_incomplete_uploads(self, older_than_s: float | None = None, keep: Any = None) -> int:
            asked.append(older_than_s)
            # This save's own data files are kept, on any rank and spread prefix; others are not.
            kept.extend(
                keep(n) for n in ("__0_4567cdef_0.distcp", "0a/__9_4567cdef_12.distcp", "__0_0123abcd_0.distcp")
            )
            return 0

    volume = make_volume(kind, tmp_path, memory_root, RecordsAborts)
    begin(volume, SaveMarker(None, "0123abcd"))
    # No marker: no save was killed or failed here (each leaves its marker), so no request is sent.
    assert asked == []
    begin(volume, SaveMarker(None, "4567cdef"))
    assert asked == [publish.LIVE_UPLOAD_S]  # another save's marker: its uploads may be live, old ones go
    assert kept == [True, True, False]


# ---- after the uploads ---------------------------------------------------------------------------


def test_data_files_must_all_be_there_with_their_sizes(volume: Volume) -> None:
    listing = {"__0_t_0.distcp": 10, "__1_t_0.distcp": 7}
    publish.check_data_files(volume, listing, {"__0_t_0.distcp": 10, "__1_t_0.distcp": 7}, ["__0_t_0.distcp"])
    with pytest.raises(TransferError, match=r"__1_t_0\.distcp has 7 bytes on the volume, expected 8"):
        publish.check_data_files(volume, listing, {"__1_t_0.distcp": 8}, [])
    with pytest.raises(TransferError, match=r"__2_t_0\.distcp has None bytes"):
        publish.check_data_files(volume, listing, {"__2_t_0.distcp": 1}, [])
    with pytest.raises(TransferError, match=r"no upload record for __1_t_0\.distcp"):
        publish.check_data_files(volume, listing, {"__0_t_0.distcp": 10}, ["__0_t_0.distcp", "__1_t_0.distcp"])


def test_the_last_save_to_claim_a_location_is_the_one_that_publishes(volume: Volume) -> None:
    first, second = SaveMarker(None, "aaaa0000"), SaveMarker(None, "bbbb0000")
    claim1 = begin(volume, first)
    publish.check_claim(volume, first, claim1)  # alone: its own
    claim2 = begin(volume, second)
    publish.check_claim(volume, second, claim2)
    with pytest.raises(ConcurrentSaveError, match="another save started at this location") as err:
        publish.check_claim(volume, first, claim1)
    assert ".uc-claim: claimed by host" in str(err.value) and f"pid {os.getpid()}" in str(err.value)
    # a rank-local save claims its own slot: no conflict with the collective one
    local = SaveMarker(0, "cccc0000")
    publish.check_claim(volume, local, begin(volume, local))
    publish.check_claim(volume, second, claim2)
    # a claim deleted (or damaged) under a save: nobody's, so not this save's
    volume.delete(".uc-claim")
    with pytest.raises(ConcurrentSaveError, match=r"\.uc-claim: it is gone"):
        publish.check_claim(volume, second, claim2)
    volume.publish_bytes(".uc-claim", b"not json")
    with pytest.raises(ConcurrentSaveError, match="claimed by an unreadable writer"):
        publish.check_claim(volume, second, claim2)


def test_a_tag_that_differs_is_settled_by_the_claims_token(volume: Volume) -> None:
    # A store whose HEAD reports the ETag in another form than its PUT's answer must not refuse the
    # save: the claim is read and its token compared.
    mine = SaveMarker(None, "dddd0000")
    claim = begin(volume, mine)
    publish.check_claim(volume, mine, publish.Claim(claim.published, tag='"another-form"'))
    other = SaveMarker(None, "eeee0000")
    begin(volume, other)
    with pytest.raises(ConcurrentSaveError):
        publish.check_claim(volume, mine, publish.Claim(claim.published, tag='"another-form"'))


def test_interleaved_starts_still_leave_exactly_one_save_to_publish(volume: Volume) -> None:
    # A writes its marker, B its marker and claim, then A its claim: by the markers B is newer, by
    # the claims A. One judge only (the claim), so A publishes and B is refused, never both.
    a, b = SaveMarker(None, "aaaa1111"), SaveMarker(None, "bbbb1111")
    volume.prepare_for_write()
    a.write(volume, "save-a")
    claim_b = begin(volume, b)
    tag_a = volume.write_tagged(".uc-claim", a.body("save-a"))
    claim_a = publish.Claim(published="", tag=tag_a)
    outcomes = []
    for marker, claim in ((a, claim_a), (b, claim_b)):
        try:
            publish.check_claim(volume, marker, claim)
            outcomes.append("publishes")
        except ConcurrentSaveError:
            outcomes.append("refused")
    assert outcomes == ["publishes", "refused"]


class _WrittenOverBeforeReadBack:
    """Another writer acts on a small file between its write and the write's size read-back (the
    window two saves claiming one location at once share): ``meanwhile[name]`` is the bytes that
    writer publishes there, or None for a delete (which reads back as a lost write)."""

    meanwhile: dict[str, bytes | None]

    def size(self, name: str) -> int | None:
        pending = getattr(self, "meanwhile", {})
        if name in pending:
            other = pending.pop(name)
            if other is None:
                self.delete(name)  # type: ignore[attr-defined]
            else:
                self.publish_bytes(name, other)  # type: ignore[attr-defined]
        return super().size(name)  # type: ignore[misc]


@pytest.mark.parametrize("kind", KINDS)
def test_a_claim_written_over_by_another_save_refuses_this_one_not_fails_it(
    kind: str, tmp_path: Path, memory_root: str
) -> None:
    # Two saves claiming at once: B's claim replaced A's between A's write and A's read-back, with
    # a body of another length (pid and start time vary). A's claim write is not a failed transfer:
    # A is refused as a concurrent save, B publishes. A CI run once saw A fail with TransferError.
    volume = make_volume(kind, tmp_path, memory_root, fault=_WrittenOverBeforeReadBack)
    a, b = SaveMarker(None, "aaaa2222"), SaveMarker(None, "bbbb2222")
    theirs = b.body("save-b-with-a-longer-id")
    volume.meanwhile = {".uc-claim": theirs}  # type: ignore[attr-defined]
    claim_a = begin(volume, a)
    assert volume.read_bytes(".uc-claim") == theirs
    with pytest.raises(ConcurrentSaveError, match=r"another save started at this location"):
        publish.check_claim(volume, a, claim_a)
    publish.check_claim(volume, b, publish.Claim(published="", tag=None))
    # The same window on a file only one save writes (.metadata) is still a failed publish ...
    volume.meanwhile = {".metadata": b"someone else's, longer"}  # type: ignore[attr-defined]
    with pytest.raises(TransferError, match=r"\.metadata"):
        volume.publish_bytes(".metadata", b"mine")
    # ... and a claim that is gone after its write was lost, not taken by another save.
    volume.meanwhile = {".uc-claim": None}  # type: ignore[attr-defined]
    with pytest.raises(TransferError, match=r"\.uc-claim"):
        volume.write_tagged(".uc-claim", a.body("save-a"))


# ---- publishing -----------------------------------------------------------------------------------


def test_publish_lands_and_a_changed_checkpoint_is_not_replaced(volume: Volume) -> None:
    volume.prepare_for_write()
    volume.publish_bytes(".metadata", b"v1")
    seen = publish.digest(b"v1")
    assert publish.read_published(volume, ".metadata", volume.list_files(), seen, _no_manifest) == b"v1"
    assert publish.read_published(volume, ".metadata", {}, "", _no_manifest) is None  # not listed: none
    publish.publish_metadata(volume, ".metadata", b"v2", overwrite=True, read_manifest=_no_manifest)
    assert volume.read_bytes(".metadata") == b"v2"
    with pytest.raises(
        ConcurrentSaveError, match=r"another save published .* \(by a writer that did not record itself\)"
    ):
        publish.read_published(volume, ".metadata", volume.list_files(), seen, _no_manifest)
    other = json.dumps({"save_id": "s-9", "saved_by": {"host": "h9", "pid": 9, "time": 0}}).encode()
    volume.publish_bytes(".metadata", other)
    with pytest.raises(ConcurrentSaveError, match=r"\(save s-9: host h9, pid 9, published 1970-01-01 00:00:00 UTC\)"):
        publish.read_published(volume, ".metadata", volume.list_files(), seen, _json_manifest)
    volume.delete(".metadata")
    with pytest.raises(ConcurrentSaveError, match="and it has since been deleted"):
        publish.read_published(volume, ".metadata", volume.list_files(), seen, _json_manifest)
    volume.publish_bytes(".metadata", b"v3")
    with pytest.raises(CheckpointExistsError):
        publish.publish_metadata(volume, ".metadata", b"v4", overwrite=False, read_manifest=_no_manifest)
    assert volume.read_bytes(".metadata") == b"v3"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("before", [None, b"old checkpoint"])
def test_a_lost_publish_is_detected(kind: str, before: bytes | None, tmp_path: Path, memory_root: str) -> None:
    class LosesMetadata:
        """Answers as if ``.metadata`` had been written, and keeps what was there."""

        def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
            if name != ".metadata":
                return super().publish_bytes(name, data, overwrite=overwrite)  # type: ignore[misc]
            return False

    volume = make_volume(kind, tmp_path, memory_root, LosesMetadata)
    volume.prepare_for_write()
    if before is not None:
        super(LosesMetadata, volume).publish_bytes(".metadata", before)  # type: ignore[misc]
    with pytest.raises(TransferError, match="the volume lost the write. Nothing was deleted") as err:
        publish.publish_metadata(volume, ".metadata", b"new checkpoint", overwrite=True, read_manifest=_no_manifest)
    found = "gives nothing" if before is None else "gives 14 bytes of other content (by a writer that did not record"
    assert found in str(err.value) and "was written (14 bytes)" in str(err.value)
    assert volume.read_bytes(".metadata") == before


def _metadata(save_id: str, pad: str = "") -> bytes:
    """A stand-in ``.metadata`` whose manifest (read by ``_json_manifest``) records ``save_id``."""
    return json.dumps({"save_id": save_id, "saved_by": {"host": "h", "pid": 7, "time": 0}, "pad": pad}).encode()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "other-size"])
def test_another_save_publishing_right_after_this_one_refuses_it(
    kind: str, same_size: bool, tmp_path: Path, memory_root: str
) -> None:
    # Save B publishes over save A between A's write and A's read-back (B read A's .metadata as
    # the one it replaces). A did not lose a write: it was replaced by a later save, whose
    # checkpoint stands. Found by a fresh-user attack (TransferError "the volume lost the write").
    volume = make_volume(kind, tmp_path, memory_root, fault=_WrittenOverBeforeReadBack)
    volume.prepare_for_write()
    old, mine = _metadata("s-old"), _metadata("s-mine")
    theirs = _metadata("s-late", "" if same_size else "longer")
    volume.publish_bytes(".metadata", old)
    volume.meanwhile = {".metadata": theirs}  # type: ignore[attr-defined]
    with pytest.raises(ConcurrentSaveError, match=r"another save published .*right after this one.*save s-late"):
        publish.publish_metadata(volume, ".metadata", mine, overwrite=True, read_manifest=_json_manifest, replaced=old)
    assert volume.read_bytes(".metadata") == theirs
    # The checkpoint it replaced reading back is a lost write, whoever wrote it.
    volume.meanwhile = {".metadata": old}  # type: ignore[attr-defined]
    with pytest.raises(TransferError, match=r"\(save s-old: .*the volume lost the write"):
        publish.publish_metadata(volume, ".metadata", mine, overwrite=True, read_manifest=_json_manifest, replaced=old)


def test_superseded_files_go_and_nothing_else(volume: Volume) -> None:
    volume.prepare_for_write()
    for name in ("__0_old_0.distcp", "__0_old_1.distcp", "__0_new_0.distcp", "__0_other_0.distcp"):
        volume.publish_bytes(name, b"x")
    publish.remove_superseded(volume, {"__0_old_0.distcp", "__0_old_1.distcp", "__0_gone_0.distcp"})
    assert set(volume.list_files()) == {"__0_new_0.distcp", "__0_other_0.distcp"}


@pytest.mark.parametrize("kind", KINDS)
def test_deleting_is_best_effort(kind: str, tmp_path: Path, memory_root: str, caplog: pytest.LogCaptureFixture) -> None:
    tried: list[str] = []

    class RefusesDeletes:
        def delete(self, name: str) -> None:
            tried.append(name)
            raise PermissionError(f"no deleting {name}")

    volume = make_volume(kind, tmp_path, memory_root, RefusesDeletes)
    publish.remove_superseded(volume, ["__0_b_0.distcp", "__0_a_0.distcp"])
    SaveMarker(None, "0123abcd").remove(volume)
    assert tried == ["__0_a_0.distcp", "__0_b_0.distcp", ".uc-save-0123abcd"]  # every one tried, none raised
    assert "could not delete superseded file" in caplog.text and "could not delete the save marker" in caplog.text


# ---- an "already exists" or failed answer to this save's own write ------------------------------


class _LandsThenAnswers:
    """Writes ``.metadata`` (as ``landed``, default the bytes given), then answers with ``answer``:
    a retried conditional write whose first answer was lost, or a write whose answer never came."""

    landed: bytes | None = None
    answer: Exception = CheckpointExistsError("already exists")

    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        if name != ".metadata":
            return super().publish_bytes(name, data, overwrite=overwrite)  # type: ignore[misc]
        super().publish_bytes(name, self.landed if self.landed is not None else data, overwrite=True)  # type: ignore[misc]
        raise self.answer


@pytest.fixture
def link_then_eexist(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``os.link`` creates the link, then reports EEXIST (NFS after a retransmitted request)."""
    from uc_checkpoint.volumes import local as local_volume

    real, linked = os.link, []

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real(src, dst, *args, **kwargs)
        linked.append(Path(dst).name)
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    monkeypatch.setattr(local_volume.os, "link", link)
    return linked


def test_an_exists_answer_from_link_to_this_saves_own_publish_is_a_publish(
    tmp_path: Path, link_then_eexist: list[str]
) -> None:
    volume = LocalVolume(tmp_path / "ckpt")
    volume.prepare_for_write()
    mine = _metadata("s-mine")
    publish.publish_metadata(volume, ".metadata", mine, overwrite=False, read_manifest=_json_manifest)
    assert link_then_eexist == [".metadata"] and volume.read_bytes(".metadata") == mine
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".tmp")]  # no temp file left


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("landed", ["same-bytes", "same-save-id"])
def test_an_exists_answer_to_this_saves_own_publish_is_a_publish(
    kind: str, landed: str, tmp_path: Path, memory_root: str
) -> None:
    volume = make_volume(kind, tmp_path, memory_root, _LandsThenAnswers)
    volume.prepare_for_write()
    mine = _metadata("s-mine")
    if landed == "same-save-id":  # this save's .metadata in another encoding
        volume.landed = _metadata("s-mine", "re-encoded")  # type: ignore[attr-defined]
    publish.publish_metadata(volume, ".metadata", mine, overwrite=False, read_manifest=_json_manifest)
    assert volume.read_bytes(".metadata") in (mine, _metadata("s-mine", "re-encoded"))


@pytest.mark.parametrize("kind", KINDS)
def test_an_exists_answer_over_another_saves_metadata_is_refused_naming_it(
    kind: str, tmp_path: Path, memory_root: str
) -> None:
    volume = make_volume(kind, tmp_path, memory_root, _LandsThenAnswers)
    volume.prepare_for_write()
    theirs = _metadata("s-theirs")
    volume.landed = theirs  # type: ignore[attr-defined]
    with pytest.raises(CheckpointExistsError, match=r"\.metadata already exists and overwrite=False: .*save s-theirs"):
        publish.publish_metadata(
            volume, ".metadata", _metadata("s-mine"), overwrite=False, read_manifest=_json_manifest
        )
    assert volume.read_bytes(".metadata") == theirs
    # Unreadable bytes there are not this save's either.
    volume.landed = b"not a manifest"  # type: ignore[attr-defined]
    with pytest.raises(CheckpointExistsError, match="did not record itself"):
        publish.publish_metadata(
            volume, ".metadata", _metadata("s-mine"), overwrite=False, read_manifest=_json_manifest
        )


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_reported_failed_that_landed_whole_is_a_publish(
    kind: str, tmp_path: Path, memory_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    volume = make_volume(kind, tmp_path, memory_root, _LandsThenAnswers)
    volume.answer = TransferError("connection reset after the store acted")  # type: ignore[attr-defined]
    volume.prepare_for_write()
    mine = _metadata("s-mine")
    publish.publish_metadata(volume, ".metadata", mine, overwrite=True, read_manifest=_json_manifest)
    assert volume.read_bytes(".metadata") == mine
    assert "reported a failure, but it is on the volume whole" in caplog.text
    # Other bytes there (the write did not land): the write's own error.
    volume.landed = _metadata("s-mine", "torn")  # type: ignore[attr-defined]
    with pytest.raises(TransferError, match="connection reset after the store acted"):
        publish.publish_metadata(volume, ".metadata", mine, overwrite=True, read_manifest=_json_manifest)


class _LandsThenFailsReads(_LandsThenAnswers):
    """The write lands, its answer is lost, and reading ``.metadata`` back fails too (an outage)."""

    answer = TransferError("read timeout on PUT .metadata")

    def read_bytes(self, name: str) -> bytes | None:
        if name == ".metadata":
            raise TransferError("read timeout on GET .metadata")
        return super().read_bytes(name)  # type: ignore[misc]


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_write_that_cannot_be_read_back_says_it_may_have_landed(
    kind: str, tmp_path: Path, memory_root: str
) -> None:
    volume = make_volume(kind, tmp_path, memory_root, _LandsThenFailsReads)
    volume.prepare_for_write()
    with pytest.raises(TransferError, match=r"read timeout on PUT .*this publish may have landed: look before") as err:
        publish.publish_metadata(volume, ".metadata", _metadata("s-mine"), overwrite=True, read_manifest=_json_manifest)
    assert isinstance(err.value.__cause__, TransferError)


@pytest.mark.parametrize("kind", KINDS)
def test_a_claim_the_volume_did_not_keep_is_a_lost_write_not_another_save(
    kind: str, tmp_path: Path, memory_root: str
) -> None:
    class KeepsOldClaim:
        """Answers as if the claim had been replaced, and keeps the old one."""

        def write_tagged(self, name: str, data: bytes) -> str | None:
            if self.read_bytes(name) is None:  # type: ignore[attr-defined]
                return super().write_tagged(name, data)  # type: ignore[misc]
            return None

    volume = make_volume(kind, tmp_path, memory_root, KeepsOldClaim)
    earlier = SaveMarker(None, "0123abcd")
    begin(volume, earlier)
    earlier.remove(volume)  # the earlier save ended
    mine = SaveMarker(None, "4567cdef")
    claim = begin(volume, mine, save_id="save-2")
    assert claim.previous == volume.read_bytes(".uc-claim")
    with pytest.raises(TransferError, match="the volume did not keep the write") as err:
        publish.check_claim(volume, mine, claim)
    assert not isinstance(err.value, ConcurrentSaveError)
    assert f"pid {os.getpid()}" in str(err.value) and ".uc-claim was written by this save" in str(err.value)
    # Another save's claim written over this one's is still a concurrent save.
    claim = begin(volume, mine, save_id="save-3")
    volume.publish_bytes(".uc-claim", SaveMarker(None, "89abcdef").body("save-4"))
    with pytest.raises(ConcurrentSaveError, match="another save started at this location"):
        publish.check_claim(volume, mine, claim)
