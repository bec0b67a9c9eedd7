"""FUSE mounts for benchmarks: s3fs-fuse over an S3 server, and bindfs.

The benchmark runner compares our plugin with the obvious alternative of pointing DCP's own
``FileSystemWriter`` at a FUSE mount of the bucket. This module sets those mounts up and, above
all, tears them down again: a FUSE mount left behind by a crashed run blocks the next one and
hangs anything that walks the file system.

* :func:`fuse_problem` says why mounts cannot be made here (or None); it installs nothing, so a
  test skips with its reason. :func:`ensure_fuse_tools`, for the benchmark runner only, installs
  the missing tools first (as root, with apt-get).
* :func:`s3fs_mount` mounts a bucket with s3fs-fuse; :func:`bindfs_mount` mounts a local
  directory through a FUSE passthrough (a FUSE baseline with no network in it).

The S3 servers are in :mod:`benchmarks.servers`. The FUSE daemons run in the foreground (``-f``) as
children of this process, so each context manager owns its daemon and can wait for it, or kill it,
when the mount goes away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.support.s3_fixtures import REGION

log = logging.getLogger(__name__)

#: Seconds to wait for a mount to answer, and for it to disappear after an unmount.
MOUNT_TIMEOUT_S = 30.0
#: Seconds a FUSE daemon gets to exit after its mount is gone before it is sent SIGTERM
#: (then as long again before SIGKILL). s3fs may still be flushing uploads at that point.
DAEMON_EXIT_TIMEOUT_S = 30.0

_APT_PACKAGES = ("fuse3", "s3fs", "bindfs")
# Binary -> Debian package that provides it.
_TOOLS = {"s3fs": "s3fs", "bindfs": "bindfs", "fusermount3": "fuse3"}
_APT_TIMEOUT_S = 600
# Environment variables handed to FUSE daemons. Everything else is left out: the machine sets
# AWS_CA_BUNDLE, CURL_CA_BUNDLE and friends (which break some S3 clients even over plain http),
# and stray AWS_* credentials must never mix with the fake ones in the passwd file.
_DAEMON_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ")
_LOG_TAIL_BYTES = 4000


# -- tools --------------------------------------------------------------------------------


def fuse_problem() -> str | None:
    """Why FUSE mounts cannot be made here, or None: not root, ``/dev/fuse`` missing or not readable
    and writable, or ``s3fs``, ``bindfs`` or ``fusermount3`` missing (the message names the
    packages). Installs nothing."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "FUSE mounts need root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (container started without the FUSE device?)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    missing = _missing_tools()
    if missing:
        return f"missing binaries: {', '.join(missing)} (apt-get install {' '.join(_APT_PACKAGES)})"
    return None


def ensure_fuse_tools() -> None:
    """Make FUSE mounts possible for the benchmark runner, which is asked for explicitly
    (``./scripts/bench.sh``): as root, missing ``s3fs``, ``bindfs`` and ``fusermount3`` are installed
    with ``apt-get install -y fuse3 s3fs bindfs`` (``apt-get update`` and one retry if the first
    install fails; needs the package mirrors). Tests never call it: they skip on
    :func:`fuse_problem`.

    Raises:
        RuntimeError: :func:`fuse_problem` still names a problem afterwards, or the install failed.
    """
    if os.geteuid() == 0 and os.path.exists("/dev/fuse") and _missing_tools():
        _apt_install()
    problem = fuse_problem()
    if problem is not None:
        raise RuntimeError("FUSE benchmarks cannot run: " + problem)
    log.debug("FUSE tools present: %s", ", ".join(shutil.which(t) or t for t in _TOOLS))


def _missing_tools() -> list[str]:
    return [f"{tool} (package {pkg})" for tool, pkg in _TOOLS.items() if shutil.which(tool) is None]


def _apt_install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", *_APT_PACKAGES]
    log.info("installing %s with apt-get", " ".join(_APT_PACKAGES))
    first = _run_quiet(install, env)
    if first.returncode == 0:
        return
    # A fresh container often has no package lists yet; update only then, as it is slow.
    log.info("apt-get install failed (rc %d); running apt-get update and retrying", first.returncode)
    update = _run_quiet(["apt-get", "update"], env)
    if update.returncode != 0:
        raise RuntimeError(f"apt-get update failed (rc {update.returncode}): {update.stdout[-2000:]}")
    second = _run_quiet(install, env)
    if second.returncode != 0:
        raise RuntimeError(
            f"apt-get install {' '.join(_APT_PACKAGES)} failed (rc {second.returncode}): {second.stdout[-2000:]}"
        )


def _run_quiet(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=_APT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{' '.join(cmd)} could not run: {exc}") from exc


# -- FUSE mounts --------------------------------------------------------------------------


@contextlib.contextmanager
def s3fs_mount(
    endpoint_url: str,
    bucket: str,
    mountpoint: Path,
    *,
    extra_options: Sequence[str] = (),
) -> Iterator[Path]:
    """Mount ``bucket`` from the S3 endpoint ``endpoint_url`` at ``mountpoint`` with s3fs-fuse.

    Requests are path-style, signed for us-east-1 with the fake keys ``testing:testing`` (from
    a mode-600 passwd file in a private temporary directory, which also holds s3fs's log).
    Each entry of ``extra_options`` is passed as ``-o ENTRY``, e.g. ``"multipart_size=64"``
    (MiB) or ``"parallel_count=8"``. ``mountpoint`` is created if missing. s3fs uploads a
    file when it is closed (or fsynced), so once ``close()`` returns the object is in S3.

    Yields ``mountpoint`` once the mount answers a directory listing. On exit, however the
    body ends, the mount is unmounted (``fusermount3 -u``, then ``umount -l`` if that fails),
    gone from the mount table, and the s3fs process has exited: it gets
    :data:`DAEMON_EXIT_TIMEOUT_S` seconds to finish pending uploads, then SIGTERM. If a file
    on the mount is still open at exit (so only ``umount -l`` works), s3fs is stopped after
    2 s and what was written through that file is lost.

    Raises:
        RuntimeError: ``mountpoint`` is already a mount point, or the mount did not come up
            within :data:`MOUNT_TIMEOUT_S` seconds or s3fs exited (the message carries the
            tail of s3fs's log), or the unmount did not take effect.
        FileNotFoundError: the ``s3fs`` binary is missing (see :func:`ensure_fuse_tools`).
    """
    with tempfile.TemporaryDirectory(prefix="uc-s3fs-") as private:
        # mkdtemp makes the directory 0700; the file itself must be 0600 or s3fs refuses it.
        passwd = Path(private, "passwd")
        fd = os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("testing:testing\n")
        logfile = Path(private, "s3fs.log")
        options = [
            f"url={endpoint_url}",
            "use_path_request_style",
            f"passwd_file={passwd}",
            f"endpoint={REGION}",
            "dbglevel=warn",
            f"logfile={logfile}",
            *extra_options,
        ]
        cmd = ["s3fs", bucket, str(mountpoint), "-f"]
        for option in options:
            cmd += ["-o", option]
        with _fuse_daemon("s3fs", cmd, mountpoint, Path(private), logfile) as mounted:
            yield mounted


@contextlib.contextmanager
def bindfs_mount(source: Path, mountpoint: Path) -> Iterator[Path]:
    """Mount directory ``source`` at ``mountpoint`` through bindfs (a FUSE passthrough).

    Mounted with ``-o big_writes`` so writes reach the daemon in up to 128 KiB requests rather
    than 4 KiB ones (about 3x the throughput here); everything else is passed straight to
    ``source``, which makes it a FUSE baseline without any network. ``mountpoint`` is created
    if missing.

    Yields ``mountpoint`` once the mount answers a directory listing; on exit it is unmounted
    and the daemon has exited, as for :func:`s3fs_mount`.

    Raises:
        RuntimeError: ``mountpoint`` is already a mount point, the mount did not come up
            within :data:`MOUNT_TIMEOUT_S` seconds or bindfs exited (with its output), or the
            unmount did not take effect.
        FileNotFoundError: ``source`` is not a directory, or ``bindfs`` is missing.
    """
    if not Path(source).is_dir():
        raise FileNotFoundError(f"bindfs source {source} is not a directory")
    with tempfile.TemporaryDirectory(prefix="uc-bindfs-") as private:
        cmd = ["bindfs", "-f", "-o", "big_writes", str(source), str(mountpoint)]
        with _fuse_daemon("bindfs", cmd, mountpoint, Path(private), None) as mounted:
            yield mounted


@contextlib.contextmanager
def _fuse_daemon(name: str, cmd: list[str], mountpoint: Path, private: Path, logfile: Path | None) -> Iterator[Path]:
    """Run a foreground FUSE daemon for ``mountpoint``; unmount and reap it on exit."""
    mountpoint = Path(mountpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    # Resolved before mounting: once a FUSE daemon dies, stat() on the mount point fails.
    target = os.path.realpath(mountpoint)
    if _in_mount_table(target):
        raise RuntimeError(f"{mountpoint} is already a mount point")
    output_path = private / f"{name}.out"
    started = time.monotonic()
    with open(output_path, "wb") as output:
        log.debug("starting %s", " ".join(cmd))
        # Own session: a Ctrl-C meant for the benchmark must not kill the daemon before the
        # unmount below has run, which would leave a dead mount ("Transport endpoint is not
        # connected") behind.
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=_daemon_env(private),
            start_new_session=True,
        )
        try:
            _wait_mounted(name, proc, target, output_path, logfile)
            log.info("%s mounted at %s in %.2f s", name, mountpoint, time.monotonic() - started)
            yield mountpoint
        finally:
            _unmount_and_reap(name, proc, target, output_path, logfile)


def _daemon_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _DAEMON_ENV_KEEP}
    env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    # s3fs falls back to ~/.passwd-s3fs and ~/.aws/credentials; point HOME at an empty place.
    env["HOME"] = str(home)
    return env


def _wait_mounted(name: str, proc: subprocess.Popen[bytes], target: str, output: Path, logfile: Path | None) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while True:
        if _in_mount_table(target) and _listdir_answers(target, deadline - time.monotonic()):
            return
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(
                f"{name} exited with status {rc} before {target} was mounted\n" + _diagnostics(output, logfile)
            )
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{name} mount at {target} not ready after {MOUNT_TIMEOUT_S:.0f} s\n" + _diagnostics(output, logfile)
            )
        time.sleep(0.05)


def _listdir_answers(path: str, timeout_s: float) -> bool:
    """Whether listing ``path`` succeeds within ``timeout_s`` seconds.

    Run in a thread because a FUSE daemon that hangs would otherwise hang us with it.
    """
    result: list[bool] = []

    def probe() -> None:
        try:
            os.listdir(path)
            result.append(True)
        except OSError as exc:
            log.debug("listdir %s: %r", path, exc)
            result.append(False)

    thread = threading.Thread(target=probe, name="fuse-mount-probe", daemon=True)
    thread.start()
    thread.join(max(timeout_s, 0.1))
    return bool(result and result[0])


def _unmount_and_reap(
    name: str, proc: subprocess.Popen[bytes], target: str, output: Path, logfile: Path | None
) -> None:
    started = time.monotonic()
    errors = []
    was_mounted = _in_mount_table(target)
    lazy = False
    if was_mounted:
        for cmd in (["fusermount3", "-u", target], ["umount", "-l", target]):
            try:
                done = subprocess.run(
                    cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                errors.append(f"{cmd[0]}: {exc}")
                continue
            if done.returncode == 0:
                lazy = cmd[0] == "umount"
                break
            # Typically EBUSY: a file on the mount is still open. umount -l detaches the
            # mount now and lets the kernel finish once the last user lets go.
            errors.append(f"{' '.join(cmd)}: rc {done.returncode}: {done.stderr.strip()}")
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while _in_mount_table(target) and time.monotonic() < deadline:
        time.sleep(0.05)
    still_mounted = _in_mount_table(target)
    unmounted_s = time.monotonic() - started
    # After a clean unmount s3fs may still be finishing uploads, so it gets time. After a
    # lazy one the daemon lives until the open file is closed, usually by the very code now
    # waiting on us, and a daemon that never mounted is hung or failing: no point waiting.
    grace = DAEMON_EXIT_TIMEOUT_S if was_mounted and not lazy and not still_mounted else 2.0
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log.warning(
            "%s (pid %d) still running %.0f s after unmount; sending SIGTERM%s",
            name,
            proc.pid,
            grace,
            " (writes through files still open on the mount are lost)" if lazy else "",
        )
        _signal(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()
    if still_mounted:
        # The daemon is gone now, so a lazy unmount cannot hang on it.
        subprocess.run(
            ["umount", "-l", target],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=MOUNT_TIMEOUT_S,
            check=False,
        )
        if _in_mount_table(target):
            raise RuntimeError(
                f"could not unmount {name} at {target}: {'; '.join(errors)}\n" + _diagnostics(output, logfile)
            )
    if errors:
        log.warning("unmounting %s at %s: %s", name, target, "; ".join(errors))
    if was_mounted:
        log.info(
            "%s at %s unmounted in %.2f s, daemon exited (rc %s) after %.2f s",
            name,
            target,
            unmounted_s,
            proc.returncode,
            time.monotonic() - started,
        )


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)


def _in_mount_table(target: str) -> bool:
    """Whether ``target`` (a resolved path) is a mount point, per ``/proc/self/mounts``.

    Used instead of :func:`os.path.ismount` because that stats the mount point, which fails
    (and so reads as "not mounted") when the FUSE daemon behind it has died.
    """
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return os.path.ismount(target)
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 1 and _unescape_mount_path(fields[1]) == target:
            return True
    return False


def _unescape_mount_path(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in mount paths as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _diagnostics(output: Path, logfile: Path | None) -> str:
    parts = [f"--- {output.name} (tail) ---\n{_tail(output)}"]
    if logfile is not None:
        parts.append(f"--- {logfile.name} (tail) ---\n{_tail(logfile)}")
    return "\n".join(parts)


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - _LOG_TAIL_BYTES, 0))
            return f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(unreadable: {exc})"


__all__ = [
    "DAEMON_EXIT_TIMEOUT_S",
    "MOUNT_TIMEOUT_S",
    "bindfs_mount",
    "ensure_fuse_tools",
    "fuse_problem",
    "s3fs_mount",
]
