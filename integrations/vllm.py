"""vLLM load-format plugin: ``vllm serve MODEL --load-format fastckpt``.

Registered through the ``vllm.general_plugins`` entry point (see pyproject.toml)::

    [project.entry-points."vllm.general_plugins"]
    fastckpt = "fastckpt.integrations.vllm:register"

:func:`register` calls vLLM's ``register_model_loader("fastckpt")`` (vLLM >= 0.10) with a
subclass of vLLM's ``BaseModelLoader``. The loader validates every header (and, for fastckpt
checkpoints, the manifest) before reading, then streams ``(name, tensor)`` pairs to the
model's own ``load_weights`` in batches of at most ``batch_bytes``, reading the next batch with
fastckpt's parallel large reads while vLLM copies the current one (no mmap page faults).
The model handles tensor-parallel sharding in its weight loaders, exactly as with the default
loader. Each tensor is yielded with its stored dtype and values (never reinterpreted bytes); the
model's weight loaders cast it to the parameter's dtype (vLLM's ``default_weight_loader``:
``param.data.copy_(loaded_weight)``, after checking the size), as DCP's reader casts.
Options go in ``--model-loader-extra-config '{"threads": 16, "batch_bytes": 2147483648,
"verify": true, "device": "cuda"}'`` (``device``: stream batches into device memory through the
pinned bounce ring of :mod:`fastckpt.loading.device` instead of host memory).

This module imports without vLLM (CI tests the contract: ``download_model``, ``load_weights``,
:meth:`FastCkptLoaderMixin.get_weights_iterator`); vLLM is imported only inside the functions.
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch

from fastckpt import check_servable, resolve_source

logger = logging.getLogger(__name__)

LOAD_FORMAT = "fastckpt"
DEFAULT_BATCH_BYTES = 1 << 30
_OPTIONS = {"threads", "batch_bytes", "verify", "device", "ring_bytes"}
_HF_PATTERNS = ["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class FastCkptLoaderMixin:
    """The loader logic; vLLM's ``BaseModelLoader`` is mixed in by :func:`loader_class`.

    Call order (vLLM's): ``__init__(load_config)`` -> ``download_model(model_config)`` ->
    ``load_model(vllm_config=..., model_config=...)`` (vLLM's base builds the model, calls
    ``load_weights(model, model_config)``, then post-processes the weights).
    """

    def __init__(self, load_config: Any):
        self.load_config = load_config
        extra = dict(getattr(load_config, "model_loader_extra_config", None) or {})
        unknown = set(extra) - _OPTIONS
        if unknown:
            raise ValueError(f"--model-loader-extra-config: unknown fastckpt options {sorted(unknown)}; "
                             f"known: {sorted(_OPTIONS)}")
        self.threads: int | None = extra.get("threads")
        self.batch_bytes = int(extra.get("batch_bytes", DEFAULT_BATCH_BYTES))
        self.verify = bool(extra.get("verify", True))
        self.device: str | None = extra.get("device")
        self.ring_bytes: int | None = extra.get("ring_bytes")

    def _local_path(self, model_config: Any) -> str:
        path = os.fspath(model_config.model)
        if os.path.isdir(path):
            return path
        from huggingface_hub import snapshot_download
        return snapshot_download(path, revision=getattr(model_config, "revision", None),
                                 cache_dir=getattr(self.load_config, "download_dir", None),
                                 allow_patterns=_HF_PATTERNS)

    def download_model(self, model_config: Any) -> None:
        """Fetch a hub model if needed, validate its headers/index/manifest (no tensor data read) and
        run the servability gate (:func:`fastckpt.check_servable`): ``config.json`` names an
        architecture and a dtype, and the folder holds every parameter of that architecture with
        its shape (tied ones may be stored once). Skipped, with a logged warning, for what the gate
        cannot build without running checkpoint code (``auto_map``) or for quantized models.

        Raises:
            NotServableError: naming the missing or mis-shaped keys (before any weight is read).
            CheckpointNotFoundError, HeaderError, CorruptCheckpointError: invalid files.
        """
        src = resolve_source(self._local_path(model_config))
        rep = check_servable(src.path)  # the checkpoint chosen (a run root's newest step)
        for w in rep.warnings:
            logger.warning("fastckpt: %s: %s", src.path, w)

    def get_weights_iterator(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(HF tensor name, tensor)`` for every weight of ``path``, file order.

        Each tensor owns its memory (CPU, or ``device`` from the extra config). At most two
        batches of ``batch_bytes`` are held: the next is read while the current is consumed.

        Raises:
            CheckpointNotFoundError, HeaderError, CorruptCheckpointError, ChecksumMismatchError.
        """
        src = resolve_source(path)
        batches: list[list[str]] = [[]]
        size = 0
        for name in src.weights:
            n = src.nbytes(name)
            if batches[-1] and size + n > self.batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(name)
            size += n
        with ThreadPoolExecutor(1, thread_name_prefix="fastckpt-vllm") as ex:
            nxt = ex.submit(self._read, src, batches[0]) if batches[0] else None
            for i in range(len(batches)):
                got = nxt.result() if nxt is not None else {}
                nxt = ex.submit(self._read, src, batches[i + 1]) if i + 1 < len(batches) else None
                for name in batches[i]:
                    yield name, got.pop(name)

    def _read(self, src, names: list[str]) -> dict[str, torch.Tensor]:
        device = self.device if self.device and torch.device(self.device).type != "cpu" else "cpu"
        return src.read(names, device=device, threads=self.threads, verify=self.verify,
                        ring_bytes=self.ring_bytes)

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        """Stream the weights into ``model.load_weights`` and check that every parameter was loaded.

        Raises:
            ValueError: (unquantized models) parameters that no weight initialized, named.
        """
        path = self._local_path(model_config)
        loaded = model.load_weights(self.get_weights_iterator(path))
        if loaded is None or getattr(model_config, "quantization", None) is not None:
            return
        missing = {n for n, _ in model.named_parameters()} - set(loaded)
        if missing:
            raise ValueError(f"{path}: weights not initialized from the checkpoint: {sorted(missing)[:10]}")


class FastCkptModelLoader(FastCkptLoaderMixin):
    """The loader without vLLM's base class (what CI tests); vLLM gets :func:`loader_class`."""


@functools.lru_cache(maxsize=None)
def loader_class() -> type:
    """``FastCkptLoaderMixin`` combined with vLLM's ``BaseModelLoader`` (imports vLLM).

    Raises:
        ImportError: vLLM (>= 0.10) is not importable.
    """
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    return type("FastCkptModelLoader", (FastCkptLoaderMixin, BaseModelLoader), {"__module__": __name__})


def register() -> None:
    """Entry point of ``vllm.general_plugins``: register ``--load-format fastckpt``.

    vLLM runs general plugins in every process it starts; with a vLLM older than 0.10 (no
    ``register_model_loader``) this logs a warning and registers nothing.
    """
    try:
        from vllm.model_executor.model_loader import register_model_loader
    except ImportError:
        logger.warning("fastckpt: this vLLM has no register_model_loader (needs vLLM >= 0.10); "
                       "--load-format fastckpt is not available")
        return
    register_model_loader(LOAD_FORMAT)(loader_class())
