"""WebDatasetReader: keys and fields as webdataset names them, directories skipped, a member index
cached and rebuilt when stale, truncated and non-tar files."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from uc_checkpoint.data.readers import WebDatasetReader
from uc_checkpoint.data.readers.base import INDEX_SUFFIX
from uc_checkpoint.data.readers.webdataset import split_key
from uc_checkpoint.errors import DataFormatError


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_split_key() -> None:
    assert split_key("a/b.seg.jpg") == ("a/b", "seg.jpg")
    assert split_key("x.txt") == ("x", "txt")
    assert split_key("IMG_0001.Seg.JPG") == ("IMG_0001", "seg.jpg")
    assert split_key("d.e/f") is None  # no extension: webdataset skips the member


def test_grouping_and_directories(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        d = tarfile.TarInfo("dir")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        add(tar, "dir/x.seg.png", b"1")
        add(tar, "dir/x.json", b"{}")
        add(tar, "dir/y.json", b"[]")
    reader = WebDatasetReader(tmp_path)
    (shard,) = reader.shards()
    assert shard.num_samples == 2
    assert list(reader(shard, 0, 2)) == [
        {"__key__": "dir/x", "seg.png": b"1", "json": b"{}"},
        {"__key__": "dir/y", "json": b"[]"},
    ]
    assert (tmp_path / ("a.tar" + INDEX_SUFFIX)).exists()


def test_stale_index_rebuilt(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        add(tar, "a.txt", b"a")
    WebDatasetReader(tmp_path).shards()
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        add(tar, "a.txt", b"a")
        add(tar, "b.txt", b"b")
    st = (tmp_path / "a.tar").stat()
    os.utime(tmp_path / "a.tar", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    reader = WebDatasetReader(tmp_path)
    (shard,) = reader.shards()
    assert list(reader(shard, 1, 2)) == [{"__key__": "b", "txt": b"b"}]


def test_truncated_tar(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        add(tar, "a.bin", b"x" * 5000)
        add(tar, "b.bin", b"y" * 5000)
    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "a.tar").write_bytes(data[:7000])
    with pytest.raises(DataFormatError, match=r"a\.tar.*truncated"):
        WebDatasetReader(tmp_path).shards()


def test_not_a_tar(tmp_path: Path) -> None:
    (tmp_path / "a.tar").write_bytes(b"\x01" * 2048)
    with pytest.raises(DataFormatError, match=r"a\.tar.*not a readable tar"):
        WebDatasetReader(tmp_path).shards()


def test_a_member_twice_in_one_sample_is_refused(tmp_path: Path) -> None:
    """tarfile keeps both members of one name; a sample with the field twice would lose one."""
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        add(tar, "0001.txt", b"a")
        add(tar, "0001.txt", b"b")
    with pytest.raises(DataFormatError, match=r"dup\.tar: member '0001\.txt' appears twice"):
        WebDatasetReader(tmp_path).shards()


def test_keys_fields_and_skipped_members_as_webdataset_gives_them(tmp_path: Path) -> None:
    """The samples webdataset 1.0.2's ``WebDataset(url)`` yields for this tar (less ``__url__``):
    fields lowercased, names without an extension and ``__...__`` metadata members skipped,
    non-regular members skipped."""
    names = [
        "IMG_0001.JPG",
        "IMG_0001.Seg.PNG",
        "LICENSE",
        "__meta__",
        "__meta__/x.txt",
        "d.e/f",
        "dir.d/README",
        "dir/a.b.c",
        "dir/a.json",
        "x.",
        "a/.hidden",
        "___",
        "dir/__key__.txt",
        "b/c.TXT",
        "b/c.cls",
        "z.tar.gz",
    ]
    with tarfile.open(tmp_path / "n.tar", "w") as tar:
        d = tarfile.TarInfo("dir")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        for i, name in enumerate(names):
            add(tar, name, str(i).encode())
        link = tarfile.TarInfo("link.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "x."
        tar.addfile(link)
    reader = WebDatasetReader(tmp_path)
    (shard,) = reader.shards()
    assert list(reader(shard, 0, shard.num_samples)) == [
        {"__key__": "IMG_0001", "jpg": b"0", "seg.png": b"1"},
        {"__key__": "dir/a", "b.c": b"7", "json": b"8"},
        {"__key__": "x", "": b"9"},
        {"__key__": "a/", "hidden": b"10"},
        {"__key__": "dir/__key__", "txt": b"12"},
        {"__key__": "b/c", "txt": b"13", "cls": b"14"},
        {"__key__": "z", "tar.gz": b"15"},
    ]


def test_a_field_twice_after_lowercasing_is_refused(tmp_path: Path) -> None:
    """webdataset lowercases fields before grouping: ``a.jpg`` and ``a.JPG`` are one field twice."""
    with tarfile.open(tmp_path / "dup.tar", "w") as tar:
        add(tar, "a.jpg", b"1")
        add(tar, "a.JPG", b"2")
    with pytest.raises(DataFormatError, match=r"dup\.tar: member 'a\.JPG' appears twice: sample 'a' has two 'jpg'"):
        WebDatasetReader(tmp_path).shards()
