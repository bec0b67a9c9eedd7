"""ProcessLocal (uc_checkpoint.volumes.process_local): one value per process, built once under
racing threads, built again in a forked child, never pickled or deep-copied."""

from __future__ import annotations

import copy
import os
import pickle
import threading

import pytest

from uc_checkpoint.volumes.process_local import ProcessLocal


class Built:
    """A value that records the process that built it."""

    def __init__(self) -> None:
        self.pid = os.getpid()


def test_built_once_on_first_use_and_kept() -> None:
    local: ProcessLocal[Built] = ProcessLocal()
    assert local.peek() is None
    first = local.get(Built)
    assert local.get(Built) is first and local.peek() is first and first.pid == os.getpid()


def test_a_failed_build_passes_and_the_next_get_tries_again() -> None:
    local: ProcessLocal[Built] = ProcessLocal()

    def broken() -> Built:
        raise OSError("no client today")

    with pytest.raises(OSError, match="no client today"):
        local.get(broken)
    assert local.peek() is None and isinstance(local.get(Built), Built)


def test_racing_threads_build_once() -> None:
    local: ProcessLocal[Built] = ProcessLocal()
    builds: list[Built] = []
    start = threading.Barrier(8)

    def build() -> Built:
        builds.append(Built())
        return builds[-1]

    got: list[Built] = []

    def worker() -> None:
        start.wait()
        got.append(local.get(build))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and all(g is builds[0] for g in got)


def test_take_forgets_the_value_for_closing() -> None:
    local: ProcessLocal[Built] = ProcessLocal()
    assert local.take() is None
    first = local.get(Built)
    assert local.take() is first and local.peek() is None
    assert local.get(Built) is not first


@pytest.mark.parametrize("clone", [lambda v: pickle.loads(pickle.dumps(v)), copy.deepcopy], ids=["pickle", "deepcopy"])
def test_a_copy_is_empty_and_builds_its_own(clone) -> None:  # type: ignore[no-untyped-def]
    local: ProcessLocal[Built] = ProcessLocal()
    built = local.get(Built)
    holder = {"local": local, "other": 3}
    copied = clone(holder)
    assert copied["other"] == 3 and copied["local"].peek() is None
    assert copied["local"].get(Built) is not built
    assert local.peek() is built  # the original keeps its own


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_builds_its_own_even_with_the_parents_lock_held() -> None:
    local: ProcessLocal[Built] = ProcessLocal()
    parents = local.get(Built)
    read, write = os.pipe()
    lock = local._locks[os.getpid()]
    with lock:  # as while another thread of the parent builds at the fork
        pid = os.fork()
        if pid == 0:  # the child: exits with 0 only if every check holds
            ok = False
            try:
                ok = local.peek() is None and local.take() is None
                child = local.get(Built)
                ok = ok and child is not parents and child.pid == os.getpid() and local.get(Built) is child
            finally:
                os.write(write, b"1" if ok else b"0")
                os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1", "the forked child shared its parent's value or waited on its lock"
    assert local.peek() is parents
