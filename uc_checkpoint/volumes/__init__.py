"""Volume backends, chosen by URL: a local or FUSE-mounted path, ``s3://`` through boto3, and any
other fsspec URL (``memory://`` included: fsspec's in-memory filesystem).

:class:`MemoryVolume` (a dict of bytes in this process, the test double that ships with the
library) has no URL: pass the object itself wherever a location is taken; see
:mod:`uc_checkpoint.volumes.memory` for why ``mem://`` is not a scheme."""

from __future__ import annotations

import os
from typing import Any

from uc_checkpoint.errors import VolumeError
from uc_checkpoint.volumes.base import Entry, FileRecord, FileStat, Volume
from uc_checkpoint.volumes.fsspec_volume import FsspecVolume
from uc_checkpoint.volumes.local import LocalVolume
from uc_checkpoint.volumes.locations import local_path_of_file_url, require_location
from uc_checkpoint.volumes.memory import MemoryStore, MemoryVolume
from uc_checkpoint.volumes.s3 import S3Volume

__all__ = [
    "Entry",
    "FileRecord",
    "FileStat",
    "FsspecVolume",
    "LocalVolume",
    "MemoryStore",
    "MemoryVolume",
    "S3Volume",
    "Volume",
    "open_volume",
]


def open_volume(location: str | os.PathLike[str] | Volume, **options: Any) -> Volume:
    """The :class:`Volume` for a checkpoint location.

    Args:
        location: a local or FUSE path (``str`` or ``PathLike``) or ``file://`` URL
            (:class:`LocalVolume`); ``s3://bucket/prefix`` (:class:`S3Volume`, boto3's default
            configuration); any other URL fsspec knows (:class:`FsspecVolume`, ``memory://``
            included); or a :class:`Volume` (a :class:`MemoryVolume` among them), returned as is.
        options: keyword arguments for the volume's constructor: :class:`S3Volume`'s
            (``endpoint_url``, ``addressing_style``, ``part_size``, ``checksums``, ...) or an fsspec
            filesystem's storage options. Every URL entry point passes them through
            (``volume_options=`` of the writer, reader and manager; ``-o KEY=VALUE`` of the CLI).

    Every spelling of one place gives the same :attr:`Volume.url` (empty path segments, trailing
    slashes, ``file://localhost``; see :mod:`uc_checkpoint.volumes.locations`).

    Raises:
        VolumeError: the location is empty, the URL's scheme has no backend, an S3 bucket name S3
            does not allow, a ``.``/``..`` segment in an object-store URL, a ``file://`` URL
            naming another host, or ``options`` the volume does not take.
    """
    if isinstance(location, Volume):
        if options:
            raise VolumeError(f"volume options {sorted(options)} cannot apply to the ready volume {location.url}")
        return location
    text = require_location(os.fspath(location))
    if text[:5].lower() == "file:" and text[5:7] != "//":
        text = "file://" + text[5:]  # file:/p (RFC 8089's short form) is file:///p, not a relative path
    scheme = text.partition("://")[0].lower() if "://" in text else "file"
    if scheme == "file":
        if options:
            raise VolumeError(f"local paths take no volume options, got {sorted(options)} for {text!r}")
        return LocalVolume(local_path_of_file_url(text) if "://" in text else text)
    if scheme == "s3":
        try:
            return S3Volume(text, **options)
        except TypeError as exc:  # an option S3Volume does not have
            raise VolumeError(f"bad volume option for {text!r}: {exc}") from exc
    return FsspecVolume(text, **options)
