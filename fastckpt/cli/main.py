"""The ``fastckpt`` command line: ls, verify, prune, load (and subcommands added by integrations).

Exit codes: 0 success, 1 a check failed (verify mismatch), 2 bad usage or nothing found.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import FastCkptError
from ..manager import CheckpointManager
from ..storage.commit import MANIFEST, read_manifest
from ..storage.retention import scan_checkpoints
from .common import human_bytes, parse_bytes  # noqa: F401  (parse_bytes re-exported: tests, scripts)
from .serve import add_load_parser


def _guess_prefix(root: str) -> str:
    """``checkpoint-`` (Trainer), ``checkpoint_`` (accelerate) or ``step-`` (the default)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return "step-"
    for prefix in ("checkpoint-", "checkpoint_"):
        if any(n.startswith(prefix) for n in names):
            return prefix
    return "step-"


def cmd_ls(args: argparse.Namespace) -> int:
    """List committed steps with sizes, and what was skipped and why."""
    prefix = args.prefix or _guess_prefix(args.root)
    scan = scan_checkpoints(args.root, prefix)
    skipped = scan.skipped()
    if not scan.committed and not skipped:
        print(f"{args.root}: no checkpoints (prefix {prefix!r})")
        return 2
    print(f"{'step':>10}  {'size':>10}  {'files':>5}  {'tensors':>7}  path")
    for s, p in scan.committed:
        m = read_manifest(str(p))
        size = m.get("bytes_total", 0) + os.path.getsize(p / MANIFEST)  # the manifest cannot list itself
        print(f"{s:>10}  {human_bytes(size):>10}  {len(m['files']) + 1:>5}  {len(m['tensors']):>7}  {p}")
    print(f"latest committed: {scan.steps[-1] if scan.steps else '-'}")
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
    print(f"{path}: {status}, {human_bytes(rep.bytes_checked)} checked")
    return 0 if rep.ok else 1


def cmd_prune(args: argparse.Namespace) -> int:
    """Keep the newest N committed steps; remove older ones and dead temporaries."""
    mgr = CheckpointManager(args.root, prefix=args.prefix or _guess_prefix(args.root))
    removed = mgr.prune(args.keep)
    print(f"removed steps: {removed or 'none'}; kept: {mgr.steps()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fastckpt`` (subcommands ls, verify, prune, load)."""
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
