"""Resolve what a path holds before reading a byte of tensor data.

A path is one of: a committed fastckpt checkpoint folder (``manifest.json``), a foreign
HF model folder (``*.safetensors.index.json`` or ``*.safetensors`` files), or a single
safetensors file. Every header is parsed and validated, every manifest/index entry is
checked against the headers and file sizes, and no tensor may appear in two files.

Files are read through symlinks wherever they point (a ``huggingface_hub`` cache snapshot,
``models--org--name/snapshots/<rev>/``, holds only relative symlinks into ``../../blobs/``);
names taken from an index or manifest must still stay inside the folder
(:func:`fastckpt.storage.model_files.safe_join`). A model folder's
``model.safetensors.index.json`` names exactly the files loaded: other layouts beside it
(``consolidated.safetensors``, an ``original/`` sub-folder, leftovers) are never mixed in, and a
shard it names that is missing is refused, naming the index and the shard.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import xxhash

from ..storage import commit as cm
from ..errors import (CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError, HeaderError,
                      InvalidArgumentError, NativeCheckpointError, ShardedCheckpointError)
from ..format.safetensors import INDEX_SUFFIX, Header, TensorInfo
from ..storage.model_files import read_header, read_index, safe_join
from ..format.manifest import Manifest, TensorEntry
from ..storage.retention import newest_committed
from ..storage.store import LOCAL


@dataclass
class Resolved:
    """A validated view of a checkpoint.

    Attributes:
        root: folder (or the file itself for a single safetensors file).
        headers: file name -> validated :class:`~fastckpt.format.safetensors.Header`.
        tensors: key -> ``(file name, TensorInfo)`` for every stored tensor (key paths for
            fastckpt checkpoints, tensor names for foreign files).
        manifest: the fastckpt manifest, or ``None`` for foreign files.
        skeleton: the state skeleton (``state.json``), or ``None`` for foreign files.
        owner: for one safetensors file of a committed fastckpt checkpoint (``CKPT/model.safetensors``,
            ``CKPT/second/adapter_model.safetensors``): ``(checkpoint folder, its manifest, the file's
            name in it)``, whose entries the file was checked against and whose checksums a load
            verifies; else ``None``.
    """

    root: str
    headers: dict[str, Header] = field(default_factory=dict)
    tensors: dict[str, tuple[str, TensorInfo]] = field(default_factory=dict)
    manifest: Manifest | None = None
    skeleton: object = None
    owner: tuple[str, Manifest, str] | None = None

    def file_entries(self) -> dict[str, tuple[str, TensorEntry]]:
        """``{tensor name in the file: (manifest key, entry)}`` of an :attr:`owner`'s file (empty otherwise)."""
        if self.owner is None:
            return {}
        _, m, fname = self.owner
        return {e.name: (k, e) for k, e in m.tensors.items() if e.stored and e.file == fname and e.name is not None}

    def entries(self) -> dict[str, TensorEntry]:
        """The manifest entry (checksums) of each key of :attr:`tensors` that has one: a checkpoint's
        own manifest, an :attr:`owner`'s for one of its files, none for other files."""
        if self.manifest is not None:
            return self.manifest.tensors
        return {n: e for n, (_, e) in self.file_entries().items()}

    def file_path(self, name: str) -> str:
        """Absolute path of file ``name``."""
        return self.root if LOCAL.isfile(self.root) else os.path.join(self.root, name)


def resolve(path: str | os.PathLike, *, values: bool = True) -> Resolved:
    """Validate ``path`` and describe every tensor in it (see module docstring).

    Args:
        path: a checkpoint or model folder (a hub cache snapshot included), or one
            safetensors file; symlinks are followed for reading.
        values: read a fastckpt checkpoint's ``state.json`` (its non-tensor values) into
            ``skeleton``, checked against the manifest's xxh3 (default ``True``: every load);
            ``False`` leaves ``skeleton`` ``None`` (``verify``, which re-reads every file itself).

    Raises:
        CheckpointNotFoundError: nothing loadable there, or an uncommitted fastckpt folder.
        HeaderError / CorruptCheckpointError: any header, index or manifest problem, a shard
            named by an index that is missing (names both), a dangling symlink.
        UnsafePathError: a file name from an index or manifest leaves the folder (absolute,
            ``..``, or through a sub-folder that is a symlink out of it).
        InvalidArgumentError: ``path`` is not a ``str`` / ``os.PathLike``.
        NotSafetensorsError: ``path`` is a file of another format (``torch.save``, pickle, JSON).
        ChecksumMismatchError: ``state.json``'s bytes differ from the manifest's xxh3 (``values``).
        ShardedCheckpointError: a file of DCP's ``HuggingFaceStorageWriter(save_distributed=True)``
            save that was not consolidated (one rank's piece under the full tensor's name).
    """
    path = os.path.abspath(InvalidArgumentError.check_path(path))
    if LOCAL.isfile(path):
        h = read_header(path)
        _refuse_dcp_piece(path, h)
        r = Resolved(path, {os.path.basename(path): h})
        r.tensors = {n: (os.path.basename(path), t) for n, t in h.tensors.items()}
        r.owner = _owning_manifest(path, h)
        return r
    if not LOCAL.isdir(path):
        index = path + ".index.json" if path.endswith(".safetensors") else None
        if index is not None and LOCAL.exists(index):  # model.safetensors asked for, weights sharded
            raise CheckpointNotFoundError(
                f"{path}: no such file, but {os.path.basename(index)} is there: the weights are sharded "
                f"(model-0000k-of-0000n.safetensors, e.g. saved by several ranks); load the folder "
                f"{os.path.dirname(path)} instead (or one of its shard files)")
        raise CheckpointNotFoundError(f"{path}: no such checkpoint, folder or safetensors file")
    if LOCAL.exists(os.path.join(path, cm.MANIFEST)):
        return _resolve_fastckpt(path, values)
    if LOCAL.exists(os.path.join(path, cm.STATE_JSON)):
        raise CheckpointNotFoundError(f"{path}: fastckpt folder without manifest.json: the save never "
                                      "committed (crashed or still running); it is not a checkpoint")
    return _resolve_foreign(path)


def _resolve_fastckpt(path: str, values: bool = True) -> Resolved:
    if os.path.basename(path).startswith("."):
        raise CheckpointNotFoundError(f"{path}: hidden folders are uncommitted temporaries, not checkpoints")
    m = cm.read_manifest(path)
    r = Resolved(path, manifest=m)
    for name, info in m.files.items():
        full = safe_join(path, name)
        try:
            size = LOCAL.size(full)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: manifest lists {name!r}, which is missing", path=full) from None
        if size != info.bytes:
            raise CorruptCheckpointError(f"{full}: {size} bytes on disk, manifest says {info.bytes} "
                                         "(truncated or replaced)", path=full)
        if name.endswith(".safetensors"):
            r.headers[name] = read_header(full)
    for key, e in m.tensors.items():
        if e.file is None:
            continue
        h = r.headers.get(e.file)
        t = h.tensors.get(e.name) if h and e.name is not None else None
        if t is None or t.dtype != e.dtype or tuple(t.shape) != e.shape \
                or (h.data_offset + t.start, h.data_offset + t.end) != e.offsets:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} in manifest does not match the header of "
                                         f"{e.file!r}", path=os.path.join(path, e.file), tensor=key)
        r.tensors[key] = (e.file, t)
    if not values:
        return r
    spath = safe_join(path, cm.STATE_JSON)
    try:
        raw = LOCAL.read_bytes(spath)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{spath}: missing; the checkpoint is damaged", path=spath) from None
    want = m.files[cm.STATE_JSON].xxh3 if cm.STATE_JSON in m.files else None
    got = xxhash.xxh3_64(raw).hexdigest() if want is not None else None
    if got != want:  # the values every load returns (small): always checked
        raise ChecksumMismatchError(
            f"{spath}: xxh3 {got}, manifest says {want}: the checkpoint's non-tensor values (steps, learning "
            "rates, ...) are damaged", path=spath,
            fix="restore it from a copy or load an earlier checkpoint (`fastckpt verify` checks every file)")
    try:
        r.skeleton = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise CorruptCheckpointError(f"{spath}: not valid JSON ({type(e).__name__}: {e}); the checkpoint is "
                                     "damaged (run `fastckpt verify`)", path=spath) from None
    return r


def _owning_manifest(path: str, h: Header) -> tuple[str, Manifest, str] | None:
    """``(checkpoint folder, manifest, name)`` when the file ``path`` is one a committed fastckpt
    checkpoint's manifest lists (in its folder, or ``<sub>/<file>`` in the parent's: peft's second
    adapter), after checking the file against it: its size and every stored tensor's dtype, shape
    and byte range. ``None`` for a file no manifest lists.

    Raises:
        CorruptCheckpointError: the manifest is damaged, or the file differs from what it lists
            (truncated, replaced), naming both.
    """
    # where the file is named (a hub snapshot's manifest sits beside its symlink), then what it is
    # (a serving folder's symlink to a checkpoint's file)
    for p in dict.fromkeys((path, LOCAL.realpath(path))):
        found = cm.listing_checkpoint(os.path.dirname(p), os.path.basename(p))
        if found is None:
            continue
        root, m, name = found
        size = LOCAL.size(path)
        if size != m.files[name].bytes:
            raise CorruptCheckpointError(f"{path}: {size} bytes on disk, {os.path.join(root, cm.MANIFEST)} says "
                                         f"{m.files[name].bytes} (truncated or replaced); run `fastckpt verify {root}`",
                                         path=path)
        for key, e in m.tensors.items():
            if not e.stored or e.file != name:
                continue
            t = h.tensors.get(e.name) if e.name is not None else None
            if t is None or t.dtype != e.dtype or tuple(t.shape) != e.shape \
                    or (h.data_offset + t.start, h.data_offset + t.end) != e.offsets:
                raise CorruptCheckpointError(f"{path}: tensor {e.name!r} differs from {key!r} in "
                                             f"{os.path.join(root, cm.MANIFEST)} (replaced?); run `fastckpt verify "
                                             f"{root}`", path=path, tensor=key)
        return root, m, name
    return None


#: The index transformers and vLLM read in a model folder; when present it alone says what to load.
MAIN_INDEX = "model" + INDEX_SUFFIX
#: The single-file weights transformers reads when a folder has no index.
MAIN_FILE = "model.safetensors"
#: The same two in a diffusers component folder (``unet/``, ``vae/``...), as ``ModelMixin.from_pretrained`` reads them.
DIFFUSERS_INDEX, DIFFUSERS_FILE = "diffusion_pytorch_model" + INDEX_SUFFIX, "diffusion_pytorch_model.safetensors"
#: ``{name}.{variant}.safetensors`` / ``{name}-0000k-of-0000n.{variant}.safetensors`` /
#: ``{name}.{variant}-0000k-of-0000n.safetensors`` (transformers 5's shards): save_pretrained(variant=...)
_VARIANT = re.compile(r"^(.+?)(?:(-\d{5}-of-\d{5})?\.(?P<v>[A-Za-z0-9_]+)|\.(?P<vs>[A-Za-z0-9_]+)-\d{5}-of-\d{5})"
                      r"\.safetensors$")


#: A native DeepSpeed checkpoint file (a torch.save pickle).
DS_FILE_RE = re.compile(r".*_(model|optim)_states\.pt$")


def refuse_native(path: str) -> None:
    """Refuse a native DeepSpeed or DCP checkpoint (pickled) given as ``path``; nothing of it is read.

    Looks at ``path`` itself, at the tag folder ``path/latest`` names and at a DCP folder's
    ``.metadata``.

    Raises:
        NativeCheckpointError: naming the pickle file and what to do instead.
    """
    path = os.path.abspath(path)
    candidates = [path] + [t for t in [latest_tag(path)] if t]
    for folder in candidates:
        if LOCAL.isfile(folder) and DS_FILE_RE.match(os.path.basename(folder)):
            raise native_ds(folder)
        if not LOCAL.isdir(folder):
            continue
        for name in sorted(LOCAL.listdir(folder)):
            p = os.path.join(folder, name)
            if DS_FILE_RE.match(name) and LOCAL.isfile(p):
                raise native_ds(p)
        meta = os.path.join(folder, ".metadata")
        if LOCAL.isfile(meta):
            raise NativeCheckpointError(
                f"{meta}: a native torch.distributed.checkpoint folder (its .metadata is a pickle, and so are "
                "the *.distcp records); fastckpt never unpickles. Re-save with fastckpt's DCP writer "
                "(fastckpt.dcp.FastCkptWriter) or fastckpt.save, or knowingly convert it with "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save (which unpickles)", pickle_file=meta)


def native_ds(p: str) -> NativeCheckpointError:
    """The error of a native DeepSpeed checkpoint file ``p`` (a pickle)."""
    return NativeCheckpointError(
        f"{p}: a native DeepSpeed checkpoint file (torch.save pickle); fastckpt never unpickles. Save with "
        "fastckpt's engine (fastckpt.integrations.deepspeed.engine.install(engine) before save_checkpoint), or knowingly "
        "use DeepSpeed's own zero_to_fp32.py on a folder you trust (it unpickles)", pickle_file=p)


def latest_tag(save_dir: str) -> str | None:
    """``save_dir/<tag named by save_dir/latest>``, or None: no ``latest`` file, or one that does not
    name a folder directly inside ``save_dir`` (never followed: it is not DeepSpeed's pointer)."""
    latest = os.path.join(save_dir, "latest")
    if not LOCAL.isfile(latest):
        return None
    name = LOCAL.read_bytes(latest, 4096).decode("utf-8", "replace").strip()
    if not name or name in (".", "..") or "/" in name or os.sep in name or name.startswith("."):
        return None
    return os.path.join(save_dir, name)


def _foreign_files(path: str) -> tuple[list[str], dict[str, str]]:
    """The weight files of a foreign folder and the index's ``tensor -> file`` map, in the order
    transformers' ``from_pretrained`` looks for them (``_get_resolved_checkpoint_files``):

    ``model.safetensors`` alone when it is a file, whatever index lies beside it (``save_pretrained``
    leaves the other layout of an earlier save in the folder: a stale ``model.safetensors`` beside a
    new index, or a stale index beside a new ``model.safetensors``; transformers loads the file);
    else ``model.safetensors.index.json`` names exactly what is loaded (other ``*.safetensors`` in
    the folder, e.g. ``consolidated.safetensors`` or leftover shards, are ignored); other indexes
    are used only without it; with no index, every top-level ``*.safetensors`` file. A diffusers
    component folder the same way with ``diffusion_pytorch_model.safetensors`` (and its index), so
    ``save_pretrained(variant="fp16")`` files beside the default ones are not mixed in (variant
    indexes, ``*.safetensors.index.fp16.json``, never match the index pattern).
    """
    indexes = LOCAL.glob(path, "*" + INDEX_SUFFIX)
    for name in (MAIN_FILE, DIFFUSERS_FILE):  # diffusers: the same rule for its component folders
        main = os.path.join(path, name)
        if LOCAL.isfile(main) or (not indexes and LOCAL.lexists(main)):  # (a dangling link: named when read)
            return [name], {}
    for name in (MAIN_INDEX, DIFFUSERS_INDEX):
        if os.path.join(path, name) in indexes:
            indexes = [os.path.join(path, name)]
            break
    wanted: dict[str, str] = {}
    for ix in indexes:
        for name, shard in read_index(ix).items():
            if name in wanted and wanted[name] != shard:
                raise HeaderError(f"{ix}: tensor {name!r} is mapped to {shard!r} and {wanted[name]!r}",
                                  path=ix, tensor=name)
            wanted[name] = shard
    if indexes:
        return sorted(set(wanted.values())), wanted
    return sorted(os.path.basename(p) for p in LOCAL.glob(path, "*.safetensors")), wanted


def _foreign_header(path: str, name: str) -> Header:
    """Validated header of file ``name`` of ``path`` (symlinks followed, names kept inside)."""
    full = safe_join(path, name)
    try:
        return read_header(full)
    except FileNotFoundError:
        link = LOCAL.link_target(full)
        target = f" (a dangling symlink to {link}: an interrupted download?)" if link is not None else ""
        raise HeaderError(f"{full}: missing{target}", path=full) from None


#: ``__metadata__`` key of DCP's ``HuggingFaceStorageWriter`` files: ``{tensor: {"saved_offsets": [...]}}``
#: (torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY).
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"


def _refuse_dcp_piece(file: str, h: Header, also: str | None = None) -> None:
    """Refuse a file of a distributed ``HuggingFaceStorageWriter`` save that was not consolidated:
    each holds one rank's piece of every tensor under the full tensor's name (offsets in its
    ``__metadata__``), which read alone is a smaller, wrong tensor. A piece is known by a non-zero
    offset, another file in the folder holding the same name (``also``), or, for a file read alone,
    a sibling file of the same save that does.

    Raises:
        ShardedCheckpointError: naming the file, the tensor, its piece and how to read the save.
    """
    raw = (h.metadata or {}).get(DCP_SHARDING_INFO)
    if raw is None:
        return
    try:
        info = json.loads(raw)
        offsets = {k: list(v["saved_offsets"]) for k, v in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return  # not DCP's layout: read as the plain safetensors file it also is
    piece = next(((k, o) for k, o in offsets.items() if any(o) and k in h.tensors), None)
    where = also
    if piece is None and also is not None:
        piece = next(((k, o) for k, o in offsets.items() if k in h.tensors), None)
    if piece is None and also is None:  # one file asked for: a sibling holding one of its names?
        folder = os.path.dirname(file)
        for sib in sorted(LOCAL.glob(folder, "*.safetensors")):
            if os.path.basename(sib) == os.path.basename(file):
                continue
            try:
                sh = read_header(sib)
            except (HeaderError, OSError):
                continue
            common = sorted(set(sh.tensors) & set(h.tensors))
            if common and DCP_SHARDING_INFO in (sh.metadata or {}):
                piece, where = (common[0], offsets.get(common[0], [])), os.path.basename(sib)
                break
    if piece is None:
        return
    k, o = piece
    raise ShardedCheckpointError(
        f"{file}: tensor {k!r} ({list(h.tensors[k].shape)} at offsets {o}) is one rank's piece of a tensor that "
        f"DCP's HuggingFaceStorageWriter(save_distributed=True) saved without consolidation"
        + (f" ({where} holds another piece)" if where else "")
        + "; read alone it is a smaller, wrong tensor, so fastckpt refuses it. Consolidate the folder into full "
        "tensors first (torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files("
        "FOLDER, OUT), or save with enable_consolidation=True), or read it with "
        "dcp.load(state, storage_reader=HuggingFaceStorageReader(FOLDER))")


def _resolve_foreign(path: str) -> Resolved:
    r = Resolved(path)
    files, wanted = _foreign_files(path)
    if not files:
        refuse_native(path)  # a native DCP / DeepSpeed folder: say so (as the CLI does), not "nothing to load"
        names = LOCAL.listdir(path)
        ours = sorted(n for n in names if LOCAL.isfile(os.path.join(path, n, cm.MANIFEST)))
        pickled = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))
                         and LOCAL.isfile(os.path.join(path, n)))
        hint = (f"; it holds {', '.join(pickled[:3])}{' ...' if len(pickled) > 3 else ''}: torch.save (pickle) "
                "files, which fastckpt never unpickles. If you trust them, convert once: "
                "fastckpt.save(torch.load(FILE, weights_only=True), FOLDER), or load the model with "
                "transformers and save_pretrained(FOLDER) (safetensors)") if pickled else ""
        if ours:  # e.g. Lightning's ModelCheckpoint names: epoch=E-step=S.ckpt, last.ckpt (folders here)
            hint = (f"; it holds fastckpt checkpoints {', '.join(ours[:4])}{' ...' if len(ours) > 4 else ''}: "
                    f"pass one of them (e.g. the newest, {os.path.join(path, newest_committed(path, ours))})") + hint
        if not hint and LOCAL.isfile(os.path.join(path, "model_index.json")):  # a diffusers pipeline
            parts = sorted(n for n in LOCAL.listdir(path) if LOCAL.isdir(os.path.join(path, n))
                           and LOCAL.glob(os.path.join(path, n), "*.safetensors"))
            hint = (f"; it is a diffusers pipeline (model_index.json): each model is a sub-folder "
                    f"({', '.join(parts) or 'none with *.safetensors'}): load one of them, e.g. "
                    f"{os.path.join(path, parts[0]) if parts else path + '/unet'}")
        raise CheckpointNotFoundError(f"{path}: no manifest.json, no *.safetensors.index.json and no "
                                      f"*.safetensors files: nothing to load{hint}")
    for name in files:
        h = _foreign_header(path, name)
        r.headers[name] = h
        for tname, t in h.tensors.items():
            if tname in r.tensors:
                _refuse_dcp_piece(os.path.join(path, name), h, also=r.tensors[tname][0])
                variants = sorted({m.group("v") or m.group("vs") for f in files if (m := _VARIANT.match(f))})
                hint = (f": the folder holds variants ({', '.join(variants)}) of one model's weights "
                        f"(save_pretrained(variant=...)); pass the file of the one you want, e.g. "
                        f"{os.path.join(path, name)}") if variants else "; refusing to pick one"
                raise HeaderError(f"{path}: tensor {tname!r} is stored in both {r.tensors[tname][0]!r} and "
                                  f"{name!r}{hint}", path=os.path.join(path, name), tensor=tname)
            r.tensors[tname] = (name, t)
    for tname, shard in wanted.items():
        if tname not in r.tensors or r.tensors[tname][0] != shard:
            raise HeaderError(f"{path}: index maps {tname!r} to {shard!r} but that shard's header lacks it",
                              path=os.path.join(path, shard), tensor=tname)
    return r
