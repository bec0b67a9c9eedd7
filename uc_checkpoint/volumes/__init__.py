"""Volume backends, chosen by URL: a local or FUSE-mounted path today; ``s3://`` and other fsspec
URLs plug in here as one module each."""

from __future__ import annotations

import os

from ..errors import VolumeError
from .base import FileRecord, Volume
from .local import LocalVolume

__all__ = ["FileRecord", "LocalVolume", "Volume", "open_volume"]


def open_volume(location: str | os.PathLike[str] | Volume) -> Volume:
    """The :class:`Volume` for a checkpoint location.

    Args:
        location: a local or FUSE path (``str`` or ``PathLike``), a ``file://`` URL, or a
            :class:`Volume` (returned as is).

    Raises:
        VolumeError: the URL scheme has no backend.
    """
    if isinstance(location, Volume):
        return location
    text = os.fspath(location)
    if "://" not in text:
        return LocalVolume(text)
    scheme, _, rest = text.partition("://")
    if scheme == "file":
        return LocalVolume(rest)
    raise VolumeError(f"no volume backend for {text!r}: scheme {scheme!r} is not supported")
