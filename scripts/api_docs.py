"""Write docs/api.md, the API reference, from the public objects' signatures and docstrings.

.venv/bin/python scripts/api_docs.py          # rewrite docs/api.md
.venv/bin/python scripts/api_docs.py --check  # exit 1 if docs/api.md is out of date (the tests do this)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "api.md"

# (module, public names) in reading order.
SECTIONS: list[tuple[str, list[str]]] = [
    ("uc_checkpoint.dcp.writer", ["UCVolumeWriter"]),
    ("uc_checkpoint.dcp.planner", ["UCSavePlanner", "place_replicated"]),
    ("uc_checkpoint.dcp.reader", ["UCVolumeReader"]),
    ("uc_checkpoint.dcp.stager", ["BackgroundStager"]),
    ("uc_checkpoint.dcp.buffers", ["StagingBuffers", "BufferLease"]),
    ("uc_checkpoint.ops.manager", ["CheckpointManager", "CheckpointInfo"]),
    ("uc_checkpoint.dcp.options", ["WriterOptions", "ReaderOptions", "Staging"]),
    (
        "uc_checkpoint.ops.interval",
        ["EverySteps", "EverySeconds", "BlockedFraction", "YoungDaly", "Tighter", "Looser", "IntervalPolicy"],
    ),
    ("uc_checkpoint.ops.retention", ["steps_to_delete"]),
    ("uc_checkpoint.volumes", ["open_volume", "Volume", "LocalVolume", "S3Volume", "FsspecVolume"]),
    ("uc_checkpoint.data.tracker", ["DataTracker", "ShardSpec", "DatasetChange"]),
    ("uc_checkpoint.data.loading", ["TrackedDataLoader", "TrackedShardDataset", "TrackerStateful"]),
    (
        "uc_checkpoint.data.readers",
        [
            "ShardReader",
            "TokenReader",
            "ParquetReader",
            "JsonlReader",
            "GzipJsonlReader",
            "WebDatasetReader",
            "HfDatasetReader",
            "file_fingerprint",
        ],
    ),
    ("uc_checkpoint.ops.export", ["export_checkpoint", "ExportSummary"]),
    ("uc_checkpoint.ops.garbage", ["collect_garbage", "GCReport"]),
    ("uc_checkpoint.ops.lineage", ["retention_plan", "abandonment_marker", "marker_applies"]),
    ("uc_checkpoint.ops.summary", ["list_root", "describe_checkpoint", "CheckpointSummary"]),
    ("uc_checkpoint.ops.verify", ["verify_checkpoint", "VerifyReport"]),
    ("uc_checkpoint.observability", ["TransferRecord", "SaveEvent", "resume_mlflow_run"]),
    ("uc_checkpoint.errors", None),  # every exception class, in file order
]


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "(no docstring)")


def _methods(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties defined in the class body that have a docstring."""
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_"):
            continue
        func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if (callable(func) or isinstance(member, property)) and getattr(func, "__doc__", None):
            out.append((name, member))
    return out


def render() -> str:
    lines = ["# API reference", "", "Generated from the docstrings by `scripts/api_docs.py`; do not edit by hand.", ""]
    for module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _doc(module).split("\n\n")[0], ""]
        if names is None:
            names = [
                n
                for n, o in vars(module).items()
                if inspect.isclass(o) and issubclass(o, BaseException) and o.__module__ == module_name
            ]
        for name in names:
            obj = getattr(module, name)
            kind = "class" if inspect.isclass(obj) else "def"
            lines += [f"### {kind} `{name}{_signature(obj)}`", "", _doc(obj), ""]
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                for mname, member in _methods(obj):
                    if isinstance(member, property):
                        lines += [f"- property `{mname}`: {_doc(member).splitlines()[0]}"]
                    else:
                        func = getattr(member, "__func__", member)
                        lines += [
                            f"- `{mname}{_signature(func)}`: {_doc(func).split(chr(10) + chr(10))[0]}".replace(
                                "\n", " "
                            )
                        ]
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check that docs/api.md is up to date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run .venv/bin/python scripts/api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
