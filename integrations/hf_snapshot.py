"""Snapshot pieces shared by the Trainer callback and the accelerate plugin.

RNG states (Python, NumPy, torch CPU, CUDA/NPU) as JSON-able values and tensors, the model's
weights in HF layout (for a peft model: base weights under plain HF names plus the adapter),
``config.json`` / ``generation_config.json`` / tokenizer files as bytes. Nothing here pickles.
"""

from __future__ import annotations

import json
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


def _dedup_tied(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that share storage with an earlier key (tied embeddings), like HF does."""
    seen: set[tuple[int, int, tuple]] = set()
    out = {}
    for k, t in sd.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out[k] = t
    return out


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _peft_base_weights(model) -> dict[str, torch.Tensor]:
    """Base-model weights of a PeftModel under the plain HF names (``x.base_layer.w`` -> ``x.w``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    tuner_prefixes = [n for n, m in base.named_modules() if isinstance(m, BaseTunerLayer) and n]
    sd = base.state_dict()
    out = {}
    for key, t in sd.items():
        owner = next((p for p in tuner_prefixes if key.startswith(p + ".")), None)
        if owner is None:
            out[key] = t
            continue
        rest = key[len(owner) + 1:]
        if rest.startswith("base_layer."):
            out[f"{owner}.{rest[len('base_layer.'):]}"] = t
    return _dedup_tied(out)


def model_snapshot(model) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str], dict[str, bytes]]:
    """Split a model into fastckpt ``state`` entries, the ``weights`` map and ``extra_files``.

    Args:
        model: a ``PreTrainedModel`` or ``peft.PeftModel`` (unwrapped; tensors on any device).

    Returns:
        ``(state, weights, extra_files)``: ``state["model"]`` holds the full weights under HF
        names (written as ``model-*.safetensors`` + index); for a PeftModel ``state["adapter"]``
        holds the adapter (written as ``adapter_model.safetensors``) and ``extra_files`` has
        ``adapter_config.json``; ``config.json`` is always included when the model has a config,
        ``generation_config.json`` when it has a generation config (the base model's for a PeftModel).
    """
    extra: dict[str, bytes] = {}
    weights = {"model": "model"}
    if _is_peft(model):
        from peft import get_peft_model_state_dict

        state = {"model": _peft_base_weights(model)}
        name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
        state["adapter"] = dict(get_peft_model_state_dict(model, adapter_name=name))
        weights["adapter"] = "adapter_model.safetensors"
        cfg = model.peft_config[name].to_dict()
        extra["adapter_config.json"] = json.dumps(
            cfg, indent=2, sort_keys=True, default=lambda o: sorted(o) if isinstance(o, set) else str(o)
        ).encode()
        config = model.get_base_model().config
        gen = getattr(model.get_base_model(), "generation_config", None)
    else:
        state = {"model": _dedup_tied(model.state_dict())}
        config = getattr(model, "config", None)
        gen = getattr(model, "generation_config", None)
    if config is not None and hasattr(config, "to_json_string"):
        extra["config.json"] = config.to_json_string().encode()
    if gen is not None and hasattr(gen, "to_json_string"):
        extra["generation_config.json"] = gen.to_json_string(use_diff=True).encode()
    return state, weights, extra


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


# ---------------------------------------------------------------------------------------------
# Checkpoint folders
# ---------------------------------------------------------------------------------------------
def _snapshot_bytes_estimate(model) -> int:
    """Bytes of a whole snapshot: every parameter and buffer, plus two Adam moments per trainable
    parameter, plus 64 MiB for headers/alignment padding and small state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + buffers + 2 * trainable + (64 << 20)


