"""The code's shape stays as documented (docs/architecture.md, "The import rule"):

- each folder of the package is one layer, and imports go downward only:
  ``cli``/``demo`` -> ``ops`` -> ``dcp`` -> ``engine`` -> ``volumes`` -> ``format`` -> ``errors``/``observability``;
  ``data/`` (the data-pipeline tracker) stands apart and imports only ``errors``, and only
  ``ops``, the top layer and its format readers import it; the readers, ``data/readers/``, are a
  layer beside ``dcp`` (they read shards through volumes);
- the package root holds the layers' folders and a few files, nothing else (no alias modules);
- torch's (and Python's) private names are reached only through ``uc_checkpoint/dcp/compat.py``,
  where each is listed with the versions it was checked on.
"""

from __future__ import annotations

import ast
from pathlib import Path

from uc_checkpoint.dcp import compat as dcp_compat

PACKAGE = Path(__file__).resolve().parents[2] / "uc_checkpoint"

# Rank of each layer: a module may import its own layer and lower ranks only.
LAYERS = {
    "errors": 0,
    "observability": 0,
    "format": 1,
    "volumes": 2,
    "engine": 3,
    "dcp": 4,
    "data.readers": 4,
    "ops": 5,
    "cli": 6,
    "demo": 6,
    "__init__": 6,
    "__main__": 6,
}


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[1:3] == ["data", "readers"]:
        return "data.readers"
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute uc_checkpoint module) for every import in ``path``, including lazy ones."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != "uc_checkpoint":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in _modules() else base))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "uc_checkpoint"]
        elif isinstance(node, ast.Call) and _is_import_call(node.func):
            # importlib.import_module("uc_checkpoint...") / __import__("uc_checkpoint..."): an
            # import spelled as a string is an import too.
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("uc_checkpoint"):
                found.append((node.lineno, arg.value))
    return found


def _is_import_call(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )


def test_imports_go_downward_only() -> None:
    offenders = []
    for module, path in sorted(_modules().items()):
        mine = _layer(module)
        for line, target in _imports(module, path):
            theirs = _layer(target)
            where = f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}"
            if "data" in (mine, theirs):
                allowed = (
                    theirs in ("data", "errors")
                    if mine == "data"
                    else mine == "data.readers" or LAYERS.get(mine, -1) >= LAYERS["ops"]
                )
                if not allowed:
                    offenders.append(
                        f"{where} (data/ stands apart: it imports only errors; only its readers, ops and the top layer "
                        "import it)"
                    )
            elif mine not in LAYERS or theirs not in LAYERS:
                offenders.append(f"{where} (not in a known layer)")
            elif LAYERS[theirs] > LAYERS[mine]:
                offenders.append(f"{where} (upward: {mine} -> {theirs})")
    offenders = list(dict.fromkeys(offenders))
    assert not offenders, "imports must go downward (docs/architecture.md):\n" + "\n".join(offenders)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    # The check above must be able to fail: an engine module importing the DCP layer is upward.
    fake = tmp_path / "uc_checkpoint" / "engine" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "import importlib\nfrom uc_checkpoint.dcp import writer\nfrom ..format import layout\n"
        "def f():\n    return importlib.import_module('uc_checkpoint.ops.manager')\n"
    )
    found = _imports("uc_checkpoint.engine.bad", fake)
    assert sorted(_layer(t) for _, t in found) == ["dcp", "format", "ops"]
    assert LAYERS["ops"] > LAYERS["dcp"] > LAYERS["engine"] >= LAYERS["format"]


def test_every_folder_is_a_known_layer() -> None:
    unknown = {_layer(m) for m in _modules()} - set(LAYERS) - {"data"}
    assert not unknown, f"new top-level module or folder {unknown}: give it a layer here and in docs/architecture.md"


def test_the_package_root_holds_the_layers_and_a_few_files() -> None:
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    folders = {name for name in entries if (PACKAGE / name).is_dir()}
    assert folders == {"data", "dcp", "demo", "engine", "format", "ops", "volumes"}, folders
    assert entries - folders == {"__init__.py", "cli.py", "errors.py", "observability.py"}, entries - folders


def _runtime_imports(tree: ast.AST) -> list[ast.stmt]:
    """Import statements that run at import time or in a function (not under ``if TYPE_CHECKING:``)."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def test_torch_free_layers_do_not_import_torch() -> None:
    # The on-volume format (names, manifest, checksums), the volumes and the data tracker (not its
    # DataLoader wrapper) work without torch.
    offenders = []
    for module, path in sorted(_modules().items()):
        torch_free = (
            _layer(module) in ("format", "volumes", "errors", "data") and module != "uc_checkpoint.data.loading"
        )
        if not torch_free:
            continue
        for node in _runtime_imports(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            offenders += [f"{where}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, "\n".join(offenders)


def _private_torch_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module_private = any(part.startswith("_") for part in (node.module or "").split("."))
            names = [a.name for a in node.names if a.name.startswith("_")]
            if module_private or names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            # torch._x, threading._x, and a private name at the end of a torch module chain
            # (dist.distributed_c10d._x, torch.distributed.checkpoint._x).
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("torch", "threading", "dist", "dcp"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_names_only_in_the_compat_module() -> None:
    compat = PACKAGE / "dcp" / "compat.py"
    offenders = [
        hit for path in sorted(PACKAGE.rglob("*.py")) if path != compat for hit in _private_torch_imports(path)
    ]
    assert not offenders, "reach these through uc_checkpoint/dcp/compat.py:\n" + "\n".join(offenders)


def test_the_compat_module_resolves_every_name_under_this_torch() -> None:
    missing = [name for name in dcp_compat.__all__ if not hasattr(dcp_compat, name)]
    assert not missing, missing
