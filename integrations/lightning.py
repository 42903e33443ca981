"""Lightning way in: ``ModelParallelStrategy`` (FSDP2 / TP) saving and resuming through fastckpt.

Usage (Lightning 2.6)::

    from fastckpt.integrations.lightning import FastCkptModelParallelStrategy

    trainer = L.Trainer(strategy=FastCkptModelParallelStrategy(data_parallel_size=2,
                                                               tensor_parallel_size=1), ...)
    trainer.fit(module)                                   # ModelCheckpoint / save_checkpoint as usual
    trainer.fit(module, ckpt_path="ckpts/epoch=0-step=2.ckpt")   # resume: in place, resharding

What changes against Lightning's ``ModelParallelStrategy``: only ``save_checkpoint``,
``load_checkpoint`` and ``remove_checkpoint``. Lightning's strategy writes DCP's ``.distcp`` files
plus a pickled ``meta.pt`` (``torch.save``); this one writes ONE committed fastckpt folder at the
checkpoint path with :func:`fastckpt.save` on every rank (the DTensor route: each rank writes its
own chunks of the full tensors, atomic commit after every rank succeeded):

- ``state_dict``: the LightningModule's state, HF layout (``model.safetensors``; ``model-*`` + index past one shard; full
  tensors, the module's own parameter names), readable by ``safetensors``;
- ``optimizer_0``, ``optimizer_1``...: ``get_optimizer_state_dict`` of each optimizer (FQN keys);
- ``lightning``: everything else Lightning puts in a checkpoint (epoch, global_step, loops,
  callbacks, lr_schedulers, hyper_parameters...), as JSON + tensors. Nothing is pickled.

Resume fills the live FSDP2 / TP parameters and optimizer states in place with
:func:`fastckpt.load_into` (each rank reads only its own shards; any world size to any), then
hands Lightning the ``lightning`` part to restore loops, callbacks and schedulers. Checkpoint paths
that are not fastckpt folders (Lightning's own DCP folders or full ``.ckpt`` files) load through
Lightning's own code. ``save_distributed_checkpoint=False`` (one full-state file from rank 0) is
Lightning's pickle path and is refused here.

Lightning is imported only when ``FastCkptModelParallelStrategy`` is first used.
Tested: real ``lightning.pytorch.Trainer``, 2 ranks, gloo, CPU, FSDP2 ``fully_shard`` in
``configure_model`` (tests/integrations/test_lightning.py). Lightning's ``FSDPStrategy`` (FSDP1)
is not covered.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import fastckpt
from fastckpt.storage import delete_checkpoint

__all__ = ["FastCkptModelParallelStrategy"]

STATE_KEY, META_KEY = "state_dict", "lightning"


@functools.lru_cache(maxsize=None)
def _build_strategy_class():
    """Define the subclass (imports Lightning; called once, on first use)."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    class FastCkptModelParallelStrategy(ModelParallelStrategy):
        """Lightning's ``ModelParallelStrategy`` with fastckpt checkpoints (see the module doc).

        Args:
            *args, **kwargs: those of ``ModelParallelStrategy`` (``data_parallel_size``,
                ``tensor_parallel_size``, ``process_group_backend``, ``timeout``).
            save_options: dict of :func:`fastckpt.save` options (``threads``, ``o_direct``,
                ``timeout_s``...); ``weights`` and ``overwrite`` are set here (``state_dict`` is the
                HF-layout subtree; an existing checkpoint path is replaced atomically, as
                Lightning overwrites ``last.ckpt``).

        Raises:
            ValueError: ``save_distributed_checkpoint=False`` (Lightning's pickled full-state file).
            fastckpt.DistributedSaveError / UnsupportedValueError: from ``save_checkpoint``.
            fastckpt load errors (missing / mismatched keys, checksums) from ``load_checkpoint``.
        """

        def __init__(self, *args: Any, save_options: dict | None = None, **kwargs: Any) -> None:
            if kwargs.get("save_distributed_checkpoint", True) is False:
                raise ValueError("FastCkptModelParallelStrategy writes each rank's shards into one "
                                 "fastckpt folder; save_distributed_checkpoint=False (one pickled "
                                 "full-state file) is Lightning's own path: use ModelParallelStrategy")
            super().__init__(*args, **kwargs)
            self._save_options = dict(save_options or {})

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
            """Write ``checkpoint`` (Lightning's dict; every rank calls this) as one fastckpt folder.

            ``state_dict`` and ``optimizer_states`` are popped from ``checkpoint`` (as Lightning's
            own strategy does); the rest is stored under ``"lightning"``.
            """
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not "
                                "supported: the checkpoint goes through fastckpt, not a CheckpointIO")
            path = Path(self.broadcast(filepath))
            state = {STATE_KEY: checkpoint.pop(STATE_KEY)}
            for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{i}"] = optim_state
            state[META_KEY] = checkpoint
            opts = {**self._save_options, "weights": {STATE_KEY: "model"}, "overwrite": True}
            fastckpt.save(state, path, process_group=dist.group.WORLD, **opts)

        def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
            """Fill the model and optimizers in place; return the rest for Lightning to restore."""
            path = Path(self.broadcast(checkpoint_path))
            if not fastckpt.is_committed(path):
                return super().load_checkpoint(path, weights_only=weights_only)
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                set_model_state_dict, set_optimizer_state_dict)
            strict = self.lightning_module.strict_loading
            # Lightning's own part first (small: loops, callbacks...); it is also part of the target,
            # so load_into's strict check compares the whole checkpoint with the whole state
            meta = fastckpt.load(path, keys=META_KEY)[META_KEY]
            target: dict[str, Any] = {STATE_KEY: get_model_state_dict(self.model)}
            for i, optim in enumerate(self.optimizers):
                target[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optim)
            target[META_KEY] = meta
            loaded = fastckpt.load_into(target, path, strict=strict)
            set_model_state_dict(self.model, loaded[STATE_KEY], options=StateDictOptions(strict=strict))
            for i, optim in enumerate(self.optimizers):
                set_optimizer_state_dict(self.model, optim, optim_state_dict=loaded[f"optimizer_{i}"])
            return loaded[META_KEY]

        def remove_checkpoint(self, filepath) -> None:
            """Rank 0 deletes a fastckpt folder atomically (rename, then remove); others as Lightning."""
            if self.is_global_zero and fastckpt.is_committed(filepath):
                delete_checkpoint(filepath)
            else:
                super().remove_checkpoint(filepath)

    FastCkptModelParallelStrategy.__module__ = __name__
    return FastCkptModelParallelStrategy


def __getattr__(name: str) -> Any:
    """Lazy ``FastCkptModelParallelStrategy`` (imports Lightning on first access)."""
    if name == "FastCkptModelParallelStrategy":
        return _build_strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
