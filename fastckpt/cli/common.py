"""Helpers shared by the ``fastckpt`` subcommands: byte sizes in and out (the core takes ints)."""

from __future__ import annotations

import argparse


def parse_bytes(text: str) -> int:
    """Parse ``"512MiB"``, ``"5GB"``, ``"4096"`` into bytes (CLI only; the core takes ints).

    Decimal units (``k``, ``KB``, ``M``, ``GB``, ``T``...) are powers of 1000, binary ones
    (``KiB``, ``MiB``, ``GiB``, ``TiB``) powers of 1024; case is ignored.

    Raises:
        argparse.ArgumentTypeError: not a byte size (argparse prints it as a usage error).
    """
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
    t = text.strip().lower()
    num = t.rstrip("kmgtib")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4096, 512MiB, 5GB)") from None


def human_bytes(n: float) -> str:
    """``n`` bytes as ``"512 B"``, ``"1.5 KiB"`` ... ``"2.0 TiB"`` (binary units, one decimal)."""
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.1f} {u}" if u != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
