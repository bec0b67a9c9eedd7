"""What the writer and the reader share: a checkpoint's location, as given and as DCP's
``checkpoint_id`` moves it.

A location is a path, a URL or a :class:`~uc_checkpoint.volumes.Volume`; the writer or reader opens
it as a volume on first use (clients are made lazily, and rebuilt after pickling).
"""

from __future__ import annotations

import os

from uc_checkpoint.errors import VolumeError
from uc_checkpoint.volumes import Volume, open_volume


def volume_location(path: object) -> str | Volume:
    """A writer's or reader's ``path`` argument as a location: a :class:`Volume` as it is, a path
    or URL as text (a PathLike that gives bytes decoded, never ``str(b"...")``).

    Raises:
        TypeError: ``path`` is neither a path, a URL nor a :class:`Volume`, naming its type.
    """
    if isinstance(path, Volume):
        return path
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path, URL or Volume, got {type(path).__name__}")
    return os.fsdecode(path)


def location_of(checkpoint_id: object, current: str | Volume) -> str | Volume:
    """DCP's ``checkpoint_id`` as a location: a :class:`Volume` as it is; a path or URL of the kind
    of store ``current`` (the writer's or reader's location) is, carrying its volume's settings
    (:meth:`Volume.with_location`: an ``S3Volume``'s endpoint, not the default one), else as given
    (opened with the writer's or reader's ``volume_options``).

    Raises:
        TypeError: ``checkpoint_id`` is neither a path, a URL nor a :class:`Volume`.
    """
    if isinstance(checkpoint_id, Volume):
        return checkpoint_id
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_id must be a path, a URL or a uc_checkpoint Volume, got {type(checkpoint_id).__name__}: "
            f"{checkpoint_id!r}"
        )
    text = os.fsdecode(checkpoint_id)
    if isinstance(current, Volume):
        carried = current.with_location(text)
        if carried is not None:
            return carried
    return text


def location_is_valid(checkpoint_id: str | os.PathLike[str]) -> bool:
    """DCP's ``validate_checkpoint_id``: whether a volume can open ``checkpoint_id``."""
    try:
        open_volume(checkpoint_id)
    except VolumeError:
        return False
    return True


__all__ = ["location_is_valid", "location_of", "volume_location"]
