"""Byte-level training data for the demo, built from the Python standard library's sources.

Every Python installation ships its standard library as ``.py`` files, so this corpus exists on
any machine without a download. The sources are concatenated in a fixed order (sorted by relative
POSIX path), cut to at most ``max_bytes`` bytes and split into a few raw-byte shard files of
deliberately unequal size. An ``index.json`` next to the shards records each shard's name, size
(bytes) and SHA-256, plus where the text came from.

Tokens are single bytes (vocabulary 256). A *sample* is a window of ``seq_len + 1`` consecutive
bytes that lies entirely inside one shard; the windows of a shard do not overlap and the tail of
a shard that is shorter than a window is never used. Input and target of a sample are
``window[:-1]`` and ``window[1:]``.

The corpus depends on the Python version and the installed standard library, so two machines
may produce different shards; on one machine the result is byte-for-byte reproducible.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

INDEX_NAME = "index.json"
"""File name of the shard index inside a shard directory."""

INDEX_FORMAT = 1
"""Version of the ``index.json`` layout written by :func:`build_shards`."""

DEFAULT_MAX_BYTES = 16 << 20
"""Default corpus size cap: 16 MiB."""

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

# Relative shard weights, cycled when more shards than weights are asked for. Shards are within
# roughly +-25 % of the mean, and no two neighbouring shards have the same size.
_SPLIT_WEIGHTS = (20, 23, 17, 22, 19, 25, 16, 21, 18, 24, 15)

_SHARD_NAME_RE = re.compile(r"^shard_\d{5}\.bin$")
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class ShardInfo:
    """One shard file as recorded in ``index.json``.

    Attributes:
        name: File name inside the shard directory, e.g. ``"shard_00000.bin"``.
        size: File size in bytes.
        sha256: Lower-case hex SHA-256 of the file's bytes.
    """

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ShardSet:
    """A validated directory of byte shards.

    Attributes:
        root: The directory that holds ``index.json`` and the shard files.
        shards: The shards in index order (their concatenation is the corpus).
    """

    root: Path
    shards: tuple[ShardInfo, ...]

    @classmethod
    def load(cls, root: Path | str, *, verify_hashes: bool = True) -> ShardSet:
        """Read ``root/index.json`` and check every shard file against it.

        Args:
            root: Shard directory.
            verify_hashes: Also recompute each file's SHA-256 (sizes are always checked).

        Returns:
            The shard set.

        Raises:
            FileNotFoundError: ``index.json`` does not exist.
            ValueError: The index is malformed, or a shard file is missing or its size or hash
                differs from the index; the message names the offending file.
        """
        root = Path(root)
        index_path = root / INDEX_NAME
        index = _read_index(index_path)
        shards = _shards_from_index(index, index_path)
        for info in shards:
            _check_shard_file(root / info.name, info, verify_hashes=verify_hashes)
        return cls(root=root, shards=shards)

    def path(self, shard: int) -> Path:
        """Return the file path of shard number ``shard`` (0-based).

        Raises:
            IndexError: ``shard`` is outside ``[0, len(self.shards))``.
        """
        if not 0 <= shard < len(self.shards):
            raise IndexError(f"shard {shard} out of range [0, {len(self.shards)})")
        return self.root / self.shards[shard].name

    @property
    def total_bytes(self) -> int:
        """Size of the whole corpus in bytes (sum of the shard sizes)."""
        return sum(info.size for info in self.shards)

    def samples_per_shard(self, seq_len: int) -> tuple[int, ...]:
        """Number of samples of ``seq_len + 1`` bytes in each shard, in shard order."""
        return tuple(samples_in_shard(info.size, seq_len) for info in self.shards)

    def num_samples(self, seq_len: int) -> int:
        """Number of samples of ``seq_len + 1`` bytes in the whole set."""
        return sum(self.samples_per_shard(seq_len))


def stdlib_root() -> Path:
    """Return the directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[tuple[str, Path]]:
    """List the ``.py`` files under ``root`` in corpus order.

    Directories named ``site-packages``, ``dist-packages`` or ``__pycache__`` are skipped, as
    are symbolic links to directories and anything that is not a regular file.

    Args:
        root: Directory to scan; defaults to :func:`stdlib_root`.

    Returns:
        ``(relative POSIX path, absolute path)`` pairs sorted by the relative path.
    """
    root = stdlib_root() if root is None else Path(root)
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for filename in filenames:
            if not filename.endswith(".py"):
                continue
            path = Path(dirpath) / filename
            if not path.is_file():
                continue
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def read_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> bytes:
    """Concatenate the sources from :func:`stdlib_sources`, stopping at ``max_bytes`` bytes.

    The last file read is truncated so the result is exactly ``max_bytes`` long, unless the
    sources are smaller in total. Unreadable files are skipped with a warning.

    Raises:
        ValueError: ``max_bytes`` is not positive.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    parts: list[bytes] = []
    collected = 0
    for rel, path in stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError as exc:
            logger.warning("skipping unreadable source %s: %s", rel, exc)
            continue
        take = data[: max_bytes - collected]
        parts.append(take)
        collected += len(take)
        if collected >= max_bytes:
            break
    return b"".join(parts)


def split_sizes(total: int, num_shards: int) -> list[int]:
    """Split ``total`` bytes into ``num_shards`` nearly equal, deliberately unequal sizes.

    The split follows a fixed cycle of weights, so the result depends only on the arguments.

    Raises:
        ValueError: ``num_shards < 1`` or ``total`` is too small to give every shard a byte.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    weights = [_SPLIT_WEIGHTS[i % len(_SPLIT_WEIGHTS)] for i in range(num_shards)]
    weight_sum = sum(weights)
    bounds = [0]
    running = 0
    for weight in weights:
        running += weight
        bounds.append(total * running // weight_sum)
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    if min(sizes) < 1:
        raise ValueError(f"{total} bytes are too few for {num_shards} non-empty shards")
    return sizes


def build_shards(
    out_dir: Path | str,
    num_shards: int = 8,
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    source_root: Path | None = None,
) -> ShardSet:
    """Build (or reuse) byte shards of the standard-library corpus in ``out_dir``.

    Files written: ``shard_00000.bin`` ... (raw bytes) and ``index.json``. Each file is written
    under a temporary name and moved into place with :func:`os.replace`; the index is written
    last. If ``index.json`` already describes the same request (shard count, byte cap, source
    directory, Python version) and every shard matches its recorded size and SHA-256, nothing is
    rewritten. Old ``shard_NNNNN.bin`` files that the new index does not list are removed.

    Args:
        out_dir: Destination directory (created if missing).
        num_shards: Number of shards, >= 1.
        max_bytes: Cap on the corpus size in bytes.
        source_root: Directory to read ``.py`` files from; defaults to :func:`stdlib_root`.

    Returns:
        The validated shard set.

    Raises:
        ValueError: Bad arguments, or the sources are too small for ``num_shards`` shards.
    """
    out_dir = Path(out_dir)
    source = stdlib_root() if source_root is None else Path(source_root)
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    request = {
        "num_shards": num_shards,
        "max_bytes": max_bytes,
        "source_root": str(source),
        "python_version": platform.python_version(),
    }

    reused = _try_reuse(out_dir, request)
    if reused is not None:
        logger.info("reusing %d shards in %s", len(reused.shards), out_dir)
        return reused

    corpus = read_corpus(max_bytes, source)
    sizes = split_sizes(len(corpus), num_shards)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[ShardInfo] = []
    offset = 0
    for number, size in enumerate(sizes):
        piece = corpus[offset : offset + size]
        offset += size
        name = f"shard_{number:05d}.bin"
        _atomic_write(out_dir / name, piece)
        shards.append(ShardInfo(name=name, size=size, sha256=hashlib.sha256(piece).hexdigest()))

    index = {
        "format": INDEX_FORMAT,
        **request,
        "total_bytes": len(corpus),
        "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
        "shards": [{"name": s.name, "size": s.size, "sha256": s.sha256} for s in shards],
    }
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    _atomic_write(out_dir / INDEX_NAME, text.encode("utf-8"))

    listed = {s.name for s in shards}
    for stale in out_dir.iterdir():
        if _SHARD_NAME_RE.match(stale.name) and stale.name not in listed:
            stale.unlink()
    logger.info("wrote %d shards (%d bytes) to %s", len(shards), len(corpus), out_dir)
    return ShardSet(root=out_dir, shards=tuple(shards))


def samples_in_shard(size: int, seq_len: int) -> int:
    """Number of non-overlapping ``seq_len + 1``-byte windows in a shard of ``size`` bytes.

    Raises:
        ValueError: ``size < 0`` or ``seq_len < 1``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    return size // (seq_len + 1)


def _read_index(index_path: Path) -> dict[str, Any]:
    raw = index_path.read_text(encoding="utf-8")  # FileNotFoundError propagates
    try:
        index = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{index_path}: not valid JSON ({exc})") from exc
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise ValueError(f"{index_path}: missing 'shards' list")
    return index


def _shards_from_index(index: dict[str, Any], index_path: Path) -> tuple[ShardInfo, ...]:
    shards: list[ShardInfo] = []
    for entry in index["shards"]:
        try:
            info = ShardInfo(name=entry["name"], size=entry["size"], sha256=entry["sha256"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: malformed shard entry {entry!r}") from exc
        if not isinstance(info.name, str) or not _SHARD_NAME_RE.match(info.name):
            raise ValueError(f"{index_path}: bad shard name {info.name!r}")
        if not isinstance(info.size, int) or info.size < 0 or not isinstance(info.sha256, str):
            raise ValueError(f"{index_path}: bad size or sha256 for {info.name}")
        shards.append(info)
    if not shards:
        raise ValueError(f"{index_path}: lists no shards")
    return tuple(shards)


def _check_shard_file(path: Path, info: ShardInfo, *, verify_hashes: bool) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ValueError(f"{path}: shard listed in the index is missing") from None
    if size != info.size:
        raise ValueError(f"{path}: size {size} bytes, index says {info.size}")
    if verify_hashes:
        digest = _sha256_file(path)
        if digest != info.sha256:
            raise ValueError(f"{path}: sha256 {digest}, index says {info.sha256}")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _try_reuse(out_dir: Path, request: dict[str, Any]) -> ShardSet | None:
    index_path = out_dir / INDEX_NAME
    if not index_path.exists():
        return None
    try:
        index = _read_index(index_path)
        if index.get("format") != INDEX_FORMAT or any(index.get(key) != value for key, value in request.items()):
            logger.info("%s describes a different build; rebuilding", index_path)
            return None
        return ShardSet.load(out_dir)
    except ValueError as exc:
        logger.warning("existing shards in %s are not reusable (%s); rebuilding", out_dir, exc)
        return None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
