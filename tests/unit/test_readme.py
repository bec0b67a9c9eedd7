"""The README is a door: short, no figures, every name it imports is a root name, every link lands."""

from __future__ import annotations

import re

import uc_checkpoint
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def test_the_readme_is_short_and_carries_no_figures() -> None:
    lines = README.splitlines()
    assert 80 <= len(lines) <= 150, len(lines)
    tables = [line for line in lines if line.startswith("|")]
    assert not tables, f"figures and reference tables belong in docs/: {tables[:2]}"
    assert "Unity Catalog" in README  # "UC" is spelled out
    assert "pip install" in README


def test_every_name_the_readme_imports_is_on_the_root() -> None:
    imported = [
        name.strip()
        for group in re.findall(r"from uc_checkpoint import ([\w, ]+)", README)
        for name in group.split(",")
    ]
    assert imported, "the README shows no import"
    missing = [name for name in imported if name not in uc_checkpoint.__all__]
    assert not missing, f"README imports names the root does not export: {missing}"


def test_every_relative_link_lands() -> None:
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", README) if "://" not in t]
    assert len(targets) >= 8
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
