"""Checks and helpers of ``fastckpt load --merge-lora`` (the merge itself is peft's ``merge_and_unload``).

A merge must never hide a mismatch: transformers initialises missing base weights at random and
peft skips missing adapter tensors with a warning, and the merged folder would then load without
an error and give wrong logits. :func:`missing_adapter_tensors` finds adapter tensors a fastckpt
manifest lists but ``adapter_model.safetensors`` lacks; :func:`load_base` builds the base model
and refuses missing or unexpected weights; :func:`unique_tensors` lists the merged weights, tied
ones once.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import LoraMergeError
from ..format.dtypes import dtype_to_str
from ..loading.source import ADAPTER_WEIGHTS
from ..saving.export import Entry
from ..storage.commit import MANIFEST, read_manifest_shared
from ..storage.store import LOCAL


def missing_adapter_tensors(adapter_dir: str) -> list[str]:
    """Key paths of adapter tensors that the manifest of ``adapter_dir`` lists but that are not
    stored in its ``adapter_model.safetensors`` (``alias``/``view`` entries of the adapter group:
    what fastckpt wrote before every adapter tensor was kept in that file). Empty for a folder
    without a manifest (a plain peft folder: the file is all there is)."""
    if not LOCAL.isfile(os.path.join(adapter_dir, MANIFEST)):
        return []
    man = read_manifest_shared(adapter_dir)
    tops = [top for top, stem in man.weights.items() if stem == ADAPTER_WEIGHTS]
    return sorted(k for k, e in man.tensors.items() if k.split("/", 1)[0] in tops and e.file != ADAPTER_WEIGHTS)


def check_adapter(adapter_dir: str) -> None:
    """Raise :class:`LoraMergeError` when :func:`missing_adapter_tensors` finds any."""
    gaps = missing_adapter_tensors(adapter_dir)
    if gaps:
        raise LoraMergeError(
            f"fastckpt load: {os.path.join(adapter_dir, ADAPTER_WEIGHTS)} lacks {len(gaps)} adapter tensors "
            f"its manifest lists only as aliases of other tensors ({_show(gaps)}): peft and vLLM would load "
            "the adapter without them. The checkpoint was written by an older fastckpt; save the model again "
            "(FastCkptCallback, or fastckpt.save of model_snapshot(model)) or use peft's own save_pretrained "
            "folder", path=adapter_dir, missing=gaps)


def nested_adapters(folder: str) -> list[str]:
    """Sub-folders of ``folder`` that hold a peft adapter (``adapter_config.json`` +
    ``adapter_model.safetensors``): where ``PeftModel.save_pretrained`` (and fastckpt) save every
    adapter not named ``default``. Sorted; empty for a file or a folder without any."""
    if not LOCAL.isdir(folder):
        return []
    return sorted(n for n in LOCAL.listdir(folder) if not n.startswith(".") and LOCAL.isfile(
        os.path.join(folder, n, ADAPTER_WEIGHTS)) and LOCAL.isfile(os.path.join(folder, n, "adapter_config.json")))


def refuse_nested_adapters(folder: str) -> None:
    """``--merge-lora`` of a folder without a top-level adapter: raise :class:`LoraMergeError` when
    its adapters are all in sub-folders (the merge would otherwise write the base weights unmerged)."""
    names = nested_adapters(folder)
    if names:
        raise LoraMergeError(
            f"--merge-lora: {folder} has no adapter at the top (peft's 'default') but adapters in sub-folders "
            f"({_show(names)}); merge one of them by naming it, e.g. fastckpt load {os.path.join(folder, names[0])} "
            f"--base {folder} --merge-lora --to DIR", path=folder, missing=[f"{n}/{ADAPTER_WEIGHTS}" for n in names])


def _show(names) -> str:
    """The first 4 of ``names``, sorted, then ``...`` when there are more."""
    names = sorted(names)
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def model_class(cfg, where: str):
    """The transformers class to merge into: the config's ``architectures[0]`` when transformers has
    it (``LlamaForSequenceClassification``, ``T5ForConditionalGeneration``...: what
    ``merge_and_unload().save_pretrained`` keeps), else the causal LM of its model type. Never a
    class from the checkpoint's own code.

    Raises:
        ValueError: neither exists (names ``where``, the config file).
    """
    import transformers
    for name in getattr(cfg, "architectures", None) or []:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    try:
        return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except KeyError:
        raise ValueError(f"--merge-lora: {where} names no transformers class (architectures "
                         f"{getattr(cfg, 'architectures', None)}) and {type(cfg).__name__} has no causal LM in "
                         "transformers: nothing to merge into") from None


def refuse_unmergeable(pcfg, where: str) -> None:
    """Raise :class:`LoraMergeError` for an adapter peft cannot merge (prompt tuning, prefix tuning,
    p-tuning: virtual tokens, no weights to fold in)."""
    if getattr(pcfg, "is_prompt_learning", False):
        raise LoraMergeError(
            f"--merge-lora: {where} holds a {getattr(pcfg.peft_type, 'value', pcfg.peft_type)} adapter (virtual tokens), which peft cannot merge into "
            "the weights; load it with peft (PeftModel.from_pretrained) instead", path=where, missing=[])


def load_base(cls, cfg, state: dict[str, torch.Tensor], where: str):
    """``cls.from_pretrained(None, config=cfg, state_dict=state)``, refusing any missing or
    unexpected weight (tied weights transformers re-ties are not missing).

    Raises:
        LoraMergeError: naming the first names of each kind, ``where`` being the source folder.
    """
    model, info = cls.from_pretrained(None, config=cfg, state_dict=state, dtype="auto", output_loading_info=True)
    missing, unexpected = set(info.get("missing_keys") or ()), set(info.get("unexpected_keys") or ())
    if missing or unexpected:
        raise LoraMergeError(
            f"--merge-lora: the base weights of {where} do not fit {cls.__name__}: missing {len(missing)} "
            f"({_show(missing)}), unexpected {len(unexpected)} ({_show(unexpected)}); transformers would "
            "initialise the missing ones at random. Names like 'x.original_module.weight' or "
            "'x.base_layer.weight' are peft wrapper names an older fastckpt saved: save the model again "
            "with this fastckpt (FastCkptCallback, or fastckpt.save of model_snapshot(model))",
            path=where, missing=missing, unexpected=unexpected)
    return model


def unique_tensors(model) -> tuple[dict[str, torch.Tensor], list[Entry]]:
    """``model``'s state dict as contiguous CPU tensors and export entries (:func:`unique_tensors_of`)."""
    return unique_tensors_of(model.state_dict())


def unique_tensors_of(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[Entry]]:
    """``state`` (CPU tensors) as contiguous tensors and export entries, in its order; tensors sharing
    one storage view (tied weights) once, under their first name."""
    sd, seen, entries = {}, set(), []
    for name, t in state.items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and ptr in seen:
            continue
        seen.add(ptr)
        sd[name] = t.detach().contiguous()
        entries.append((name, dtype_to_str(t.dtype, tensor=name), tuple(t.shape), t.numel() * t.element_size()))
    return sd, entries


#: The ``--max-lora-rank`` values vLLM accepts (``vllm/config/lora.py``: ``MaxLoRARanks``).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(folder: str) -> int:
    """The largest rank stored in ``folder``'s ``adapter_model.safetensors``: dim 0 of every
    ``lora_A`` / ``lora_embedding_A`` tensor (a ``rank_pattern`` or AdaLoRA may exceed the config's
    ``r``); the config's ``r`` (default 8) when the file names none.

    Raises:
        HeaderError: the adapter file's header is damaged (names the file).
    """
    from ..storage.model_files import read_header
    hdr = read_header(os.path.join(folder, ADAPTER_WEIGHTS))
    ranks = [i.shape[0] for n, i in hdr.tensors.items()
             if (".lora_A." in n or ".lora_embedding_A." in n or n.endswith("lora_embedding_A")) and i.shape]
    if ranks:
        return max(ranks)
    return int(json.loads(LOCAL.read_bytes(os.path.join(folder, "adapter_config.json"))).get("r", 8))


def vllm_max_lora_rank(rank: int) -> int | None:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds ``rank`` (None past 512)."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), None)


def vllm_lora_problem(folder: str) -> str | None:
    """Why vLLM's ``--enable-lora`` cannot serve the peft adapter in ``folder`` (None when it can):
    vLLM serves plain LoRA only (``peft_type`` ``LORA``: no DoRA, no ``modules_to_save``, no bias
    training, rank at most 512)."""
    cfg = json.loads(LOCAL.read_bytes(os.path.join(folder, "adapter_config.json")))
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        return f"a {kind} adapter (vLLM serves LoRA adapters only)"
    if cfg.get("use_dora"):
        return "a DoRA adapter (vLLM does not serve DoRA)"
    if cfg.get("modules_to_save"):
        return f"modules_to_save {cfg['modules_to_save']} (vLLM's LoRA does not load whole trained modules)"
    if cfg.get("bias", "none") != "none":
        return f"bias={cfg['bias']!r} (vLLM's LoRA does not load trained biases)"
    rank = adapter_rank(folder)
    if vllm_max_lora_rank(rank) is None:
        return f"rank {rank} (vLLM's --max-lora-rank is at most 512)"
    return None
