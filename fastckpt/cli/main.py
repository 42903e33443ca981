"""The ``fastckpt`` command line: ls, verify, prune, load (and subcommands added by integrations).

Exit codes: 0 success, 1 a check failed (verify mismatch), 2 bad usage or nothing found.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..storage.commit import MANIFEST, read_manifest
from ..errors import FastCkptError
from ..manager import CheckpointManager


def parse_bytes(text: str) -> int:
    """Parse ``"512MiB"``, ``"5GB"``, ``"4096"`` into bytes (CLI only; the core takes ints)."""
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
    t = text.strip().lower()
    num = t.rstrip("kmgtib")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4096, 512MiB, 5GB)") from None


def _human(n: float) -> str:
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.1f} {u}" if u != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _guess_prefix(root: str) -> str:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return "step-"
    if any(n.startswith("checkpoint-") for n in names):
        return "checkpoint-"
    return "step-"


def cmd_ls(args: argparse.Namespace) -> int:
    """List committed steps with sizes, and what was skipped and why."""
    prefix = args.prefix or _guess_prefix(args.root)
    mgr = CheckpointManager(args.root, prefix=prefix)
    steps, skipped = mgr._scan()
    if not steps and not skipped:
        print(f"{args.root}: no checkpoints (prefix {prefix!r})")
        return 2
    print(f"{'step':>10}  {'size':>10}  {'files':>5}  {'tensors':>7}  path")
    for s in steps:
        p = mgr.path(s)
        m = read_manifest(str(p))
        size = m.get("bytes_total", 0) + os.path.getsize(p / MANIFEST)  # the manifest cannot list itself
        print(f"{s:>10}  {_human(size):>10}  {len(m['files']) + 1:>5}  {len(m['tensors']):>7}  {p}")
    latest = mgr.latest()
    print(f"latest committed: {latest if latest is not None else '-'}")
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-read every byte against the manifest; exit 1 on any mismatch."""
    from ..storage.commit import MANIFEST
    from ..loading.verify import verify
    path = args.path
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST)):
        mgr = CheckpointManager(path, prefix=args.prefix or _guess_prefix(path))
        latest = mgr.latest()
        if latest is not None:  # a run root: verify its newest committed checkpoint
            path = str(mgr.path(latest))
            print(f"{args.path} is a run root: verifying its newest committed checkpoint {path}")
    rep = verify(path, threads=args.threads)
    for p in rep.problems:
        print(f"MISMATCH {p}")
    for n in rep.notes:
        print(f"note: {n}")
    n = len(rep.problems)
    status = ("OK" if not rep.notes else "headers and index valid, no checksums to compare") if rep.ok \
        else f"FAILED ({n} problem{'s' if n != 1 else ''})"
    print(f"{path}: {status}, {_human(rep.bytes_checked)} checked")
    return 0 if rep.ok else 1


def cmd_prune(args: argparse.Namespace) -> int:
    """Keep the newest N committed steps; remove older ones and dead temporaries."""
    mgr = CheckpointManager(args.root, prefix=args.prefix or _guess_prefix(args.root))
    removed = mgr.prune(args.keep)
    print(f"removed steps: {removed or 'none'}; kept: {mgr.steps()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fastckpt`` (subcommands ls, verify, prune)."""
    p = argparse.ArgumentParser(prog="fastckpt", description="Fast, safe checkpoint and weight I/O.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list committed checkpoints under a root, and what was skipped")
    ls.add_argument("root")
    ls.add_argument("--prefix", default=None, help="step folder prefix (default: guessed, step- or checkpoint-)")
    ls.set_defaults(func=cmd_ls)
    v = sub.add_parser("verify", help="re-read every byte of a checkpoint against its checksums",
                       description="Re-read every byte of a committed checkpoint (or the newest committed "
                                   "one of a run root) against the manifest's xxh3 checksums. Exit 0: all "
                                   "match; 1: a mismatch or damaged file (named); 2: nothing to verify.")
    v.add_argument("path", help="checkpoint folder, run root, or a foreign safetensors file/HF folder "
                                "(headers and index validated only)")
    v.add_argument("--prefix", default=None, help="step folder prefix of a run root (default: guessed)")
    v.add_argument("--threads", type=int, default=None, help="parallel readers (default 8-16)")
    v.set_defaults(func=cmd_verify)
    pr = sub.add_parser("prune", help="keep the newest N committed checkpoints; remove dead writers' leftovers")
    pr.add_argument("root")
    pr.add_argument("--keep", type=int, required=True, help="committed steps to keep (>= 1)")
    pr.add_argument("--prefix", default=None, help="step folder prefix (default: guessed, step- or checkpoint-)")
    pr.set_defaults(func=cmd_prune)
    try:
        from .serve import add_load_parser  # issue 4: `fastckpt load`
    except ImportError:
        pass
    else:
        add_load_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastckpt`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FastCkptError, OSError, ValueError) as e:
        print(f"fastckpt {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
