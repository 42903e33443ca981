"""Turn a nested state into what the planner needs: specs, sources, manifest entries.

Validation happens here, before any file exists: value types (named by key path),
dtypes, sparse/quantized/meta tensors, NumPy dtypes. NumPy arrays in a non-native byte order
(``">f4"``) are stored as a byte-swapped copy in native (little-endian) order: same values.

Tensors that share storage are stored once where only fastckpt reads them: in the ``state``
files, identical views become ``alias`` entries and different views of one storage become
``view`` entries over one byte blob, rebuilt sharing storage on load. Zero-element tensors
never share.

Every file that another reader opens holds every tensor that reader expects in it (a manifest
entry is invisible to ``safetensors``, transformers, peft and vLLM): a tensor of a ``weights``
group (an HF file stem) is written under its own name in that group's files, whatever else
shares its storage, with one exception: in a model group (a stem without ``.safetensors``,
written as ``{stem}.safetensors``, or ``{stem}-0000k-of-0000n.safetensors`` + index past one
file, see :func:`fastckpt.format.layout.shard_file_names`), a tensor that is
exactly the same view as an earlier one of the same group (tied weights, e.g. ``lm_head.weight``
= ``embed_tokens.weight``) is an ``alias`` of it, as ``save_pretrained`` and
``safetensors.torch.save_model`` drop tied duplicates and transformers re-ties them on load.
A single named file (a stem ending in ``.safetensors``, e.g. peft's ``adapter_model.safetensors``)
never aliases: peft reads it key by key. Never across groups: a ``state`` tensor identical to a
``weights`` tensor is an ``alias`` of it (fastckpt's loader resolves it), never the reverse.
A ``weights`` tensor that shares storage with others loads as a tensor of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format.dtypes import dtype_to_str
from ..errors import InvalidArgumentError, UnsupportedDtypeError, UnsupportedValueError
from ..format.layout import STATE_STEM, ArraySpec
from ..format.tree import flatten, join

logger = logging.getLogger(__name__)

#: Key-path prefix of storage blobs; ``%s`` can never come out of :func:`fastckpt.format.tree.encode_segment`.
BLOB_PREFIX = "%storage/"
STATE_GROUP = STATE_STEM


@dataclass
class Collected:
    """A validated state ready to plan.

    Attributes:
        skeleton: JSON skeleton of the state (see :mod:`fastckpt.format.tree`).
        specs: one :class:`ArraySpec` per stored array, in state order.
        sources: key path -> tensor whose bytes are stored (any device, maybe non-contiguous).
        entries: key path -> manifest entry for arrays not stored under their own key
            (``{"alias": key}`` or ``{"view": blob, "offset", "dtype", "shape", "stride"}``),
            plus ``{"ndarray": True}`` markers.
        frozen: key paths whose value was a ``torch.nn.Parameter`` with ``requires_grad=False``
            (no optimizer steps it), stored under its own key.
        trainable: key paths whose value was a ``torch.nn.Parameter`` with ``requires_grad=True``.
    """

    skeleton: Any
    specs: list[ArraySpec] = field(default_factory=list)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: dict[str, dict] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)
    trainable: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        """Bytes of array data to write."""
        return sum(s.nbytes for s in self.specs)


def _as_tensor(key: str, v: Any) -> torch.Tensor:
    if isinstance(v, np.ndarray):
        if not v.dtype.isnative:  # e.g. ">f4": safetensors is little-endian and torch knows no byte order
            v = v.astype(v.dtype.newbyteorder("="))  # a byte-swapped copy, same values (loads as native order)
        try:
            return torch.from_numpy(v if v.flags.c_contiguous else np.ascontiguousarray(v))  # keeps 0-d 0-d
        except TypeError:
            raise UnsupportedDtypeError(f"array at key path {key!r} has NumPy dtype {v.dtype}, "
                                        "which has no torch/safetensors equivalent") from None
    if v.is_sparse or v.layout != torch.strided:
        raise UnsupportedValueError(f"tensor at key path {key!r} has layout {v.layout}; call .to_dense() first")
    if v.is_quantized:
        raise UnsupportedValueError(f"tensor at key path {key!r} is quantized; store int_repr() and scales instead")
    if v.device.type == "meta":
        raise UnsupportedValueError(f"tensor at key path {key!r} is on the meta device and has no data")
    return v.detach()


def _view_in_storage(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def check_weight_keys(state: Any, weights: dict[str, str] | None) -> None:
    """Refuse ``weights=`` keys that are not top-level keys of ``state`` (a typo would otherwise save
    no ``model.safetensors`` and no HF folder, silently). ``None`` (the default ``{"model": "model"}``,
    which applies only when there is a ``"model"`` key) is never refused.

    Raises:
        InvalidArgumentError: naming the keys, the state's top-level keys and the closest one.
    """
    if not isinstance(state, dict):
        return
    for key, stem in (weights or ({"model": "model"} if "model" in state else {})).items():
        v = state.get(key)
        if isinstance(v, dict) and v and not any(_is_array(x) for x in v.values()):
            nested = _first_array_path(v, str(key))
            if nested is not None:
                msg = (f"state[{key!r}] holds its tensors in nested dicts (e.g. {nested!r}), so no {stem}.safetensors "
                       f"is written for it: an HF weights file needs flat tensor names (model.state_dict() gives "
                       f"them); its tensors are saved under their key paths in state-*.safetensors instead")
                if weights:
                    raise InvalidArgumentError(f"weights={{{key!r}: {stem!r}}}: {msg}. Pass the flat state dict "
                                               f"as state[{key!r}], or drop weights=. Nothing was written")
                logger.warning("fastckpt: %s", msg)
    if not weights:
        return
    missing = [k for k in weights if k not in state]
    if missing:
        import difflib
        close = difflib.get_close_matches(str(missing[0]), [str(k) for k in state], n=1)
        raise InvalidArgumentError(
            f"weights names {missing!r}, which the state does not have (its top-level keys: "
            f"{sorted(map(str, state))[:10]!r})" + (f"; did you mean {close[0]!r}?" if close else "")
            + ". weights maps a top-level state key to an HF file stem, e.g. weights={'model': 'model'}. "
            "Nothing was written")


def _is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def _first_array_path(v: Any, path: str, depth: int = 0) -> str | None:
    """Key path of the first tensor/array under dict ``v`` (a few levels deep), or None."""
    if depth > 4 or not isinstance(v, dict):
        return None
    for k, x in v.items():
        if _is_array(x):
            return f"{path}/{k}"
        found = _first_array_path(x, f"{path}/{k}", depth + 1)
        if found is not None:
            return found
    return None


def collect(state: Any, weights: dict[str, str]) -> Collected:
    """Validate ``state`` and describe every array to write.

    Args:
        state: nested state (see :func:`fastckpt.format.tree.flatten`).
        weights: top-level key -> HF file stem; tensors directly under ``state[key]`` keep their
            raw dict key as tensor name and go to that stem's files (``{stem}.safetensors``,
            more past one shard); all others go to ``state-0000k-of-0000n.safetensors`` under
            their key path.

    Raises:
        UnsupportedValueError, UnsupportedDtypeError: naming the key path.
    """
    arrays: list[tuple[str, Any]] = []
    skeleton = flatten(state, lambda k, v: arrays.append((k, v)))
    names: dict[str, tuple[str, str]] = {}
    if isinstance(state, dict):
        for top, stem in weights.items():
            sub = state.get(top)
            if isinstance(sub, dict):
                for rk in sub:
                    if isinstance(rk, str):
                        names[join(join("", top), rk)] = (rk, stem)
    out = Collected(skeleton)
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for key, v in arrays:
        t = _as_tensor(key, v)
        if isinstance(v, torch.nn.Parameter):
            (out.trainable if v.requires_grad else out.frozen).add(key)
        dtype_to_str(t.dtype, tensor=key)
        if isinstance(v, np.ndarray):
            out.entries[key] = {"ndarray": True}
            _add(out, key, t, names)
        elif t.numel() == 0:
            _add(out, key, t, names)
        else:
            sid = (t.device, t.untyped_storage().data_ptr())
            groups.setdefault(sid, []).append((key, t))
    for members in groups.values():
        _add_group(out, members, names)
    order = {k: i for i, (k, _) in enumerate(arrays)}
    out.specs.sort(key=lambda s: order.get(s.key, len(order)))
    return out


def _add(out: Collected, key: str, t: torch.Tensor, names: dict[str, tuple[str, str]]) -> None:
    name, group = names.get(key, (key, STATE_GROUP))
    out.specs.append(ArraySpec(key, name, group, dtype_to_str(t.dtype, tensor=key), tuple(t.shape),
                               t.numel() * t.element_size()))
    out.sources[key] = t


def _add_group(out: Collected, members: list[tuple[str, torch.Tensor]], names: dict) -> None:
    if len(members) == 1:  # the common case: a tensor that shares its storage with no other
        _add(out, members[0][0], members[0][1], names)
        return
    first: dict[tuple, str] = {}  # (stem, view) -> first key of that weights group holding that view
    rest: list[tuple[str, torch.Tensor]] = []
    for key, t in members:
        if key not in names:
            rest.append((key, t))
            continue
        stem = names[key][1]
        tied = first.get((stem, _view_in_storage(t)))
        if tied is not None and not stem.endswith(".safetensors"):
            out.entries[key] = {"alias": tied}  # tied weights within one model group
            continue
        _add(out, key, t, names)  # the group's reader expects it in its file: its own bytes
        first.setdefault((stem, _view_in_storage(t)), key)
    stored: dict[tuple, str] = {}  # view -> first weights key holding it
    for (_, view), key in first.items():
        stored.setdefault(view, key)
    state = []
    for key, t in rest:
        target = stored.get(_view_in_storage(t))
        if target is not None:
            out.entries[key] = {"alias": target}
        else:
            state.append((key, t))
    if state:
        _share(out, state)


def _share(out: Collected, members: list[tuple[str, torch.Tensor]]) -> None:
    """``state`` tensors of one storage: stored once, as aliases or views of one byte blob."""
    if len(members) == 1:
        _add(out, members[0][0], members[0][1], {})
        return
    views = {_view_in_storage(t) for _, t in members}
    first_key, first = members[0]
    if len(views) == 1:
        _add(out, first_key, first, {})
        for key, _ in members[1:]:
            out.entries[key] = {"alias": first_key}
        return
    spans = []
    for _, t in members:
        last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        spans.append((t.storage_offset() * t.element_size(), (last + 1) * t.element_size()))
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    blob_key = BLOB_PREFIX + str(len([k for k in out.sources if k.startswith(BLOB_PREFIX)]))
    blob = torch.empty(0, dtype=torch.uint8, device=first.device)
    blob.set_(first.untyped_storage(), lo, (hi - lo,))
    _add(out, blob_key, blob, {})
    for (key, t), (s, _) in zip(members, spans):
        out.entries[key] = {"view": blob_key, "offset": s - lo, "dtype": dtype_to_str(t.dtype, tensor=key),
                            "shape": list(t.shape), "stride": list(t.stride())}
