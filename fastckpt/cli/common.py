"""Helpers shared by the ``fastckpt`` subcommands: byte sizes in and out (the core takes ints), and
finding the run roots of every checkpoint layout this project writes.

Sizes are printed in decimal units (``kB``, ``MB``, ``GB``, ``TB`` = 10^3, 10^6, 10^9, 10^12 bytes),
as the progress bars of ``fastckpt load`` and the GB/s figures everywhere else; size arguments take
decimal (``5GB``) or binary (``512MiB``) units.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointExistsError
from ..storage.commit import MANIFEST, TMP_MARK
from ..storage.retention import CheckpointScan, newest_committed, scan_checkpoints
from ..storage.locate import store_for
from ..storage.store import LOCAL, Store

#: Step folder prefixes of the layouts this project writes: ``step-N`` (:class:`fastckpt.CheckpointManager`),
#: ``checkpoint-N`` (the Trainer callback, in ``output_dir``) and ``checkpoint_N`` (the accelerate
#: plugin, in ``project_dir/checkpoints``).
PREFIXES = ("step-", "checkpoint-", "checkpoint_")
#: Sub-folder of accelerate's ``project_dir`` that holds its ``checkpoint_N`` folders.
RUNS_SUBDIR = "checkpoints"

def check_export_target(to: str, overwrite: bool) -> None:
    """Refuse ``fastckpt load --to`` / a consolidation into an existing ``to`` unless ``--overwrite`` was
    given and ``to`` is what an export may replace: an empty folder, or a model folder (``config.json``,
    ``*.safetensors`` or a ``manifest.json`` in it). ``--overwrite`` never removes other files.

    Raises:
        CheckpointExistsError: ``to`` exists without ``--overwrite``, or holds something else (names
            what is there and what to do).
    """
    if not LOCAL.lexists(to):
        return
    if not overwrite:
        raise CheckpointExistsError(f"{to} exists; choose another --to or pass --overwrite")
    if LOCAL.isdir(to):
        names = LOCAL.listdir(to)
        if not names or any(n in ("config.json", MANIFEST) or n.endswith(".safetensors") for n in names):
            return
        raise CheckpointExistsError(
            f"{to} is a folder of other files ({len(names)} entries, e.g. {sorted(names)[0]!r}), not a model folder "
            "(no config.json, *.safetensors or manifest.json): --overwrite replaces only a model folder or an empty "
            "folder, never other files. Remove it yourself if it may go, or choose another --to")
    raise CheckpointExistsError(f"{to} is a file, not a folder: --overwrite replaces only a model folder or an empty "
                                "folder. Remove it yourself if it may go, or choose another --to")


def matching_files(folder: str, patterns: tuple[str, ...]) -> list[str]:
    """The files of ``folder`` matching ``patterns`` (shell patterns, one level; ``sub/pattern``
    matches in sub-folder ``sub``), as ``/``-separated names relative to ``folder``, in pattern
    order, each once."""
    out: list[str] = []
    for pat in patterns:
        sub, _, name_pat = pat.rpartition("/")
        for p in LOCAL.glob(os.path.join(folder, sub) if sub else folder, name_pat):
            name = f"{sub}/{os.path.basename(p)}" if sub else os.path.basename(p)
            if LOCAL.isfile(p) and name not in out:
                out.append(name)
    return out


def positive_int(text: str) -> int:
    """argparse type of a count option (``--threads``, ``--keep``): an int >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def progress_bar(total: int | None, desc: str, quiet: bool):
    """A tqdm bar of bytes on stderr (decimal units), as ``fastckpt load`` and ``verify`` show them;
    stdout stays clean for what the command prints. ``quiet`` (``-q``) hides it.

    Args:
        total: bytes expected (``None``: unknown until set on the bar).
        desc: the bar's label.
        quiet: no bar.
    """
    import sys

    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, disable=quiet,
                file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


SIZE_UNITS_HELP = ("Sizes are printed in decimal units (1 kB = 1000 bytes, 1 MB = 10^6, 1 GB = 10^9); "
                   "size arguments take 5GB (5*10^9) or 512MiB (512*2^20)")


def parse_bytes(text: str) -> int:
    """Parse ``"512MiB"``, ``"5GB"``, ``"4096"`` into bytes (CLI only; the core takes ints).

    Decimal units (``k``, ``KB``, ``M``, ``GB``, ``T``...) are powers of 1000, binary ones
    (``KiB``, ``MiB``, ``GiB``, ``TiB``) powers of 1024; case is ignored.

    Raises:
        argparse.ArgumentTypeError: not a byte size, negative, or 2**63 bytes or more (argparse
            prints it as a usage error).
    """
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
    t = text.strip().lower()
    num = t.rstrip("kmgtib")
    try:
        n = int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4096, 512MiB, 5GB)") from None
    if not 0 <= n < 1 << 63:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (a size is >= 0 and < 2**63 bytes)")
    return n


def positive_bytes(text: str) -> int:
    """:func:`parse_bytes`, above 0 (a shard size): 0 passed the parser and failed later, after the
    export had started, naming the Python option ``max_shard_bytes``.

    Raises:
        argparse.ArgumentTypeError: as :func:`parse_bytes`, or 0.
    """
    n = parse_bytes(text)
    if n == 0:
        raise argparse.ArgumentTypeError(f"not a positive byte size: {text!r} (e.g. 5GB)")
    return n


def human_bytes(n: float) -> str:
    """``n`` bytes as ``"512 B"``, ``"1.5 kB"``, ``"553.3 MB"`` ... ``"2.0 TB"`` (decimal units, one
    decimal: the one unit system of the CLI's output, see :data:`SIZE_UNITS_HELP`)."""
    for u in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or u == "TB":
            return f"{n:.1f} {u}" if u != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


@dataclass(frozen=True)
class Run:
    """A run root found by :func:`find_runs`: ``folder`` holds ``{prefix}{N}`` step folders
    (committed or not) or leftovers of saves into them; ``scan`` is what
    :func:`fastckpt.storage.scan_checkpoints` found there."""

    folder: Path | str
    prefix: str
    scan: CheckpointScan

    @property
    def store(self) -> Store:
        """The store holding the run (local, or the one of an ``s3://...`` URL)."""
        return store_for(self.folder)

    def describe(self) -> str:
        """``"/abs/run/checkpoint-N"``: the folder and the name pattern of its steps."""
        return self.store.join(str(self.folder), f"{self.prefix}N")


def search_folders(root: str | os.PathLike) -> list[Path | str]:
    """The folders :func:`find_runs` looks in: ``root`` and ``root/checkpoints`` (absolute; on a
    non-local store, ``root``'s URL and the URL below it)."""
    store = store_for(root)
    if not store.local:
        return [store.normalize(root), store.join(store.normalize(root), RUNS_SUBDIR)]
    root = Path(os.path.abspath(os.fspath(root)))
    return [root, root / RUNS_SUBDIR]


def _leftover_of(name: str, prefix: str) -> bool:
    return re.match(r"\." + re.escape(prefix) + r"\d+" + re.escape(TMP_MARK), name) is not None


def find_runs(root: str | os.PathLike, prefix: str | None = None) -> list[Run]:
    """Every run root at ``root``, in every layout this project writes (reads only, creates nothing).

    Looks in ``root`` and in ``root/checkpoints`` (accelerate's ``project_dir``) for folders named
    ``{prefix}{N}`` with each prefix of :data:`PREFIXES` (or only ``prefix`` when given). A prefix
    counts in a folder when a step folder or a save leftover (``.{prefix}{N}.fastckpt-tmp-...``)
    carries it; a folder with leftovers of no known prefix counts as one run of the first prefix.

    Args:
        root: a run root, or the folder above accelerate's ``checkpoints`` (or a store URL, ``s3://...``).
        prefix: only this step folder prefix (default: all of :data:`PREFIXES`).

    Returns:
        The runs found, ``root``'s first, each folder's in :data:`PREFIXES` order; ``[]`` if none.
    """
    prefixes = (prefix,) if prefix else PREFIXES
    runs: list[Run] = []
    for folder in search_folders(root):
        if not store_for(folder).isdir(str(folder)):
            continue
        scans = [scan_checkpoints(folder, p) for p in prefixes]
        found = [Run(folder, p, s) for p, s in zip(prefixes, scans)
                 if s.committed or s.uncommitted or any(_leftover_of(n, p) for n in s.leftovers)]
        if not found and scans[0].leftovers:
            found = [Run(folder, prefixes[0], scans[0])]
        runs += found
    return runs


def not_found_message(root: str | os.PathLike, prefix: str | None = None) -> str:
    """Why :func:`find_runs` found nothing: the folders and name patterns it looked for."""
    store = store_for(root)
    if not store.local:
        pats = ", ".join(f"{p}N" for p in ((prefix,) if prefix else PREFIXES))
        return f"{store.normalize(root)}: no checkpoints: no step folders ({pats}) under this prefix"
    root = os.path.abspath(os.fspath(root))
    if not LOCAL.exists(root):
        return f"{root}: no checkpoints: no such file or folder"
    if not LOCAL.isdir(root):
        check = f"; `fastckpt verify {root}` checks one safetensors file" if root.endswith(".safetensors") else ""
        return f"{root}: no checkpoints: it is a file, not a folder (pass the run root or checkpoint folder{check})"
    pats = [f"{p}N" for p in ((prefix,) if prefix else PREFIXES)]
    what = pats[0] if len(pats) == 1 else ", ".join(pats[:-1]) + " or " + pats[-1]
    where = " or ".join(str(f) for f in search_folders(root))
    hint = ""
    if LOCAL.exists(os.path.join(root, MANIFEST)):
        hint = f" ({root} is itself a checkpoint: `fastckpt verify {root}`)"
    elif (tag := _deepspeed_tag(root)) is not None:
        hint = (f"; it is a DeepSpeed save_dir written by fastckpt's engine (tag {os.path.basename(tag)}, which "
                f"'latest' names): DeepSpeed keeps its own tags. `fastckpt verify {root}` checks that tag, "
                f"`fastckpt load {root} --to DIR` exports its weights")
    elif prefix and (others := find_runs(root)):  # a --prefix that matches nothing here; the default ones do
        hint = (f"; it holds {', '.join(r.describe() for r in others)}: drop --prefix {prefix} or pass "
                f"--prefix {others[0].prefix}")
    else:  # committed checkpoints named otherwise (Lightning's ModelCheckpoint: epoch=E-step=S.ckpt, last.ckpt)
        ours = sorted(n for n in LOCAL.listdir(root) if LOCAL.isfile(os.path.join(root, n, MANIFEST)))
        if ours:
            hint = (f"; it holds fastckpt checkpoints named otherwise ({', '.join(ours[:4])}"
                    f"{' ...' if len(ours) > 4 else ''}): pass one of them, e.g. the newest, "
                    f"`fastckpt verify {os.path.join(root, newest_committed(root, ours))}`")
    return f"{root}: no checkpoints: no {what} folders in {where}{hint}"


def _deepspeed_tag(root: str) -> str | None:
    """The committed tag of a DeepSpeed ``save_dir`` that fastckpt's engine wrote, else None (never raises)."""
    from ..errors import FastCkptError
    from ..loading.zero import find_zero_tag
    try:
        return find_zero_tag(root)
    except (FastCkptError, OSError):
        return None
