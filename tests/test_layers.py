"""The code's shape stays as documented: torch's (and Python's) private names are reached only
through ``uc_checkpoint/dcp_compat.py``, where each is listed with the versions it was checked on."""

from __future__ import annotations

import ast
from pathlib import Path

from uc_checkpoint import dcp_compat

PACKAGE = Path(__file__).resolve().parent.parent / "uc_checkpoint"


def _private_torch_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module_private = any(part.startswith("_") for part in (node.module or "").split("."))
            names = [a.name for a in node.names if a.name.startswith("_")]
            if module_private or names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("torch", "threading"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {base.id}.{node.attr}")
    return found


def test_private_names_only_in_the_compat_module() -> None:
    offenders = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "dcp_compat.py"
        for hit in _private_torch_imports(path)
    ]
    assert not offenders, "reach these through uc_checkpoint/dcp_compat.py:\n" + "\n".join(offenders)


def test_the_compat_module_resolves_every_name_under_this_torch() -> None:
    missing = [name for name in dcp_compat.__all__ if not hasattr(dcp_compat, name)]
    assert not missing, missing
    assert dcp_compat.dcp_saver_file().endswith("state_dict_saver.py")
    assert dcp_compat.dcp_async_thread_file().endswith("_async_thread_executor.py")
