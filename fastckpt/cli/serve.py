"""``fastckpt load``: the step before ``vllm serve``.

``fastckpt load SOURCE [--to DIR] [--merge-lora] [--base BASE_DIR] [--config HF_DIR] [--max-shard-size SIZE]
[--overwrite] [--verify] [--warm] [--threads N] [-q]``

SOURCE may also be a DeepSpeed ``save_dir`` (or tag folder) written by fastckpt's DeepSpeed
engine: ``--to DIR`` then consolidates its ZeRO-1/2/3 partitions (any number of ranks) into a
servable HF folder of fp32 weights (:mod:`fastckpt.cli.consolidate`). An FSDP2 checkpoint
written by fastckpt (full tensors, as a one-process save writes them) exports like any fastckpt checkpoint.
``--config HF_DIR`` supplies ``config.json`` / tokenizer files (over the checkpoint's). Native
DeepSpeed (pickled ``*_model_states.pt``) and DCP (pickled ``.metadata``) folders are refused,
naming the pickle file.

1. Find the checkpoint: SOURCE is a run root (newest committed ``checkpoint-N``/``step-N``),
   a committed fastckpt checkpoint folder, or any HF model folder (or a peft adapter folder
   with ``--base``).
2. Validate: headers, index and manifest sizes always; with a manifest, every byte export
   copies or merges (weights, adapter, config and tokenizer files the manifest lists) is
   checked against its xxh3 as it is read (``--verify`` also checks all files up front).
   Nothing appears at ``--to`` unless the source is sound: the output is built in a hidden
   sibling folder and renamed into place. A ``--to`` equal to, inside or containing the
   source (or the run root it came from, or the base model folder) is refused.
3. With ``--to``: write a servable HF folder (config, generation config, tokenizer files
   from the checkpoint, else from the base model folder (``--base`` or the adapter's local
   ``base_model_name_or_path``), with a warning when none exist; the weights as ``model.safetensors``, or as
   ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` past one shard) with parallel large I/O; a LoRA adapter is merged through
   peft (``--merge-lora``) or laid out as ``DIR/adapter`` (peft's named adapters: ``DIR/adapter-NAME``)
   for ``vllm serve --enable-lora``.
   Without ``--to``: warm the page cache with parallel sequential reads of the weights (and
   check them against the manifest checksums while reading, saying whether it could).
4. Servability gate (:mod:`fastckpt.loading.servable`), on the folder built for ``--to`` before
   it is renamed into place (without ``--to``, on the source: a failure there is a WARNING, no
   command printed, exit 0 since the warm-up was done): ``config.json`` names an architecture
   (``architectures``) and a dtype (``dtype``/``torch_dtype``); every parameter of that
   architecture (transformers builds it from the config on the meta device: no weights, no code
   from the checkpoint) is in the folder with its shape; tied parameters stored twice are equal.
   A failure exits non-zero naming the missing or mis-shaped keys and leaves nothing at ``--to``
   (fix: ``--config HF_DIR`` with the config.json the model's ``save_pretrained`` wrote). A
   ``trust_remote_code`` config (``auto_map``), a quantized model (``quantization_config``) or an
   architecture transformers does not have gets only the config checks, with a WARNING that the
   parameters were not checked.
5. Print the ``vllm serve ...`` command to run (only after the gate passed).

Exit status with ``--to``: 0: the folder is ready to serve (command printed); 2: an error, a failed
gate included (named on stderr, no command printed, nothing at ``--to``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path
import warnings

from ..errors import CorruptCheckpointError, FastCkptError, LoraMergeError, NotServableError
from ..loading.source import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, Source, adapter_base_dir, file_checks,
                              resolve_source)
from ..saving.committer import folder_error
from ..saving.export import Entry, copy_checked, plan_shards, read_checked, warm_files, write_shards
from ..storage import commit as cm
from ..storage.model_files import is_inside, safe_join
from ..storage.locate import is_url, store_for
from ..storage.store import LOCAL, strategy
from ..storage.tier import tier_for

#: Exports are built in a hidden folder and renamed into place (never half-visible at --to).
_COMMIT = strategy("rename")
from ..loading.servable import (check_servable, converted_on_save, ignored_on_save, module_prefix, saved_names,
                                to_saved_layout)
from ..loading.zero import find_zero_tag
from . import lora
from .common import check_export_target, matching_files, positive_bytes, positive_int, progress_bar
from .consolidate import export_zero
#: Small files copied next to the weights when present (config, generation and tokenizer files).
META_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                 "merges.txt", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
                 "processor_config.json", "*.tiktoken", "additional_chat_templates/*.jinja",
                 "*.py")  # a trust_remote_code model's code (copied, never run), as save_pretrained copies it
#: Any of these makes ``AutoTokenizer.from_pretrained`` possible.
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")


def _entries(src: Source) -> list[Entry]:
    out = []
    for name, key in src.weights.items():
        info = src.resolved.tensors[key][1]
        out.append((name, info.dtype, tuple(info.shape), info.nbytes))
    return out


class _Checked:
    """What the export or warm-up checked against manifest checksums, and what it could not."""

    def __init__(self) -> None:
        self.tensors = 0
        self.files: list[str] = []
        self.unchecked: list[str] = []

    def summary(self) -> str:
        """One line for stderr."""
        if not self.tensors and not self.files:
            return ("NOT verified: the source has no fastckpt manifest, so there are no checksums to compare "
                    "against (headers and index were validated)")
        n = len(self.files)
        out = (f"verified while reading: {self.tensors} tensor{'s' * (self.tensors != 1)} and {n} "
               f"file{'s' * (n != 1)} matched the manifest xxh3")
        if self.unchecked:
            out += f"; no checksum for {', '.join(self.unchecked)}"
        return out


def _copy_side_file(folder: str, name: str, dst: str, checked: _Checked) -> None:
    """Copy ``folder/name`` to ``dst``, checked against ``folder``'s manifest when it lists the file."""
    src = os.path.join(folder, name)
    fc = file_checks(folder, name)
    if fc is None or not fc[1]:
        LOCAL.put_file(src, dst)
        checked.unchecked.append(name)
        return
    copy_checked(src, dst, fc[0], fc[1])
    checked.files.append(name)
    checked.tensors += sum(c.what.startswith("tensor ") for c in fc[1])


def _read_side_file(folder: str, name: str, checked: _Checked) -> bytes:
    """The bytes of the small file ``folder/name``, checked when ``folder``'s manifest lists it."""
    fc = file_checks(folder, name)
    if fc is None or not fc[1]:
        data = LOCAL.read_bytes(os.path.join(folder, name))
        checked.unchecked.append(name)
        return data
    data = read_checked(os.path.join(folder, name), fc[0], fc[1])
    checked.files.append(name)
    return data


def _meta_files(src_dir: str) -> list[str]:
    """Names (relative, ``/``-separated: transformers 5 writes each named chat template to
    ``additional_chat_templates/NAME.jinja``) of the config/tokenizer files of ``src_dir``, in
    :data:`META_PATTERNS` order."""
    return matching_files(src_dir, META_PATTERNS)


#: A sentence-transformers folder (``SentenceTransformer.save``): these files, and each module's folder
#: ``modules.json`` names (``1_Pooling/``, ``2_Dense/`` with its own weights, ``3_Normalize/``).
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def _st_files(src_dir: str) -> list[str]:
    """The files (``/``-separated, relative) that make ``src_dir`` a sentence-transformers model beyond
    its transformer weights: :data:`ST_FILES` and every file under the module folders its
    ``modules.json`` names; ``[]`` for any other folder. Without them the exported folder loads in
    ``SentenceTransformer`` with other pooling and no Dense / Normalize modules (other embeddings),
    and servers that read ``modules.json`` (vLLM's pooling) serve another model.

    Raises:
        CorruptCheckpointError: ``modules.json`` is not a list of modules.
        UnsafePathError: a module path leaves the folder.
    """
    if not LOCAL.isfile(os.path.join(src_dir, "modules.json")):
        return []
    try:
        modules = json.loads(LOCAL.read_bytes(os.path.join(src_dir, "modules.json")))
        paths = sorted({m.get("path", "") for m in modules if isinstance(m, dict)} - {""})
    except (ValueError, AttributeError, TypeError) as e:
        raise CorruptCheckpointError(f"{src_dir}/modules.json: not a sentence-transformers module list ({e})") from None
    out = [n for n in ST_FILES if LOCAL.isfile(os.path.join(src_dir, n))]

    def files_under(rel: str) -> None:
        for name in sorted(LOCAL.listdir(safe_join(src_dir, rel))):
            if name.startswith("."):
                continue
            if LOCAL.isdir(os.path.join(src_dir, rel, name)):
                files_under(f"{rel}/{name}")
            else:
                out.append(f"{rel}/{name}")
    for rel in paths:
        if LOCAL.isdir(safe_join(src_dir, rel)):
            files_under(rel.strip("/"))
    return out


def _copy_meta(src_dir: str, dst: str, checked: _Checked) -> list[str]:
    copied = []
    for name in _st_files(src_dir):  # sentence-transformers modules: pooling, dense, normalize
        if not LOCAL.exists(os.path.join(dst, name)):
            LOCAL.makedirs(os.path.dirname(os.path.join(dst, name)))
            _copy_side_file(src_dir, name, os.path.join(dst, name), checked)
            copied.append(name)
    for name in _meta_files(src_dir):
        if not LOCAL.exists(os.path.join(dst, name)):
            LOCAL.makedirs(os.path.dirname(os.path.join(dst, name)))
            _copy_side_file(src_dir, name, os.path.join(dst, name), checked)
            copied.append(name)
    return copied


def _has_tokenizer(folder: str) -> bool:
    return any(LOCAL.glob(folder, pat) for pat in TOKENIZER_PATTERNS)


def _meta_fallbacks(src: Source, args: argparse.Namespace) -> list[str]:
    """Folders to take missing tokenizer/generation-config files from, after ``src.meta_dir``:
    ``--base``, then the adapter's local ``base_model_name_or_path``."""
    out = []
    for d in (getattr(args, "config", None), getattr(args, "base", None),
              src.adapter_dir and adapter_base_dir(src.adapter_dir)):
        if d and LOCAL.isdir(d) and os.path.abspath(d) != os.path.abspath(src.meta_dir) \
                and os.path.abspath(d) not in out:
            out.append(os.path.abspath(d))
    return out


def _copy_all_meta(src: Source, dst: str, args: argparse.Namespace, checked: _Checked) -> list[str]:
    """Copy config/generation/tokenizer files from ``--config`` (over the source's: the user named
    that folder, e.g. to replace a config.json that fails the servability gate), then from the
    source, then the missing ones from the base model folder when known (each checked against its
    folder's manifest when it lists it); warn when the result has no tokenizer."""
    copied = []
    config = getattr(args, "config", None)
    if config and LOCAL.isdir(config):
        copied = _copy_meta(config, dst, checked)
        if copied:
            print(f"fastckpt load: copied {', '.join(copied)} from --config {config}", file=sys.stderr)
    copied += _copy_meta(src.meta_dir, dst, checked)
    for d in _meta_fallbacks(src, args):
        if _has_tokenizer(dst) and all(LOCAL.exists(os.path.join(dst, n))
                                       for n in ("config.json", "generation_config.json")):
            break
        more = _copy_meta(d, dst, checked)
        if more:
            print(f"fastckpt load: copied {', '.join(more)} from the base model folder {d}", file=sys.stderr)
        copied += more
    if not _has_tokenizer(dst):
        where = ", ".join([src.meta_dir] + _meta_fallbacks(src, args))
        print(f"fastckpt load: WARNING: no tokenizer files found (looked in {where}); the output folder has "
              f"no tokenizer and vllm serve / AutoTokenizer will fail on it. Save one into it "
              f"(tokenizer.save_pretrained(DIR)), pass --config HF_DIR (or --base BASE_MODEL_DIR), or give vllm serve --tokenizer.",
              file=sys.stderr)
    return copied


def merged_state(src: Source, config_dir: str, scratch: str, checked: _Checked, *, threads: int | None = None):
    """Merge ``src``'s adapter into its base through peft; returns ``(state_dict, entries)`` (CPU).

    Every byte comes through fastckpt's reader, checked against the manifest xxh3 when there is
    one: the base weights (:meth:`Source.read`), the adapter tensors (:meth:`Source.read_adapter`)
    and ``adapter_config.json``; the model is built from ``config_dir/config.json`` (the export's
    own checked copy). peft reads the adapter back from ``scratch`` (an empty folder that the
    caller removes), where the checked tensors are written. Tied weights (one storage under
    several names) are written once, under their first name (:mod:`fastckpt.cli.lora`).

    Raises:
        ChecksumMismatchError: a source byte differs from the manifest (names file and tensor).
        LoraMergeError: base weights missing or unexpected for the model, or adapter tensors the
            manifest lists but ``adapter_model.safetensors`` lacks (nothing merged).
        ValueError: no ``config.json``, or no transformers class for it (:func:`lora.model_class`).
    """
    import peft
    import transformers
    from safetensors.torch import save as safetensors_bytes

    if not LOCAL.isfile(os.path.join(config_dir, "config.json")):
        raise ValueError(f"--merge-lora: {src.meta_dir} has no config.json (nor has the base model folder): "
                         "transformers cannot build the model to merge into; pass --base BASE_MODEL_DIR")
    cfg = transformers.AutoConfig.from_pretrained(config_dir)
    cls = lora.model_class(cfg, os.path.join(src.meta_dir, "config.json"))
    tied = getattr(cfg, "tie_word_embeddings", None)  # before the merge: peft unties a trained tied module
    lora.check_adapter(src.adapter_dir)
    base = src.read(list(src.weights), threads=threads)  # each tensor's xxh3 checked (manifest)
    model = lora.load_base(cls, cfg, base, src.path)
    del base
    if src.checksummed:
        checked.tensors += len(src.weights)
    acfg = _read_side_file(src.adapter_dir, ADAPTER_CONFIG, checked)
    LOCAL.write_file(os.path.join(scratch, ADAPTER_CONFIG), acfg, fsync=False)
    adapter = src.read_adapter(threads=threads)  # each tensor's xxh3 checked when the adapter has a manifest
    if file_checks(src.adapter_dir, ADAPTER_WEIGHTS):
        checked.tensors += len(adapter)
    else:
        checked.unchecked.append(ADAPTER_WEIGHTS)
    LOCAL.write_file(os.path.join(scratch, ADAPTER_WEIGHTS), safetensors_bytes(adapter), fsync=False)
    del adapter
    lora.refuse_unmergeable(peft.PeftConfig.from_pretrained(scratch), src.adapter_dir)
    adapted = peft.PeftModel.from_pretrained(model, scratch)
    try:
        merged = adapted.merge_and_unload()
    except (NotImplementedError, RuntimeError, AttributeError, TypeError) as e:  # peft's own refusal
        kind = getattr(adapted.peft_config[adapted.active_adapter].peft_type, "value", "?")
        raise LoraMergeError(
            f"--merge-lora: peft cannot merge the {kind} adapter of {src.adapter_dir} into the weights "
            f"({type(e).__name__}: {e}); load it with peft (PeftModel.from_pretrained) instead, or export "
            "it unmerged (fastckpt load SOURCE --to DIR, without --merge-lora)", path=src.adapter_dir,
            missing=[]) from e
    untied = getattr(merged.config, "tie_word_embeddings", None)
    if tied is not None and untied is not None and untied != tied:  # modules_to_save on a tied embedding / head
        path = os.path.join(config_dir, "config.json")
        on_disk = json.loads(LOCAL.read_bytes(path))
        on_disk["tie_word_embeddings"] = untied  # as merge_and_unload().save_pretrained writes it
        LOCAL.write_file(path, (json.dumps(on_disk, indent=2, sort_keys=True) + "\n").encode(), replace=True)
    return lora.unique_tensors(merged)


def _header_checks(src: Source) -> None:
    """Check the headers of the weight files against the manifest: the export parses them (and
    compares every tensor entry with the manifest) but does not copy them, so a flip that leaves
    valid JSON (padding, ``__metadata__``) would otherwise go unnoticed."""
    if not src.checksummed:
        return
    for p in src.weight_files:
        fc = file_checks(src.path, os.path.basename(p))
        hdr = [c for c in (fc[1] if fc else ()) if c.what.startswith("header ")]
        if hdr:
            read_checked(p, None, hdr)


def check_to(to: str, src: Source, args: argparse.Namespace) -> None:
    """Refuse a ``--to`` that is, lies inside or contains anything the export reads: the source
    as given (a run root), the checkpoint chosen, its adapter and base model folders (symlinks
    resolved), so that ``--overwrite`` can never delete the source.

    Raises:
        ValueError: naming both paths (before anything is written or removed).
    """
    real = LOCAL.realpath
    separate_adapter = src.adapter_dir is not None and real(src.adapter_dir) != real(src.path)
    given = "the source" if real(args.source) in (real(src.path), real(src.adapter_dir or src.path)) \
        else "the run root the source checkpoint was taken from,"
    reads = [(args.source, given),
             (src.path, "the base model folder" if separate_adapter else "the source checkpoint"),
             (src.adapter_dir, "the LoRA adapter folder"), (getattr(args, "base", None), "the base model folder")]
    reads += [(d, "the base model folder") for d in _meta_fallbacks(src, args)]
    real_to = LOCAL.realpath(to)
    for p, what in reads:
        if not p:
            continue
        rp = LOCAL.realpath(p)
        how = "is" if real_to == rp else "is inside" if is_inside(real_to, rp) else \
            "contains" if is_inside(rp, real_to) else None
        if how:
            raise ValueError(f"refusing --to {to}: it {how} {what} {os.path.abspath(p)}; writing there (and with "
                             f"--overwrite, replacing it) would destroy what the export reads. Choose a --to "
                             f"that is neither {os.path.abspath(p)}, inside it, nor a folder above it")


def _user_path_error(e: OSError, to: str) -> OSError:
    """``e`` naming ``to`` (or the file inside it) instead of the hidden temporary folder; typed
    (:class:`~fastckpt.errors.FolderNotWritableError`, :class:`~fastckpt.errors.NotAFolderError`) where
    the folder ``to`` goes in is read-only or a file."""
    typed = folder_error(Path(to), e)
    if typed is not None:
        return typed
    prefix = os.path.join(os.path.dirname(to), "." + os.path.basename(to) + cm.TMP_MARK)
    names = []
    for f in (e.filename, e.filename2):
        f = os.fsdecode(f) if f is not None else None
        if f is not None and f.startswith(prefix):
            rest = f[len(prefix):]
            inner = rest.split(os.sep, 1)[1] if os.sep in rest else ""
            names.append(os.path.join(to, inner) if inner else to)
    if not names:
        return e
    return OSError(e.errno, e.strerror, names[0])


def export(src: Source, to: str, args: argparse.Namespace) -> str:
    """Build the servable folder in a hidden sibling of ``to`` and rename it into place; returns ``to``.

    Every byte copied or merged from a checkpoint with a manifest is checked against its xxh3 while
    it is read (weights, adapter, config/tokenizer files the manifest lists); stderr says what was
    checked.

    Raises:
        ChecksumMismatchError / CorruptCheckpointError: a source byte is damaged (nothing at ``to``).
        CheckpointExistsError: ``to`` exists and ``--overwrite`` was not given, or ``to`` is not a model
            folder or an empty folder (:func:`~fastckpt.cli.common.check_export_target`).
        OSError: naming ``to`` (not the temporary folder) when it cannot be written.
    """
    check_export_target(to, args.overwrite)
    checked = _Checked()
    try:
        LOCAL.makedirs(os.path.dirname(to) or ".")
        tmp = _COMMIT.begin(LOCAL, to, overwrite=args.overwrite)
    except OSError as e:
        raise _user_path_error(e, to) from None
    claim = None
    try:
        _header_checks(src)
        _copy_all_meta(src, tmp, args, checked)  # first: a merge builds the model from the checked config
        if not LOCAL.isfile(os.path.join(tmp, "config.json")):
            gate(tmp, to)  # no config.json anywhere: refused now, not after copying every weight byte
        if args.merge_lora and src.adapter_dir:
            scratch = os.path.join(tmp, ".merge-adapter")
            LOCAL.makedirs(scratch)
            with warnings.catch_warnings():
                if args.quiet:  # -q: also transformers' own "Loading weights" bar and notices
                    import transformers
                    transformers.utils.logging.disable_progress_bar()
                    transformers.utils.logging.set_verbosity_error()
                    warnings.simplefilter("ignore", FutureWarning)
                try:
                    sd, entries = merged_state(src, tmp, scratch, checked, threads=args.threads)
                finally:
                    LOCAL.remove(scratch)
            fetch = lambda names: {n: sd[n] for n in names}  # noqa: E731
        else:
            entries = _entries(src)
            fetch = lambda names: src.read(names, threads=args.threads)  # noqa: E731  (checksums if a manifest)
            if src.checksummed:
                checked.tensors += len(entries)
        if not src.checksummed:
            checked.unchecked += [os.path.basename(p) for p in src.weight_files]
        entries, fetch = _as_saved(entries, fetch, tmp)
        plan = plan_shards(entries, args.max_shard_size)
        claim = tier_for(tmp).checkpoint(tmp, plan.total_bytes, cls="models")  # counted once committed
        with progress_bar(plan.total_bytes, "export", args.quiet) as bar:
            write_shards(plan, fetch, tmp, threads=args.threads, progress=bar.update, tier=claim)
        if not args.merge_lora:
            for name, folder in adapters_of(src):
                _layout_adapter(folder, os.path.join(tmp, adapter_folder_name(name)), to, checked)
        gate(tmp, to)  # a folder vllm serve cannot load as its config.json says never appears at --to
        _COMMIT.finish(LOCAL, tmp, to, overwrite=args.overwrite)
        claim.done(stored=True)
    except BaseException as e:
        if claim is not None:
            claim.done(stored=False)  # a refused or failed export holds no bytes of the tier's budget
        _COMMIT.abort(LOCAL, tmp)
        named = _user_path_error(e, to) if isinstance(e, OSError) and not isinstance(e, FastCkptError) else e
        if named is not e:
            raise named from e
        raise
    print(f"fastckpt load: {checked.summary()}", file=sys.stderr)
    return to


def _as_saved(entries: list[Entry], fetch, config_dir: str):
    """``(entries, fetch)`` with the weights named as ``save_pretrained`` of the model names them on
    disk: a wrapper's attribute prefix dropped (:func:`fastckpt.loading.servable.module_prefix`: a
    LightningModule's ``llama.model...`` is ``model...``), then transformers' save-time renaming
    (:func:`fastckpt.loading.servable.saved_names`: GPT-NeoX's in-memory ``lm_head.weight`` is
    ``embed_out.weight``, which vLLM and the gate look for). A checkpoint holds the in-memory names
    (``model.state_dict()``), an HF folder already the saved ones (then nothing changes)."""
    names = {e[0] for e in entries}
    pre = module_prefix(config_dir, names)
    if pre:
        print(f"fastckpt load: every weight is named under {pre!r} (the attribute of a wrapper module, e.g. a "
              f"LightningModule, that holds the model): written without it, as the model's save_pretrained "
              f"names them", file=sys.stderr)
    bare = {n: n[len(pre):] for n in names}
    ignored = ignored_on_save(config_dir) & set(bare.values())
    if ignored:  # an older fastckpt kept them: written as save_pretrained writes the model, without them
        print(f"fastckpt load: {len(ignored)} weight(s) left out, as save_pretrained leaves them out "
              f"(_keys_to_ignore_on_save): {', '.join(sorted(ignored)[:4])}", file=sys.stderr)
        entries = [e for e in entries if bare[e[0]] not in ignored]
        names = {e[0] for e in entries}
        bare = {n: bare[n] for n in names}
    ren = {a: b for a, b in saved_names(config_dir).items() if a in bare.values() and b not in bare.values()}
    if ren:
        print(f"fastckpt load: {len(ren)} weight(s) named as save_pretrained names them on disk (transformers' "
              f"conversion mapping): {', '.join(f'{a} -> {b}' for a, b in list(ren.items())[:4])}", file=sys.stderr)
    final = {n: ren.get(b, b) for n, b in bare.items()}
    conv = converted_on_save(config_dir, final.values())
    if conv:  # save_pretrained's conversion, renamings included, of the in-memory names
        print(f"fastckpt load: {len(conv)} weight(s) held as transformers holds them in memory "
              f"({', '.join(conv[:3])}{', ...' if len(conv) > 3 else ''}): converted as save_pretrained converts "
              "them (transformers' revert_weight_conversion), with every weight in memory", file=sys.stderr)
        got = fetch([e[0] for e in entries])
        sd, entries = lora.unique_tensors_of(to_saved_layout(config_dir, {bare[n]: t for n, t in got.items()}))
        return entries, lambda want: {n: sd[n] for n in want}
    if all(a == b for a, b in final.items()):
        return entries, fetch
    back = {b: a for a, b in final.items()}
    return ([(final[e[0]], *e[1:]) for e in entries],
            lambda want: (lambda got: {n: got[back[n]] for n in want})(fetch([back[n] for n in want])))


def _layout_adapter(adapter_dir: str, dst: str, base: str, checked: _Checked) -> None:
    """``dst/adapter_config.json`` (base pointed at the export) + the adapter weights, fsynced; both
    checked against the adapter folder's manifest when it has one. Raises ``LoraMergeError`` when
    the manifest lists adapter tensors the file lacks (:func:`fastckpt.cli.lora.check_adapter`)."""
    lora.check_adapter(adapter_dir)  # peft/vLLM would load the adapter without them
    LOCAL.makedirs(dst)
    cfg = json.loads(_read_side_file(adapter_dir, ADAPTER_CONFIG, checked))
    cfg["base_model_name_or_path"] = base
    LOCAL.write_file(os.path.join(dst, ADAPTER_CONFIG), json.dumps(cfg, indent=2, sort_keys=True).encode())
    _copy_side_file(adapter_dir, ADAPTER_WEIGHTS, os.path.join(dst, ADAPTER_WEIGHTS), checked)
    LOCAL.sync_dir(dst)


def adapters_of(src: Source) -> list[tuple[str, str]]:
    """``(name, folder)`` of every peft adapter ``src`` holds: peft's ``default`` at the top
    (:attr:`Source.adapter_dir`), then each named one in its sub-folder (``NAME/``, where
    ``PeftModel.save_pretrained`` and fastckpt put every adapter not named ``default``)."""
    out = [("default", src.adapter_dir)] if src.adapter_dir else []
    root = src.adapter_dir or src.path
    return out + [(n, os.path.join(root, n)) for n in lora.nested_adapters(root)]


def adapter_folder_name(name: str) -> str:
    """Where the export lays out adapter ``name``: ``adapter`` (peft's ``default``), ``adapter-NAME``."""
    return "adapter" if name == "default" else f"adapter-{name}"


def vllm_command(model_dir: str, adapters: list[tuple[str, str]] = ()) -> str:
    """The ``vllm serve`` command line for ``model_dir`` (``--trust-remote-code`` when its config.json
    has an ``auto_map``) and the LoRA adapters ``[(name, folder)]``
    vLLM can serve (``--lora-modules NAME=FOLDER``, peft's ``default`` as ``adapter``); the others
    are named in a WARNING on stderr (serve them merged: ``--merge-lora``). ``--max-lora-rank`` is
    the largest stored rank rounded up to a value vLLM accepts (:data:`lora.VLLM_MAX_LORA_RANKS`)."""
    cmd = ["vllm", "serve", model_dir]
    cfg_path = os.path.join(model_dir, "config.json")
    try:
        if LOCAL.isfile(cfg_path) and "auto_map" in json.loads(LOCAL.read_bytes(cfg_path)):
            cmd.append("--trust-remote-code")  # vLLM refuses an auto_map model without it
    except ValueError:
        pass  # the gate already named an unreadable config.json
    served, rank = [], 0
    for name, folder in adapters:
        why = lora.vllm_lora_problem(folder)
        if why is not None:
            print(f"fastckpt load: WARNING: adapter {name!r} ({folder}) is {why}: left out of the vllm serve command; "
                  f"serve it merged (--merge-lora{'' if name == 'default' else ' of that adapter folder'}) where peft "
                  "can merge it (LoRA and most weight adapters; not prompt or prefix tuning: load those with peft)",
                  file=sys.stderr)
            continue
        served.append(f"{'adapter' if name == 'default' else name}={folder}")
        rank = max(rank, lora.adapter_rank(folder))
    if served:
        cmd += ["--enable-lora", "--lora-modules", *served, "--max-lora-rank", str(lora.vllm_max_lora_rank(rank))]
        if len(served) > 1:
            cmd += ["--max-loras", str(len(served))]
    return " ".join(shlex.quote(c) for c in cmd)


def cmd_load(args: argparse.Namespace) -> int:
    """Resolve, verify, export or warm, then print the ``vllm serve`` command (stdout's only line;
    none when the source is not servable as it is, or fails ``--verify``). Returns the exit status."""
    if is_url(args.source):  # s3://...: a local copy, exported from there
        if not args.to:
            raise ValueError(f"{args.source}: a load without --to warms the page cache of local files; an object "
                             "store's checkpoint is downloaded: pass --to DIR to export it into a local folder")
        with store_for(args.source).local_folder(args.source) as local:
            print(f"fastckpt load: downloaded {args.source} into {local} (removed afterwards)", file=sys.stderr)
            args.source = local
            return cmd_load(args)
    zero_tag = find_zero_tag(args.source)  # refuses native DeepSpeed / DCP folders (pickles)
    if zero_tag is not None:
        if not args.to:  # warming is the job without --to; the ZeRO partitions are not servable as they are
            _warm_zero_tag(zero_tag, args)
            print(f"fastckpt load: WARNING: warmed, but {zero_tag} is a DeepSpeed ZeRO checkpoint (partitioned "
                  "weights): no vllm serve command; pass --to DIR to consolidate it into a servable HF folder",
                  file=sys.stderr)
            return 0
        out = export_zero(zero_tag, os.path.abspath(args.to), args, META_PATTERNS, gate)
        print(f"wrote {out}", file=sys.stderr)
        print(vllm_command(out))
        return 0
    src = resolve_source(args.source, base=args.base)
    adapters = adapters_of(src)
    print(f"source: {src.path} ({len(src.weights)} weight tensors"
          f"{', LoRA adapter ' + src.adapter_dir if src.adapter_dir else ''}"
          f"{', named adapters ' + ', '.join(n for n, _ in adapters if n != 'default') if len(adapters) > bool(src.adapter_dir) else ''})",
          file=sys.stderr)
    if args.to:
        check_to(os.path.abspath(args.to), src, args)
    if args.merge_lora and not src.adapter_dir:
        lora.refuse_nested_adapters(src.path)  # peft's named adapters live in NAME/: never merge nothing silently
        print("fastckpt load: --merge-lora: the source has no adapter; nothing to merge", file=sys.stderr)
    if args.merge_lora and src.adapter_dir and not args.to:
        raise ValueError("--merge-lora writes a new folder: pass --to DIR")
    if args.merge_lora and src.adapter_dir and len(adapters) > 1:  # peft's merge_and_unload merges the active one
        print(f"fastckpt load: WARNING: --merge-lora merges peft's 'default' adapter only; not merged, not exported: "
              f"{', '.join(f'{n} ({d})' for n, d in adapters[1:])} (merge one by naming its folder: fastckpt load "
              f"{adapters[1][1]} --base {src.path} --merge-lora --to DIR)", file=sys.stderr)
    if args.verify:
        if not _verify_source(src):
            return 1
    if args.to:
        out = export(src, os.path.abspath(args.to), args)
        served = [] if args.merge_lora else [(n, os.path.join(out, adapter_folder_name(n))) for n, _ in adapters]
        if args.warm:
            _warm(LOCAL.glob(out, "*.safetensors"), args)
        print(f"wrote {out}", file=sys.stderr)
    else:
        _warm_source(src, args)
        out, served = src.path, adapters
        try:  # warming was the job and it is done: a source that fails the gate gets no command, exit 0
            if not LOCAL.isdir(out):
                raise NotServableError(
                    f"vllm serve cannot serve {out}: it is a file and vLLM needs a model folder with a config.json "
                    "(write one with --to DIR --config HF_DIR, a folder providing config.json and tokenizer, or "
                    "--base BASE_MODEL_DIR)", path=out, problems=["a file"])
            gate(out, out)
        except NotServableError as e:
            print(f"fastckpt load: WARNING: warmed, but {e}", file=sys.stderr)
            return 0
    print(vllm_command(out, served))
    return 0


def gate(folder: str, shown: str) -> None:
    """The servability gate (:func:`fastckpt.loading.servable.check_servable`) of ``folder``, reported
    as ``shown`` (``--to``, not the hidden folder it is built in); its warnings go to stderr.

    Raises:
        NotServableError: naming the problems, missing and mis-shaped keys and how to fix them
            (the caller then removes the hidden folder: nothing appears at ``--to``).
    """
    try:
        rep = check_servable(folder)
    except NotServableError as e:
        msg = str(e).replace(folder, shown)
        raise NotServableError(f"{msg}\nno vllm serve command printed" + (
            f"; nothing was written to {shown}" if folder != shown else ""), path=shown, problems=e.problems,
            missing=e.missing, mismatched=e.mismatched) from None
    for w in rep.warnings:
        print(f"fastckpt load: WARNING: {shown}: {w}", file=sys.stderr)
    if rep.checked:
        print(f"fastckpt load: servable: config.json names {rep.architecture} ({rep.dtype}); all {rep.checked} "
              "of its parameters are in the folder with their shapes", file=sys.stderr)


def _warm_source(src: Source, args: argparse.Namespace) -> None:
    """Warm the weight (and adapter) files of ``src``, checking them against the manifest xxh3 while
    reading when there is one (not again after ``--verify``); say on stderr what was verified."""
    adapters = [d for _, d in adapters_of(src)]
    files = list(src.weight_files) + [os.path.join(d, ADAPTER_WEIGHTS) for d in adapters]
    if args.verify:
        _warm(files, args)
        print("fastckpt load: warmed; verified up front (--verify)", file=sys.stderr)
        return
    checked, checks = _Checked(), {}
    for p in files:
        fc = file_checks(os.path.dirname(p), os.path.basename(p)) if LOCAL.isdir(os.path.dirname(p)) else None
        if fc and fc[1]:
            checks[p] = fc[1]
            checked.files.append(os.path.basename(p))
            checked.tensors += sum(c.what.startswith("tensor ") for c in fc[1])
        else:
            checked.unchecked.append(os.path.basename(p))
    for d in dict.fromkeys([src.meta_dir] + adapters):
        if LOCAL.isdir(d):
            for name in _meta_files(d) + ([ADAPTER_CONFIG] if d in adapters else []):
                _read_side_file(d, name, checked)
    _warm(files, args, checks)
    print(f"fastckpt load: warmed; {checked.summary()}", file=sys.stderr)


def _warm_zero_tag(tag: str, args: argparse.Namespace) -> None:
    """Warm every weight file of DeepSpeed tag folder ``tag`` (one fastckpt folder per ``*_states.pt``),
    each checked against its folder's manifest xxh3 while reading (so ``--verify`` reads nothing twice).

    Raises:
        ChecksumMismatchError: a file whose bytes differ from its manifest, naming file and range.
    """
    from ..loading.resolve import DS_FILE_RE
    checks, files = {}, []
    for n in sorted(LOCAL.listdir(tag)):
        d = os.path.join(tag, n)
        if DS_FILE_RE.match(n) and LOCAL.isdir(d):
            for p in sorted(LOCAL.glob(d, "*.safetensors")):
                files.append(p)
                fc = file_checks(d, os.path.basename(p))
                if fc and fc[1]:
                    checks[p] = fc[1]
    _warm(files, args, checks)
    print(f"fastckpt load: warmed {len(files)} file(s) of DeepSpeed tag {tag}, {len(checks)} checked against "
          "their manifests while reading", file=sys.stderr)


def _verify_source(src: Source) -> bool:
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


def _warm(files: list[str], args: argparse.Namespace, checks: dict | None = None) -> None:
    total = sum(LOCAL.size(p) for p in files)
    with progress_bar(total, "warm", args.quiet) as bar:
        warm_files(files, threads=args.threads, progress=bar.update, checks=checks)


def add_load_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``fastckpt load`` to the ``fastckpt`` subcommands (called by :mod:`fastckpt.cli.main`)."""
    p = subparsers.add_parser("load", help="prepare a checkpoint for vllm serve: verify, merge LoRA, export or warm",
                              description=re.sub(r"`fastckpt load SOURCE .*?`\n\n", "",  # argparse prints the usage itself
                                                 re.sub(r":[a-z]+:`", "`", __doc__.replace("``", "`")), count=1, flags=re.S), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="run root, checkpoint folder, HF model folder or peft adapter folder")
    p.add_argument("--to", default=None, help="write a servable HF folder here (a fast local disk)")
    p.add_argument("--merge-lora", action="store_true", help="merge the LoRA adapter into the weights (peft)")
    p.add_argument("--verify", action="store_true", help="re-read every file against the manifest checksums first")
    p.add_argument("--warm", action="store_true", help="read the weights into the page cache (default without --to)")
    p.add_argument("--threads", type=positive_int, default=None, help="parallel I/O requests (default 8-16)")
    p.add_argument("--max-shard-size", type=positive_bytes, default=5_000_000_000, help="bytes per shard (default 5GB)")
    p.add_argument("--base", default=None, help="base model folder when SOURCE is an adapter-only folder")
    p.add_argument("--config", default=None, help="HF folder whose config.json / tokenizer files are used (over the "
                   "checkpoint's): one the model's save_pretrained wrote")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --to folder atomically: a model folder "
                   "(config.json, *.safetensors or manifest.json in it) or an empty one, never a folder of other files")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_load)
    return p
