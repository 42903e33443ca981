"""The servability gate: does a model folder hold what its ``config.json`` says the model is?

``fastckpt load --to DIR`` runs :func:`check_servable` on the folder it built (before renaming it
into place, so a folder that fails never appears at ``DIR``), ``fastckpt load SOURCE`` on the
source before it prints a ``vllm serve`` line, and the vLLM plugin on the folder it loads. The
checks, in order:

1. ``config.json`` exists, is a JSON object, names an architecture (``architectures``, what vLLM
   and ``AutoModel`` pick the model class by) and a dtype (``dtype``, or the older ``torch_dtype``:
   what vLLM serves in by default). ``save_pretrained`` writes both; a config built in code
   (``LlamaConfig(...)``) has neither until a model saved it. A config without a dtype whose
   floating weights are all float32 passes with a warning: transformers loads it in float32 and
   vLLM takes a config without a dtype as float32 (old ``save_pretrained`` versions wrote none,
   e.g. all-MiniLM-L6-v2's, transformers 4.8); with weights of another dtype it is refused.
2. The folder's weights (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with
   ``model.safetensors.index.json``, or a fastckpt checkpoint; headers and index validated, no
   tensor data read) hold every parameter of that architecture with its shape. The expected
   names and shapes are what ``save_pretrained`` of the model would write: transformers builds
   the class named in ``architectures`` from the config on the ``meta`` device (no memory, no
   weights), drops the model's ``_keys_to_ignore_on_save`` (Marian's sinusoidal position tables,
   rebuilt at init) and tied duplicates (``remove_tied_weights_from_state_dict``) and applies its own
   save-time renaming (``revert_weight_conversion``). Persistent buffers are checked for shape
   when the folder has them.
3. Tying: where the model ties a parameter to another (``tie_word_embeddings`` and the model's
   own tying rules), the folder may hold only the kept name; if it holds both, their values must
   be equal (transformers and vLLM would silently keep one). Untied, both must be present (2.).

No code from the checkpoint runs: a config with ``auto_map`` (``trust_remote_code`` models), a
quantized model (``quantization_config``: other tensor names and shapes), a
``model_type`` transformers does not know, or an ``architectures`` class transformers lacks
(a vLLM-only model) gets checks 1 only, and :attr:`ServableReport.warnings` says that the
parameters were not checked.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Container, Iterable

import torch

from ..errors import NotServableError
from ..storage.store import LOCAL
from .source import open_source

#: How many names a message lists of each kind before ``...``.
SHOW = 8


@dataclass(frozen=True)
class ServableReport:
    """What :func:`check_servable` found in a folder that passed.

    Attributes:
        path: the folder.
        architecture: ``architectures[0]`` of its ``config.json``.
        dtype: the config's ``dtype`` (or ``torch_dtype``), e.g. ``"bfloat16"``.
        checked: parameters checked for presence and shape (0 when the check was skipped).
        warnings: what could not be checked and why (one line each).
    """

    path: str
    architecture: str
    dtype: str
    checked: int
    warnings: list[str] = field(default_factory=list)


def _names(names) -> str:
    names = sorted(names)
    return ", ".join(names[:SHOW]) + (f", ... ({len(names)} in all)" if len(names) > SHOW else "")


def _read_config(folder: str) -> dict:
    p = os.path.join(folder, "config.json")
    if not LOCAL.isfile(p):
        raise NotServableError(
            f"{folder}: no config.json, from which vLLM and transformers read the model's architecture. "
            "Export with --config HF_DIR (a folder holding the config.json and tokenizer that the model's "
            "save_pretrained wrote) or --base BASE_MODEL_DIR", path=folder, problems=["no config.json"])
    try:
        cfg = json.loads(LOCAL.read_bytes(p))
    except ValueError as e:
        raise NotServableError(f"{p}: not valid JSON ({e}); pass --config HF_DIR with the model's config.json",
                               path=folder, problems=[f"config.json: {e}"]) from None
    if not isinstance(cfg, dict):
        raise NotServableError(f"{p}: not a JSON object; pass --config HF_DIR with the model's config.json",
                               path=folder, problems=["config.json is not an object"])
    return cfg


def _name_problems(cfg: dict) -> list[str]:
    out = []
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and arch and all(isinstance(a, str) and a for a in arch)):
        out.append(f"config.json names no architecture (architectures={arch!r}); vLLM picks the model class by it. "
                   "A config built in code gets it only from model.save_pretrained: pass --config HF_DIR with the "
                   "config.json the model's save_pretrained wrote (or set config.architectures = "
                   "[type(model).__name__] before saving)")
    dt = cfg.get("dtype", cfg.get("torch_dtype"))
    if not (isinstance(dt, str) and isinstance(getattr(torch, dt, None), torch.dtype)):
        out.append(f"config.json names no dtype (dtype={cfg.get('dtype')!r}, torch_dtype={cfg.get('torch_dtype')!r}); "
                   "vLLM serves in it. Pass --config HF_DIR with the config.json the model's save_pretrained wrote "
                   "(or set config.dtype, e.g. \"bfloat16\", before saving)")
    return out


def _meta_model(cfg: dict, folder: str) -> Any:
    """The architecture ``cfg["architectures"][0]`` built by transformers from ``folder/config.json`` on
    the meta device (no weights, no code from the folder), or why it cannot be (a str). Built once
    per folder and config (an export asks for its saved names, then gates the folder)."""
    return _meta_model_of(os.path.abspath(folder), json.dumps(cfg, sort_keys=True, default=str))


@functools.lru_cache(maxsize=2)
def _meta_model_of(folder: str, cfg_json: str) -> Any:
    cfg = json.loads(cfg_json)
    import transformers
    arch = cfg["architectures"][0]
    cls = getattr(transformers, arch, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return (f"architectures names {arch}, which transformers {transformers.__version__} does not "
                "have (a vLLM-only model class?): the parameters were NOT checked")
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as e:  # noqa: BLE001 - transformers' own refusal, reported as what was not checked
        return (f"transformers {transformers.__version__} could not build {arch} from config.json on the "
                f"meta device ({type(e).__name__}: {e}): the parameters were NOT checked")


def _buildable_config(folder: str) -> dict | None:
    """``folder/config.json`` when transformers can build its architecture without code or
    quantization (what :func:`saved_names`, :func:`converted_on_save` and :func:`ignored_on_save`
    ask the built model); None for a missing or unusable config, a quantized or ``auto_map`` one."""
    try:
        cfg = _read_config(folder)
    except NotServableError:
        return None
    if _name_problems(cfg) or cfg.get("quantization_config") or "auto_map" in cfg:
        return None
    return cfg


def saved_names(folder: str | os.PathLike) -> dict[str, str]:
    """``{in-memory name: saved name}`` of the parameters and buffers ``save_pretrained`` of the
    architecture in ``folder/config.json`` writes under another name (transformers 5 reverts its
    load-time renaming on save, ``revert_weight_conversion``: GPT-NeoX's ``lm_head.weight`` is
    ``embed_out.weight`` on disk). Pure renamings only (a conversion that builds new tensors, such
    as MoE experts fused on load, is left out); empty when nothing is renamed, or when the
    architecture cannot be built (quantized, ``auto_map``, unknown to transformers)."""
    folder = os.fspath(folder)
    cfg = _buildable_config(folder)
    if cfg is None:
        return {}
    return dict(_saved_names_of(os.path.abspath(folder), json.dumps(cfg, sort_keys=True, default=str)))


@functools.lru_cache(maxsize=2)
def _saved_names_of(folder: str, cfg_json: str) -> dict[str, str]:
    """:func:`saved_names` computed once per folder and config: an export asks for it when it names
    the weights (a wrapper's prefix, then the renaming) and again when it gates the folder."""
    cfg = json.loads(cfg_json)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if cfg.get("model_type") not in CONFIG_MAPPING:
        return {}
    model = _meta_model(cfg, folder)
    if isinstance(model, str):
        return {}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {}
    sd = model.state_dict()
    by_id = {id(t): n for n, t in sd.items()}
    try:
        out = revert_weight_conversion(model, dict(sd))
    except Exception:  # noqa: BLE001 - a conversion that cannot run on meta tensors: not a renaming
        return {}
    return {by_id[id(t)]: n for n, t in out.items() if id(t) in by_id and by_id[id(t)] != n}


def converted_on_save(folder: str | os.PathLike, names: Iterable[str]) -> list[str]:
    """Of ``names`` (a checkpoint's weights, already under :func:`saved_names`), those
    ``save_pretrained`` of the architecture in ``folder/config.json`` writes as *other* tensors:
    transformers 5 builds them on load (MoE experts fused into ``mlp.experts.gate_up_proj``, fused
    projections) and splits them back on save (``revert_weight_conversion``). Non-empty only when
    every such in-memory name is among ``names`` (a checkpoint of ``model.state_dict()``); ``[]``
    for a folder already in the saved layout or an architecture that cannot be built."""
    folder = os.fspath(folder)
    cfg = _buildable_config(folder)
    if cfg is None:
        return []
    params, buffers, tied, skip = _expected(cfg, folder)
    if skip:
        return []
    return _held_in_memory_layout(cfg, folder, {*params, *buffers, *(n for g in tied for n in g)}, set(names))


def ignored_on_save(folder: str | os.PathLike) -> set[str]:
    """The names ``save_pretrained`` of the architecture in ``folder/config.json`` leaves out of its
    files (the model's ``_keys_to_ignore_on_save``: Marian's sinusoidal position tables); empty when
    there are none or the architecture cannot be built."""
    folder = os.fspath(folder)
    cfg = _buildable_config(folder)
    if cfg is None:
        return set()
    model = _meta_model(cfg, folder)
    return set() if isinstance(model, str) else set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def to_saved_layout(folder: str | os.PathLike, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` (the in-memory state dict, CPU tensors) converted as ``save_pretrained`` of the
    architecture in ``folder/config.json`` converts it (``revert_weight_conversion`` of transformers,
    run with the model built on the meta device: the tensors are ``sd``'s, split or copied by
    transformers). Use when :func:`converted_on_save` is non-empty.

    Raises:
        NotServableError: the architecture cannot be built (names why).
    """
    folder = os.fspath(folder)
    cfg = _read_config(folder)
    model = _meta_model(cfg, folder)
    if isinstance(model, str):
        raise NotServableError(f"{folder}: {model}", path=folder)
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(sd))


def module_prefix(folder: str | os.PathLike, names: Iterable[str]) -> str:
    """The attribute path (``"llama."``) every one of ``names`` carries in front of the names the
    architecture in ``folder/config.json`` has, or ``""``. A LightningModule (or any wrapper module)
    holding the HF model as ``self.llama`` saves ``llama.model.layers.0...``; ``save_pretrained`` of
    the model it holds writes ``model.layers.0...``. Found only when it is unambiguous: every name
    has the prefix, every name without it is one of the architecture's (parameters, buffers, tied
    or in-memory names), and every parameter ``save_pretrained`` writes is then present."""
    names = sorted(set(names))
    try:
        cfg = _read_config(os.fspath(folder))
    except NotServableError:
        return ""
    if not names or _name_problems(cfg):
        return ""
    params, buffers, tied, skip = _expected(cfg, os.fspath(folder))
    if skip or not params or set(params) <= set(names):
        return ""
    in_memory = saved_names(folder)
    known = {*params, *buffers, *(n for g in tied for n in g), *in_memory}
    parts = names[0].split(".")
    for i in range(1, len(parts)):
        pre = ".".join(parts[:i]) + "."
        if not all(n.startswith(pre) for n in names):
            break
        bare = {in_memory.get(n[len(pre):], n[len(pre):]) for n in names}
        if {n[len(pre):] for n in names} <= known and set(params) <= bare:
            return pre
    return ""


def _expected(cfg: dict, folder: str) -> tuple[dict, dict, list[list[str]], str | None]:
    """``(params, buffers, tied_groups, skip_reason)``: name -> shape of what ``save_pretrained`` of
    the architecture writes (parameters; persistent buffers), and the groups of names that share
    one parameter in the model (first: the name kept). ``skip_reason`` is set (and the rest empty)
    when the architecture is not one transformers builds without remote code."""
    arch = cfg["architectures"][0]
    if cfg.get("quantization_config"):
        return {}, {}, [], (f"config.json has a quantization_config ({(cfg['quantization_config'] or {}).get('quant_method')}): "
                            "quantized tensors have other names and shapes than the architecture's parameters, "
                            "which were NOT checked")
    if "auto_map" in cfg:
        return {}, {}, [], (f"config.json has auto_map (a trust_remote_code model, {arch}): fastckpt runs no code "
                            "from a checkpoint, so the parameters were NOT checked against the architecture "
                            "(vllm serve needs --trust-remote-code)")
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if cfg.get("model_type") not in CONFIG_MAPPING:
        return {}, {}, [], (f"model_type {cfg.get('model_type')!r} is not one transformers "
                            f"{transformers.__version__} knows: the parameters were NOT checked")
    model = _meta_model(cfg, folder)
    if isinstance(model, str):
        return {}, {}, [], model
    params = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for n, p in params.items():
        groups.setdefault(id(p), []).append(n)
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())  # save_pretrained leaves them out
    kept = remove_tied_weights_from_state_dict({n: p for n, p in params.items() if n not in ignored}, model)
    tied = [[k for k in g if k in kept] + [k for k in g if k not in kept] for g in groups.values() if len(g) > 1]
    try:
        from transformers.core_model_loading import revert_weight_conversion
        kept = revert_weight_conversion(model, kept)
    except ImportError:  # a transformers without save-time renaming writes the names as they are
        pass
    pnames = set(params)
    buffers = {n: tuple(b.shape) for n, b in model.state_dict().items() if n not in pnames}
    return {n: tuple(t.shape) for n, t in kept.items()}, buffers, tied, None


def check_servable(folder: str | os.PathLike) -> ServableReport:
    """Check that ``folder`` is a model folder ``vllm serve`` loads as its ``config.json`` describes.

    See the module docstring for the checks. Reads ``config.json``, the safetensors headers and
    index; tensor data only where one tied parameter is stored under two names (to compare them).

    Args:
        folder: an HF model folder (``model.safetensors``, or shards + ``model.safetensors.index.json``)
            or a fastckpt checkpoint folder.

    Returns:
        A :class:`ServableReport` (with warnings for what could not be checked).

    Raises:
        NotServableError: naming every problem found (``problems``), the missing parameters
            (``missing``) and the mis-shaped ones (``mismatched``), and how to fix it.
        HeaderError, CorruptCheckpointError, CheckpointNotFoundError: invalid or no weight files.
    """
    folder = os.fspath(folder)
    cfg = _read_config(folder)
    problems = _name_problems(cfg)
    no_dtype = [q for q in problems if q.startswith("config.json names no dtype")]
    if problems != no_dtype or not no_dtype:  # (no problem, or others than the dtype alone)
        if problems:
            raise NotServableError(f"{folder} is not servable:\n  - " + "\n  - ".join(problems), path=folder,
                                   problems=problems)
    src = open_source(folder)
    notes = []
    if no_dtype:
        floats = {src.resolved.tensors[k][1].dtype for k in src.weights.values()} & {"F64", "F32", "F16", "BF16"}
        if floats - {"F32"}:
            raise NotServableError(f"{folder} is not servable:\n  - {no_dtype[0]} (the weights are "
                                   f"{', '.join(sorted(floats))}, and servers take a config without one as float32)",
                                   path=folder, problems=no_dtype)
        notes.append("config.json names no dtype: float32 assumed, as the weights are (transformers and vLLM take a "
                     "config without one as float32; vllm serve --dtype picks another)")
    have = {n: tuple(src.resolved.tensors[k][1].shape) for n, k in src.weights.items()}
    params, buffers, tied, skip = _expected(cfg, folder)
    arch, dtype = cfg["architectures"][0], cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    if skip:
        return ServableReport(folder, arch, dtype, 0, notes + [skip])
    missing = sorted(n for n in params if n not in have)
    bad = {n: (s, have[n]) for n, s in {**params, **buffers}.items() if n in have and have[n] != s}
    for g in tied:  # a name dropped as a tied duplicate, present anyway: its shape and values must agree
        for n in g[1:]:
            if n in have and g[0] in have:
                if have[n] != have[g[0]]:
                    bad[n] = (have[g[0]], have[n])
    problems = []
    if missing:
        unexpected = sorted(set(have) - set(params) - set(buffers) - {n for g in tied for n in g})
        problems.append(f"{len(missing)} of the {len(params)} parameters of {arch} are not in the folder: "
                        f"{_names(missing)}" + (f" (the folder has instead: {_names(unexpected)})" if unexpected else ""))
    if bad:
        problems.append(f"{len(bad)} tensors have another shape than {arch} built from config.json has: "
                        + "; ".join(f"{n} {list(b)} in the folder, {list(a)} expected" for n, (a, b) in
                                    sorted(bad.items())[:SHOW]))
    hint = ("The config.json does not describe these weights: pass --config HF_DIR with the config.json "
            "(and tokenizer) of the model that was trained, as its save_pretrained wrote it")
    renamed = {b: a for a, b in saved_names(folder).items() if a in have}
    converted = []
    if missing and not bad and all(m in renamed for m in missing):
        hint = (f"The folder holds transformers' in-memory names ({', '.join(f'{renamed[m]} for {m}' for m in missing[:3])}), "
                "as a checkpoint of model.state_dict() does; save_pretrained renames them on disk. Export it with "
                "fastckpt load SOURCE --to DIR, which writes the saved names")
    elif missing and not bad:
        converted = _held_in_memory_layout(cfg, folder, {*params, *buffers, *(n for g in tied for n in g)}, have)
    if converted:
        hint = (f"The folder holds {arch}'s weights as transformers holds them in memory ({_names(converted)}): its "
                "conversion mapping builds them on load (fused MoE experts, fused projections) and save_pretrained "
                "converts them back into other tensors. Export it with fastckpt load SOURCE --to DIR, which converts "
                "them as save_pretrained does")
    pre = module_prefix(folder, have) if missing and not bad else ""
    if pre:
        hint = (f"Every weight is named under {pre!r}, the attribute of a wrapper module (e.g. a LightningModule) "
                "that held the model; save_pretrained of the model names them without it. Export it with "
                "fastckpt load SOURCE --to DIR, which drops the prefix")
    if not problems:
        problems = _tie_values(src, tied, have, cfg)
        hint = "Set tie_word_embeddings in config.json to what the weights are, or save them tied"
    if problems:
        raise NotServableError(f"{folder} is not servable:\n  - " + "\n  - ".join(problems) + f"\n{hint}",
                               path=folder, problems=problems, missing=missing, mismatched=bad)
    return ServableReport(folder, arch, dtype, len(params), notes)


def _held_in_memory_layout(cfg: dict, folder: str, saved: set, have: Container[str]) -> list[str]:
    """The names of the architecture's in-memory state dict that ``save_pretrained`` writes as other
    tensors (not in ``saved``: its parameters, buffers and tied names; nor renamed), when ``have`` holds every
    one of them (a checkpoint of ``model.state_dict()`` of a model transformers converts on load);
    else ``[]``."""
    model = _meta_model(cfg, folder)
    if isinstance(model, str):
        return []
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    renamed = set(saved_names(folder))  # pure renamings: the export writes them under the saved name
    extra = sorted(set(model.state_dict()) - saved - ignored - renamed)
    return extra if extra and all(n in have for n in extra) else []


def _tie_values(src, tied: list[list[str]], have: dict, cfg: dict) -> list[str]:
    """Problems where a tied group is stored under two names with different values."""
    out = []
    for g in tied:
        both = [n for n in g if n in have]
        if len(both) < 2:
            continue
        got = src.read(both)
        for n in both[1:]:
            if not torch.equal(got[n], got[both[0]]):
                out.append(f"{n} and {both[0]} are one tied parameter for this config "
                           f"(tie_word_embeddings={cfg.get('tie_word_embeddings')!r}) but differ in the folder: "
                           f"transformers and vLLM would serve {both[0]} for both")
    return out
