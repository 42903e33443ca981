"""``fastckpt load``: the step before ``vllm serve``.

``fastckpt load SOURCE [--to DIR] [--merge-lora] [--verify] [--warm] [--threads N]``

1. Find the checkpoint: SOURCE is a run root (newest committed ``checkpoint-N``/``step-N``),
   a committed fastckpt checkpoint folder, or any HF model folder (or a peft adapter folder
   with ``--base``).
2. Validate: headers, index and manifest sizes always; with a manifest, every tensor's xxh3
   (``--verify`` checks all files up front; otherwise tensors are checked as they are copied
   and the output is committed only if all match). Nothing appears at ``--to`` unless the
   source is sound: the output is built in a hidden sibling folder and renamed into place.
3. With ``--to``: write a servable HF folder (config, generation config, tokenizer files
   from the checkpoint, else from the base model folder (``--base`` or the adapter's local
   ``base_model_name_or_path``), with a warning when none exist; sharded safetensors + index) with parallel large I/O; a LoRA adapter is merged through
   peft (``--merge-lora``) or laid out as ``DIR/adapter`` for ``vllm serve --enable-lora``.
   Without ``--to``: warm the page cache with parallel sequential reads of the weights.
4. Print the ``vllm serve ...`` command to run.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shlex
import shutil
import sys
import tempfile
import warnings

from ..errors import CheckpointExistsError, CorruptCheckpointError
from ..loading.source import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Source, adapter_base_dir, resolve_source
from ..saving.export import Entry, plan_shards, warm_files, write_shards
from ..storage import commit as cm
from ..storage.io import copy_file, fsync_dir
from .common import parse_bytes
#: Small files copied next to the weights when present (config, generation and tokenizer files).
META_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                 "merges.txt", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
                 "processor_config.json", "*.tiktoken")
#: Any of these makes ``AutoTokenizer.from_pretrained`` possible.
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")


def _entries(src: Source) -> list[Entry]:
    out = []
    for name, key in src.weights.items():
        info = src.resolved.tensors[key][1]
        out.append((name, info.dtype, tuple(info.shape), info.nbytes))
    return out


def _copy_meta(src_dir: str, dst: str) -> list[str]:
    copied = []
    for pat in META_PATTERNS:
        for p in sorted(glob.glob(os.path.join(glob.escape(src_dir), pat))):
            name = os.path.basename(p)
            if os.path.isfile(p) and not os.path.exists(os.path.join(dst, name)):
                copy_file(p, os.path.join(dst, name))
                copied.append(name)
    return copied


def _has_tokenizer(folder: str) -> bool:
    return any(glob.glob(os.path.join(glob.escape(folder), pat)) for pat in TOKENIZER_PATTERNS)


def _meta_fallbacks(src: Source, args: argparse.Namespace) -> list[str]:
    """Folders to take missing tokenizer/generation-config files from, after ``src.meta_dir``:
    ``--base``, then the adapter's local ``base_model_name_or_path``."""
    out = []
    for d in (getattr(args, "base", None), src.adapter_dir and adapter_base_dir(src.adapter_dir)):
        if d and os.path.isdir(d) and os.path.abspath(d) != os.path.abspath(src.meta_dir) \
                and os.path.abspath(d) not in out:
            out.append(os.path.abspath(d))
    return out


def _copy_all_meta(src: Source, dst: str, args: argparse.Namespace) -> list[str]:
    """Copy config/generation/tokenizer files from the source, then the missing ones from the
    base model folder when known; warn when the result has no tokenizer."""
    copied = _copy_meta(src.meta_dir, dst)
    for d in _meta_fallbacks(src, args):
        if _has_tokenizer(dst) and os.path.exists(os.path.join(dst, "generation_config.json")):
            break
        more = _copy_meta(d, dst)
        if more:
            print(f"fastckpt load: copied {', '.join(more)} from the base model folder {d}", file=sys.stderr)
        copied += more
    if not _has_tokenizer(dst):
        where = ", ".join([src.meta_dir] + _meta_fallbacks(src, args))
        print(f"fastckpt load: WARNING: no tokenizer files found (looked in {where}); the output folder has "
              f"no tokenizer and vllm serve / AutoTokenizer will fail on it. Save one into it "
              f"(tokenizer.save_pretrained(DIR)), pass --base BASE_MODEL_DIR, or give vllm serve --tokenizer.",
              file=sys.stderr)
    return copied


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, disable=quiet,
                file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


@contextlib.contextmanager
def _view(files: dict[str, str]):
    """A temporary folder of symlinks ``name -> path`` (to show peft/transformers only some files)."""
    d = tempfile.mkdtemp(prefix="fastckpt-view-")
    try:
        for name, p in files.items():
            os.symlink(p, os.path.join(d, name))
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def merged_state(src: Source):
    """Merge ``src``'s adapter into its base through peft; returns ``(state_dict, entries)`` (CPU).

    Tied weights (one storage under several names) are written once, under their first name.
    """
    import peft
    from transformers import AutoModelForCausalLM

    from ..format.dtypes import dtype_to_str
    base_files = {os.path.basename(p): p for p in src.weight_files}
    for ix in glob.glob(os.path.join(glob.escape(src.path), "*.safetensors.index.json")):
        base_files[os.path.basename(ix)] = ix
    base_files["config.json"] = os.path.join(src.meta_dir, "config.json")
    ad = {n: os.path.join(src.adapter_dir, n) for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}
    with _view(base_files) as bdir, _view(ad) as adir:
        model = AutoModelForCausalLM.from_pretrained(bdir, dtype="auto")
        merged = peft.PeftModel.from_pretrained(model, adir).merge_and_unload()
    sd, seen, entries = {}, set(), []
    for name, t in merged.state_dict().items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and ptr in seen:
            continue
        seen.add(ptr)
        sd[name] = t.detach().contiguous()
        entries.append((name, dtype_to_str(t.dtype, tensor=name), tuple(t.shape), t.numel() * t.element_size()))
    return sd, entries


def export(src: Source, to: str, args: argparse.Namespace) -> str:
    """Build the servable folder in a hidden sibling of ``to`` and rename it into place; returns ``to``.

    Raises:
        ChecksumMismatchError / CorruptCheckpointError: a source tensor is damaged (nothing at ``to``).
        CheckpointExistsError: ``to`` exists and ``--overwrite`` was not given.
    """
    if os.path.lexists(to) and not args.overwrite:
        raise CheckpointExistsError(f"{to} exists; choose another --to or pass --overwrite")
    os.makedirs(os.path.dirname(to) or ".", exist_ok=True)
    tmp = cm.make_temp_dir(to)
    try:
        if args.merge_lora and src.adapter_dir:
            with warnings.catch_warnings():
                if args.quiet:  # -q: also transformers' own "Loading weights" bar and notices
                    import transformers
                    transformers.utils.logging.disable_progress_bar()
                    transformers.utils.logging.set_verbosity_error()
                    warnings.simplefilter("ignore", FutureWarning)
                sd, entries = merged_state(src)
            fetch = lambda names: {n: sd[n] for n in names}  # noqa: E731
        else:
            entries = _entries(src)
            fetch = lambda names: src.read(names, threads=args.threads)  # noqa: E731  (checksums if a manifest)
        plan = plan_shards(entries, args.max_shard_size)
        with _progress(plan.total_bytes, "export", args.quiet) as bar:
            write_shards(plan, fetch, tmp, threads=args.threads, progress=bar.update)
        _copy_all_meta(src, tmp, args)
        if src.adapter_dir and not args.merge_lora:
            _layout_adapter(src.adapter_dir, os.path.join(tmp, "adapter"), to)
        os.unlink(os.path.join(tmp, cm.OWNER))
        cm.commit_dir(tmp, to, overwrite=args.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to


def _layout_adapter(adapter_dir: str, dst: str, base: str) -> None:
    """``dst/adapter_config.json`` (base pointed at the export) + the adapter weights, fsynced."""
    os.makedirs(dst)
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG), "rb") as f:
        cfg = json.loads(f.read())
    cfg["base_model_name_or_path"] = base
    cm.write_small_file(os.path.join(dst, ADAPTER_CONFIG), json.dumps(cfg, indent=2, sort_keys=True).encode())
    copy_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS), os.path.join(dst, ADAPTER_WEIGHTS))
    fsync_dir(dst)


def vllm_command(model_dir: str, adapter_dir: str | None) -> str:
    """The ``vllm serve`` command line for ``model_dir`` (+ a LoRA adapter folder)."""
    cmd = ["vllm", "serve", model_dir]
    if adapter_dir:
        with open(os.path.join(adapter_dir, ADAPTER_CONFIG), "rb") as f:
            rank = int(json.loads(f.read()).get("r", 16))
        cmd += ["--enable-lora", "--lora-modules", f"adapter={adapter_dir}", "--max-lora-rank", str(rank)]
    return " ".join(shlex.quote(c) for c in cmd)


def cmd_load(args: argparse.Namespace) -> int:
    """Resolve, verify, export or warm, then print the ``vllm serve`` command."""
    src = resolve_source(args.source, base=args.base)
    print(f"source: {src.path} ({len(src.weights)} weight tensors"
          f"{', LoRA adapter ' + src.adapter_dir if src.adapter_dir else ''})", file=sys.stderr)
    if args.merge_lora and not src.adapter_dir:
        print("fastckpt load: --merge-lora: the source has no adapter; nothing to merge", file=sys.stderr)
    if args.verify:
        if not _verify(src):
            return 1
    if args.to:
        out = export(src, os.path.abspath(args.to), args)
        adapter = os.path.join(out, "adapter") if src.adapter_dir and not args.merge_lora else None
        if args.warm:
            _warm(glob.glob(os.path.join(glob.escape(out), "*.safetensors")), args)
        print(f"wrote {out}", file=sys.stderr)
    else:
        if args.merge_lora and src.adapter_dir:
            raise ValueError("--merge-lora writes a new folder: pass --to DIR")
        _warm(src.weight_files, args)
        out, adapter = src.path, src.adapter_dir
    print(vllm_command(out, adapter))
    return 0


def _verify(src: Source) -> bool:
    from ..loading.verify import verify
    if src.resolved.manifest is None:
        print(f"{src.path}: no manifest, no checksums: headers and index validated", file=sys.stderr)
        return True
    rep = verify(src.path)
    for p in rep.problems:
        print(f"MISMATCH {p}", file=sys.stderr)
    if not rep.ok:
        raise CorruptCheckpointError(f"{src.path}: {len(rep.problems)} checksum problems; refusing to serve it",
                                     path=src.path)
    print(f"{src.path}: checksums OK ({rep.bytes_checked} bytes)", file=sys.stderr)
    return True


def _warm(files: list[str], args: argparse.Namespace) -> None:
    total = sum(os.stat(p).st_size for p in files)
    with _progress(total, "warm", args.quiet) as bar:
        warm_files(files, threads=args.threads, progress=bar.update)


def add_load_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``fastckpt load`` to the ``fastckpt`` subcommands (called by :mod:`fastckpt.cli.main`)."""
    p = subparsers.add_parser("load", help="prepare a checkpoint for vllm serve: verify, merge LoRA, export or warm",
                              description=__doc__.replace("``", "`"), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="run root, checkpoint folder, HF model folder or peft adapter folder")
    p.add_argument("--to", default=None, help="write a servable HF folder here (a fast local disk)")
    p.add_argument("--merge-lora", action="store_true", help="merge the LoRA adapter into the weights (peft)")
    p.add_argument("--verify", action="store_true", help="re-read every file against the manifest checksums first")
    p.add_argument("--warm", action="store_true", help="read the weights into the page cache (default without --to)")
    p.add_argument("--threads", type=int, default=None, help="parallel I/O requests (default 8-16)")
    p.add_argument("--max-shard-size", type=parse_bytes, default=5_000_000_000, help="bytes per shard (default 5GB)")
    p.add_argument("--base", default=None, help="base model folder when SOURCE is an adapter-only folder")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --to folder atomically")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_load)
    return p
