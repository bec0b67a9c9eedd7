"""Retention as a pure function (uc_checkpoint.ops.retention.steps_to_delete), over tables of cases,
and the manager deleting exactly what it names."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.lineage import retention_plan
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.retention import steps_to_delete


@pytest.mark.parametrize(
    ("published", "keep_last", "keep_every", "protect", "abandoned", "deleted"),
    [
        # keep_last alone
        ([1, 2, 3], 2, None, (), (), [1]),
        ([1, 2, 3], None, None, (), (), []),  # None keeps everything
        ([1, 2, 3], 3, None, (), (), []),
        ([1, 2, 3], 5, None, (), (), []),
        ([], 1, None, (), (), []),
        ([3, 1, 2], 1, None, (), (), [1, 2]),  # any input order, oldest first out
        # keep_every keeps multiples, never pushes a newer one out
        ([1, 2, 3, 4], 1, 2, (), (), [1, 3]),
        ([10, 20, 30, 40, 50], 2, 20, (), (), [10, 30]),
        ([1, 2, 3], 1, 0, (), (), [1, 2]),  # 0: no keep_every rule
        # protect (the save just published, the one in flight)
        ([1, 2, 3], 1, None, (1,), (), [2]),
        ([1, 2, 3], 1, None, (1, 2), (), []),
        ([1, 2, 3], 1, None, (99,), (), [1, 2]),  # protecting an unknown step changes nothing
        # a rollback: abandoned steps rank below the current line, whatever their number
        ([100, 110, 200], 2, None, (), (200,), [200]),
        ([100, 110, 200, 300], 2, None, (), (200, 300), [200, 300]),
        ([100, 110, 200, 300], 3, None, (), (200, 300), [200]),
        ([100, 200], 1, None, (), (100, 200), [100]),  # all abandoned: step order among them
        ([100, 110, 200], 1, None, (200,), (200,), [100]),  # protect beats abandonment
        ([100, 110, 200], 1, 100, (), (200,), []),  # keep_every keeps multiples, abandoned or not
        ([100, 110, 150, 200], 1, None, (), (150, 200), [150, 200, 100]),
    ],
)
def test_steps_to_delete(published, keep_last, keep_every, protect, abandoned, deleted) -> None:
    got = steps_to_delete(published, keep_last=keep_last, keep_every=keep_every, protect=protect, abandoned=abandoned)
    assert got == deleted


def test_same_policy_as_lineage_retention_plan() -> None:
    """steps_to_delete is the policy lineage.retention_plan states over (step, abandoned) pairs:
    both agree on every small case."""
    rng = random.Random(15)
    cases = 0
    for n in range(6):
        for published in itertools.combinations(range(1, 9), n):
            abandoned = {s for s in published if rng.random() < 0.3}
            protect = {s for s in published if rng.random() < 0.2}
            for keep_last, keep_every in itertools.product((None, 1, 2, 4), (None, 2, 3)):
                pairs = [(s, s in abandoned) for s in published]
                want = retention_plan(pairs, keep_last=keep_last, keep_every=keep_every, protect=protect)
                got = steps_to_delete(
                    published, keep_last=keep_last, keep_every=keep_every, protect=protect, abandoned=abandoned
                )
                assert got == want, (published, abandoned, protect, keep_last, keep_every)
                cases += 1
    assert cases > 2000


def test_never_deletes_among_the_newest_kept() -> None:
    """Whatever the policy, a step deleted is older (in lineage order) than every one of the
    keep_last newest: nothing protected or newer is ever named."""
    rng = random.Random(7)
    for _ in range(500):
        published = rng.sample(range(1, 60), rng.randint(0, 12))
        abandoned = set(rng.sample(published, rng.randint(0, len(published))))
        protect = set(rng.sample(published, rng.randint(0, min(2, len(published)))))
        keep_last = rng.randint(1, 5)
        deleted = steps_to_delete(published, keep_last=keep_last, protect=protect, abandoned=abandoned)
        order = sorted(published, key=lambda s: (s not in abandoned, s))
        newest = set(order[len(order) - keep_last :]) if keep_last <= len(order) else set(order)
        assert not set(deleted) & (newest | protect), (published, abandoned, protect, keep_last, deleted)
        assert len(published) - len(deleted) >= min(keep_last, len(published))
        assert deleted == [s for s in order if s in set(deleted)]  # oldest first


def test_the_manager_deletes_what_the_policy_names(tmp_path: Path, staging: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "run"), keep_last=None, keep_every=None, staging=Staging(mode="sync"))
    for step in (1, 2, 3, 4, 5, 6):
        manager.save(step, {"w": torch.full((4,), float(step))})
    manager.keep_last, manager.keep_every = 2, 3
    want = steps_to_delete([1, 2, 3, 4, 5, 6], keep_last=2, keep_every=3)
    assert want == [1, 2, 4]
    assert manager.prune() == want
    assert [(i.step, i.published) for i in manager.list()] == [(3, True), (5, True), (6, True)]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "latest",
        "step_00000003",
        "step_00000005",
        "step_00000006",
    ]
