"""The one retry loop (uc_checkpoint.volumes.retry): attempts, delays doubling up to their cap,
full jitter within its bounds, and errors it does not retry raised at once."""

from __future__ import annotations

import random

import pytest

from uc_checkpoint.errors import TransferError, VolumeError
from uc_checkpoint.volumes.retry import retry


class Flaky:
    """Fails with ``errors`` one after the other, then returns ``"ok"``."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def test_returns_once_an_attempt_succeeds_sleeping_the_doubling_delays() -> None:
    slept: list[float] = []
    seen: list[tuple[int, float, str]] = []
    fn = Flaky(TransferError("a"), TransferError("b"), TransferError("c"))
    got = retry(
        fn,
        attempts=5,
        retry_on=TransferError,
        backoff_s=1.0,
        max_backoff_s=10.0,
        on_retry=lambda n, delay, exc: seen.append((n, delay, str(exc))),
        sleep=slept.append,
    )
    assert got == "ok" and fn.calls == 4
    assert slept == [1.0, 2.0, 4.0]
    assert seen == [(1, 1.0, "a"), (2, 2.0, "b"), (3, 4.0, "c")]


def test_the_delay_stops_doubling_at_its_cap_and_the_last_error_is_raised_as_it_is() -> None:
    slept: list[float] = []
    last = TransferError("last")
    fn = Flaky(*[TransferError(str(n)) for n in range(6)], last)
    with pytest.raises(TransferError) as raised:
        retry(fn, attempts=7, retry_on=TransferError, backoff_s=1.5, max_backoff_s=10.0, sleep=slept.append)
    assert raised.value is last and fn.calls == 7
    assert slept == [1.5, 3.0, 6.0, 10.0, 10.0, 10.0]  # no delay after the last attempt


def test_full_jitter_draws_each_delay_between_zero_and_its_cap() -> None:
    draws: list[tuple[float, float]] = []
    rng = random.Random(7)

    def uniform(a: float, b: float) -> float:
        draws.append((a, b))
        return rng.uniform(a, b)

    slept: list[float] = []
    fn = Flaky(*[ConnectionError(str(n)) for n in range(9)])
    with pytest.raises(ConnectionError, match="^8$"):
        retry(
            fn,
            attempts=9,
            retry_on=(ConnectionError, TimeoutError),
            backoff_s=0.2,
            max_backoff_s=20.0,
            jitter=True,
            sleep=slept.append,
            uniform=uniform,
        )
    caps = [min(20.0, 0.1 * 2**n) for n in range(1, 9)]  # S3Volume's GET: 0.2 s, 0.4 s, ... 20 s
    assert draws == [(0, cap) for cap in caps]
    assert len(slept) == 8 and all(0 <= s <= cap for s, cap in zip(slept, caps, strict=True))
    same_seed = random.Random(7)
    assert slept == [same_seed.uniform(0, cap) for cap in caps]  # the injected draws, as drawn


def test_errors_not_retried_are_raised_at_once() -> None:
    slept: list[float] = []
    fn = Flaky(TransferError("flaky"), VolumeError("no bucket"))
    with pytest.raises(VolumeError, match="no bucket"):
        retry(fn, attempts=5, retry_on=TransferError, backoff_s=1.0, sleep=slept.append)
    assert fn.calls == 2 and slept == [1.0]


def test_no_delay_retries_without_sleeping() -> None:
    def never(delay: float) -> None:
        raise AssertionError(f"slept {delay} s")

    fn = Flaky(KeyError("gone"), FileNotFoundError("gone"))
    assert retry(fn, attempts=3, retry_on=(FileNotFoundError, KeyError), sleep=never) == "ok"
    assert fn.calls == 3


def test_one_attempt_is_no_retry_and_fewer_are_refused() -> None:
    fn = Flaky(TransferError("once"))
    with pytest.raises(TransferError, match="once"):
        retry(fn, attempts=1, retry_on=TransferError, backoff_s=1.0, sleep=lambda s: None)
    assert fn.calls == 1
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        retry(fn, attempts=0, retry_on=TransferError)
