"""How the benchmark reports write numbers: one formatter for every figure in their tables."""

from __future__ import annotations

MIB = 1 << 20
GIB = 1 << 30


def num(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    """``x / scale`` with ``digits`` decimals (``num(3 << 20, MIB, 0)`` is ``"3"``); ``"-"`` for a
    figure a run does not have (None)."""
    return "-" if x is None else f"{x / scale:.{digits}f}"


def point(x: float) -> str:
    """A sweep's x value: whole numbers with thousands separated (``1,000``), fractions as they are
    (``0.5``)."""
    return f"{x:,.0f}" if x >= 1 else f"{x:g}"
