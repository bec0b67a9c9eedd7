"""One canonical spelling of a checkpoint location, for every volume kind.

Writer, reader, manager, CLI and garbage collection all reach a location through
:func:`~uc_checkpoint.volumes.open_volume`, so they agree once the volume itself canonicalises:

* local and FUSE paths: absolute, normalised (``a//b``, ``a/./b``, trailing ``/``);
  ``file:///p`` and ``file://localhost/p`` are the path ``/p``;
* ``s3://bucket/prefix`` and fsspec URLs: empty path segments dropped (``run1//step`` is
  ``run1/step``, as a root with a trailing slash plus ``/step`` would spell it) and trailing slashes
  dropped; a ``.`` or ``..`` segment is refused (object stores keep them as literal key parts, so
  ``run1/../x`` would silently be a different place from what it reads as);
* the empty location is refused (it used to mean "the current directory");
* S3 bucket names are checked against S3's naming rules before any request, so a typo fails at
  once instead of after seconds of retries.
"""

from __future__ import annotations

import re

from uc_checkpoint.errors import VolumeError

# S3's rules for bucket names (docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html):
# 3-63 characters; lowercase letters, digits, dots and hyphens; a letter or digit at both ends.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")


def require_location(text: str) -> str:
    """``text``, or :class:`VolumeError` when it is empty or blank."""
    if not text.strip():
        raise VolumeError(
            "empty checkpoint location: pass a directory path or a URL (an empty string would mean "
            "the current directory)"
        )
    return text


def canonical_key_path(path: str, url: str) -> str:
    """``path`` (a key prefix or an object-store path) with empty segments and trailing slashes
    dropped, keeping one leading ``/`` if it had one.

    Raises:
        VolumeError: a ``.`` or ``..`` segment (named, with ``url``).
    """
    segments = path.split("/")
    for seg in segments:
        if seg in (".", ".."):
            raise VolumeError(
                f"checkpoint location {url!r} has a {seg!r} path segment; object stores keep it as a "
                "literal part of the key, so spell the location without it"
            )
    joined = "/".join(seg for seg in segments if seg)
    return "/" + joined if path.startswith("/") and joined else joined


def check_bucket_name(bucket: str, url: str) -> str:
    """``bucket``, or :class:`VolumeError` naming the S3 rule it breaks."""
    problem = None
    if not 3 <= len(bucket) <= 63:
        problem = f"it has {len(bucket)} characters, S3 allows 3 to 63"
    elif bucket != bucket.lower():
        problem = "it has upper-case letters, S3 allows only lower-case ones"
    elif not _BUCKET.match(bucket):
        problem = "S3 allows only lower-case letters, digits, dots and hyphens, with a letter or digit at both ends"
    elif ".." in bucket:
        problem = "S3 allows no two adjacent dots"
    elif _IPV4.match(bucket):
        problem = "S3 allows no name shaped like an IP address"
    elif bucket.startswith(("xn--", "sthree-")) or bucket.endswith(("-s3alias", "--ol-s3", ".mrap", "--x-s3")):
        problem = "S3 reserves the prefixes xn-- and sthree- and the suffixes -s3alias, --ol-s3, .mrap and --x-s3"
    if problem:
        raise VolumeError(f"invalid S3 bucket name {bucket!r} in {url!r}: {problem}")
    return bucket


def local_path_of_file_url(url: str) -> str:
    """The path of a ``file://`` URL: ``file:///p`` and ``file://localhost/p`` are ``/p``.

    Raises:
        VolumeError: another host (a file URL cannot reach another machine).
    """
    rest = url[len("file://") :]
    if rest.startswith("/"):
        return rest
    host, sep, path = rest.partition("/")
    if host.lower() == "localhost":
        return "/" + path
    raise VolumeError(f"file URL {url!r} names the host {host!r}; use file:///path or a plain path")


__all__ = ["canonical_key_path", "check_bucket_name", "local_path_of_file_url", "require_location"]
