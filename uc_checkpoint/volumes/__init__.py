"""Volume backends, chosen by URL: a local or FUSE-mounted path, ``s3://`` through boto3, and any
other fsspec URL."""

from __future__ import annotations

import os

from ..errors import VolumeError
from .base import FileRecord, Volume
from .fsspec_volume import FsspecVolume
from .local import LocalVolume
from .locations import local_path_of_file_url, require_location
from .s3 import S3Volume

__all__ = ["FileRecord", "FsspecVolume", "LocalVolume", "S3Volume", "Volume", "open_volume"]


def open_volume(location: str | os.PathLike[str] | Volume) -> Volume:
    """The :class:`Volume` for a checkpoint location.

    Args:
        location: a local or FUSE path (``str`` or ``PathLike``) or ``file://`` URL
            (:class:`LocalVolume`); ``s3://bucket/prefix`` (:class:`S3Volume`, boto3's default
            configuration); any other URL fsspec knows (:class:`FsspecVolume`); or a
            :class:`Volume`, returned as is. Build the volume yourself to pass options (endpoint,
            client, part size, storage options).

    Every spelling of one place gives the same :attr:`Volume.url` (empty path segments, trailing
    slashes, ``file://localhost``; see :mod:`uc_checkpoint.volumes.locations`).

    Raises:
        VolumeError: the location is empty, the URL's scheme has no backend, an S3 bucket name S3
            does not allow, a ``.``/``..`` segment in an object-store URL, or a ``file://`` URL
            naming another host.
    """
    if isinstance(location, Volume):
        return location
    text = require_location(os.fspath(location))
    if "://" not in text:
        return LocalVolume(text)
    scheme = text.partition("://")[0].lower()
    if scheme == "file":
        return LocalVolume(local_path_of_file_url(text))
    if scheme == "s3":
        return S3Volume(text)
    return FsspecVolume(text)
