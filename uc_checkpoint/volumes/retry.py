"""One retry loop for the package's own retries (botocore retries each S3 request itself).

:func:`retry` calls a function until it returns, an error it does not retry is raised, or the
attempts run out. Its callers: the manager's store requests (``TransferError``, the delay doubling
up to 10 s), a GET whose body was cut off (:class:`~uc_checkpoint.volumes.s3.S3Volume`, full
jitter), and a listing an entry vanished from (:class:`~uc_checkpoint.volumes.fsspec_volume.FsspecVolume`,
no delay). Each caller words its own log lines and errors.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def retry(
    fn: Callable[[], T],
    *,
    attempts: int,
    retry_on: type[BaseException] | tuple[type[BaseException], ...],
    backoff_s: float = 0.0,
    max_backoff_s: float = float("inf"),
    jitter: bool = False,
    on_retry: Callable[[int, float, BaseException], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    uniform: Callable[[float, float], float] | None = None,
) -> T:
    """``fn()``, called again when it raises one of ``retry_on``, ``attempts`` calls in all.

    The first delay is ``backoff_s`` seconds and each later one twice the one before, at most
    ``max_backoff_s``: before the retry after attempt ``n`` (counted from 1),
    ``min(max_backoff_s, backoff_s * 2 ** (n - 1))`` for ``n > 1``. A delay of 0 retries at once.
    With ``jitter`` each delay is drawn uniformly from ``[0, that]`` instead ("full jitter", as
    botocore's standard mode draws its delays).

    Args:
        fn: the attempt; its result is returned.
        attempts: calls of ``fn`` at most, the first included (>= 1).
        retry_on: the exception classes that are retried (subclasses included).
        backoff_s: the first delay, in seconds (>= 0).
        max_backoff_s: the longest delay the doubling reaches, in seconds.
        jitter: draw each delay uniformly between 0 and its value.
        on_retry: called as ``on_retry(attempt, delay_s, error)`` before each delay (to log it,
            count it); not called after the last attempt.
        sleep: waits ``delay_s`` seconds (default ``time.sleep``; not called for a delay of 0).
        uniform: ``uniform(a, b)`` draws a jittered delay (default :func:`random.uniform`).

    Raises:
        ValueError: ``attempts`` is below 1.
        The last attempt's error, as it was raised, when every attempt failed with one of
        ``retry_on``; any other error of ``fn`` at once (``fn`` is not called again).
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    delay = backoff_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except retry_on as exc:
            if attempt == attempts:
                raise
            wait = (uniform or random.uniform)(0, delay) if jitter else delay
            if on_retry is not None:
                on_retry(attempt, wait, exc)
            if wait > 0:
                sleep(wait)
            delay = min(2 * delay, max_backoff_s)
    raise AssertionError("unreachable")


__all__ = ["retry"]
