"""Resolve a source to serve: which folder, which weights, which adapter (no tensor data read).

A source is a run root (its newest committed ``checkpoint-N``/``step-N``), a committed fastckpt
checkpoint folder, any HF model folder or safetensors file, or a peft adapter folder (with its
base model folder). :func:`resolve_source` validates every header, index and manifest entry
(:func:`fastckpt.loading.resolve.resolve`) and returns a :class:`Source`, whose
:meth:`Source.read` streams weights with the parallel reader (CPU) or the device ring, and
:meth:`Source.read_adapter` the LoRA adapter's tensors; :func:`file_checks` lists the byte ranges
of a checkpoint file that its manifest checksums (what ``fastckpt load`` checks while copying).

Used by ``fastckpt load`` (:mod:`fastckpt.cli.serve`) and the vLLM loader plugin
(:mod:`fastckpt.integrations.vllm`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import CheckpointNotFoundError
from ..storage.commit import MANIFEST, listing_checkpoint, read_manifest_shared
from ..storage.retention import scan_checkpoints
from ..format.dtypes import itemsize, str_to_dtype
from ..format.manifest import RangeCheck
from ..storage.model_files import safe_join
from ..storage.store import LOCAL
from .reader import read_tensors
from .regions import Stored, box_runs
from .resolve import Resolved, resolve

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_STEP_RE = re.compile(r"^(checkpoint-|step-|checkpoint_)(\d+)$")  # manager, Trainer callback, accelerate plugin


@dataclass
class Source:
    """What a source serves.

    Attributes:
        path: the checkpoint / model folder chosen.
        resolved: its validated description (weights tensors).
        weights: HF tensor name -> stored key in ``resolved.tensors``, in file order.
        meta_dir: folder holding config and tokenizer files.
        adapter_dir: folder with ``adapter_config.json`` + ``adapter_model.safetensors``, or ``None``.
    """

    path: str
    resolved: Resolved
    weights: dict[str, str]
    meta_dir: str
    adapter_dir: str | None = None

    @property
    def checksummed(self) -> bool:
        """True when the weights come with manifest checksums (a fastckpt checkpoint)."""
        return self.resolved.manifest is not None

    @property
    def weight_files(self) -> list[str]:
        """Absolute paths of the files holding the weights."""
        return sorted({self.resolved.file_path(self.resolved.tensors[k][0]) for k in self.weights.values()})

    def nbytes(self, name: str) -> int:
        """Stored bytes of weight ``name`` (an HF tensor name of :attr:`weights`)."""
        return self.resolved.tensors[self.weights[name]][1].nbytes

    def read(self, names: Iterable[str], *, device: str | torch.device = "cpu", threads: int | None = None,
             verify: bool = True, ring_bytes: int | None = None) -> dict[str, torch.Tensor]:
        """Read weights ``names`` into new tensors on ``device``, each owning its memory.

        Args:
            names: HF tensor names (keys of :attr:`weights`).
            device: ``"cpu"`` (default: parallel reads straight into the tensors) or a device
                (``"cuda:N"``, ``"npu:N"``: through the pinned bounce ring of
                :func:`fastckpt.loading.device.load_tensors`).
            threads: reads in flight (default :func:`fastckpt.storage.io.default_threads`).
            verify: check each tensor's xxh3 against the manifest when there is one (default True).
            ring_bytes: host bounce memory in bytes for a device read (default 256 MiB).

        Returns:
            HF name -> tensor with the stored dtype and shape, in the order of ``names``.

        Raises:
            KeyError: a name that is not a weight of this source.
            CorruptCheckpointError: a file is shorter than its header says.
            ChecksumMismatchError: with ``verify``, a tensor's bytes differ from the manifest.
            OSError: from the reads.
        """
        names = list(names)
        keys = [self.weights[n] for n in names]
        check = verify and self.resolved.manifest is not None
        if torch.device(device).type == "cpu":
            got = read_tensors(self.resolved, keys, threads=threads, verify=check)
        else:
            from .device import load_tensors
            extra = {} if ring_bytes is None else {"ring_bytes": ring_bytes}
            got = load_tensors(self.resolved, keys, device, threads=threads, verify=check, **extra)
        return {n: got[k] for n, k in zip(names, keys)}

    def read_adapter(self, *, threads: int | None = None) -> dict[str, torch.Tensor]:
        """Read the LoRA adapter's tensors (names as stored in ``adapter_model.safetensors``) into CPU
        tensors, each checked against its xxh3 when the adapter folder is a fastckpt checkpoint or a sub-folder
        of one that lists it (:func:`owning_checkpoint`).

        Raises:
            ValueError: the source has no adapter.
            ChecksumMismatchError: a tensor's bytes differ from the manifest (names file and tensor).
            HeaderError, CorruptCheckpointError, OSError: invalid or unreadable adapter file.
        """
        if self.adapter_dir is None:
            raise ValueError(f"{self.path}: no LoRA adapter")
        root, fname = owning_checkpoint(self.adapter_dir, ADAPTER_WEIGHTS)  # a sub-folder adapter: its parent's
        if LOCAL.isfile(os.path.join(root, MANIFEST)):
            r = self.resolved if os.path.abspath(root) == os.path.abspath(self.path) else resolve(root)
            keys = {k: r.manifest.tensors[k].name for k, (f, _) in r.tensors.items() if f == fname}
            got = read_tensors(r, list(keys), threads=threads, verify=True)
            return {keys[k]: t for k, t in got.items()}
        r = resolve(os.path.join(self.adapter_dir, ADAPTER_WEIGHTS))
        return read_tensors(r, list(r.tensors), threads=threads)


def owning_checkpoint(folder: str, name: str) -> tuple[str, str]:
    """``(checkpoint folder, file name in it)`` of file ``name`` of ``folder``: ``folder`` itself when it
    has a manifest, else the parent whose manifest lists ``<folder's name>/<name>`` (peft's second
    adapter; :func:`~fastckpt.storage.commit.listing_checkpoint`); ``(folder, name)`` when neither is a checkpoint."""
    if LOCAL.isfile(os.path.join(folder, MANIFEST)):
        return folder, name
    found = listing_checkpoint(folder, name)
    return (found[0], found[2]) if found else (folder, name)


def file_checks(folder: str | os.PathLike, name: str) -> tuple[int, list[RangeCheck]] | None:
    """Size and checksummed byte ranges of file ``name`` of the fastckpt checkpoint ``folder``.

    The ranges are the whole file (small files: config, tokenizer, adapter config), the header
    of a safetensors file, and each of its tensors, as the manifest lists them
    (:meth:`~fastckpt.format.manifest.Manifest.checks`), sorted by start; a format-2 chunk only
    when it is one contiguous byte range of the file (every chunk of a dim-0 split, e.g. FSDP2's;
    other chunks are checked by ``fastckpt verify`` and ``load(verify=True)``).

    Returns:
        ``(bytes, ranges)`` (each range with ``box=None``), or ``None`` when ``folder`` has no
        manifest or the manifest does not list ``name`` (nothing to check it against).

    Raises:
        CorruptCheckpointError: an unreadable manifest. UnsafePathError: ``name`` leaves the folder.
    """
    folder, name = owning_checkpoint(os.fspath(folder), name)
    if not LOCAL.isfile(os.path.join(folder, MANIFEST)):
        return None
    m = read_manifest_shared(folder)
    info = m.files.get(name)
    if info is None:
        return None
    fpath = safe_join(folder, name)
    out = []
    for c in m.checks(name):
        if c.box is None:
            out.append(c)
            continue
        assert c.key is not None and c.shape is not None and c.dtype is not None
        isz = itemsize(str_to_dtype(c.dtype, tensor=c.key, path=fpath))
        whole = Stored(c.key, fpath, c.start, c.shape, c.dtype, isz, (0,) * len(c.shape))
        runs = box_runs(whole, c.box, c.box)
        if len(runs) == 1:
            r = runs[0]
            out.append(RangeCheck(f"tensor {c.key!r} chunk at offsets {list(c.box[0])}", c.file, r.file_offset,
                                  r.file_offset + r.nbytes, c.xxh3, c.key))
    out.sort(key=lambda c: (c.start, c.end))
    return info.bytes, out


def find_checkpoint(source: str | os.PathLike) -> str:
    """The folder to serve: ``source`` itself, or the newest committed step of a run root.

    A folder holding ``step-N``, ``checkpoint-N`` or ``checkpoint_N`` folders, itself or in its
    ``checkpoints/`` sub-folder (accelerate's ``project_dir``), and no ``manifest.json`` or
    ``*.safetensors`` of its own, is a run root; anything else is returned as is (absolute).

    Raises:
        CheckpointNotFoundError: a run root without any committed step (lists what was skipped).
    """
    source = os.path.abspath(os.fspath(source))
    if not LOCAL.isdir(source) or LOCAL.exists(os.path.join(source, MANIFEST)):
        return source
    if LOCAL.glob(source, "*.safetensors"):
        return source
    names = LOCAL.listdir(source)
    prefixes = sorted({m.group(1) for n in names if (m := _STEP_RE.match(n))})
    sub = os.path.join(source, "checkpoints")
    if not prefixes and LOCAL.isdir(sub):  # accelerate: project_dir/checkpoints/checkpoint_N
        source, names = sub, LOCAL.listdir(sub)
        prefixes = sorted({m.group(1) for n in names if (m := _STEP_RE.match(n))})
    if not prefixes:
        return os.path.dirname(sub) if source == sub else source
    best: tuple[int, str] | None = None
    skipped: dict[str, str] = {}
    for pre in prefixes:
        scan = scan_checkpoints(source, pre)
        newest = scan.newest()  # the most recently committed, as CheckpointManager.latest()
        if newest is not None and (best is None or newest[0] > best[0]):
            best = (newest[0], str(newest[1]))
        skipped.update(scan.skipped())
    if best is None:
        why = "; ".join(f"{n}: {w}" for n, w in sorted(skipped.items())) or "none"
        raise CheckpointNotFoundError(f"{source}: run root without a committed checkpoint (skipped: {why})")
    return best[1]


def _weights_key(weights: dict[str, str]) -> str:
    """The top-level state key of the model weights in a manifest's ``weights`` map: ``"model"``, else
    the key written as the ``model`` stem (Lightning's ``state_dict``: ``weights={"state_dict": "model"}``)."""
    if "model" in weights:
        return "model"
    return next((k for k, stem in weights.items() if stem == "model"), "model")


def open_source(path: str | os.PathLike, base: str | os.PathLike | None = None) -> Source:
    """Validate ``path`` (headers, index, manifest sizes) and describe its weights and adapter.

    Args:
        path: a checkpoint or model folder, a safetensors file, or a peft adapter folder.
        base: base model folder of an adapter-only ``path`` (default: the adapter's
            ``base_model_name_or_path`` when it is a local folder).

    Raises:
        CheckpointNotFoundError: no weights (an adapter folder needs ``base``).
        HeaderError, CorruptCheckpointError: invalid files.
    """
    path = os.fspath(path)
    adapter = path if LOCAL.isfile(os.path.join(path, ADAPTER_CONFIG)) else None
    if adapter and not LOCAL.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        raise CheckpointNotFoundError(f"{path}: has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    if adapter:
        resolve(os.path.join(path, ADAPTER_WEIGHTS))  # header validation of the adapter
    r = resolve(path)
    if r.manifest is not None:
        top = _weights_key(r.manifest.weights)
        stem = r.manifest.weights.get(top, "model")
        weights = {e.name: k for k, e in r.manifest.tensors.items() if e.file is not None and k.startswith(top + "/")
                   and (e.file.startswith(stem + "-") or e.file == stem + ".safetensors" or e.file == stem)}
    else:
        weights = {n: n for n, (f, _) in r.tensors.items() if f != ADAPTER_WEIGHTS}
    if not weights:
        if adapter is None:
            raise CheckpointNotFoundError(f"{path}: no model weights found")
        base = base or adapter_base_dir(path)
        if base is None:
            try:
                named = json.loads(LOCAL.read_bytes(os.path.join(path, ADAPTER_CONFIG))).get("base_model_name_or_path")
            except (ValueError, AttributeError, OSError):
                named = None
            why = (f"its adapter_config.json names base_model_name_or_path={named!r}, which is not a local folder "
                   "(a hub id is never downloaded here)") if named else "its adapter_config.json names no base model"
            raise CheckpointNotFoundError(f"{path}: adapter only ({why}); pass --base BASE_MODEL_DIR, a local "
                                          "folder of the base model")
        src = open_source(os.path.abspath(base))
        src.adapter_dir = adapter
        return src
    order = sorted(weights.items(), key=lambda kv: (r.tensors[kv[1]][0], r.tensors[kv[1]][1].start))
    return Source(path, r, dict(order), path, adapter)


def resolve_source(source: str | os.PathLike, *, base: str | os.PathLike | None = None) -> Source:
    """:func:`open_source` of :func:`find_checkpoint`: a run root, checkpoint, HF folder or adapter
    folder, validated and described (no tensor data read).

    Raises:
        CheckpointNotFoundError: nothing to serve (a run root without a committed step, no
            weights, an adapter without a base). HeaderError, CorruptCheckpointError: invalid files.

    Example::

        src = resolve_source("runs/a")          # newest committed checkpoint-N of the run
        first = next(iter(src.weights))
        t = src.read([first])[first]
    """
    return open_source(find_checkpoint(source), base)


def adapter_base_dir(path: str) -> str | None:
    """``base_model_name_or_path`` of the adapter folder ``path`` when it is a local folder, else None
    (also when ``adapter_config.json`` is not a JSON object: a damaged file is named by the
    manifest check of whoever reads its bytes, e.g. ``fastckpt load``, not by a JSON error here)."""
    raw = LOCAL.read_bytes(os.path.join(path, ADAPTER_CONFIG))
    try:
        b = json.loads(raw).get("base_model_name_or_path")
    except (ValueError, AttributeError):  # invalid JSON / UTF-8, or not an object
        return None
    return b if isinstance(b, str) and LOCAL.isdir(b) else None
