"""Local staging directories: where checkpoint files are serialised before upload and fetched
before a load; who owns each one, and how those of dead processes are reclaimed.

Layout: ``<staging root>/uc-checkpoint-<uid>/<kind>-<location hash>-<save or load id>-rank-<r>``.
The staging root is ``staging_dir=`` or ``$UC_CHECKPOINT_STAGING_DIR`` (default: the system temp
dir); ``uc-checkpoint-<uid>`` under it is this user's own, created mode 0700, and refused when it
exists but is a symbolic link, belongs to another user or is writable by others (on a shared
``/tmp`` anyone could have made it first). One directory per checkpoint and rank, so concurrent
saves, ranks sharing a host, several jobs and several users on one machine never collide.

Beside each staging directory ``<d>`` lie ``<d>.lock``, on which its owner holds an exclusive
``flock`` for as long as the directory exists, and ``<d>.owner``, the owner's record (host, boot,
pid namespace, pid and the process's start time). Creating a staging directory first reclaims
those of this host whose owner is provably dead (:func:`reclaim_dead_staging`): a save SIGKILLed
mid-upload leaves its files, and the next save or load on the host removes them before they fill
the disk.

Why the lock decides liveness: the kernel releases a ``flock`` when the last descriptor of its
open file goes, however the process ends (SIGKILL, the OOM killer), so "I could take the lock"
proves the owner gone. It needs no clock and no grace period, is immune to pid reuse, and holds
across pid namespaces on one kernel (two containers sharing a host's disk see each other's locks,
not each other's pids; a record is only judged where its host name is this one's). ``flock`` rather than ``fcntl``/``lockf`` record locks: those belong to
the process, so a second staging directory of the same process (a load starting while an async
save uploads) would find its own lock free, and closing any descriptor of the file drops them
(see flock(2) and fcntl(2), "Advisory record locking"). Where Linux emulates ``flock`` with record
locks (NFS), a reclaimer never opens the lock of a record naming its own process (the record is a
file apart from the lock for that), so its own locks are never dropped. A pid with its start time from ``/proc/<pid>/stat`` (the identity
psutil's ``Process`` uses against pid reuse) is the fallback only on a file system without locks,
and is believed only on the same host, boot and pid namespace. A forked child (a DataLoader
worker) inherits the locked descriptor: its directory is kept until the child ends too.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from uc_checkpoint.errors import StagingError

logger = logging.getLogger(__name__)

#: Environment variable that sets the default staging root (else the system temp dir).
STAGING_ENV = "UC_CHECKPOINT_STAGING_DIR"

#: What every staging error tells the user to do.
STAGING_HINT = (
    f"move staging to a local directory of your own with room for a rank's share of the checkpoint: "
    f"set {STAGING_ENV}, or pass staging_dir= to UCVolumeWriter, UCVolumeReader or CheckpointManager "
    "(--staging-dir for uc-checkpoint export and gc)"
)

#: Suffixes of the files beside a staging directory ``<d>``: the owner's record and its lock.
OWNER_SUFFIX = ".owner"
LOCK_SUFFIX = ".lock"

#: Errors of a ``flock`` that another holder refuses (anything else: no locks on that file system).
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN)


def default_staging_root() -> Path:
    """The staging root: ``$UC_CHECKPOINT_STAGING_DIR`` if set, else :func:`tempfile.gettempdir`."""
    return Path(os.environ.get(STAGING_ENV) or tempfile.gettempdir())


def user_staging_base(root: str | os.PathLike[str] | None) -> Path:
    """This user's directory of staging directories under ``root`` (``None``: the default root):
    ``<root>/uc-checkpoint-<uid>`` (not created)."""
    base = Path(root) if root is not None else default_staging_root()
    return base / f"uc-checkpoint-{os.geteuid()}"


def staging_dir_for(root: str | os.PathLike[str] | None, kind: str, location: str, op_id: str, rank: int) -> Path:
    """The staging directory of one save or load on one rank (not created).

    Args:
        root: staging root, or ``None`` for :func:`default_staging_root`.
        kind: ``"save"``, ``"load"`` or ``"export"``.
        location: the checkpoint's URL on the volume.
        op_id: DCP's ``save_id`` / ``load_id`` (or any id unique to the operation).
        rank: the process's rank.
    """
    digest = hashlib.sha1(location.encode()).hexdigest()[:12]
    return user_staging_base(root) / f"{kind}-{digest}-{op_id[:12]}-rank-{rank}"


@dataclass(frozen=True)
class OwnerRecord:
    """Who created a staging directory (the ``<d>.owner`` file).

    Attributes:
        host: the host name.
        boot: the kernel's boot id (``/proc/sys/kernel/random/boot_id``), or None.
        pid_ns: the pid namespace (``/proc/self/ns/pid``'s link), or None.
        pid: the process id in that namespace.
        start: the process's start time, clock ticks after boot (``/proc/<pid>/stat``), or None.
        locked: whether the owner holds the lock (False: the file system has no locks).
    """

    host: str
    boot: str | None
    pid_ns: str | None
    pid: int
    start: int | None
    locked: bool

    @classmethod
    def of_this_process(cls, locked: bool = True) -> OwnerRecord:
        """The record of the calling process."""
        pid = os.getpid()
        return cls(socket.gethostname(), _boot_id(), _pid_namespace(), pid, _start_ticks(pid), locked)

    def to_json(self) -> str:
        """The record as the JSON text of a ``<d>.owner`` file."""
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def read(cls, path: Path) -> OwnerRecord | None:
        """The record in ``path``, or None when it is missing, partly written or not ours."""
        try:
            raw = json.loads(path.read_text())
            record = cls(**raw)
        except (OSError, ValueError, TypeError):
            return None
        fields_ok = (
            isinstance(record.host, str)
            and isinstance(record.pid, int)
            and isinstance(record.locked, bool)
            and all(v is None or isinstance(v, str) for v in (record.boot, record.pid_ns))
            and (record.start is None or isinstance(record.start, int))
        )
        return record if fields_ok else None

    def is_process(self, other: OwnerRecord) -> bool:
        """Whether both records name the same process (same host, boot, namespace, pid and start)."""
        return (self.host, self.boot, self.pid_ns, self.pid, self.start) == (
            other.host,
            other.boot,
            other.pid_ns,
            other.pid,
            other.start,
        )

    def proves_dead(self, me: OwnerRecord) -> bool:
        """Whether ``me`` (the caller, on the same host) can tell from pid and start time alone that
        this record's process is gone: another boot, or the same namespace without that process."""
        if me.boot is None or self.boot is None:
            return False
        if self.boot != me.boot:
            return True  # a reboot ended every process of the old boot
        if me.pid_ns is None or self.pid_ns != me.pid_ns or self.start is None:
            return False
        return _start_ticks(self.pid) != self.start


def _read_first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read_first_line("/proc/sys/kernel/random/boot_id")


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time, clock ticks after boot), or None: no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        # The command name (field 2) may hold spaces and parentheses: count from its last ")".
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _refuse(path: Path, why: str) -> StagingError:
    return StagingError(f"cannot create staging directory {path}: {why}; {STAGING_HINT}")


def _private_dir(base: Path, for_path: Path) -> None:
    """Create ``base`` mode 0700 if missing (its parents as usual); refuse one that is not a real
    directory, belongs to another user or is writable by others.

    Raises:
        StagingError: naming ``for_path``, the reason and :data:`STAGING_HINT`.
    """
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:  # the root, or a folder above it, is a file
        raise _refuse(for_path, f"{base.parent} cannot be a directory: it, or a folder above it, is a file") from exc
    except OSError as exc:
        raise _refuse(for_path, f"{base.parent}: {exc.strerror or exc}") from exc
    try:
        base.mkdir(mode=0o700)
    except FileExistsError:
        pass  # checked below
    except OSError as exc:
        raise _refuse(for_path, f"{base}: {exc.strerror or exc}") from exc
    try:
        st = os.lstat(base)
    except OSError as exc:
        raise _refuse(for_path, f"{base}: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(for_path, f"{base} is a symbolic link (someone else may have made it)")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(for_path, f"{base} is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(for_path, f"{base} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(for_path, f"{base} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})")


class StagingDir:
    """A staging directory this process created and owns (its lock held) until :meth:`remove`.

    Attributes:
        path: the directory.
    """

    def __init__(self, path: Path, lock_fd: int | None) -> None:
        self.path = path
        self._lock_fd = lock_fd

    def remove(self) -> None:
        """Remove the directory and its owner files, then release the lock; never raises (logs
        instead). A directory that cannot be removed keeps its record: the next reclaim on this
        host tries again. Calling it again does nothing."""
        if self._lock_fd is None and not self.path.exists():
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if self.path.exists():
            logger.warning("could not remove staging directory %s", self.path)
        else:
            for suffix in (OWNER_SUFFIX, LOCK_SUFFIX):
                _sibling(self.path, suffix).unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def create_staging_dir(path: Path) -> StagingDir:
    """Create the staging directory ``path`` for this process: its parent made private if new
    (:func:`user_staging_base`'s rules), the dead owners' staging there reclaimed first
    (:func:`reclaim_dead_staging`), then the lock taken, the owner recorded and the directory made.

    Raises:
        StagingError: it cannot be created or written, its parent is not this user's own, or
            another live process holds it; the message names the path and :data:`STAGING_HINT`.
    """
    base = path.parent
    _private_dir(base, path)
    reclaim_dead_staging(base)
    lock_path = _sibling(path, LOCK_SUFFIX)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _refuse(path, f"{lock_path}: {exc.strerror or exc}") from exc
    locked = True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _HELD:
            os.close(fd)
            raise StagingError(f"staging directory {path} is in use by another live process; {STAGING_HINT}") from exc
        locked = False
        logger.debug("no locks on the file system of %s (%s): liveness by pid and start time", path, exc)
    held = StagingDir(path, fd)
    try:
        _sibling(path, OWNER_SUFFIX).write_text(OwnerRecord.of_this_process(locked).to_json())
        path.mkdir(exist_ok=True)
    except OSError as exc:
        held.remove()
        raise _refuse(path, exc.strerror or str(exc)) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        held.remove()
        raise _refuse(path, "it is not writable")
    return held


@dataclass(frozen=True)
class Reclaimed:
    """A staging directory of a dead process, removed (or, in a dry run, found).

    Attributes:
        path: the directory.
        bytes: the size of the files it held, in bytes.
        pid: its owner's process id.
    """

    path: Path
    bytes: int
    pid: int


def reclaim_dead_staging(base: Path, *, dry_run: bool = False) -> list[Reclaimed]:
    """Remove the staging directories under ``base`` whose owner is provably dead: recorded on this
    host, and its lock free (or, on a file system without locks, its pid gone or reused in this
    boot and namespace). Never one of a live process, of another host, or without a readable
    record. One listing of ``base``, a small read per record, a lock attempt per other process's;
    safe beside another reclaimer (only the one holding the dead owner's lock removes). Logs each
    removal with its bytes; never raises.

    Args:
        base: a directory of staging directories (:func:`user_staging_base`).
        dry_run: find them, remove nothing.
    """
    try:
        names = os.listdir(base)
    except OSError:
        return []
    me = OwnerRecord.of_this_process()
    found = []
    for name in names:
        if not name.endswith(OWNER_SUFFIX):
            continue
        path = base / name[: -len(OWNER_SUFFIX)]
        record = OwnerRecord.read(base / name)
        if record is None or record.host != me.host or record.is_process(me):
            continue
        gone = _reclaim_if_dead(path, record, me, dry_run)
        if gone is not None:
            found.append(gone)
    return found


def _reclaim_if_dead(path: Path, record: OwnerRecord, me: OwnerRecord, dry_run: bool) -> Reclaimed | None:
    if not record.locked:
        return _remove_dead(path, record, dry_run) if record.proves_dead(me) else None
    try:
        fd = os.open(_sibling(path, LOCK_SUFFIX), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # removed meanwhile (by its owner or another reclaimer)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # held: the owner lives (or another reclaimer is removing it)
        if not _sibling(path, OWNER_SUFFIX).exists():
            return None  # another reclaimer removed it between our read and our lock
        return _remove_dead(path, record, dry_run)
    finally:
        os.close(fd)


def _remove_dead(path: Path, record: OwnerRecord, dry_run: bool) -> Reclaimed | None:
    nbytes = tree_bytes(path)
    if not dry_run:
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            logger.warning("could not remove staging directory %s of dead process %d", path, record.pid)
            return None
        for suffix in (OWNER_SUFFIX, LOCK_SUFFIX):
            _sibling(path, suffix).unlink(missing_ok=True)
    logger.info(
        "%s staging directory %s of process %d on %s, which is gone (%d bytes)",
        "would reclaim" if dry_run else "reclaimed",
        path,
        record.pid,
        record.host,
        nbytes,
    )
    return Reclaimed(path, nbytes, record.pid)


def tree_bytes(path: Path) -> int:
    """Total size in bytes of the files under ``path`` (symbolic links not followed; 0 if missing)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def owned_on_this_host(path: Path) -> bool:
    """Whether the staging directory ``path`` has a readable owner record of this host (then only
    :func:`reclaim_dead_staging` may remove it, once its owner is dead)."""
    record = OwnerRecord.read(_sibling(path, OWNER_SUFFIX))
    return record is not None and record.host == socket.gethostname()
