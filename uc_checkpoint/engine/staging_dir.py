"""Local staging directories: where checkpoint files are serialised before upload and fetched
before a load.

Layout: ``<staging_dir>/uc-checkpoint/<kind>-<location hash>-<save or load id>/rank-<r>``. One
directory per checkpoint and rank, so concurrent saves, ranks sharing a host, and several jobs on one
machine never collide; the hash makes the owner of a stale directory findable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from uc_checkpoint.errors import StagingError

logger = logging.getLogger(__name__)

#: Environment variable that sets the default staging directory (else the system temp dir).
STAGING_ENV = "UC_CHECKPOINT_STAGING_DIR"


def default_staging_root() -> Path:
    """The staging root: ``$UC_CHECKPOINT_STAGING_DIR`` if set, else :func:`tempfile.gettempdir`."""
    return Path(os.environ.get(STAGING_ENV) or tempfile.gettempdir())


def staging_dir_for(root: str | os.PathLike[str] | None, kind: str, location: str, op_id: str, rank: int) -> Path:
    """The staging directory of one save or load on one rank (not created).

    Args:
        root: staging root, or ``None`` for :func:`default_staging_root`.
        kind: ``"save"`` or ``"load"``.
        location: the checkpoint's URL on the volume.
        op_id: DCP's ``save_id`` / ``load_id`` (or any id unique to the operation).
        rank: the process's rank.
    """
    base = Path(root) if root is not None else default_staging_root()
    digest = hashlib.sha1(location.encode()).hexdigest()[:12]
    return base / "uc-checkpoint" / f"{kind}-{digest}-{op_id[:12]}" / f"rank-{rank}"


def create_staging_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and check that it is a writable directory.

    Raises:
        StagingError: it cannot be created or written; the message names the path.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StagingError(f"cannot create staging directory {path}: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise StagingError(f"staging directory {path} is not writable")
    return path


def remove_staging_dir(path: Path) -> None:
    """Remove a staging directory and its now-empty parent; never raises (logs instead)."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()  # only succeeds once every rank on this host is done
    except OSError:
        pass
    if path.exists():
        logger.warning("could not remove staging directory %s", path)
