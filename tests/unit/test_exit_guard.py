"""The exit guard's view of a save in flight (uc_checkpoint.dcp.exit_guard), without DCP: a ticket
is over once the save's call has left DCP's ``save`` (stood in for by a function of this file), also
when no hook of ours ended it, and nothing reads another thread's stack to tell (walking a running
thread's frames can crash CPython 3.11)."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from uc_checkpoint.dcp import compat as dcp_compat
from uc_checkpoint.dcp import exit_guard

#: The file name of the stand-in for DCP's ``state_dict_saver`` (only ``save`` comes from it, as
#: only DCP's save frames come from DCP's file).
SAVER = "<dcp save stand-in>"
_STAND_IN = """
def save(bind, inside, leave):
    staged = bytearray(1 << 20)  # a local the finished frame must let go of
    bind()
    inside.set()
    leave.wait(30)
    del staged
    raise RuntimeError("another rank failed")
"""
_namespace: dict[str, Any] = {}
exec(compile(_STAND_IN, SAVER, "exec"), _namespace)
#: Plays DCP's ``save(bind, inside, leave)``: our hook (``bind``) runs inside it; it then raises
#: without ending the ticket, as DCP does when another rank fails between our hooks.
_dcp_save_stand_in: Callable[[Callable[[], None], threading.Event, threading.Event], None] = _namespace["save"]


@pytest.fixture
def stand_in_is_dcps_saver(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(dcp_compat, "dcp_saver_file", lambda: SAVER)

    def refuse(*args: Any) -> Any:
        raise AssertionError("the exit guard read another thread's stack")

    monkeypatch.setattr(sys, "_current_frames", refuse)
    yield


def test_a_ticket_is_over_once_its_thread_has_left_dcps_save(stand_in_is_dcps_saver: None) -> None:
    ticket = exit_guard.SaveTicket("ckpt")
    inside, leave, moved_on, done = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def thread_body() -> None:
        try:
            _dcp_save_stand_in(ticket.bind, inside, leave)
        except RuntimeError:
            pass
        moved_on.set()
        done.wait(30)  # the thread lives on, doing other work

    thread = threading.Thread(target=thread_body)
    thread.start()
    try:
        assert inside.wait(30)
        assert not ticket.over()  # inside the save: the exit must wait
        assert not ticket.over()  # asking does not change the answer
        leave.set()
        assert moved_on.wait(30)
        assert thread.is_alive()
        assert ticket.over()  # left the save, never ended: over all the same
        assert ticket._frame is None  # the frame (and the state it held) is let go
    finally:
        leave.set()
        done.set()
        thread.join(30)


def test_an_ended_ticket_is_over_and_holds_no_frame(stand_in_is_dcps_saver: None) -> None:
    ticket = exit_guard.SaveTicket("ckpt")
    inside, leave = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: _call_ignoring(ticket, inside, leave))
    thread.start()
    try:
        assert inside.wait(30)
        assert ticket._frame is not None
        ticket.end()
        assert ticket.over() and ticket._frame is None
    finally:
        leave.set()
        thread.join(30)


def _call_ignoring(ticket: exit_guard.SaveTicket, inside: threading.Event, leave: threading.Event) -> None:
    try:
        _dcp_save_stand_in(ticket.bind, inside, leave)
    except RuntimeError:
        pass


def test_a_ticket_bound_outside_dcps_save_does_not_hold_the_exit() -> None:
    # No frame of DCP's save on the binding thread (hooks called directly): nothing to wait for.
    ticket = exit_guard.SaveTicket("ckpt")
    started, release = threading.Event(), threading.Event()

    def body() -> None:
        ticket.bind()
        started.set()
        release.wait(30)

    thread = threading.Thread(target=body)
    thread.start()
    try:
        assert started.wait(30)
        assert ticket.over()
    finally:
        release.set()
        thread.join(30)


def test_dcps_async_save_threads_are_found_by_name(stand_in_is_dcps_saver: None) -> None:
    release = threading.Event()
    worker = threading.Thread(target=release.wait, args=(30,), name=f"{dcp_compat.DCP_ASYNC_THREAD_PREFIX}_0")
    other = threading.Thread(target=release.wait, args=(30,), name="not-a-save")
    worker.start()
    other.start()
    try:
        assert exit_guard._dcp_async_saves() == [worker]
    finally:
        release.set()
        worker.join(30)
        other.join(30)
    assert exit_guard._dcp_async_saves() == []


def test_many_threads_opening_tickets_while_others_save(stand_in_is_dcps_saver: None) -> None:
    # The guard prunes old tickets on every open: with saves running in several threads this once
    # walked their stacks and crashed. Now it asks each ticket's frame object only.
    errors: list[BaseException] = []

    def saver(i: int) -> None:
        try:
            for _ in range(200):
                inside, leave = threading.Event(), threading.Event()
                leave.set()
                ticket = exit_guard.open_ticket(f"ckpt-{i}")
                try:
                    _dcp_save_stand_in(ticket.bind, inside, leave)
                except RuntimeError:
                    pass
                if i % 2:
                    ticket.end()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=saver, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    gc.collect()
    left = [t for t in exit_guard._GUARD._tickets if t.what.startswith("ckpt-") and not t.over()]
    assert not left


def test_a_real_save_dcp_fails_between_our_hooks_is_over_once_dcp_returns(tmp_path: Any) -> None:
    # DCP raises out of save() after our set_up_storage_writer and before any hook that would end
    # the ticket (here the planner's global step fails, as when another rank's plan fails): the
    # save's thread goes on living, and the exit must not wait for it.
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from uc_checkpoint import UCVolumeWriter

    inside, proceed = threading.Event(), threading.Event()

    class FailingGlobalPlan(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            inside.set()
            proceed.wait(30)
            raise RuntimeError("another rank's plan failed")

    seen: list[exit_guard.SaveTicket] = []
    real_open = exit_guard.open_ticket

    def recording_open(what: str, *, background: bool = False) -> exit_guard.SaveTicket:
        ticket = real_open(what, background=background)
        seen.append(ticket)
        return ticket

    failed, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            dcp.save(
                {"w": torch.ones(8)},
                storage_writer=UCVolumeWriter(tmp_path / "ckpt"),
                planner=FailingGlobalPlan(),
                no_dist=True,
            )
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)
        failed.set()
        release.wait(30)

    exit_guard.open_ticket = recording_open  # type: ignore[assignment]
    thread = threading.Thread(target=body)
    try:
        thread.start()
        assert inside.wait(60)
        assert len(seen) == 1
        ticket = seen[0]
        assert not ticket.over()  # inside DCP's save: an exit now must wait for it
        proceed.set()
        assert failed.wait(60)
    finally:
        proceed.set()
        exit_guard.open_ticket = real_open  # type: ignore[assignment]
    try:
        assert errors and "another rank's plan failed" in str(errors[0])
        assert thread.is_alive()
        assert not ticket._ended.is_set()  # no hook of ours ended it
        assert ticket._frame is not None  # DCP's save frame (and the state in it) is held until asked
        exit_guard.prune()  # as the next snapshot does before taking its copy
        assert ticket._frame is None
        assert ticket.over()  # DCP's save has returned on that thread
    finally:
        release.set()
        thread.join(30)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_save_dcp_stops_between_our_hooks_is_logged_when_in_the_background(
    mode: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # An async save whose future nobody reads must not fail without a word; a synchronous one
    # raised into its caller, which is word enough.
    import logging

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from uc_checkpoint import UCVolumeWriter

    class FailingGlobalPlan(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            raise RuntimeError("another rank's plan failed")

    where = tmp_path / f"ckpt-{mode}"
    state, writer = {"w": torch.ones(8)}, UCVolumeWriter(where)
    with caplog.at_level(logging.ERROR, logger="uc_checkpoint.dcp.exit_guard"):
        if mode == "async":
            fut = dcp.async_save(state, storage_writer=writer, planner=FailingGlobalPlan(), no_dist=True)
            with pytest.raises(BaseException, match="another rank's plan failed"):
                fut.result(timeout=60)
        else:
            with pytest.raises(BaseException, match="another rank's plan failed"):
                dcp.save(state, storage_writer=writer, planner=FailingGlobalPlan(), no_dist=True)
        exit_guard.prune()  # what the next save's start (or the exit) does
    logged = [r.getMessage() for r in caplog.records if r.name == exit_guard.__name__ and str(where) in r.getMessage()]
    if mode == "async":
        assert len(logged) == 1 and "failed in the background: DCP stopped it between the writer's steps" in logged[0]
    else:
        assert logged == []
    assert not (where / ".metadata").exists()
