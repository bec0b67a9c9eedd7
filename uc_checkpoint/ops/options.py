"""The checks of :class:`~uc_checkpoint.ops.manager.CheckpointManager`'s own arguments (their
meanings are documented there). The writer's, reader's and staging settings are checked where
they are declared, in :mod:`uc_checkpoint.dcp.options`.
"""

from __future__ import annotations

import math
import numbers
import os
from datetime import timedelta

from uc_checkpoint.dcp.options import ReaderOptions, Staging, WriterOptions
from uc_checkpoint.volumes import Volume


def check_manager_arguments(
    root: object,
    *,
    keep_last: int | None,
    keep_every: int | None,
    list_attempts: int,
    staging: object,
    writer: object,
    reader: object,
) -> None:
    """The checks of :class:`~uc_checkpoint.ops.manager.CheckpointManager`'s own arguments (the
    meanings are documented there).

    Raises:
        TypeError: ``root`` is not a path, URL or Volume, a count is not an int, or ``staging``,
            ``writer`` or ``reader`` is not a :class:`Staging`, :class:`WriterOptions` or
            :class:`ReaderOptions` (or None).
        ValueError: a value out of range (each message names it).
    """
    if not isinstance(root, (str, os.PathLike, Volume)):
        raise TypeError(f"root must be a path, URL or Volume, got {type(root).__name__}")
    for arg, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{arg} must be an int or None, got {type(value).__name__}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    for arg, given, cls in (
        ("staging", staging, Staging),
        ("writer", writer, WriterOptions),
        ("reader", reader, ReaderOptions),
    ):
        if given is not None and not isinstance(given, cls):
            raise TypeError(
                f"{arg} must be a uc_checkpoint.{cls.__name__} or None, got {type(given).__name__}"
                + (f" (pass {cls.__name__}(**options) for a dict)" if isinstance(given, dict) else "")
            )
    if list_attempts < 1:
        raise ValueError(f"list_attempts must be >= 1, got {list_attempts}")


def check_timeout(timeout: object) -> timedelta | None:
    """``CheckpointManager(timeout=...)`` as a ``timedelta``: seconds (an int or float) or a
    ``timedelta``, finite and > 0; None stays None (the process group's timeout applies).

    Raises:
        TypeError: ``timeout`` is neither (a bool is not a number of seconds).
        ValueError: it is under a millisecond (zero, negative), NaN, infinite or past
            ``timedelta``'s range.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (a number) or a datetime.timedelta, got {type(timeout).__name__}")
    # gloo and the c10d store count in milliseconds: less than one would be no wait at all.
    if not math.isfinite(seconds) or seconds < 0.001:
        raise ValueError(f"timeout must be a finite number of seconds, at least 0.001, got {timeout!r}")
    try:
        return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(
            f"timeout must be at most {timedelta.max.total_seconds():g} seconds, got {timeout!r}"
        ) from None


__all__ = ["check_manager_arguments", "check_timeout"]
