"""fsspec filesystems that cache directory listings the way s3fs and gcsfs do, over local files.

s3fs and gcsfs keep every listing in ``fs.dircache`` (no expiry by default) and answer ``ls``,
``info``, ``exists``, ``isfile`` and ``size`` from it: ``info`` of a path whose parent was listed
answers from that listing, and raises FileNotFoundError when the listing did not have it. Only
``refresh=True`` or ``invalidate_cache(path)`` (which drops the path and all its parents) make them
ask the store again. s3fs cannot be installed beside this project's boto3, so these stand in for it,
on real files, so that several instances and processes share one store.

One difference, on purpose: these never invalidate on their own writes (s3fs drops the written
path's listings). That makes one instance behave like a second process behind the cache (or DCP's
PROCESS-mode daemon writing for the training process), and it puts the writer's own checks before
publishing (size after upload, the listing before ``.metadata``) behind a stale cache too.

Registered protocols (on import):

* ``uccache://`` :class:`CachingLocalFileSystem`: ``ls`` and ``info`` take ``refresh`` (as s3fs's).
* ``uccachenr://`` :class:`InvalidateOnlyFileSystem`: ``ls``/``info`` take no ``refresh`` and no
  ``**kwargs`` (passing one raises TypeError); only ``invalidate_cache`` refreshes them.

Both accept a ``tag`` storage option that does nothing but give an instance of its own (fsspec
shares one instance per protocol, options and thread).
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


class CachingLocalFileSystem(LocalFileSystem):
    """Local files with listings cached in ``self.dircache`` as s3fs caches them.

    ``listings`` counts the real directory scans, so a test can tell a cached answer from a fresh one.
    """

    protocol = ("uccache",)

    def __init__(self, tag: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag
        self.listings = 0

    def _cached_ls(self, path: str, detail: bool, refresh: bool) -> list[Any]:
        path = self._strip_protocol(path)
        if refresh or path not in self.dircache:
            self.listings += 1
            if os.path.isdir(path):
                entries = []
                with os.scandir(path) as it:
                    for entry in it:
                        try:
                            entries.append(LocalFileSystem.info(self, entry))
                        except FileNotFoundError:
                            continue
                self.dircache[path] = entries  # only directories are cached, as in s3fs
            else:
                entries = [LocalFileSystem.info(self, path)]  # a file, or FileNotFoundError
        else:
            entries = self.dircache[path]
        return [dict(e) for e in entries] if detail else [e["name"] for e in entries]

    def _cached_info(self, path: Any, refresh: bool) -> dict[str, Any]:
        if isinstance(path, os.DirEntry):  # LocalFileSystem.ls describes its entries through info()
            return LocalFileSystem.info(self, path)
        path = self._strip_protocol(path)
        if not refresh:
            cached = self._ls_from_cache(path)  # raises FileNotFoundError if the parent's listing lacks it
            if cached is not None:
                if path in self.dircache:
                    return {"name": path, "size": 0, "type": "directory"}
                return dict(cached[0])
        return LocalFileSystem.info(self, path)

    def ls(self, path: str, detail: bool = False, refresh: bool = False, **kwargs: Any) -> list[Any]:
        return self._cached_ls(path, detail, refresh)

    def info(self, path: Any, refresh: bool = False, **kwargs: Any) -> dict[str, Any]:
        return self._cached_info(path, refresh)

    def invalidate_cache(self, path: str | None = None) -> None:
        """Drop the listings of ``path`` and every parent (all with None), as s3fs does."""
        if path is None:
            self.dircache.clear()
        else:
            path = self._strip_protocol(path)
            while path:
                self.dircache.pop(path, None)
                parent = self._parent(path)
                if parent == path:
                    break
                path = parent
        super().invalidate_cache(path)


class InvalidateOnlyFileSystem(CachingLocalFileSystem):
    """As :class:`CachingLocalFileSystem`, but ``ls``/``info`` accept no ``refresh`` (nor any other
    keyword): a caller that passes one fails, as it would against a filesystem that forwards unknown
    keywords to its store's API."""

    protocol = ("uccachenr",)

    def ls(self, path: str, detail: bool = False) -> list[Any]:  # type: ignore[override]
        return self._cached_ls(path, detail, refresh=False)

    def info(self, path: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._cached_info(path, refresh=False)

    def exists(self, path: str) -> bool:  # type: ignore[override]
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False


fsspec.register_implementation("uccache", CachingLocalFileSystem, clobber=True)
fsspec.register_implementation("uccachenr", InvalidateOnlyFileSystem, clobber=True)
