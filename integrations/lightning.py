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
:func:`fastckpt.load_into` (each rank reads only its own shards; any world size to any; checksums
checked; a dtype difference, e.g. ``precision="bf16-true"``, cast as DCP's reader casts), then
hands Lightning the ``lightning`` part to restore loops, callbacks and schedulers. Every way
Lightning loads a checkpoint through its strategy works: ``fit``, ``validate``, ``test`` and
``predict`` with ``ckpt_path=`` (without optimizers, the checkpoint's optimizer states are not
read), ``weights_only=`` either way; ``strict_loading`` applies to the module's keys, as in
Lightning's own load. ``LightningModule.load_from_checkpoint`` reads one file with ``torch.load``
and fails on a folder, fastckpt's as Lightning's own distributed checkpoint (``IsADirectoryError``).
Checkpoint paths
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
            own strategy does); the rest, rank 0's (values that differ per rank, such as a Timer's
            elapsed time, are taken from rank 0 as Lightning's single-file strategies do), is stored
            under ``"lightning"``.
            """
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not "
                                "supported: the checkpoint goes through fastckpt, not a CheckpointIO")
            path = Path(self.broadcast(filepath))
            state = {STATE_KEY: checkpoint.pop(STATE_KEY)}
            for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{i}"] = optim_state
            # Lightning's own dict (loops, callbacks, hparams, on_save_checkpoint extras) is rank 0's, as
            # Lightning's single-writer strategies keep it: a Timer's elapsed time, an un-synced monitored
            # metric or an RNG state differs per rank and was refused (RankValuesDifferError). Broadcast
            # between the job's own ranks in memory (Lightning's broadcast), never read from disk.
            state[META_KEY] = self.broadcast(checkpoint, src=0)
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
            target: dict[str, Any] = {STATE_KEY: get_model_state_dict(self.model)}
            if strict:  # strict_loading is about the module, as in Lightning's own load
                _refuse_unexpected_module_keys(path, target[STATE_KEY])
            for i, optim in enumerate(self.optimizers):  # none under validate / test / predict
                target[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optim)
            # Lightning's own part (small: loops, callbacks...) read first; it is also part of the target
            target[META_KEY] = fastckpt.load(path, keys=META_KEY)[META_KEY]
            # the target names what is read (the optimizers' keys only when there are optimizers);
            # checksums checked, dtypes cast to the module's (bf16-true...) as DCP's reader does
            loaded = fastckpt.load_into(target, path, strict=None if strict else False)
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


def _refuse_unexpected_module_keys(path: Path, module_state: dict) -> None:
    """``strict_loading``: the checkpoint's module tensors must all be the live module's (the other
    direction, module keys the checkpoint lacks, is :func:`fastckpt.load_into`'s default check).

    Raises:
        fastckpt.errors.StateMismatchError: names the checkpoint keys the module lacks (only the manifest is read).
    """
    from fastckpt.errors import StateMismatchError
    from fastckpt.format.tree import join
    have = {join(STATE_KEY, k) for k in module_state}
    extra = sorted(k for k in fastckpt.read_manifest(path).tensors
                   if k.startswith(STATE_KEY + "/") and k not in have)
    if extra:
        raise StateMismatchError(
            f"{path}: the checkpoint holds {len(extra)} module tensor(s) the LightningModule does not have, e.g. "
            f"{extra[:5]}; nothing was loaded. Build the module from the same config, or set "
            "module.strict_loading = False to ignore them", path=str(path), unexpected=extra)


def __getattr__(name: str) -> Any:
    """Lazy ``FastCkptModelParallelStrategy`` (imports Lightning on first access)."""
    if name == "FastCkptModelParallelStrategy":
        return _build_strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
