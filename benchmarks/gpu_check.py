"""One-shot check on a CUDA machine: ``dcp.async_save`` of a GPU state through ``UCVolumeWriter``
with our staging and with DCP's, then a load back to the GPU.

    python -m benchmarks.gpu_check                         # 2 GiB state, 3 repeats, results to $OUT
    python -m benchmarks.gpu_check --size-gib 4 --repeats 2 --out gpu_check.json
    python -m benchmarks.gpu_check --device cpu --size-gib 0.004 --repeats 1   # the same logic, on CPU

Runs after ``pip install -e .``, or with ``PYTHONPATH=.`` where torch is installed (from the
repository root either way: ``benchmarks`` is not installed). Exit codes: 0 every save published and
loaded back bit-exact; 1 a save failed or a load differed; 2 it could not start (torch or a package
missing, no CUDA for ``--device cuda``, too little disk), with one line on stderr saying why.

The state (:func:`build_state`): :mod:`benchmarks.state`'s ``gpt`` kind on the device, bfloat16
parameters and float32 AdamW moments. Methods (:data:`METHODS`, :data:`STAGERS`): our writer's
``stage()`` (``uc``), the same with one :class:`~uc_checkpoint.dcp.buffers.StagingBuffers` for the
run (``uc-kept``: what ``cache_staged_state_dict=True`` gives one writer), ``BackgroundStager``
(``uc-async``), DCP's ``DefaultStager`` with pinned memory, async staging and non-blocking copies,
one for the run (``dcp-pinned``; on CPU, which refuses those, without them), and
``DefaultStager(StagingOptions(False, False, False, False))`` per save, what ``async_save`` uses
for a writer that is not a stager (``dcp-default``).

Every method saves once per round, rounds interleaved; round 0 (the first save: pinning) is reported
apart, the others as medians of ``blocked_s`` (until ``async_save`` returns), ``staged_s`` (until
the host copy is complete) and ``published_s`` (until ``.metadata`` is on the volume), seconds from
the call. Every tensor changes in place before each save, so a snapshot into stale buffers would
not load back equal; the last round loads each checkpoint back into zeroed tensors on the device
(``load_s``) and compares it bit for bit. ``--budget-s`` skips repeat rounds that would leave no
time for the last one. One markdown table and one JSON line go to stdout, the JSON (with the table)
to ``--out``, rewritten after each round. What each figure means, and the figures:
docs/benchmarks-gpu.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .fmt import GIB

try:
    import numpy  # noqa: F401 - loading a checkpoint needs it (Tensor.numpy()); missing, main() says so
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    from uc_checkpoint import StagingBuffers, UCVolumeReader, UCVolumeWriter
    from uc_checkpoint.dcp.stager import BackgroundStager

    from . import gpu_check_report as report
    from . import state
except ImportError as exc:  # reported by main() in one line, with what to install
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None

log = logging.getLogger("benchmarks.gpu_check")

METHODS = ("uc", "uc-kept", "uc-async", "dcp-pinned", "dcp-default")
#: Exit code when the check cannot start (missing package, no CUDA, too little disk).
EXIT_CANNOT_START = 2
#: Seconds past ``--budget-s`` a save may take before the check stops waiting for it.
HANG_GRACE_S = 40.0
#: Free disk wanted under ``--dir``, in state sizes: one checkpoint on the volume, its staged files
#: (deleted as they are uploaded) and room to spare.
DISK_FACTOR = 3


class CannotStart(Exception):
    """The check cannot run here (the message says why, in one line)."""


def missing_dependency() -> str | None:
    """One line naming what is missing to run the check (torch, uc_checkpoint or one of its
    dependencies), None when everything imports."""
    if IMPORT_ERROR is None:
        return None
    name = getattr(IMPORT_ERROR, "name", None) or str(IMPORT_ERROR)
    if name == "torch":
        return f"gpu_check: torch is missing ({IMPORT_ERROR}); install torch (a CUDA build for --device cuda)"
    if name.startswith("torch."):
        version = getattr(sys.modules.get("torch"), "__version__", "?")
        return f"gpu_check: torch {version} lacks what the check uses ({IMPORT_ERROR}); install torch 2.13"
    return (
        f"gpu_check: cannot import {name!r} ({IMPORT_ERROR}); run from the repository root after "
        "`pip install -e .`, or with PYTHONPATH=. where torch and uc_checkpoint's dependencies are installed"
    )


# ---- the state ----------------------------------------------------------------------------------
def build_state(size_bytes: int, device: torch.device) -> dict[str, Any]:
    """A GPT-like training state of about ``size_bytes`` bytes on ``device``: :mod:`benchmarks.state`'s
    ``gpt`` kind (seeded values in [0, 1)) with its parameters cast to bfloat16 and its AdamW moments
    kept in float32, both moved to ``device``; ``step`` scalars stay on the CPU.

    Layout: ``{"model": {name: bf16}, "optim": {"state": {name: {"step", "exp_avg", "exp_avg_sq"}}},
    "step": int}``: 10 bytes a parameter (2 + 4 + 4), so the parameters are a fifth of the bytes."""
    # The builder sizes float32 params + 2 moments (12 bytes a parameter); bf16 params make it 10.
    sd = state.build("gpt", size_bytes * 12 // 10)
    with torch.no_grad():
        model = sd["model"]
        for name in list(model):
            model[name] = model[name].to(device=device, dtype=torch.bfloat16)
        for moments in sd["optim"]["state"].values():
            for key in ("exp_avg", "exp_avg_sq"):
                moments[key] = moments[key].to(device)
    return sd


def zeros_like(sd: Any) -> Any:
    """A load target of ``sd``'s structure: every tensor zeroed on its own device and dtype, every
    other leaf -1."""
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return -1


def first_difference(expected: Any, got: Any, path: str = "") -> str | None:
    """The dotted key of the first value of ``got`` that is not bit-identical to ``expected``
    (structure, dtype, shape, device type and every element compared), None when none differs."""
    here = path or "<root>"
    if isinstance(expected, dict):
        if not isinstance(got, dict) or expected.keys() != got.keys():
            return f"{here} (keys)"
        for k in expected:
            found = first_difference(expected[k], got[k], f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
        return None
    if isinstance(expected, torch.Tensor):
        same = (
            isinstance(got, torch.Tensor)
            and got.dtype == expected.dtype
            and got.shape == expected.shape
            and got.device.type == expected.device.type
            and torch.equal(got, expected)
        )
        return None if same else here
    return None if type(got) is type(expected) and got == expected else here


def training_step(sd: dict[str, Any], step: int) -> None:
    """Change every tensor of ``sd`` in place (``+1``) and set its ``step``: the next save must
    hold these values, not the last save's."""
    with torch.no_grad():
        for t in state.tensors_of(sd):
            t.add_(1)
    sd["step"] = step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_pinned_cache(device: torch.device) -> bool:
    """Hand the pinned blocks torch's caching host allocator keeps back to CUDA (so a method's first
    save pays for its own pinning); False where this torch has no such call or there is no CUDA."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if device.type != "cuda" or empty is None:
        return False
    empty()
    return True


def drop_from_page_cache(root: Path) -> bool:
    """Ask the kernel to drop the files under ``root`` from the page cache (``posix_fadvise``
    DONTNEED; the writer fsyncs them, so their pages are clean); False where that is not available."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


# ---- one save, one load -------------------------------------------------------------------------
def pinned_options(device: torch.device) -> StagingOptions:
    """``dcp-pinned``'s options: pinned memory, async staging and non-blocking copies on CUDA;
    without pinning and non-blocking copies elsewhere (DCP refuses them without an accelerator)."""
    accel = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=accel, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=accel
    )


def staging_options(method: str, device: torch.device) -> StagingOptions | None:
    """DCP's ``StagingOptions`` of a ``dcp-*`` method on ``device`` (None for ours)."""
    if method == "dcp-pinned":
        return pinned_options(device)
    if method == "dcp-default":
        return StagingOptions(False, False, False, False)
    return None


@dataclass
class Run:
    """What the methods keep across saves (the ``uc-kept`` buffers, the ``dcp-pinned`` stager) and
    the ``time.monotonic()`` by which every save must be published (:class:`SaveHung` past it)."""

    device: torch.device
    volume: Path
    staging: Path
    deadline: float
    buffers: StagingBuffers = field(default_factory=lambda: StagingBuffers())
    kept_stager: DefaultStager | None = None

    def stager(self, method: str) -> tuple[Any, bool]:
        """The ``async_stager`` for one save of ``method`` and whether that save owns it (closes it)."""
        if method == "uc-async":
            return BackgroundStager(), False
        options = staging_options(method, self.device)
        if options is None:
            return None, False
        if method == "dcp-pinned":
            if self.kept_stager is None:
                self.kept_stager = DefaultStager(options)
            return self.kept_stager, False
        return DefaultStager(options), True

    def close(self) -> None:
        if self.kept_stager is not None:
            self.kept_stager.close()
            self.kept_stager = None
        self.buffers.clear()


class SaveHung(Exception):
    """A save was not done by the check's deadline (its thread may still be running)."""


def _completion(fut: Any, deadline: float) -> Callable[[], float]:
    """A wait for ``fut`` that returns the ``perf_counter`` time it completed (raises its error, or
    :class:`SaveHung` at ``deadline``, a ``time.monotonic()``). The time is taken in a done callback,
    which runs after waiters are woken: the wait waits for it too."""
    done = threading.Event()
    at: list[float] = []

    def mark(_: Any) -> None:
        at.append(time.perf_counter())
        done.set()

    fut.add_done_callback(mark)

    def wait() -> float:
        left = max(1.0, deadline - time.monotonic())
        if not done.wait(left):
            raise SaveHung(f"not done after {left:.0f} s, past the check's budget: the check stops here")
        fut.result()
        return at[0]

    return wait


def timed_save(sd: dict[str, Any], method: str, dest: Path, run: Run) -> dict[str, float]:
    """One ``dcp.async_save`` of ``sd`` to ``dest`` with ``method``; ``blocked_s``, ``staged_s`` and
    ``published_s`` in seconds (see the module docstring).

    Raises:
        BaseException: what the save raised (DCP's ``CheckpointException`` is a BaseException).
        SaveHung: the save was not done by ``run.deadline``.
        RuntimeError: the save completed without a ``.metadata`` at ``dest``.
    """
    buffers = run.buffers if method == "uc-kept" else None
    writer = UCVolumeWriter(str(dest), staging_dir=run.staging, staging_buffers=buffers)
    stager, owned = run.stager(method)
    _sync(run.device)
    try:
        t0 = time.perf_counter()
        response = dcp.async_save(sd, storage_writer=writer, async_stager=stager)
        blocked = time.perf_counter() - t0
        if isinstance(response, AsyncSaveResponse):
            staged_at = _completion(response.staging_completion, run.deadline)
            published_at = _completion(response.upload_completion, run.deadline)
            staged = staged_at() - t0
        else:
            published_at = _completion(response, run.deadline)
            staged = blocked
        published = published_at() - t0
    except SaveHung:
        raise  # its stager may still be in use
    except BaseException:
        if owned:
            stager.close()
        raise
    if owned:
        stager.close()
    if not (dest / ".metadata").is_file():
        raise RuntimeError(f"the save to {dest} completed but {dest / '.metadata'} is missing")
    return {"blocked_s": round(blocked, 6), "staged_s": round(staged, 6), "published_s": round(published, 6)}


def timed_load(sd: dict[str, Any], target: dict[str, Any], src: Path, device: torch.device) -> dict[str, Any]:
    """``dcp.load`` of the checkpoint at ``src`` into ``target`` (zeroed first) with
    ``UCVolumeReader``; ``load_s`` (seconds, to the device's synchronisation), whether the files
    were dropped from the page cache first, and the first key whose loaded value differs from
    ``sd`` (None: bit-exact)."""
    with torch.no_grad():
        for t in state.tensors_of(target):
            t.zero_()
    dropped = drop_from_page_cache(src)
    _sync(device)
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=UCVolumeReader(str(src)))
    _sync(device)
    load_s = time.perf_counter() - t0
    mismatch = first_difference(sd, target)
    return {
        "load_s": round(load_s, 6),
        "page_cache_dropped": dropped,
        "bit_exact": mismatch is None,
        "mismatch": mismatch,
    }


def _error_text(exc: BaseException) -> str:
    """One line for a failed step: DCP's ``CheckpointException`` by each rank's own error (its
    ``str`` leads with the tracebacks), at most 600 characters."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        text = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in failures.items())
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= 600 else text[:600] + "..."


# ---- the check ------------------------------------------------------------------------------------
def _warm_up(workdir: Path, device: torch.device) -> None:
    """One tiny save and load from ``device`` (imports, DCP's and the device's first-call costs),
    reported nowhere."""
    tiny = {"model": {"w": torch.ones(1024, device=device)}, "step": 0}
    dest = workdir / "warm-up"
    response = dcp.async_save(tiny, storage_writer=UCVolumeWriter(str(dest), staging_dir=workdir / "staging"))
    (response.upload_completion if isinstance(response, AsyncSaveResponse) else response).result()
    dcp.load(zeros_like(tiny), storage_reader=UCVolumeReader(str(dest)))
    shutil.rmtree(dest)


def check(
    size_bytes: int,
    repeats: int,
    device: torch.device,
    workdir: Path,
    budget_s: float,
    methods: list[str],
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every method in ``repeats + 1`` interleaved rounds, the last with the load checks (see the
    module docstring); the results as :func:`main` prints them. ``on_round`` gets the results so far
    after each round (``"complete": False`` until the end).

    A save not published within the budget's end plus :data:`HANG_GRACE_S` ends the check: the
    results then say ``"hung": True``, and DCP's save thread is still running (see :func:`main`).

    Raises:
        CannotStart: less than :data:`DISK_FACTOR` times the state's size free under ``workdir``.
    """
    start = time.monotonic()
    free = shutil.disk_usage(workdir).free
    if free < DISK_FACTOR * size_bytes:
        raise CannotStart(
            f"gpu_check: {free / GIB:.1f} GiB free under {workdir}, {DISK_FACTOR * size_bytes / GIB:.1f} GiB wanted "
            "(--dir elsewhere, or a smaller --size-gib)"
        )
    run = Run(device, workdir / "volume", workdir / "staging", deadline=start + budget_s + HANG_GRACE_S)
    run.volume.mkdir()
    sd = build_state(size_bytes, device)
    target = zeros_like(sd)
    try:
        _warm_up(workdir, device)
        warm_up_error = None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - each method's own save then reports what fails
        warm_up_error = _error_text(exc)
        log.error("warm-up save: %s", warm_up_error)
    _empty_pinned_cache(device)
    rows: dict[str, dict[str, Any]] = {
        m: {"stager": STAGERS[m], "first": None, "samples": [], "error": None} for m in methods
    }
    results: dict[str, Any] = {
        "check": "benchmarks.gpu_check",
        "complete": False,
        "hung": False,
        "env": report.environment(device, workdir),
        "state": report.state_summary(sd, device),
        "settings": {
            "repeats": repeats,
            "budget_s": budget_s,
            "methods": methods,
            "writer": _writer_settings(run.volume),
            "dcp_pinned_options": asdict(pinned_options(device)),
        },
        "skipped": [],
        "warm_up_error": warm_up_error,
    }

    def results_now() -> dict[str, Any]:
        results["methods"] = {m: report.summarise(row) for m, row in rows.items()}
        results["elapsed_s"] = time.monotonic() - start
        return results

    step = 0
    round_s = 0.0
    try:
        for rnd in range(repeats + 1):
            last = rnd == repeats
            now = time.monotonic() - start
            # A repeat round runs only if this round, the last one and its loads (about a save
            # each, as round 0 measured them) fit: the last round, with the checks, always runs.
            if rnd and not last and now + 3 * round_s > budget_s:
                results["skipped"].append(f"round {rnd} (budget: {now:.1f} s of {budget_s:.1f} s used)")
                continue
            began = time.monotonic()
            for m in methods:
                row = rows[m]
                if row["error"] is not None:
                    continue
                if time.monotonic() - start > budget_s:
                    results["skipped"].append(f"round {rnd} {m} (budget spent)")
                    continue
                step += 1
                training_step(sd, step)
                if rnd == 0:
                    row["pinned_cache_emptied"] = _empty_pinned_cache(device)
                dest = run.volume / m / f"round{rnd}"
                try:
                    figures = timed_save(sd, m, dest, run)
                    log.info("%s round %d: %s", m, rnd, ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
                    if rnd == 0:
                        row["first"] = figures
                    else:
                        row["samples"].append(figures)
                    if last:
                        row.update(timed_load(sd, target, dest, device))
                except SaveHung as exc:
                    row["error"] = str(exc)
                    results["hung"] = True
                    return results_now()  # the hung save still holds dest: it stays
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException too: reported per method
                    log.error("%s, round %d: %s", m, rnd, exc)  # DCP's: every rank's traceback
                    row["error"] = _error_text(exc)
                    shutil.rmtree(dest, ignore_errors=True)
                    continue
                shutil.rmtree(dest)
            if rnd == 0:
                round_s = time.monotonic() - began
            if on_round is not None:
                on_round(results_now())
        results["complete"] = True
        return results_now()
    finally:
        if not results["hung"]:
            run.close()


#: What each method passes to ``async_save`` (the table's second column).
STAGERS = {
    "uc": "the writer's stage(): pinned memory from torch's host cache",
    "uc-kept": "the writer's stage() into StagingBuffers kept across saves",
    "uc-async": "async_stager=BackgroundStager()",
    "dcp-pinned": "async_stager=DefaultStager(pinned, async, non-blocking), one per run",
    "dcp-default": "async_stager=DefaultStager(StagingOptions(False x4)), one per save",
}


def _writer_settings(volume: Path) -> dict[str, Any]:
    """The writer's settings every save used (its defaults)."""
    w = UCVolumeWriter(str(volume / "settings"))
    return {
        "upload_workers": w.options.upload_workers,
        "thread_count": w.options.thread_count,
        "sync_files": w.options.sync_files,
        "file_size_bytes": w.options.file_size_bytes,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="state size in GiB (default 2; at least ~10 MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="saves per method after the first (1-20, default 3)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where the state lives")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--dir", type=Path, help="where the volume and staging go (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep --dir's work directory")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="seconds: skip repeat rounds that would run past this (default 360)",
    )
    parser.add_argument("--out", type=Path, help="write the results here (default: $OUT/gpu_check.json if $OUT is set)")
    args = parser.parse_args(argv)
    if not 0 < args.size_gib <= 64:
        parser.error(f"--size-gib must be in (0, 64], got {args.size_gib}")
    if not 1 <= args.repeats <= 20:
        parser.error(f"--repeats must be in 1..20, got {args.repeats}")
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / "gpu_check.json"
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check (arguments: ``--help``); the exit code (see the module docstring)."""
    args = _parse(argv)
    missing = missing_dependency()
    if missing is not None:
        print(missing, file=sys.stderr)
        return EXIT_CANNOT_START
    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu_check: --device cuda, but CUDA is not available (torch {torch.__version__}, {build})", file=sys.stderr
        )
        return EXIT_CANNOT_START
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("uc_checkpoint").setLevel(logging.WARNING)  # a line per save otherwise
    warnings.filterwarnings("ignore")  # DCP warns on every save without a process group
    base = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    try:
        base.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="uc-gpu-check-", dir=base))
    except OSError as exc:
        print(f"gpu_check: cannot create a work directory under {base}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START

    def write(results: dict[str, Any]) -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            results = {**results, "ok": report.passed(results), "table": report.table(results)}
            args.out.write_text(json.dumps(results, indent=1) + "\n")

    try:
        size = round(args.size_gib * GIB)
        results = check(size, args.repeats, torch.device(args.device), workdir, args.budget_s, args.methods, write)
    except CannotStart as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CANNOT_START
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    results["ok"] = report.passed(results)
    print(report.table(results))
    print(json.dumps(results))
    write(results)
    if args.out is not None:
        log.info("results written to %s", args.out)
    if results["hung"]:
        # Python's exit would join DCP's save thread, which is stuck: leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
