"""The CPU snapshot async_save takes (uc_checkpoint.dcp.stager, its copy threads in dcp.parallel_copy, and
UCVolumeWriter.stage)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.stager import UnsupportedSnapshot, cpu_snapshot


@dataclass
class Progress:
    seen: list[int]


def test_snapshot_copies_each_tensor_once_and_keeps_the_structure() -> None:
    tied = torch.randn(8, 4)
    param = torch.nn.Parameter(torch.randn(3, 5))
    sd = {
        "emb": tied,
        "head": tied,  # tied weights: one copy, referenced twice
        "t": torch.arange(20.0).reshape(4, 5).t(),  # not contiguous
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "bf16": torch.randn(6).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "param": param,
        "grad": torch.randn(4, requires_grad=True),  # a plain tensor in autograd: no history staged
        "slice": torch.arange(1000.0)[10:20],  # a view into a larger storage
        "nested": {"list": [torch.ones(2), 1, "x", None], "tuple": (torch.zeros(3), 2.5)},
        "blob": io.BytesIO(b"abc"),
        "progress": Progress([1, 2]),
    }
    snap = cpu_snapshot(sd)

    assert snap.keys() == sd.keys()
    assert snap["emb"] is snap["head"]
    assert isinstance(snap["nested"]["tuple"], tuple) and isinstance(snap["nested"]["list"], list)
    assert snap["nested"]["list"][1:] == [1, "x", None]
    for key in ("emb", "t", "scalar", "empty", "bf16", "mask", "param", "grad", "slice"):
        src, out = sd[key], snap[key]
        assert type(out) is torch.Tensor and out.dtype == src.dtype and out.shape == src.shape, key
        assert torch.equal(out, src.detach()), key
        assert out.is_contiguous() and not out.requires_grad, key
        assert out.numel() == 0 or out.data_ptr() != src.data_ptr(), key
        assert out.grad_fn is None and out.untyped_storage().nbytes() == out.nbytes, key  # compact, detached
    assert snap["blob"] is not sd["blob"] and snap["blob"].getvalue() == b"abc"
    assert snap["progress"] is not sd["progress"] and snap["progress"] == Progress([1, 2])

    # Training goes on: changing the originals must not reach the snapshot.
    expected = {k: sd[k].detach().clone() for k in ("emb", "t", "param")}
    with torch.no_grad():
        tied.add_(1)
        sd["t"].mul_(-1)
        param.zero_()
    sd["blob"].write(b"zzz")
    sd["progress"].seen.append(3)
    for key, value in expected.items():
        assert torch.equal(snap[key], value), key
    assert snap["blob"].getvalue() == b"abc" and snap["progress"].seen == [1, 2]


def test_snapshot_copies_a_tensor_once_across_nesting_and_dict_kinds() -> None:
    from collections import OrderedDict

    shared = torch.randn(16)
    sd = {
        "model": OrderedDict([("b", shared), ("a", torch.ones(3))]),  # a module's state_dict()
        "optim": {"state": {0: {"exp_avg": shared}}, "groups": [shared]},
    }
    snap = cpu_snapshot(sd)

    assert type(snap["model"]) is dict and list(snap["model"]) == ["b", "a"]  # order kept
    copy = snap["model"]["b"]
    assert snap["optim"]["state"][0]["exp_avg"] is copy and snap["optim"]["groups"][0] is copy
    assert copy.data_ptr() != shared.data_ptr() and torch.equal(copy, shared)


def test_snapshot_keeps_a_dtensors_layout(single_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(16, 4)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    snap = cpu_snapshot({"w": dt})["w"]
    assert type(snap) is DTensor
    assert snap.placements == dt.placements and snap.device_mesh == dt.device_mesh
    assert snap.shape == dt.shape and snap.stride() == dt.stride()
    assert snap.to_local().data_ptr() != dt.to_local().data_ptr()
    assert torch.equal(snap.full_tensor(), full)


def test_sharded_tensor_is_left_to_dcps_stager(single_rank_group: None, tmp_path: Path) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor, empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    st = empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 8, 4)
    st.local_shards()[0].tensor.copy_(torch.arange(32.0).reshape(8, 4))
    with pytest.raises(UnsupportedSnapshot, match="ShardedTensor"):
        cpu_snapshot({"st": st})
    with pytest.raises(UnsupportedSnapshot, match="sparse"):
        cpu_snapshot({"s": torch.eye(3).to_sparse()})
    staged = UCVolumeWriter(tmp_path / "ckpt").stage({"st": st, "x": torch.ones(2)})
    assert isinstance(staged["st"], ShardedTensor)
    assert torch.equal(staged["st"].local_shards()[0].tensor, torch.arange(32.0).reshape(8, 4))
    assert torch.equal(staged["x"], torch.ones(2))


def test_async_save_keeps_the_values_of_the_moment_it_returned(single_rank_group: None, tmp_path: Path) -> None:
    """The snapshot is what gets saved: in-place updates right after async_save returns (the next
    optimizer step) must not reach the checkpoint, for plain tensors and DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sd = {"model": {"w": distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)]), "b": torch.randn(32)}, "step": 7}
    expected = {"w": sd["model"]["w"].full_tensor().clone(), "b": sd["model"]["b"].clone()}
    fut = dcp.async_save(sd, storage_writer=UCVolumeWriter(tmp_path / "ckpt"))
    with torch.no_grad():
        sd["model"]["w"].mul_(0)
        sd["model"]["b"].add_(100)
    sd["step"] = 8
    fut.result(timeout=120)

    target = {"model": {"w": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)]), "b": torch.zeros(32)}, "step": 0}
    dcp.load(target, storage_reader=UCVolumeReader(tmp_path / "ckpt"))
    assert torch.equal(target["model"]["w"].full_tensor(), expected["w"])
    assert torch.equal(target["model"]["b"], expected["b"])
    assert target["step"] == 7


@pytest.fixture
def two_torch_threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_big_tensors_are_copied_on_threads_of_our_own_without_openmp(
    two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With OpenMP, torch's pool threads spin on their cores for milliseconds after a parallel copy,
    # delaying the thread async_save starts next: the big copies run on our threads, OpenMP off.
    import threading

    from uc_checkpoint.dcp import parallel_copy

    if parallel_copy._openmp() is None:
        pytest.skip("torch here does not run on an OpenMP runtime we can set per thread")
    seen: list[tuple[int, int, int]] = []
    real = parallel_copy._copy_piece

    def recording(piece: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        nbytes = sum(src.numel() * src.element_size() for src, _ in piece)
        seen.append((threading.get_ident(), torch.get_num_threads(), nbytes))
        real(piece)

    monkeypatch.setattr(parallel_copy, "_copy_piece", recording)
    started: list[object] = []
    real_start = parallel_copy._thread.start_new_thread

    class _Threads:
        @staticmethod
        def start_new_thread(fn: Any, args: tuple[Any, ...]) -> int:
            started.append(fn)
            return real_start(fn, args)

    monkeypatch.setattr(parallel_copy, "_thread", _Threads)
    big = torch.nn.Parameter(torch.randn(3 << 20))  # 12 MiB: cut into 2 MiB pieces
    sd = {
        "big": big,
        "mid": torch.arange(1 << 20, dtype=torch.int64),  # 8 MiB
        "half": torch.randn(1 << 20).half(),
        "tied": big,
        "small": torch.randn(100),  # under ATen's grain: cloned in the walk
        "strided": torch.randn(2048, 64).t(),  # not contiguous: cloned in the walk
        "nested": {"m": torch.randn(256, 1024)},
    }
    snap = cpu_snapshot(sd)
    assert snap["tied"] is snap["big"]
    for key in ("big", "mid", "half", "small", "strided"):
        assert torch.equal(snap[key], sd[key].detach()) and snap[key].data_ptr() != sd[key].data_ptr(), key
        assert type(snap[key]) is torch.Tensor and not snap[key].requires_grad and snap[key].grad_fn is None, key
        assert snap[key].is_contiguous(), key
    assert torch.equal(snap["nested"]["m"], sd["nested"]["m"])
    assert {threads for _, threads, _ in seen} == {1}  # no OpenMP team on any copying thread
    assert len(started) == 1  # the calling thread and one helper (torch's 2 threads)
    assert len({ident for ident, _, _ in seen}) <= 2
    assert sum(n for _, _, n in seen) == (12 + 8 + 2 + 1) << 20  # each big tensor once, tied once
    assert max(n for _, _, n in seen) <= parallel_copy._COPY_PIECE_BYTES
    assert torch.get_num_threads() == 2  # the caller's OpenMP setting is back


def test_a_failed_copy_is_raised_on_the_caller_and_every_helper_ends(
    two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from uc_checkpoint.dcp import parallel_copy

    if parallel_copy._openmp() is None:
        pytest.skip("torch here does not run on an OpenMP runtime we can set per thread")
    caller = threading.get_ident()
    helper_started = threading.Event()

    def failing_on_a_helper(piece: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if threading.get_ident() != caller:
            helper_started.set()
            raise MemoryError("no memory for the copy")
        # On a loaded machine the caller could copy every piece before the helper runs; it waits
        # for the helper's first piece (the helper must fail, not just exist).
        assert helper_started.wait(10), "no helper ever took a piece"
        for src, dst in piece:
            dst.copy_(src)

    monkeypatch.setattr(parallel_copy, "_copy_piece", failing_on_a_helper)
    with pytest.raises(MemoryError, match="no memory for the copy"):
        cpu_snapshot({"a": torch.randn(4 << 20), "b": torch.randn(4 << 20)})
    assert torch.get_num_threads() == 2


def test_without_an_openmp_runtime_to_set_torch_copies_as_before(
    two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uc_checkpoint.dcp import parallel_copy

    monkeypatch.setattr(parallel_copy, "_openmp", lambda: None)
    monkeypatch.setattr(parallel_copy, "_copy_piece", lambda piece: pytest.fail("no piece is ours to copy"))
    sd = {"a": torch.randn(3 << 20), "b": torch.nn.Parameter(torch.randn(1 << 20))}
    snap = cpu_snapshot(sd)
    assert torch.equal(snap["a"], sd["a"]) and torch.equal(snap["b"], sd["b"].detach())


def test_pieces_cover_every_element_once_biggest_first() -> None:
    from uc_checkpoint.dcp.parallel_copy import _pieces

    pairs = [
        (torch.arange(n, dtype=dt), torch.zeros(n, dtype=dt))
        for n, dt in ((5, torch.int64), (37, torch.float32), (3, torch.uint8))
    ]
    pieces = _pieces(pairs, 16)  # bytes: 40, 148 and 3 -> pieces of at most 16 bytes
    assert all(sum(src.numel() * src.element_size() for src, _ in piece) <= 16 for piece in pieces)
    assert pieces[0][0][0].dtype == torch.float32  # the biggest tensor's pieces first
    for piece in pieces:
        for src, dst in piece:
            dst.copy_(src)
    for src, dst in pairs:
        assert torch.equal(src, dst)
    assert sum(src.numel() for piece in pieces for src, _ in piece) == 5 + 37 + 3
    # tensors under the size go together: one call for many small ones
    small = [(torch.ones(4), torch.zeros(4)) for _ in range(6)]  # 16 bytes each
    assert [len(piece) for piece in _pieces(small, 40)] == [2, 2, 2]


def test_a_helper_that_cannot_start_leaves_its_share_to_the_caller(
    two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uc_checkpoint.dcp import parallel_copy

    if parallel_copy._openmp() is None:
        pytest.skip("torch here does not run on an OpenMP runtime we can set per thread")

    class _NoThreads:
        @staticmethod
        def start_new_thread(fn: Any, args: tuple[Any, ...]) -> int:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(parallel_copy, "_thread", _NoThreads)
    sd = {"a": torch.randn(4 << 20), "b": torch.randn(4 << 20)}
    snap = cpu_snapshot(sd)  # returns (no wait on a helper that never ran), every byte copied
    assert torch.equal(snap["a"], sd["a"]) and torch.equal(snap["b"], sd["b"])
