"""Rebuild full weights from a DeepSpeed ZeRO-1/2/3 checkpoint written by fastckpt's engine.

A DeepSpeed ``save_dir`` written through :class:`fastckpt.integrations.deepspeed.engine.FastCkptCheckpointEngine`
holds ``latest`` (the tag name) and ``TAG/``, in which every DeepSpeed "file" is a committed
fastckpt folder (``{"ds": state}``; values DeepSpeed stores that are not tensors are tagged JSON,
e.g. ``{"__ds_size__": [64, 32]}`` for a ``torch.Size``) and ``fastckpt_tag.json`` lists the
files every rank committed. :func:`find_zero_tag` finds that tag; :func:`consolidate` reads it
(every tensor checked against its manifest xxh3 while read) and returns the full model state
dict. Nothing is unpickled and no class named by the checkpoint is built: only tensors, numbers,
strings and the tagged sizes are read.

The reconstruction follows DeepSpeed 0.19's own offline converter
(``deepspeed/utils/zero_to_fp32.py``, ``_zero2_merge_trainable_params`` and
``_zero3_merge_trainable_params``):

* **ZeRO-1/2**: rank ``r``'s ``optimizer_state_dict.single_partition_of_fp32_groups[g]`` is the
  ``r``-th equal slice of param group ``g`` flattened (params in ``param_shapes[g]`` order,
  optionally followed by ``param_alignment_paddings[g][i]`` elements each), the group padded to
  a multiple of ``2 * world_size``. Concatenating the ranks' slices of a group and cutting it
  in ``param_shapes`` order gives each parameter.
* **ZeRO-3**: each parameter of ``n`` elements is split into ``ceil(n / world_size)``-element
  pieces, the last one zero-padded; rank ``r``'s ``fp32_flat_groups`` (concatenated) holds its
  piece of every parameter in ``param_shapes`` order. Parameter ``i`` is the concatenation of the
  ranks' pieces at the same offset, cut to ``n`` elements.
* Frozen parameters (``frozen_param_fragments``: whole for ZeRO-2, per-rank pieces for ZeRO-3;
  ZeRO-1 stores none, so a frozen ZeRO-1 parameter is taken whole from the ``module`` state, where
  ``zero_to_fp32`` drops it) and persistent buffers (``module`` entries named in ``buffer_names``) are taken as stored;
  ``shared_params`` (tied weights) are left out of the result, as ``save_pretrained`` leaves out
  tied weights (transformers ties them again from ``config.json``).

The weights come out in **fp32**: they are the optimizer's fp32 master copies (for fp16/bf16
training more precise than the module's half-precision copy, as ``zero_to_fp32`` gives).
Native DeepSpeed folders (pickled ``*_model_states.pt`` files) and native DCP folders (pickled
``.metadata``) are refused by :func:`refuse_native` before any of their bytes are read.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import CorruptCheckpointError, IncompleteTagError, KeysNotFoundError, ShardedCheckpointError
from ..format.layout import ENGINE_TAG_MARKER
from ..storage.store import LOCAL
from .reader import load
from .resolve import DS_FILE_RE, latest_tag, refuse_native

MARKER = ENGINE_TAG_MARKER
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_OSD = "ds/optimizer_state_dict/"


@dataclass(frozen=True)
class ZeroInfo:
    """What :func:`consolidate` read: ZeRO ``stage`` (0 when there is no ZeRO optimizer state),
    data-parallel ``world_size`` (ranks of the save), the ``tag`` folder and the ``dtype`` of the
    weights returned."""

    stage: int
    world_size: int
    tag: str
    dtype: torch.dtype


def find_zero_tag(path: str) -> str | None:
    """The tag folder of a DeepSpeed checkpoint written by fastckpt's engine, or None.

    Args:
        path: a DeepSpeed ``save_dir`` (its ``latest`` names the tag) or a tag folder.

    Raises:
        NativeCheckpointError: ``path`` is a native DeepSpeed or DCP checkpoint (see :func:`refuse_native`).
        IncompleteTagError: a tag folder with fastckpt-written DeepSpeed files but no marker
            (a save some rank failed, or one still running).
    """
    refuse_native(path)
    path = os.path.abspath(path)
    for folder in [t for t in [latest_tag(path) if LOCAL.isdir(path) else None, path] if t]:
        if LOCAL.isfile(os.path.join(folder, MARKER)):
            return folder
        if LOCAL.isdir(folder) and any(DS_FILE_RE.match(n) for n in LOCAL.listdir(folder)):
            raise IncompleteTagError(f"{folder}: DeepSpeed files written by fastckpt but no {MARKER}: this tag "
                                     "was never committed by every rank; use the tag that 'latest' names", path=folder)
    return None


def _size(v: object, where: str) -> tuple[int, ...]:
    if isinstance(v, dict) and isinstance(v.get("__ds_size__"), list):
        v = v["__ds_size__"]
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) and x >= 0 for x in v):
        return tuple(v)
    raise CorruptCheckpointError(f"{where}: expected a torch.Size, found {v!r}", path=where)


def _int(v: object) -> int | list:
    if isinstance(v, dict) and "__ds_enum__" in v:  # ZeroStageEnum stored as tagged JSON: its value only
        v = v.get("value")
    return v  # type: ignore[return-value]


def _files(tag_dir: str) -> tuple[dict, list[tuple[int, str]], list[tuple[int, str]]]:
    marker = json.loads(LOCAL.read_bytes(os.path.join(tag_dir, MARKER)))
    names = [n for n in marker.get("files", []) if isinstance(n, str)]
    model = sorted((int(m.group(1) or 0), n) for n in names if (m := _MODEL_RE.match(n)))
    optim = sorted((int(m.group(1)), n) for n in names if (m := _OPTIM_RE.match(n)))
    if not model:
        raise IncompleteTagError(f"{tag_dir}: {MARKER} lists no *_model_states.pt ({names})", path=tag_dir)
    mp = sorted({int(m.group(2)) for n in names if (m := _MODEL_RE.match(n) or _OPTIM_RE.match(n))})
    if mp != [0]:  # (the files would be merged as one model-parallel rank's: a wrong "incomplete tag")
        raise ShardedCheckpointError(
            f"{tag_dir}: a model- or pipeline-parallel DeepSpeed tag (files of mp_rank_{', '.join(f'{r:02d}' for r in mp)}); "
            "`fastckpt load` consolidates tags of one model-parallel rank (data-parallel ZeRO) only. Load it with "
            "the same parallel layout through install(engine), and save the model from there (e.g. "
            "engine.save_16bit_model)")
    return marker, model, optim


def _optim(path: str) -> tuple[int, int | list, list[torch.Tensor], list | None]:
    """``(stage, partition_count, this rank's fp32 flat groups, param_alignment_paddings)`` of one optim folder."""
    head = load(path, keys=[_OSD + "zero_stage", _OSD + "partition_count"], verify=True)["ds"]["optimizer_state_dict"]
    stage, count = _int(head["zero_stage"]), _int(head["partition_count"])
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups = load(path, keys=_OSD + key, verify=True)["ds"]["optimizer_state_dict"][key]
    try:
        pads = load(path, keys=_OSD + "param_alignment_paddings")["ds"]["optimizer_state_dict"]["param_alignment_paddings"]
    except KeysNotFoundError:
        pads = None
    if not isinstance(groups, list) or not all(isinstance(g, torch.Tensor) and g.dim() == 1 for g in groups):
        raise CorruptCheckpointError(f"{path}: {key} is not a list of flat tensors", path=path)
    return stage, count, groups, pads


def consolidate(tag_dir: str) -> tuple["OrderedDict[str, torch.Tensor]", ZeroInfo]:
    """Full weights of the model saved in ``tag_dir`` (see the module docstring for the algorithm).

    Args:
        tag_dir: a tag folder with ``fastckpt_tag.json`` (:func:`find_zero_tag`).

    Returns:
        ``(state_dict, info)``: parameter and buffer name -> full CPU tensor (fp32 parameters,
        buffers in their stored dtype), in the module's order; and a :class:`ZeroInfo`.

    Raises:
        IncompleteTagError: the marker lists fewer optimizer files than ranks.
        ShardedCheckpointError: a model- or pipeline-parallel tag (files of ``mp_rank_01`` and up).
        CorruptCheckpointError / ChecksumMismatchError: a file is damaged, or the flat partitions
            do not add up to the parameter shapes (names the file and the numbers).
    """
    marker, model_files, optim_files = _files(tag_dir)
    models = [load(os.path.join(tag_dir, n), verify=True)["ds"] for _, n in model_files]
    first = models[0]
    module = first.get("module") or {}
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    buffers = set(first.get("buffer_names") or [])
    if not optim_files:  # no ZeRO optimizer: the module holds the full weights
        full = OrderedDict((k, v) for k, v in module.items() if isinstance(v, torch.Tensor))
        return full, ZeroInfo(0, 1, tag_dir, _dtype(full))
    parts = [_optim(os.path.join(tag_dir, n)) for _, n in optim_files]
    stage, count = parts[0][0], parts[0][1]
    world = max(count) if isinstance(count, list) else count
    if world != len(optim_files) or [r for r, _ in optim_files] != list(range(world)):
        raise IncompleteTagError(f"{tag_dir}: ZeRO-{stage} of {world} ranks but the tag holds the optimizer files "
                                 f"{[n for _, n in optim_files]}", path=tag_dir)
    params: dict[str, torch.Tensor] = {}
    shapes = [OrderedDict((k, _size(v, f"{tag_dir} param_shapes/{k}")) for k, v in g.items())
              for g in first.get("param_shapes") or []]
    if stage == 3:
        _zero3(params, shapes, [p[2] for p in parts], world, tag_dir)
        _frozen3(params, models, world, tag_dir)
    elif stage in (1, 2):
        _zero12(params, shapes, [p[2] for p in parts], parts[0][3], world, tag_dir)
        for k, v in (first.get("frozen_param_fragments") or {}).items():
            params[k] = v
    else:
        raise CorruptCheckpointError(f"{tag_dir}: unknown ZeRO stage {stage!r}", path=tag_dir)
    shared = set((first.get("shared_params") or {}).keys())
    frozen = _frozen_from_module(params, module, buffers, shared, int(stage), tag_dir)
    for k in module:  # module order first (HF order), then what the module did not list
        if k in params and k not in shared:
            out[k] = params.pop(k)
        elif k in frozen:
            out[k] = frozen[k]
        elif k in buffers and isinstance(module[k], torch.Tensor):
            out[k] = module[k]
    for k, v in params.items():
        if k not in shared:
            out[k] = v
    return out, ZeroInfo(int(stage), int(world), tag_dir, torch.float32)


def _frozen_from_module(params: dict, module: dict, buffers: set, shared: set, stage: int,
                        where: str) -> dict[str, torch.Tensor]:
    """Module parameters the optimizer partitions and ``frozen_param_fragments`` do not hold.

    DeepSpeed stores ``frozen_param_fragments`` only when ZeRO partitions gradients (stage 2
    and 3); under ZeRO-1 a ``requires_grad=False`` parameter is only in the ``module`` state
    (rank 0's full tensor), and DeepSpeed's own ``zero_to_fp32`` leaves it out. Under ZeRO-1/2
    the module state holds every parameter whole, so such a parameter is taken from it, as
    ``load_checkpoint`` restores it. Under ZeRO-3 the module state holds empty placeholders: a
    parameter found nowhere else cannot be rebuilt.

    Raises:
        CorruptCheckpointError: ZeRO-3 module parameters with neither an fp32 partition nor a
            frozen fragment (or an empty ZeRO-1/2 module tensor), named.
    """
    out, lost = {}, []
    for k, v in module.items():
        if k in params or k in buffers or k in shared or not isinstance(v, torch.Tensor):
            continue
        if stage == 3 or v.numel() == 0:
            lost.append(k)
        else:
            out[k] = v
    if lost:
        raise CorruptCheckpointError(
            f"{where}: ZeRO-{stage} module parameters {sorted(lost)[:8]}{' ...' if len(lost) > 8 else ''} "
            f"({len(lost)}) are in no optimizer partition and not in frozen_param_fragments, so their values "
            "were not saved (a save with exclude_frozen_parameters=True?). Save again without "
            "exclude_frozen_parameters, or export the weights with engine.save_16bit_model", path=where)
    return out


def _dtype(sd: dict) -> torch.dtype:
    return next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)


def _zero12(out: dict, shapes: list, flat: list[list[torch.Tensor]], pads: list | None, world: int, where: str) -> None:
    """ZeRO-1/2: concatenate each group's rank slices, cut in ``param_shapes`` order (zero_to_fp32)."""
    if any(len(f) != len(shapes) for f in flat):
        raise CorruptCheckpointError(f"{where}: {len(shapes)} param groups in param_shapes but the ranks hold "
                                     f"{[len(f) for f in flat]} fp32 partitions", path=where)
    align = 2 * world
    for g, group in enumerate(shapes):
        full = torch.cat([f[g] for f in flat])
        off = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            if off + n > full.numel():
                raise CorruptCheckpointError(f"{where}: group {g} holds {full.numel()} elements but {name} needs "
                                             f"[{off}, {off + n})", path=where, tensor=name)
            out[name] = full[off:off + n].view(shape).clone()
            off += n + (int(pads[g][i]) if pads else 0)
        if align * math.ceil(off / align) != align * math.ceil(full.numel() / align):
            raise CorruptCheckpointError(f"{where}: group {g} used {off} of {full.numel()} elements "
                                         f"(padded to a multiple of {align}): param_shapes do not match", path=where)


def _zero3(out: dict, shapes: list, flat: list[list[torch.Tensor]], world: int, where: str) -> None:
    """ZeRO-3: parameter i is the ranks' ``ceil(n / world)``-element pieces at one offset (zero_to_fp32)."""
    per_rank = [torch.cat(f) if f else torch.empty(0) for f in flat]
    if len({p.numel() for p in per_rank}) != 1:
        raise CorruptCheckpointError(f"{where}: ranks hold {[p.numel() for p in per_rank]} fp32 elements; ZeRO-3 "
                                     "partitions are equal", path=where)
    off = 0
    for name, shape in ((k, v) for g in shapes for k, v in g.items()):
        n = math.prod(shape)
        piece = math.ceil(n / world)
        if off + piece > per_rank[0].numel():
            raise CorruptCheckpointError(f"{where}: {name} {list(shape)} needs elements [{off}, {off + piece}) of each "
                                         f"rank's {per_rank[0].numel()}", path=where, tensor=name)
        out[name] = torch.cat([p[off:off + piece] for p in per_rank])[:n].view(shape).clone()
        off += piece
    if off != per_rank[0].numel():
        raise CorruptCheckpointError(f"{where}: param_shapes use {off} of each rank's {per_rank[0].numel()} fp32 "
                                     "elements", path=where)


def _frozen3(out: dict, models: list[dict], world: int, where: str) -> None:
    """ZeRO-3 frozen parameters: each rank's fragment, concatenated and cut (zero_to_fp32)."""
    fshapes = models[0].get("frozen_param_shapes") or {}
    if fshapes and len(models) != world:
        raise IncompleteTagError(f"{where}: {len(models)} model-states files for {world} ranks", path=where)
    for name, s in fshapes.items():
        shape = _size(s, f"{where} frozen_param_shapes/{name}")
        frags = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        out[name] = torch.cat(frags)[:math.prod(shape)].view(shape).clone()
