"""A listing of an fsspec location that fails on an entry deleted while it ran (another save's
marker, a retention delete) is made again, not read as an empty location: an empty listing hides
every checkpoint there. The fault is raised by a stand-in for the filesystem's ``ls`` (as fsspec's
memory filesystem raises KeyError, and filesystems that stat each entry FileNotFoundError, when an
entry goes mid-listing), since the race cannot be caused on demand."""

from __future__ import annotations

from typing import Any

import pytest

from uc_checkpoint.errors import TransferError
from uc_checkpoint.volumes import FsspecVolume, fsspec_volume


class _VanishingEntries(FsspecVolume):
    """Its first ``failures`` listings fail as if an entry was deleted while they ran."""

    failures: list[BaseException] = []

    def _ls(self, path: str, detail: bool = True) -> Any:
        if self.failures:
            raise self.failures.pop(0)
        return super()._ls(path, detail)


@pytest.fixture
def url(memory_root: str) -> str:
    return f"memory://{memory_root}/ckpt"


def _volume_with_files(url: str) -> _VanishingEntries:
    volume = _VanishingEntries(url)
    volume.prepare_for_write()
    volume.publish_bytes(".metadata", b"m")
    volume.publish_bytes("__0_t_0.distcp", b"data")
    return volume


@pytest.mark.parametrize("fault", [KeyError("/ckpt/.uc-save-1"), FileNotFoundError("/ckpt/.uc-save-1")])
def test_a_listing_an_entry_vanished_from_is_made_again(url: str, fault: BaseException) -> None:
    volume = _volume_with_files(url)
    volume.failures = [fault, fault]
    assert volume.list_files() == {".metadata": 1, "__0_t_0.distcp": 4}
    assert volume.failures == []


def test_a_listing_that_keeps_failing_so_is_an_error_not_an_empty_location(url: str) -> None:
    volume = _volume_with_files(url)
    volume.failures = [FileNotFoundError("/ckpt/x")] * fsspec_volume.LIST_ATTEMPTS
    with pytest.raises(TransferError, match=r"listing .*ckpt failed 3 times, each on an entry that vanished"):
        volume.list_files()


def test_a_missing_location_still_lists_as_empty(url: str) -> None:
    volume = _VanishingEntries(url + "-never-written")
    volume.failures = [FileNotFoundError("gone")]
    assert volume.list_files() == {}


def test_other_listing_errors_are_not_retried(url: str) -> None:
    volume = _volume_with_files(url)
    volume.failures = [PermissionError("denied"), PermissionError("denied")]
    with pytest.raises(TransferError, match="denied"):
        volume.list_files()
    assert len(volume.failures) == 1
