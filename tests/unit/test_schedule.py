"""The schedule behind ``CheckpointManager.should_save`` (uc_checkpoint.ops.schedule) in one process,
with a clock the test advances. Its decisions across real ranks: tests/integration/test_interval_multirank.py."""

from __future__ import annotations

import pytest

from uc_checkpoint.ops.interval import BlockedFraction, EverySeconds, EverySteps
from uc_checkpoint.ops.ranks import RankGroup
from uc_checkpoint.ops.schedule import PROBE_STEPS, SaveSchedule


class Clock:
    """Seconds that the test advances (rank 0's step timing)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_loop(schedule: SaveSchedule, clock: Clock, steps: range, step_s: float, save_s: float) -> list[int]:
    saved = []
    for step in steps:
        clock.now += step_s
        if schedule.should_save(step):
            clock.now += save_s
            schedule.saved(step, save_s)
            saved.append(step)
    return saved


def test_schedule_every_steps_in_one_process() -> None:
    schedule = SaveSchedule(EverySteps(10), RankGroup(None, name="memory://root"))
    assert run_loop(schedule, Clock(), range(1, 45), 1.0, 0.0) == [10, 20, 30, 40]


def test_schedule_every_seconds_times_steps_first() -> None:
    clock = Clock()
    schedule = SaveSchedule(EverySeconds(20.0), RankGroup(None, name="memory://root"), clock=clock)
    # Steps of 2 s: the first decision times PROBE_STEPS steps, then 10 steps after the step before
    # the first; every save is 10 steps after the last, the save's own time not counted.
    saved = run_loop(schedule, clock, range(0, 50), 2.0, 7.0)
    assert saved == [9, 19, 29, 39, 49] and PROBE_STEPS < 9


def test_schedule_blocked_fraction_adapts_to_the_save_cost() -> None:
    clock = Clock()
    schedule = SaveSchedule(BlockedFraction(0.2), RankGroup(None, name="memory://root"), clock=clock)
    # 1 s steps, 4 s saves: 16 s of training between saves (4 / (4 + 16) = 0.2).
    saved = run_loop(schedule, clock, range(0, 60), 1.0, 4.0)
    assert saved == [PROBE_STEPS + 1 + 16 * k for k in range(4)] == [6, 22, 38, 54]


def test_schedule_stays_true_until_a_save_and_restarts_after_a_load() -> None:
    schedule = SaveSchedule(EverySteps(5), RankGroup(None, name="memory://root"))
    assert [schedule.should_save(s) for s in (4, 5, 6)] == [False, True, True]
    schedule.saved(6, 0.1)
    assert schedule.should_save(7) is False and schedule.should_save(10) is True
    schedule.restart()  # loaded step 3 again
    assert [s for s in range(4, 12) if schedule.should_save(s)] == [5, 6, 7, 8, 9, 10, 11]


def test_schedule_refuses_bad_steps_and_policies() -> None:
    with pytest.raises(TypeError, match="save_interval"):
        SaveSchedule(100, RankGroup(None))  # type: ignore[arg-type]
    schedule = SaveSchedule(EverySteps(5), RankGroup(None, name="memory://root"))
    with pytest.raises(ValueError, match="step"):
        schedule.should_save(-1)
    with pytest.raises(TypeError, match="step"):
        schedule.should_save(1.5)  # type: ignore[arg-type]
