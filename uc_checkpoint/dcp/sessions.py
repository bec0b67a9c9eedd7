"""What the writer and the reader share: the checkpoint's location, and state kept per save or load.

DCP runs one save (or load) wholly in one thread, calling the storage object's hooks in order: the
caller's thread for ``dcp.save``/``dcp.load``, a new executor thread for each ``dcp.async_save``.
Users reuse one writer object for overlapping async saves (stock ``FileSystemWriter`` lets them, and
silently loses one). State kept on the object itself (location, staging directory, file-name token,
rank) would then be overwritten by the other save midway. So everything that belongs to one save or
load lives in a :class:`Session`, keyed by the thread that runs it; the object holds only its
settings. A thread outside any save sees the idle session: the object's configured location.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from uc_checkpoint.errors import VolumeError
from uc_checkpoint.volumes import Volume, open_volume


def check_types(path: object, ints: Mapping[str, object]) -> None:
    """The argument types a storage writer and reader share: ``path`` a path, URL or
    :class:`Volume`, and each of ``ints`` (argument name -> value) an int (a bool is not one).

    Raises:
        TypeError: naming the first argument of the wrong type, and that type.
    """
    if not isinstance(path, (str, os.PathLike, Volume)):
        raise TypeError(f"path must be a path, URL or Volume, got {type(path).__name__}")
    for arg, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} must be an int, got {type(value).__name__}")


@dataclass
class Session:
    """State of one save or load on one rank.

    Attributes:
        location: the checkpoint's path, URL or :class:`Volume`.
        options: volume options for a path or URL (see :func:`uc_checkpoint.volumes.open_volume`).
        fresh: made by ``reset(checkpoint_id)``, not yet claimed by the save's or load's first hook.
        rank, use_collectives: what DCP passed to ``set_up_storage_writer``/``_reader``.
    """

    location: str | Volume
    options: dict[str, Any] = field(default_factory=dict)
    fresh: bool = False
    rank: int | None = None
    use_collectives: bool = True
    _volume: Volume | None = None

    @property
    def volume(self) -> Volume:
        """The location as a :class:`Volume`, opened on first use (clients are made lazily)."""
        if self._volume is None:
            self._volume = open_volume(self.location, **self.options)
        return self._volume


class SessionOwner:
    """Mixin for a DCP storage writer or reader: per-thread :class:`Session` objects, the
    ``volume``/``checkpoint_id`` identity, ``reset`` and pickling (DCP's PROCESS mode pickles the
    writer: volumes, sessions and their clients are rebuilt on the other side).

    Subclasses set :attr:`session_type` and call :meth:`_init_sessions` before the DCP base class's
    ``__init__`` (which assigns ``rank``, ``path`` and the like, stored in the idle session)."""

    session_type: type[Session] = Session

    def _init_sessions(self, location: str | os.PathLike[str] | Volume, volume_options: dict[str, Any] | None) -> None:
        """Raises VolumeError at once for a location no volume can take (empty, a bad bucket name,
        options the volume does not have)."""
        self._location: str | Volume = location if isinstance(location, Volume) else os.fsdecode(location)
        self._volume_options: dict[str, Any] = dict(volume_options or {})
        open_volume(self._location, **self._volume_options)
        self._sessions_lock = threading.Lock()
        self._sessions: dict[int, tuple[threading.Thread, Session]] = {}
        self._idle = self._make_session(self._location)

    def _make_session(self, location: str | Volume, fresh: bool = False) -> Session:
        # A ready Volume carries its own options; a path or URL gets the object's.
        options = {} if isinstance(location, Volume) else self._volume_options
        return self.session_type(location, options=options, fresh=fresh)

    def _own_session(self) -> Session | None:
        """The calling thread's session, if it has one. By thread, not by ident alone: a new thread
        can get the ident of a finished one (an async save DCP failed after its reset), whose
        session must not become the new thread's."""
        entry = self._sessions.get(threading.get_ident())
        return entry[1] if entry is not None and entry[0] is threading.current_thread() else None

    @property
    def _session(self) -> Session:
        mine = self._own_session()
        return mine if mine is not None else self._idle

    def _begin_session(self, location: str | Volume | None = None) -> Session:
        """The calling thread starts a save or load: a new session, unless ``reset(checkpoint_id)``
        just made one for it. Its location: ``location`` (where the caller stood when it asked
        for this save), else this thread's last one, else the object's."""
        mine = self._own_session()
        if mine is not None and mine.fresh:
            mine.fresh = False
            return mine
        if location is None:
            # A thread's saves stay where its last reset(checkpoint_id) pointed, whatever other threads do.
            location = mine.location if mine is not None else self._location
        return self._new_session(location, fresh=False)

    def _new_session(self, location: str | Volume, *, fresh: bool) -> Session:
        session = self._make_session(location, fresh)
        thread = threading.current_thread()
        with self._sessions_lock:
            # Threads of finished async saves are gone: drop their sessions.
            self._sessions = {k: v for k, v in self._sessions.items() if v[0].is_alive()}
            self._sessions[thread.ident or 0] = (thread, session)
        return session

    def _reset_location(self, checkpoint_id: str | os.PathLike[str] | Volume | None) -> Session:
        """``reset``'s common part: ``checkpoint_id`` (when given) becomes the location of this
        thread's next save or load (and of later ones that pass none, as with DCP's own storage
        classes); returns the fresh session."""
        mine = self._own_session()
        location = mine.location if mine is not None else self._location
        # None or "" names no location (as DCP's own storage classes take them); any other value
        # is checked, falsy ones ({}, 0) included.
        if checkpoint_id is not None and not (isinstance(checkpoint_id, str) and not checkpoint_id):
            # The argument, not self._location: another thread may reset it at the same moment.
            location = self._location_of(checkpoint_id)
            self._location = location
            self._idle = self._make_session(location)
        return self._new_session(location, fresh=True)

    def _location_of(self, checkpoint_id: object) -> str | Volume:
        """DCP's ``checkpoint_id`` as a session location: a :class:`Volume` as it is; a path or URL
        of the kind of store this object was built for carrying its volume's settings
        (:meth:`Volume.with_location`: an ``S3Volume``'s endpoint, not the default one), else as
        given (opened with this object's ``volume_options``).

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
        text = os.fsdecode(checkpoint_id)  # a PathLike may give bytes: decoded, never str(b"...")
        if isinstance(self._location, Volume):
            carried = self._location.with_location(text)
            if carried is not None:
                return carried
        return text

    # ---- identity -----------------------------------------------------------------------------
    @property
    def volume(self) -> Volume:
        """The checkpoint's location as a :class:`Volume`: this thread's save or load's, else the
        configured one (created on first use, never pickled)."""
        return self._session.volume

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's URL on the volume (recorded as ``StorageMeta.checkpoint_id``)."""
        return self.volume.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            open_volume(checkpoint_id)
        except VolumeError:
            return False
        return True

    # DCP's base classes keep these on the object; here they belong to the save or load.
    @property
    def rank(self) -> int | None:
        return self._session.rank

    @rank.setter
    def rank(self, value: int | None) -> None:
        self._session.rank = value

    @property
    def use_collectives(self) -> bool:
        return self._session.use_collectives

    @use_collectives.setter
    def use_collectives(self, value: bool) -> None:
        self._session.use_collectives = value

    def _rank(self) -> int:
        rank = self._session.rank
        return rank if rank is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_sessions"] = {}
        state["_sessions_lock"] = None
        # Only the location travels: the other side starts its own session for the save.
        state["_idle"] = self._make_session(self._session.location)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sessions_lock = threading.Lock()


__all__ = ["Session", "SessionOwner"]
