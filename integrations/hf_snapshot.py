"""Snapshot pieces shared by the Trainer callback and the accelerate plugin.

RNG states (Python, NumPy, torch CPU, CUDA/NPU) as JSON-able values and tensors, the model's
weights in HF layout (for a peft model: base weights under plain HF names plus the adapter),
``config.json`` / ``generation_config.json`` / tokenizer files as bytes. Nothing here pickles.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("fastckpt.integrations.hf_trainer")


# ---------------------------------------------------------------------------------------------
# Snapshot pieces shared with the accelerate plugin
# ---------------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Return the Python, NumPy, torch CPU and (when present) CUDA/NPU RNG states.

    The result is a fastckpt-serialisable dict (tuples, numpy arrays, uint8 CPU tensors).
    """
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "get_rng_state_all"):
        rng["npu"] = npu.get_rng_state_all()
    return rng


def restore_rng_state(rng: dict[str, Any]) -> None:
    """Set the RNG states captured by :func:`capture_rng_state`.

    Raises:
        KeyError: ``rng`` lacks the ``python``, ``numpy`` or ``cpu`` entry.
    """
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = rng["numpy"]
    np.random.set_state(tuple(np_state))
    torch.set_rng_state(rng["cpu"].cpu())
    if "cuda" in rng and torch.cuda.is_available():
        states = list(rng["cuda"])
        for i, s in enumerate(states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)
    npu = getattr(torch, "npu", None)
    if "npu" in rng and npu is not None and hasattr(npu, "set_rng_state_all"):
        npu.set_rng_state_all([s.cpu() for s in rng["npu"]])


def dedup_tied(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that share storage with an earlier key (tied embeddings), like HF does.

    Args:
        sd: a state dict (tensors of any dtype and device).

    Returns:
        A new dict, in ``sd``'s order, keeping the first key of each (storage pointer, storage
        offset, shape); empty tensors are always kept.
    """
    seen: set[tuple[int, int, tuple]] = set()
    out = {}
    for k, t in sd.items():
        loc = _local(t)
        ident = (loc.untyped_storage().data_ptr(), loc.storage_offset(), tuple(t.shape)) if loc.numel() else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out[k] = t
    return out


def is_peft_model(model) -> bool:
    """True if ``model`` is a ``peft.PeftModel`` (False when peft is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def peft_base_weights(model) -> dict[str, torch.Tensor]:
    """Base-model weights of a PeftModel under the names transformers expects for the base model.

    peft wraps the modules it adapts; the wrapper names leave the key: ``x.base_layer.w`` -> ``x.w``
    (LoRA, DoRA and every other ``BaseTunerLayer``), ``x.original_module.w`` -> ``x.w``
    (``modules_to_save`` copies, ``ModulesToSaveWrapper``) and ``x.token_adapter.base_layer.w`` ->
    ``x.w`` (``trainable_token_indices``). Everything the adapter owns (``lora_A``/``lora_B``,
    ``lora_magnitude_vector``, the ``modules_to_save`` copies, token deltas) is left out: it is
    in the adapter (:func:`model_snapshot`). So ``model.embed_tokens.weight`` is the frozen
    (possibly resized) base embedding, not peft's trained copy, exactly as ``PeftModel.from_pretrained``
    expects the base model it is given.

    Args:
        model: a ``peft.PeftModel`` (tensors on any device).

    Returns:
        Name -> tensor (views of the live weights, no copy), in state-dict order, tied weights once
        (:func:`dedup_tied`).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    base = model.get_base_model()
    modules = dict(base.named_modules(remove_duplicate=False))
    wrappers = (BaseTunerLayer, AuxiliaryTrainingWrapper)
    out = {}
    for key, t in base.state_dict().items():
        *path, leaf = key.split(".")
        cur, plain = "", []
        for seg in path:
            parent, child = modules.get(cur), f"{cur}.{seg}" if cur else seg
            if isinstance(parent, wrappers):
                wrapped_tuner = isinstance(parent, AuxiliaryTrainingWrapper) and \
                    isinstance(modules.get(child), BaseTunerLayer)  # TrainableTokensWrapper.token_adapter
                if seg not in ("base_layer", "original_module") and not wrapped_tuner:
                    break  # owned by the adapter (lora_A, modules_to_save, ...)
            else:
                plain.append(seg)
            cur = child
        else:
            if not isinstance(modules.get(cur), wrappers):  # a tensor held by a wrapper itself is the adapter's
                out[".".join(plain + [leaf])] = t
    return dedup_tied(out)


def adapter_config_bytes(model) -> bytes:
    """``adapter_config.json`` of ``model``'s active adapter, as ``PeftModel.save_pretrained`` writes it.

    peft's own ``PeftConfig.save_pretrained`` writes the file (into a temporary folder) from a copy
    of the config with what ``PeftModel.save_pretrained`` sets first: ``inference_mode=True``,
    ``base_model_name_or_path`` from the base model when unset, and ``auto_mapping`` (base model
    class and module) when ``task_type`` is unset. ``model`` itself is not changed.

    Args:
        model: a ``peft.PeftModel``.
    """
    import copy
    import tempfile

    cfg = copy.deepcopy(model.peft_config[_adapter_name(model)])
    holder = model.base_model if cfg.is_prompt_learning else model.get_base_model()
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = getattr(holder, "name_or_path", None) or None
    cfg.inference_mode = True
    auto = None
    if cfg.task_type is None:
        auto = {"base_model_class": type(holder).__name__, "parent_library": type(holder).__module__}
    with tempfile.TemporaryDirectory(prefix="fastckpt-peft-cfg-") as d:
        cfg.save_pretrained(d, auto_mapping_dict=auto)
        return (Path(d) / "adapter_config.json").read_bytes()


def model_snapshot(model) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str], dict[str, bytes]]:
    """Split a model into fastckpt ``state`` entries, the ``weights`` map and ``extra_files``.

    Args:
        model: a ``PreTrainedModel`` or ``peft.PeftModel`` (unwrapped; tensors on any device).

    Returns:
        ``(state, weights, extra_files)``: ``state["model"]`` holds the full weights under HF
        names (written as ``model-*.safetensors`` + index; for a PeftModel the base model's,
        :func:`peft_base_weights`); for a PeftModel ``state["adapter"]`` holds exactly what
        ``PeftModel.save_pretrained`` writes into ``adapter_model.safetensors`` (peft's own
        ``get_peft_model_state_dict``: LoRA/DoRA tensors, ``modules_to_save`` copies, resized
        embeddings; every key stored in that file, see :mod:`fastckpt.saving.collect`) and
        ``extra_files`` has ``adapter_config.json`` (:func:`adapter_config_bytes`);
        ``config.json`` is always included when the model has a config,
        ``generation_config.json`` when it has a generation config (the base model's for a PeftModel).
        Tensors are detached views of the live parameters/buffers (no copy).
    """
    if is_peft_model(model):
        from peft import get_peft_model_state_dict

        state = {"model": peft_base_weights(model),
                 "adapter": dict(get_peft_model_state_dict(model, adapter_name=_adapter_name(model)))}
    else:
        state = {"model": dedup_tied(model.state_dict())}
    return state, _weights_map(model), _model_files(model)


def _adapter_name(model) -> str:
    return model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]


def _weights_map(model) -> dict[str, str]:
    if is_peft_model(model):
        return {"model": "model", "adapter": "adapter_model.safetensors"}
    return {"model": "model"}


def _model_files(model) -> dict[str, bytes]:
    """``config.json``, ``generation_config.json`` and (peft) ``adapter_config.json`` as bytes."""
    extra: dict[str, bytes] = {}
    if is_peft_model(model):
        extra["adapter_config.json"] = adapter_config_bytes(model)
        model = model.get_base_model()
    config = getattr(model, "config", None)
    gen = getattr(model, "generation_config", None)
    if config is not None and hasattr(config, "to_json_string"):
        extra["config.json"] = config.to_json_string().encode()
    if gen is not None and hasattr(gen, "to_json_string"):
        extra["generation_config.json"] = gen.to_json_string(use_diff=True).encode()
    return extra


class ModelSnapshotter:
    """:func:`model_snapshot` that remembers which parameter or buffer backs each saved tensor.

    Building the state dicts of a peft model walks every module twice (~25 ms for SmolLM2-135M,
    measured); a training run saves the same structure every time. After the first call the
    snapshotter keeps ``(section, key, parameter-or-buffer)`` triples and returns the live
    ``torch.nn.Parameter`` objects themselves (so :func:`fastckpt.async_save` sees which are
    frozen, see its ``link_check="version"``) and ``buffer.detach()`` for buffers: no copy. This
    holds as long as the model is the same object with the same parameter and buffer objects
    (ids of all of them, ~3 ms to check) and the same active adapter. Any tensor of the snapshot
    that is not exactly a parameter or buffer view (e.g. computed by a state-dict hook) turns the
    shortcut off for that model (then it returns :func:`model_snapshot`'s detached state dicts).
    ``extra_files`` (configs) are rebuilt every call.

    Call: ``snapshotter(model) -> (state, weights, extra_files)``, as :func:`model_snapshot`.
    """

    def __init__(self) -> None:
        self._sig: tuple | None = None
        self._plan: list[tuple[str, str, torch.Tensor]] | None = None

    @staticmethod
    def _signature(model) -> tuple:
        adapter = _adapter_name(model) if is_peft_model(model) else None
        return (id(model), adapter, tuple(map(id, model.parameters())), tuple(map(id, model.buffers())))

    def __call__(self, model):
        sig = self._signature(model)
        if self._plan is None or sig != self._sig:
            state, weights, extra = model_snapshot(model)
            self._sig, self._plan = sig, _backing_objects(model, state)
            if self._plan is None:
                return state, weights, extra
        state: dict[str, dict[str, torch.Tensor]] = {}
        for section, key, obj in self._plan:
            state.setdefault(section, {})[key] = obj if isinstance(obj, torch.nn.Parameter) else obj.detach()
        return state, _weights_map(model), _model_files(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2: storage identity lives there), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _view_id(t: torch.Tensor) -> tuple:
    loc = _local(t)
    return (t.device, loc.untyped_storage().data_ptr(), loc.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _backing_objects(model, state) -> list[tuple[str, str, torch.Tensor]] | None:
    """(section, key, parameter/buffer) for every tensor of ``state``, or ``None`` if one has none."""
    owners = {}
    for _, obj in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if obj is not None:
            owners.setdefault(_view_id(obj), obj)
    plan = []
    for section, tensors in state.items():
        for key, t in tensors.items():
            obj = owners.get(_view_id(t)) if isinstance(t, torch.Tensor) else None
            if obj is None:
                return None
            plan.append((section, key, obj))
    return plan


def tokenizer_files(processing_class) -> dict[str, bytes]:
    """The files ``processing_class.save_pretrained`` writes (tokenizer / processor), as bytes.

    Saved once into a temporary folder; sub-folders are ignored. Empty when there is nothing
    to save (``None`` or an object without ``save_pretrained``).
    """
    if processing_class is None or not hasattr(processing_class, "save_pretrained"):
        return {}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fastckpt-tok-") as d:
        processing_class.save_pretrained(d)
        return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}


def snapshot_bytes_estimate(model) -> int:
    """Bytes of a whole Trainer snapshot of ``model`` (a ``torch.nn.Module``): every parameter and
    buffer, plus two Adam moments per trainable parameter, plus 64 MiB for headers, alignment
    padding and small state (what :func:`fastckpt.reserve` should reserve before training)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + buffers + 2 * trainable + (64 << 20)
