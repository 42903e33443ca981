"""The ``fastckpt`` command line: ls, verify, prune, load, tier (and subcommands added by integrations).

Exit codes: 0 success, 1 a check failed (verify mismatch), 2 bad usage or nothing found.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from ..errors import CheckpointNotFoundError, FastCkptError, FolderNotWritableError
from ..manager import CheckpointManager
from ..storage.commit import MANIFEST, read_manifest
from ..storage.locate import store_for
from ..storage.store import LOCAL
from ..storage.retention import is_temp_name
from .common import (SIZE_UNITS_HELP, Run, find_runs, human_bytes, not_found_message,  # noqa: F401
                     parse_bytes, positive_int, progress_bar)  # parse_bytes re-exported: tests, scripts
from .serve import add_load_parser
from .tier import add_tier_parser


def cmd_ls(args: argparse.Namespace) -> int:
    """List committed steps with sizes, and what was skipped and why (every layout, see find_runs); exit 2
    when nothing is committed under the root (a run of crashed saves only), as ``verify`` does."""
    runs = find_runs(args.root, args.prefix)
    if not runs:
        raise CheckpointNotFoundError(not_found_message(args.root, args.prefix))
    shown: set[tuple[Path, str]] = set()
    for run in runs:
        print(f"{run.describe()}:")
        print(f"{'step':>10}  {'size':>10}  {'files':>5}  {'tensors':>7}  path")
        store = run.store
        for s, p in run.scan.committed:
            m = read_manifest(str(p), None if store.local else store)
            size = (m.bytes_total or 0) + store.size(store.join(str(p), MANIFEST))  # the manifest cannot list itself
            print(f"{s:>10}  {human_bytes(size):>10}  {len(m.files) + 1:>5}  {len(m.tensors):>7}  {p}")
        newest = run.scan.newest()  # by commit time, as CheckpointManager.latest() and prune
        print(f"latest committed: {newest[0] if newest else '-'}")
        for name, why in run.scan.skipped():
            if (run.folder, name) not in shown:  # a folder's leftovers are in the scan of each of its runs
                shown.add((run.folder, name))
                print(f"skipped {name}: {why}")
    if not any(run.scan.committed or run.scan.engine_tags() for run in runs):  # crashed saves only
        print(f"{args.root}: no committed checkpoint (the folders above were skipped; nothing to load)",
              file=sys.stderr)
        return 2
    return 0


def _one_run(root: str, prefix: str | None, what: str) -> Run | None:
    """The single run root at ``root`` (``None`` if there is none).

    Raises:
        CheckpointNotFoundError: several runs (other prefixes or ``root/checkpoints``): names them.
    """
    runs = find_runs(root, prefix)
    if len(runs) > 1:
        raise CheckpointNotFoundError(
            f"{os.path.abspath(root)} holds several runs ({', '.join(r.describe() for r in runs)}); "
            f"to {what} one, pass its folder and --prefix")
    return runs[0] if runs else None


def _zero_tag(path: str) -> str | None:
    """The committed DeepSpeed tag folder ``path`` is or names (``save_dir`` + ``latest``), written by
    fastckpt's DeepSpeed engine (one fastckpt folder per ``*_states.pt``), else None."""
    if store_for(path) is not LOCAL or not LOCAL.isdir(path) or LOCAL.exists(os.path.join(path, MANIFEST)):
        return None
    from ..loading.zero import find_zero_tag
    return find_zero_tag(path)


def _verify_zero_tag(tag: str, verify, threads, progress):
    """Every ``*_states.pt`` fastckpt folder of DeepSpeed tag ``tag``, verified; one combined report."""
    from ..loading.resolve import DS_FILE_RE
    folders = [os.path.join(tag, n) for n in sorted(LOCAL.listdir(tag))
               if DS_FILE_RE.match(n) and LOCAL.isdir(os.path.join(tag, n))]
    out, before = None, 0
    for f in folders:
        rep = verify(f, threads=threads, progress=lambda d, t, b=before: progress(b + d, b + t))
        before += rep.bytes_checked
        if out is None:
            out = rep
            out.path = tag
        else:
            out.bytes_checked += rep.bytes_checked
            out.problems += rep.problems
            out.notes += rep.notes
    if out is None:
        raise CheckpointNotFoundError(f"{tag}: a DeepSpeed tag without any *_states.pt folder")
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-read every byte against the manifest, with a progress bar on stderr (as ``load --to``; ``-q``:
    none); exit 1 on any mismatch."""
    from ..loading.verify import verify
    path = args.path
    run = None
    store = store_for(path)
    if store.isdir(path) and not store.exists(store.join(path, MANIFEST)):
        run = _one_run(path, args.prefix, "verify")
        if run is not None and run.scan.committed:  # a run root: verify its newest committed checkpoint
            path = str(run.scan.newest()[1])
            print(f"{args.path} is a run root: verifying its newest committed checkpoint {path}")
    elif getattr(args, "prefix", None):
        print(f"note: --prefix {args.prefix} selects checkpoints of a run root; {path} is one checkpoint (or "
              "file): verifying it", file=sys.stderr)
    bars = []  # drawn once verify starts re-reading bytes (on stderr, as `load --to`; -q: none)

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(progress_bar(total, "verify", args.quiet))
        if total > (bars[0].total or 0):  # a DeepSpeed tag: one folder after another
            bars[0].total = total
        bars[0].update(done - bars[0].n)

    tag = _zero_tag(path)
    try:
        rep = _verify_zero_tag(tag, verify, args.threads, progress) if tag else \
            verify(path, threads=args.threads, progress=progress)
        if tag:
            print(f"{args.path} is a DeepSpeed save (fastckpt engine): verifying every file of its tag {tag}")
            path = tag
    except CheckpointNotFoundError as e:
        if not store.isdir(path):
            raise
        if run is None:  # nothing of ours and nothing foreign: say what was looked for
            hint = str(e).partition("nothing to load; ")[2]  # pickled weights, a diffusers pipeline: named
            raise CheckpointNotFoundError(not_found_message(path, args.prefix) + "; no manifest.json, "
                                          "*.safetensors.index.json or *.safetensors files in it either"
                                          + (f"; {hint}" if "fastckpt checkpoints" not in hint and hint else "")
                                          ) from None
        why = "; ".join(f"{n}: {w}" for n, w in run.scan.skipped())
        raise CheckpointNotFoundError(f"{run.describe()}: no committed checkpoint (skipped: {why})") from None
    finally:
        for bar in bars:
            bar.close()
    for p in rep.problems:
        print(f"MISMATCH {p}")
    for n in rep.notes:
        print(f"note: {n}")
    n = len(rep.problems)
    status = ("OK" if not rep.notes else "headers and index valid, no checksums to compare") if rep.ok \
        else f"FAILED ({n} problem{'s' if n != 1 else ''})"
    print(f"{path}: {status}, {human_bytes(rep.bytes_checked)} checked")
    damaged = run.scan.damaged() if run else []
    for n, why in damaged:  # a run root: a commit whose manifest was damaged is skipped by the scan, not OK
        print(f"DAMAGED {n}: {why}")
    return 0 if rep.ok and not damaged else 1


def cmd_prune(args: argparse.Namespace) -> int:
    """Keep the N most recently committed steps (as ``CheckpointManager``); remove older commits and
    dead temporaries.

    Touches nothing (not even the root lock file) where no run root is found.
    """
    if args.keep < 1:  # bad usage first, whatever the folder holds
        raise ValueError(f"keep must be >= 1 (an int), got {args.keep!r}")
    run = _one_run(args.root, args.prefix, "prune")
    if run is None:
        raise CheckpointNotFoundError(not_found_message(args.root, args.prefix) + "; nothing pruned")
    mgr = CheckpointManager(run.folder, prefix=run.prefix)
    store = store_for(str(run.folder))
    temps = [n for n in store.listdir(str(run.folder)) if is_temp_name(n)]
    try:
        removed = mgr.prune(args.keep)
    except OSError as e:
        if isinstance(e, FastCkptError) or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise FolderNotWritableError(
            f"{run.folder}: not writable ({e.strerror}: {e.filename}): prune removes folders there and takes the run "
            "root's lock file; nothing was pruned. Prune where the tier is mounted read-write, or as a user "
            "who may write the run root", path=str(run.folder), folder=str(run.folder), errno=e.errno) from None
    gone = [n for n in temps if not store.lexists(store.join(str(run.folder), n))]
    left = f"; removed {len(gone)} leftover folder(s) of dead writers: {', '.join(sorted(gone))}" if gone else ""
    print(f"{run.describe()}: removed steps: {removed or 'none'}; kept: {mgr.steps()}{left}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fastckpt`` (subcommands ls, verify, prune, load, tier; ``--version``)."""
    from .. import __version__
    p = argparse.ArgumentParser(prog="fastckpt", description="Fast, safe checkpoint and weight I/O.",
                                epilog=f"{_FOUND}. {SIZE_UNITS_HELP}.")
    p.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    ls = sub.add_parser("ls", help="list committed checkpoints under a root, and what was skipped",
                        description=f"List the committed checkpoints of a run root with their sizes "
                                    f"(decimal units: 1 MB = 10^6 bytes), and what was skipped and why. "
                                    f"{_FOUND}. Exit 0: listed; 2: nothing found or nothing committed (says where it looked); 141: "
                                    "the reader of its output closed the pipe first (e.g. | head).")
    ls.add_argument("root")
    ls.add_argument("--prefix", default=None, help=_PREFIX_HELP)
    ls.set_defaults(func=cmd_ls)
    v = sub.add_parser("verify", help="re-read every byte of a checkpoint against its checksums",
                       description="Re-read every byte of a committed checkpoint (or the newest committed "
                                   "one of a run root) against the manifest's xxh3 checksums (format 2: one per "
                                   "chunk of a tensor several ranks wrote; a mismatch names the chunk's offsets). "
                                   "Progress is drawn on stderr (as `load --to`; -q hides it): stdout holds only "
                                   "the result. "
                                   "Exit 0: all match; 1: a mismatch or damaged file (named); 2: nothing to verify. "
                                   f"{_FOUND}. Sizes in decimal units (1 MB = 10^6 bytes).")
    v.add_argument("path", help="checkpoint folder, run root, a DeepSpeed save_dir or tag written by fastckpt's "
                                "engine (every *_states.pt folder of the tag), one safetensors file or sub-folder "
                                "(a second adapter) of a checkpoint (checked against its manifest), or a foreign safetensors file/HF folder "
                                "(headers and index validated only)")
    v.add_argument("--prefix", default=None, help=_PREFIX_HELP)
    v.add_argument("--threads", type=positive_int, default=None, help="parallel readers (default 8-16)")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar (it is drawn on stderr)")
    v.set_defaults(func=cmd_verify)
    pr = sub.add_parser("prune", help="keep the N most recently committed checkpoints; remove dead writers' leftovers",
                        description="Keep the N most recently committed checkpoints of a run root (by the commit "
                                    "time in their manifests, as CheckpointManager and `ls`'s latest; never the "
                                    "newest one) and remove dead writers' leftovers: an earlier run's "
                                    "higher-numbered steps are older commits and go first. "
                                    f"{_FOUND}. Exit 2, touching nothing, where no run root is found.")
    pr.add_argument("root")
    pr.add_argument("--keep", type=int, required=True, help="committed steps to keep (>= 1)")
    pr.add_argument("--prefix", default=None, help=_PREFIX_HELP)
    pr.set_defaults(func=cmd_prune)
    add_load_parser(sub)
    add_tier_parser(sub)
    return p


_FOUND = ("A run root is a folder of step-N (CheckpointManager), checkpoint-N (Trainer callback) or "
          "checkpoint_N (accelerate plugin) folders; ROOT/checkpoints is searched too (accelerate's project_dir)")
_PREFIX_HELP = "only step folders named PREFIX<N> (default: step-, checkpoint- and checkpoint_)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastckpt`` console script; returns the exit code (2: no command or a bad one)."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `fastckpt`: the commands, not argparse's "required"
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `fastckpt ls ROOT | head`: the reader left; not an error of the command
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        return 141  # 128 + SIGPIPE, as a shell tool killed by the signal
    except (FastCkptError, OSError, ValueError) as e:
        print(f"fastckpt {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
