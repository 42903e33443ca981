"""``fastckpt load DEEPSPEED_SAVE_DIR --to DIR [--config HF_DIR]``: a ZeRO checkpoint to an HF folder.

Called by :func:`fastckpt.cli.serve.cmd_load` when the source is a DeepSpeed ``save_dir`` (or tag
folder) written by fastckpt's DeepSpeed engine (:func:`fastckpt.loading.zero.find_zero_tag`):
the full fp32 weights are rebuilt from every rank's ZeRO-1/2/3 partitions
(:func:`fastckpt.loading.zero.consolidate`, every tensor checked against its manifest xxh3),
written as HF sharded safetensors (:func:`fastckpt.saving.export.write_shards`) into a hidden
sibling of ``DIR`` together with ``config.json``, generation config and tokenizer files (taken
from ``--config HF_DIR`` first, then the tag folder, then ``save_dir``: HF Trainer puts them next
to ``global_stepN``), the servability gate checks it (:func:`fastckpt.loading.servable.check_servable`:
``config.json`` names architecture and dtype, every parameter of the architecture is there with its
shape; a frozen parameter a save left out is named there), and the folder is renamed into place.
Nothing appears at ``DIR`` unless all of it succeeded.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from ..format.dtypes import dtype_to_str
from ..loading.zero import consolidate
from ..saving.export import plan_shards, write_shards
from ..storage.store import LOCAL, strategy
from .common import check_export_target, matching_files

#: The consolidated folder is built in a hidden folder and renamed into place.
_COMMIT = strategy("rename")


def meta_folders(tag_dir: str, config: str | None) -> list[str]:
    """Folders config/tokenizer files are taken from, first match wins: ``--config``, the tag
    folder, its parent (the DeepSpeed ``save_dir``)."""
    out = []
    for d in (config, tag_dir, os.path.dirname(tag_dir)):
        if d and LOCAL.isdir(d) and os.path.abspath(d) not in out:
            out.append(os.path.abspath(d))
    return out


def check_to_zero(to: str, tag_dir: str, config: str | None) -> None:
    """Refuse a ``--to`` that is, lies inside or contains the save_dir, the tag or ``--config``.

    Raises:
        ValueError: naming both paths (before anything is written).
    """
    real_to = LOCAL.realpath(to)
    for p in (os.path.dirname(tag_dir), tag_dir, config):
        if not p:
            continue
        rp = LOCAL.realpath(p)
        if real_to == rp or os.path.commonpath([real_to, rp]) in (rp, real_to):
            raise ValueError(f"refusing --to {to}: it is, is inside or contains {os.path.abspath(p)}, which the "
                             "consolidation reads; choose a --to elsewhere")


def export_zero(tag_dir: str, to: str, args: argparse.Namespace, meta_patterns: tuple[str, ...],
                gate: Callable[[str, str], None] | None = None) -> str:
    """Write the servable HF folder ``to`` from the ZeRO tag ``tag_dir``; returns ``to``.

    Args:
        tag_dir: from :func:`fastckpt.loading.zero.find_zero_tag`.
        to: output folder (absolute); must not exist unless ``args.overwrite``.
        args: ``fastckpt load``'s arguments (``config``, ``overwrite``, ``threads``,
            ``max_shard_size``, ``quiet``).
        meta_patterns: glob patterns of the config/tokenizer files to copy.
        gate: called as ``gate(hidden_folder, to)`` once the folder is complete and before it is
            renamed into place (``fastckpt load``'s servability gate); what it raises leaves
            nothing at ``to``.

    Raises:
        CheckpointExistsError: ``to`` exists and ``--overwrite`` was not given, or ``to`` is not a model
            folder or an empty folder (:func:`~fastckpt.cli.common.check_export_target`).
        IncompleteTagError, CorruptCheckpointError, ChecksumMismatchError: from the checkpoint
            (nothing at ``to``).
        NotServableError: from ``gate`` (nothing at ``to``).
    """
    config = getattr(args, "config", None)
    check_to_zero(to, tag_dir, config)
    check_export_target(to, args.overwrite)
    sd, info = consolidate(tag_dir)
    print(f"source: DeepSpeed ZeRO-{info.stage} tag {tag_dir} ({info.world_size} ranks, {len(sd)} tensors, "
          f"{'fp32 master weights' if info.stage else 'module weights'})", file=sys.stderr)
    LOCAL.makedirs(os.path.dirname(to) or ".")
    tmp = _COMMIT.begin(LOCAL, to, overwrite=args.overwrite)
    try:
        copied = _copy_matching(meta_folders(tag_dir, config), tmp, meta_patterns)
        entries = [(n, dtype_to_str(t.dtype, tensor=n), tuple(t.shape), t.numel() * t.element_size())
                   for n, t in sd.items()]
        plan = plan_shards(entries, args.max_shard_size)
        write_shards(plan, lambda names: {n: sd[n].contiguous() for n in names}, tmp, threads=args.threads)
        if "config.json" not in copied:
            print(f"fastckpt load: no config.json in {', '.join(meta_folders(tag_dir, config))}; pass "
                  "--config HF_DIR (the model's config and tokenizer folder)", file=sys.stderr)
        if gate is not None:
            gate(tmp, to)
        _COMMIT.finish(LOCAL, tmp, to, overwrite=args.overwrite)
    except BaseException:
        _COMMIT.abort(LOCAL, tmp)
        raise
    return to


def _copy_matching(folders: list[str], dst: str, patterns: tuple[str, ...]) -> list[str]:
    copied: list[str] = []
    for d in folders:
        for name in matching_files(d, patterns):
            if name not in copied:
                LOCAL.makedirs(os.path.dirname(os.path.join(dst, name)))
                LOCAL.put_file(os.path.join(d, name), os.path.join(dst, name))
                copied.append(name)
    return copied
