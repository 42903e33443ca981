"""Snapshot pieces shared by the Trainer callback and the accelerate plugin.

RNG states (Python, NumPy, torch CPU, CUDA/NPU) as JSON-able values and tensors, the model's
weights in HF layout (for a peft model: base weights under plain HF names plus the adapter),
``config.json`` / ``generation_config.json`` / tokenizer files as bytes. Nothing here pickles.
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("fastckpt.integrations.hf.trainer")


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
        offset, shape); empty tensors and values that are no tensor (a module's ``_extra_state``
        from ``get_extra_state``, saved in ``state.json``) are always kept.
    """
    seen: set[tuple[int, int, tuple]] = set()
    out = {}
    for k, t in sd.items():
        if not isinstance(t, torch.Tensor):
            out[k] = t
            continue
        loc = _local(t)
        ident = (loc.untyped_storage().data_ptr(), loc.storage_offset(), tuple(t.shape)) if loc.numel() else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out[k] = t
    return out


def dedup_tied_as_saved(sd: dict, model) -> dict:
    """:func:`dedup_tied` keeping, of each tied group, the name ``save_pretrained`` keeps.

    transformers drops the names its ``_tied_weights_keys`` declare the tie's targets
    (``remove_tied_weights_from_state_dict``), whatever their place in the state dict: XLM-R's
    ``lm_head.decoder.weight`` comes before ``roberta.embeddings.word_embeddings.weight``, the
    name kept. Falls back to the first name (:func:`dedup_tied`) for a model transformers does not
    know or whose shared tensors it refuses to save (``RuntimeError``).

    Args:
        sd: the model's state dict (names as ``save_pretrained`` sees them; tensors not copied).
        model: the ``PreTrainedModel`` the names belong to.

    Returns:
        A new dict in ``sd``'s order, holding ``sd``'s own tensors.
    """
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        kept = remove_tied_weights_from_state_dict(dict(sd), model)  # a copy: it deletes (and clones) in it
    except (ImportError, RuntimeError, AttributeError, TypeError):
        return dedup_tied(sd)
    return dedup_tied({k: v for k, v in sd.items() if k in kept})


def is_peft_model(model, mixed: bool = False) -> bool:
    """True if ``model`` is a ``peft.PeftModel`` (with ``mixed``: a ``peft.PeftMixedModel``, adapters
    of several types, which is not a ``PeftModel``). Imports nothing: a peft model exists only once
    peft is imported, so a save of any other model does not pay peft's import."""
    peft = sys.modules.get("peft")
    cls = getattr(peft, "PeftMixedModel" if mixed else "PeftModel", None) if peft is not None else None
    return cls is not None and isinstance(model, cls)


def peft_base_weights(model) -> dict[str, torch.Tensor]:
    """Base-model weights of a PeftModel under the names transformers expects for the base model.

    peft wraps the modules it adapts; the wrapper names leave the key: ``x.base_layer.w`` -> ``x.w``
    (LoRA, DoRA and every other ``BaseTunerLayer``), ``x.original_module.w`` -> ``x.w``
    (``modules_to_save`` copies, ``ModulesToSaveWrapper``) and ``x.token_adapter.base_layer.w`` ->
    ``x.w`` (``trainable_token_indices``), ``self_attn.model.w`` -> ``self_attn.w`` (adaption prompt's
    ``AdaptedAttention``). Everything the adapter owns (``lora_A``/``lora_B``,
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
    from peft.tuners.adaption_prompt.layer import AdaptedAttention, AdaptedAttentionGPT
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    base = model.get_base_model()
    modules = dict(base.named_modules(remove_duplicate=False))
    attention = (AdaptedAttention, AdaptedAttentionGPT)  # adaption prompt's wrappers of whole attention modules
    wrappers = (BaseTunerLayer, AuxiliaryTrainingWrapper, *attention)
    out = {}
    for key, t in base.state_dict().items():
        *path, leaf = key.split(".")
        cur, plain = "", []
        for seg in path:
            parent, child = modules.get(cur), f"{cur}.{seg}" if cur else seg
            if isinstance(parent, wrappers):
                wrapped_tuner = isinstance(parent, AuxiliaryTrainingWrapper) and \
                    isinstance(modules.get(child), BaseTunerLayer)  # TrainableTokensWrapper.token_adapter
                held = isinstance(parent, attention) and seg == "model"  # the attention module it wraps
                if seg not in ("base_layer", "original_module") and not wrapped_tuner and not held:
                    break  # owned by the adapter (lora_A, modules_to_save, ...)
            else:
                plain.append(seg)
            cur = child
        else:
            if not isinstance(modules.get(cur), wrappers):  # a tensor held by a wrapper itself is the adapter's
                out[".".join(plain + [leaf])] = t
    return dedup_tied_as_saved(drop_ignored_on_save(out, base), base)


def _init_rewrites_base(init) -> bool:
    """Whether LoRA's ``init_lora_weights`` rewrites the base weights it adapts (peft 0.21: PiSSA,
    CorDA, OLoRA, LoftQ, LoRA-GA leave a residual there)."""
    return isinstance(init, str) and (init.startswith(("pissa", "corda")) or init.lower() in ("olora", "loftq",
                                                                                                "lora_ga"))


def adapter_config_bytes(model, adapter_name: str | None = None) -> bytes:
    """``adapter_config.json`` of one adapter of ``model``, as ``PeftModel.save_pretrained`` writes it.

    peft's own ``PeftConfig.save_pretrained`` writes the file (into a temporary folder) from a copy
    of the config with what ``PeftModel.save_pretrained`` sets first: ``inference_mode=True``,
    ``init_lora_weights=True`` for an init that rewrote the base weights (PiSSA, OLoRA, CorDA, LoftQ,
    LoRA-GA: the folder holds that residual base, which peft must not rewrite again when it loads),
    ``base_model_name_or_path`` from the base model when unset, and ``auto_mapping`` (base model
    class and module) when ``task_type`` is unset. ``model`` itself is not changed.

    Args:
        model: a ``peft.PeftModel``.
        adapter_name: the adapter (default: the active one).
    """
    import copy
    import tempfile

    # a shallow copy: its sets (target_modules) iterate in the live config's order, as peft writes them
    cfg = copy.copy(model.peft_config[adapter_name or _adapter_name(model)])
    holder = model.base_model if cfg.is_prompt_learning else model.get_base_model()
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = getattr(holder, "name_or_path", None) or None
    cfg.inference_mode = True
    if _init_rewrites_base(getattr(cfg, "init_lora_weights", None)):
        # the folder's base is the residual this init left in the model; peft would run the init again
        # on it when loading the adapter (as peft's own PiSSA / OLoRA examples say before saving)
        cfg.init_lora_weights = True
    auto = None
    if cfg.task_type is None:
        auto = {"base_model_class": type(holder).__name__, "parent_library": type(holder).__module__}
    with tempfile.TemporaryDirectory(prefix="fastckpt-peft-cfg-") as d:
        cfg.save_pretrained(d, auto_mapping_dict=auto)
        return (Path(d) / "adapter_config.json").read_bytes()


def unwrap_model(model):
    """The model that ``save_pretrained`` saves, out of its training wrappers.

    Removes ``torch.compile`` (``OptimizedModule``: its ``_orig_mod.`` key prefix), DDP,
    ``DataParallel`` and DeepSpeed's engine (``.module``), outermost first, as accelerate's
    ``unwrap_model`` / transformers' Trainer do before ``save_pretrained``. A model without
    such a wrapper (FSDP2 ``fully_shard``, peft) is returned as is. Looks only at modules
    already imported: nothing is imported here.

    Args:
        model: a ``torch.nn.Module``.
    """
    import sys

    for _ in range(8):  # wrappers nest a few levels at most (compile(DDP(model)))
        dynamo = sys.modules.get("torch._dynamo.eval_frame")
        ds = sys.modules.get("deepspeed")
        if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) or (
                ds is not None and isinstance(model, getattr(ds, "DeepSpeedEngine", ()))):
            model = model.module
        else:
            break
    return model


def model_snapshot(model) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str], dict[str, bytes]]:
    """Split a model into fastckpt ``state`` entries, the ``weights`` map and ``extra_files``.

    The folder ``fastckpt.save(state, path, weights=weights, extra_files=extra_files)`` writes is
    what the reference writers write for the same model, plus fastckpt's own files
    (:data:`fastckpt.format.layout.REFERENCE_ADDITIONS`); tests/reference/ diffs the two for many
    model kinds.

    Args:
        model: a ``PreTrainedModel`` or ``peft.PeftModel`` (tensors on any device), possibly
            wrapped by ``torch.compile``, DDP or DeepSpeed (:func:`unwrap_model`).

    Returns:
        ``(state, weights, extra_files)``: ``state["model"]`` holds the full weights under HF
        names, written as ``model.save_pretrained`` writes them (``model.safetensors``, or
        ``model-0000k-of-0000n.safetensors`` + index past one shard; tied weights once). For a
        PeftModel it holds the base model's (:func:`peft_base_weights`), written as
        ``model-0000k-of-0000n.safetensors`` + index even as one file (see
        :data:`fastckpt.format.layout.PEFT_BASE_ADDITIONS`), and every adapter
        is saved where ``PeftModel.save_pretrained`` saves it: ``state["adapter"]`` is the
        adapter ``"default"`` (``adapter_model.safetensors`` + ``adapter_config.json`` at the top),
        ``state["adapter@NAME"]`` any other adapter (``NAME/adapter_model.safetensors`` +
        ``NAME/adapter_config.json``), each exactly what peft's ``get_peft_model_state_dict``
        gives (LoRA/DoRA tensors, ``modules_to_save`` copies, resized embeddings; every key
        stored in that file, see :mod:`fastckpt.saving.collect`), plus peft's ``README.md``.
        ``extra_files`` has ``config.json`` and (for a model that can generate)
        ``generation_config.json`` as ``save_pretrained`` writes them (:func:`model_files`).
        Tensors are detached views of the live parameters/buffers (no copy).
    """
    model = unwrap_model(model)
    return _model_state(model), _weights_map(model), model_files(model)


def _model_state(model) -> dict[str, dict[str, torch.Tensor]]:
    """The ``state`` of :func:`model_snapshot` (``model`` unwrapped).

    Raises:
        UnsupportedValueError: ``model`` is a ``peft.PeftMixedModel`` (peft cannot save it either).
    """
    if is_peft_model(model, mixed=True):
        from fastckpt.errors import UnsupportedValueError

        raise UnsupportedValueError(
            "model is a peft PeftMixedModel (adapters of several types at once), which peft's own save_pretrained "
            "refuses (NotImplementedError), so there is no folder layout to write it in: its weights would be "
            "saved under peft's internal names, which from_pretrained loads as missing. Save each adapter from a "
            "PeftModel holding that one type, or fastckpt.save({'model': model.state_dict()}, PATH) for a "
            "checkpoint only fastckpt.load_into reads back")
    if is_peft_model(model):
        from peft import get_peft_model_state_dict

        state = {"model": peft_base_weights(model)}
        for name in model.peft_config:
            state[_adapter_key(name)] = dict(get_peft_model_state_dict(model, adapter_name=name))
        return state
    return {"model": dedup_tied_as_saved(drop_ignored_on_save(model.state_dict(), model), model)}


def drop_ignored_on_save(sd: dict, model) -> dict:
    """``sd`` without the keys ``PreTrainedModel.save_pretrained`` leaves out: the model's
    ``_keys_to_ignore_on_save`` (transformers gathers its modules' too; e.g. Marian's sinusoidal
    ``model.encoder.embed_positions.weight``, rebuilt at init). ``sd`` itself when there are none."""
    ignore = getattr(model, "_keys_to_ignore_on_save", None)
    if not ignore:
        return sd
    ignore = set(ignore)
    return {k: v for k, v in sd.items() if k not in ignore}


def _adapter_name(model) -> str:
    return model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]


def _adapter_key(name: str) -> str:
    """Top-level state key of adapter ``name`` (``adapter`` for peft's ``default``)."""
    return "adapter" if name == "default" else f"adapter@{name}"


def _adapter_dir(name: str) -> str:
    """Where ``PeftModel.save_pretrained`` puts adapter ``name``: the top, or a sub-folder ``name/``."""
    return "" if name == "default" else f"{name}/"


def _weights_map(model) -> dict[str, str]:
    if is_peft_model(model):
        return {"model": "model",
                **{_adapter_key(n): f"{_adapter_dir(n)}adapter_model.safetensors" for n in model.peft_config}}
    return {"model": "model"}


def model_files(model) -> dict[str, bytes]:
    """The small files the reference writers write for ``model``, as bytes.

    ``config.json`` and ``generation_config.json`` are written by transformers itself, into a
    temporary folder: ``PreTrainedConfig.save_pretrained`` of a copy of the config with the two
    fields ``PreTrainedModel.save_pretrained`` sets on it first (``dtype`` = the model's dtype,
    ``architectures`` = the model's class), and ``GenerationConfig.save_pretrained`` when the
    model ``can_generate()``, as ``save_pretrained`` does. The live config is not changed (unlike
    ``save_pretrained``, which sets both fields on it). For a PeftModel these are the base
    model's (a ``trust_remote_code`` model's code files too, copied by transformers'
    ``custom_object_save`` as ``save_pretrained`` copies them), plus what ``PeftModel.save_pretrained``
    writes besides the weights: each adapter's
    ``adapter_config.json`` (:func:`adapter_config_bytes`) and peft's model card ``README.md``.
    A model without an HF config gets only ``config.json`` from ``config.to_json_string()``
    when it has one.

    Args:
        model: a ``PreTrainedModel`` or ``peft.PeftModel`` (unwrapped, see :func:`unwrap_model`).

    Returns:
        File name (``/``-separated inside the folder) -> bytes.
    """
    import copy
    import tempfile

    extra: dict[str, bytes] = {}
    if is_peft_model(model):
        for name in model.peft_config:
            extra[f"{_adapter_dir(name)}adapter_config.json"] = adapter_config_bytes(model, name)
        with tempfile.TemporaryDirectory(prefix="fastckpt-peft-card-") as d:
            model.create_or_update_model_card(d)
            extra.update(_read_files(d))
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None:
        return extra
    if not (hasattr(config, "save_pretrained") and hasattr(model, "can_generate")):
        if hasattr(config, "to_json_string"):
            extra["config.json"] = config.to_json_string().encode()
        return extra
    cfg = copy.deepcopy(config)
    cfg.dtype = str(model.dtype).split(".")[1]  # what PreTrainedModel.save_pretrained sets on the config
    cfg.architectures = [type(model).__name__.removeprefix("FSDP")]
    with tempfile.TemporaryDirectory(prefix="fastckpt-config-") as d:
        if callable(getattr(model, "is_remote_code", None)) and model.is_remote_code():
            from transformers.dynamic_module_utils import custom_object_save  # copies files, runs none
            custom_object_save(model, d, config=cfg)  # as save_pretrained: modeling_*.py + auto_map
        cfg.save_pretrained(d)
        if model.can_generate() and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(d)
        extra.update(_read_files(d))
    return extra


def _read_files(folder: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def _files_signature(model) -> tuple:
    """What :func:`model_files` depends on, cheaply: configs as dicts, dtype, class, adapter configs."""
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    cfg, gen = getattr(base, "config", None), getattr(base, "generation_config", None)
    adapters = tuple((n, repr(c)) for n, c in model.peft_config.items()) if peft else ()
    return (id(model), type(base), str(getattr(base, "dtype", None)), getattr(base, "name_or_path", None),
            cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg),
            gen.to_dict() if hasattr(gen, "to_dict") else repr(gen), adapters)


class ModelFilesCache:
    """:func:`model_files`, built again only when what it depends on changed.

    :func:`model_files` costs milliseconds (transformers and peft write the files into a temporary
    folder: ~7 ms for a tiny Llama, ~76 ms with a LoRA adapter, peft's model card included,
    measured on the 2-core dev machine); a training run saves the same configs every time. The
    check each call (configs as dicts, dtype, class, adapter configs: ~0.07 ms) decides.

    Call: ``cache(model) -> {file name: bytes}`` (a new dict each call).
    """

    def __init__(self) -> None:
        self._files: tuple[tuple, dict[str, bytes]] | None = None

    def __call__(self, model) -> dict[str, bytes]:
        sig = _files_signature(model)
        if self._files is None or self._files[0] != sig:
            self._files = (sig, model_files(model))
        return dict(self._files[1])


class ModelSnapshotter:
    """:func:`model_snapshot` that remembers which parameter or buffer backs each saved tensor.

    Building the state dicts of a peft model walks every module twice (~25 ms for SmolLM2-135M,
    measured); a training run saves the same structure every time. After the first call the
    snapshotter keeps ``(section, key, parameter-or-buffer)`` triples and returns the live
    ``torch.nn.Parameter`` objects themselves (so :func:`fastckpt.async_save` sees which are
    frozen, see its ``link_check="version"``) and ``buffer.detach()`` for buffers: no copy. This
    holds as long as the model is the same object with the same parameter and buffer objects
    (ids of all of them, ~3 ms to check) and the same adapters. Any tensor of the snapshot
    that is not exactly a parameter or buffer view (e.g. computed by a state-dict hook) turns the
    shortcut off for that model (then it returns :func:`model_snapshot`'s detached state dicts).
    ``extra_files`` (:func:`model_files`) come from a :class:`ModelFilesCache`.

    Call: ``snapshotter(model) -> (state, weights, extra_files)``, as :func:`model_snapshot`.
    """

    def __init__(self) -> None:
        self._sig: tuple | None = None
        self._plan: list[tuple[str, str, torch.Tensor]] | None = None
        self._model_files = ModelFilesCache()

    @staticmethod
    def _signature(model) -> tuple:
        adapters = (_adapter_name(model), tuple(model.peft_config)) if is_peft_model(model) else None
        return (id(model), adapters, tuple(map(id, model.parameters())), tuple(map(id, model.buffers())))

    def __call__(self, model):
        model = unwrap_model(model)
        sig = self._signature(model)
        if self._plan is None or sig != self._sig:
            state = _model_state(model)
            self._sig, self._plan = sig, _backing_objects(model, state)
            if self._plan is None:
                return state, _weights_map(model), self._model_files(model)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for section, key, obj in self._plan:
            state.setdefault(section, {})[key] = obj if isinstance(obj, torch.nn.Parameter) else obj.detach()
        return state, _weights_map(model), self._model_files(model)


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

    Saved once into a temporary folder; files in sub-folders keep their relative name
    (transformers 5 writes each named chat template to ``additional_chat_templates/NAME.jinja``).
    Empty when there is nothing to save (``None`` or an object without ``save_pretrained``).
    """
    if processing_class is None or not hasattr(processing_class, "save_pretrained"):
        return {}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fastckpt-tok-") as d:
        processing_class.save_pretrained(d)
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def snapshot_bytes_estimate(model) -> int:
    """Bytes of a whole Trainer snapshot of ``model`` (a ``torch.nn.Module``): every parameter and
    buffer, plus two Adam moments per trainable parameter, plus 64 MiB for headers, alignment
    padding and small state (what :func:`fastckpt.reserve` should reserve before training)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + buffers + 2 * trainable + (64 << 20)
