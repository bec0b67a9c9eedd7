"""One error policy: the same exception class on every rank for the same failure (the manager's
rank-0 operations, two real gloo ranks), ItemChecksumError inside the hierarchy, and the CLI telling
DCP's CheckpointException by its class, not its name."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import traceback
from pathlib import Path
from typing import Any

import pytest

from uc_checkpoint import cli, errors
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.errors import (
    CorruptCheckpointError,
    ItemChecksumError,
    LocationNotEmptyError,
    RemoteRankError,
    UCCheckpointError,
    VolumeError,
    portable_error,
    rebuild_error,
)


class _LocalCorrupt(CorruptCheckpointError):
    """A subclass of ours defined outside uc_checkpoint.errors (a plugin's, say)."""


class _ForeignError(Exception):
    """An exception outside our hierarchy (a third-party client's, say)."""


OURS = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, UCCheckpointError) and cls is not RemoteRankError
]


# ---------------------------------------------------------------------------- in one process


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_every_class_of_ours_is_rebuilt_as_itself(cls: type[Exception]) -> None:
    exc = cls(f"{cls.__name__} at s3://b/run/step_00000001/.metadata")
    portable = portable_error(exc)
    assert portable == (cls.__name__, str(exc))
    rebuilt = rebuild_error(*portable)  # type: ignore[misc]
    assert type(rebuilt) is cls and str(rebuilt) == str(exc)


def test_builtins_subclasses_and_foreign_errors() -> None:
    assert portable_error(ValueError("bad")) == ("ValueError", "bad")
    assert type(rebuild_error("FileNotFoundError", "gone")) is FileNotFoundError
    # A subclass of ours from elsewhere travels as the nearest class of ours.
    assert portable_error(_LocalCorrupt("torn")) == ("CorruptCheckpointError", "torn")
    # json's error is a ValueError: it travels as one.
    assert portable_error(json.JSONDecodeError("x", "doc", 0))[0] == "ValueError"  # type: ignore[index]
    # KeyError quotes its message: not rebuilt from one.
    assert portable_error(KeyError("k")) is None
    assert portable_error(_ForeignError("boom")) is None
    unknown = rebuild_error("NewerPeersError", "from a newer version")
    assert type(unknown) is RemoteRankError and unknown.original_type == "NewerPeersError"
    assert str(unknown) == "NewerPeersError: from a newer version"
    copy = pickle.loads(pickle.dumps(unknown))  # crosses processes inside DCP's failures
    assert type(copy) is RemoteRankError and copy.original_type == "NewerPeersError" and str(copy) == str(unknown)


def test_item_checksum_error_is_in_the_hierarchy() -> None:
    assert issubclass(ItemChecksumError, CorruptCheckpointError)
    assert issubclass(ItemChecksumError, ValueError)  # as before it moved


def _checkpoint_exception(inner: BaseException) -> BaseException:
    from torch.distributed.checkpoint import CheckpointException

    return CheckpointException("save failed", {0: (inner, None)})  # type: ignore[dict-item]


def test_cli_tells_dcp_failures_by_class(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    inner = CorruptCheckpointError("/ckpt/__0_0.distcp is truncated: 3 of 9 bytes")

    def failing(args: Any) -> int:
        raise _checkpoint_exception(inner)

    monkeypatch.setattr(cli, "_verify", failing)
    assert cli.main(["verify", "/ckpt"]) == 2
    assert capsys.readouterr().err == f"uc-checkpoint verify: error: {inner}\n"

    class CheckpointException(BaseException):  # the same name, not DCP's: no longer swallowed
        pass

    def impostor(args: Any) -> int:
        raise CheckpointException("not DCP's")

    monkeypatch.setattr(cli, "_verify", impostor)
    with pytest.raises(CheckpointException):
        cli.main(["verify", "/ckpt"])


# ---------------------------------------------------------------------------- two real ranks


def _raiser(exc: BaseException, rank: int) -> Any:
    def fn() -> Any:
        if rank != 0:
            raise AssertionError("a rank-0 operation ran on rank 1")
        raise exc

    return fn


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        return {"value": fn()}
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test compares
        cause = exc.__cause__
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "corrupt": isinstance(exc, CorruptCheckpointError),
            "volume": isinstance(exc, VolumeError),
            "value_error": isinstance(exc, ValueError),
            "original_type": getattr(exc, "original_type", None),
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
        }


def _rank_main(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    from uc_checkpoint.ops.manager import CheckpointManager
    from uc_checkpoint.volumes import LocalVolume

    class RefusingVolume(LocalVolume):
        """Its listings fail as a store error of a VolumeError subclass (only rank 0 lists)."""

        def _scan(self, *args: Any, **kwargs: Any) -> Any:  # the primitive every listing derives from
            raise LocationNotEmptyError(f"{self.url} holds files that are not part of a checkpoint")

    out: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
        manager = CheckpointManager(str(Path(tmp) / "run"), staging=Staging(mode="sync"))
        cases = {
            "corrupt": CorruptCheckpointError(f"{tmp}/run/step_00000001/.metadata cannot be decoded"),
            "not_empty": LocationNotEmptyError(f"{tmp}/run holds stray files"),
            "item_checksum": ItemChecksumError("tensor bytes fail their crc32: 0000abcd, recorded 0000dcba"),
            "value_error": ValueError("a bad value on rank 0"),
            "local_subclass": _LocalCorrupt("a plugin's corrupt error"),
            "foreign": _ForeignError("a third-party client's error"),
        }
        for name, exc in cases.items():
            out[name] = _outcome(lambda: manager._on_leader(f"run case {name}", _raiser(exc, rank)))  # noqa: B023
        out["ok"] = _outcome(lambda: manager._on_leader("agree", lambda: 42 if rank == 0 else 7))
        # The public methods, over the same policy.
        if rank == 0:
            Path(tmp, "a-file").write_text("not a directory")
        dist.barrier()
        out["file_root"] = _outcome(lambda: CheckpointManager(str(Path(tmp) / "a-file")).latest())
        refusing = RefusingVolume(str(Path(tmp) / "run"))
        out["refusing_list"] = _outcome(lambda: CheckpointManager(refusing).list())
        out["still_in_step"] = _outcome(manager.latest)  # no rank was left behind
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        out["crash"] = traceback.format_exc()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))


def test_two_ranks_raise_the_same_class(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, str(tmp_path))) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    hung = [proc.pid for proc in procs if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    assert not hung, f"ranks {hung} hung"
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert "crash" not in rank0 and "crash" not in rank1, (rank0.get("crash"), rank1.get("crash"))

    def same(case: str, type_name: str) -> dict[str, Any]:
        a, b = rank0[case], rank1[case]
        assert a["type"] == b["type"] == type_name, (case, a, b)
        assert a["message"] == b["message"], (case, a, b)
        assert (a["corrupt"], a["volume"], a["value_error"]) == (b["corrupt"], b["volume"], b["value_error"]), case
        return b

    for case, type_name in (
        ("corrupt", "CorruptCheckpointError"),
        ("not_empty", "LocationNotEmptyError"),
        ("item_checksum", "ItemChecksumError"),
        ("value_error", "ValueError"),
    ):
        b = same(case, type_name)
        assert b["cause"].startswith(f"RemoteRankError: rank 0 failed to run case {case} under "), b
    assert rank0["item_checksum"]["corrupt"] and rank0["item_checksum"]["value_error"]
    # A subclass from elsewhere: rank 0 keeps its own, rank 1 gets the nearest class of ours.
    assert rank0["local_subclass"]["type"] == "_LocalCorrupt"
    assert rank1["local_subclass"]["type"] == "CorruptCheckpointError"
    assert rank0["local_subclass"]["message"] == rank1["local_subclass"]["message"]
    assert rank1["local_subclass"]["corrupt"]
    # A foreign class: RemoteRankError everywhere, naming the original; rank 0 keeps it as cause.
    foreign = same("foreign", "RemoteRankError")
    assert (
        foreign["original_type"]
        == rank0["foreign"]["original_type"]
        == "tests.integration.test_error_policy._ForeignError"
    )
    assert "rank 0 failed to run case foreign" in foreign["message"]
    assert "_ForeignError: a third-party client's error" in foreign["message"]
    assert rank0["foreign"]["cause"] == "_ForeignError: a third-party client's error"
    assert rank0["ok"] == rank1["ok"] == {"value": 42}
    # Public methods: a root that is a file, and a listing that fails with a VolumeError subclass.
    same("file_root", "VolumeError")
    assert "a-file" in rank1["file_root"]["message"]
    same("refusing_list", "LocationNotEmptyError")
    assert rank0["still_in_step"] == rank1["still_in_step"] == {"value": None}
