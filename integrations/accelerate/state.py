"""What the accelerate plugin captures from, and puts back into, one ``accelerate.Accelerator``.

Pure helpers of :mod:`fastckpt.integrations.accelerate.plugin` (which owns the save/load calls, the
folders and the saver). They follow accelerate 1.15.0's ``Accelerator.save_state`` /
``load_state`` and ``accelerate/checkpointing.py`` (``save_accelerator_state``,
``load_accelerator_state``): the same pre-hook calls, the same ``strict`` default (``True``, as
``safetensors.torch.load_model`` and ``nn.Module.load_state_dict``), the same ``map_location``
values, and the stateful dataloader's ``state_dict()`` (``DataLoaderConfiguration(
use_stateful_dataloader=True)``), so a resume continues mid-epoch.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from fastckpt.errors import AccelerateStateError, StateDictMismatchError

logger = logging.getLogger(__name__)

#: ``map_location`` values accelerate's ``load_accelerator_state`` accepts.
MAP_LOCATIONS = (None, "cpu", "on_device")
#: ``load_kwargs`` handed on to :func:`fastckpt.load`.
LOAD_OPTIONS = ("threads", "verify", "chunk_bytes", "io_backend")
#: ``load_kwargs`` accelerate hands to ``torch.load`` that have nothing left to do here: nothing is
#: unpickled (``weights_only`` holds whatever its value) and tensors own their memory (no ``mmap``).
TORCH_LOAD_ONLY = ("weights_only", "mmap")


def model_key(i: int) -> str:
    """State key (and weights file stem) of the ``i``-th saved model: ``model``, ``model_1``, ..."""
    return "model" if i == 0 else f"model_{i}"


# -- save ------------------------------------------------------------------------------------------
def model_weights(acc) -> list[dict[str, torch.Tensor]]:
    """One state dict per prepared model (``acc._models`` order), keys of the unwrapped model
    (no DDP ``module.`` / ``torch.compile`` ``_orig_mod.`` prefix: what ``save_pretrained`` and
    HF loaders use). These are the ``weights`` the save pre-hooks receive and may edit."""
    return [acc.unwrap_model(m).state_dict() for m in acc._models]


def run_save_hooks(acc, weights: list[dict], folder_name: str) -> dict[str, bytes]:
    """Call every ``register_save_state_pre_hook`` hook as accelerate does:
    ``hook(acc._models, weights, output_dir)``, in registration order, before anything is saved.

    ``output_dir`` is a private folder named like the checkpoint (``folder_name``); every file a
    hook writes there becomes a file of the checkpoint, committed atomically with it (the
    checkpoint folder itself appears only at the commit). A hook may remove entries from
    ``weights`` to save those models its own way, as with accelerate.

    Returns:
        ``{file name: bytes}`` of what the hooks wrote (empty without hooks).

    Raises:
        AccelerateStateError: a hook created a sub-folder (a checkpoint commits plain files at
            its top level only; write the files at the top of ``output_dir``) or a link.
        Whatever a hook raises (nothing is written then).
    """
    hooks = list(getattr(acc, "_save_model_state_pre_hook", {}).values())
    if not hooks:
        return {}
    tmp = tempfile.mkdtemp(prefix="fastckpt-accelerate-hooks-")
    try:
        out = os.path.join(tmp, folder_name)
        os.mkdir(out)
        for hook in hooks:
            hook(acc._models, weights, out)
        files: dict[str, bytes] = {}
        for name in sorted(os.listdir(out)):
            full = os.path.join(out, name)
            if os.path.islink(full) or not os.path.isfile(full):
                raise AccelerateStateError(
                    f"save_state pre-hook wrote {name!r} into output_dir, which is not a plain file (a "
                    f"sub-folder or link); fastckpt commits the files a hook writes at the top level of "
                    f"output_dir only: write them there (e.g. '{name}_adapter_model.safetensors'), or "
                    f"let the plugin save that model (keep it in `weights`)")
            with open(full, "rb") as f:
                files[name] = f.read()
        return files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_hook_files(files: dict[str, bytes], stems: list[str]) -> None:
    """Refuse hook files whose names collide with the checkpoint's own weight files.

    Raises:
        AccelerateStateError: naming the file and the stem it collides with.
    """
    for name in files:
        for stem in stems:
            if re.fullmatch(re.escape(stem) + r"(-\d+-of-\d+)?\.safetensors(\.index\.json)?", name):
                raise AccelerateStateError(
                    f"save_state pre-hook wrote {name!r}, the name of the checkpoint's own weights of "
                    f"{stem!r}; remove that model's entry from `weights` in the hook (then the hook's "
                    f"file is the one saved) or write under another name")


class ReplayableRandomSampler(torch.utils.data.RandomSampler):
    """``torch.utils.data.RandomSampler`` that remembers the RNG state each pass drew its order
    from, and can draw the next pass's order from a remembered state.

    A stateful dataloader resumed mid-epoch rebuilds the epoch's order by iterating its sampler
    again and skipping what was consumed; a plain ``RandomSampler`` would draw that order from
    the RNG as it is *after* ``load_state`` (the state at save time), a different order than the
    epoch being resumed. :func:`make_replayable` swaps this class onto a prepared dataloader's
    ``RandomSampler`` (same attributes, same orders); ``load_state`` sets ``fastckpt_replay`` so
    the resumed pass draws from the epoch's start state, after which the RNG is put back as
    ``load_state`` left it (the saved run's state).
    """

    fastckpt_epoch_rng: torch.Tensor | None = None  # RNG state the current pass drew from
    fastckpt_replay: torch.Tensor | None = None  # RNG state the next pass must draw from

    def _rng_state(self) -> torch.Tensor:
        return self.generator.get_state() if self.generator is not None else torch.get_rng_state()

    def _set_rng_state(self, state: torch.Tensor) -> None:
        if self.generator is not None:
            self.generator.set_state(state)
        else:
            torch.set_rng_state(state)

    def __iter__(self):
        replay, self.fastckpt_replay = self.fastckpt_replay, None
        now = self._rng_state() if replay is not None else None
        if replay is not None:
            self._set_rng_state(replay)
        self.fastckpt_epoch_rng = self._rng_state()
        inner = super().__iter__()
        try:
            first = next(inner)  # the pass's order is drawn here
        except StopIteration:
            return
        finally:
            if now is not None:
                self._set_rng_state(now)
        yield first
        yield from inner


def _random_sampler(dl):
    """The ``RandomSampler`` inside a prepared dataloader's batch sampler(s), or ``None``."""
    bs = getattr(dl, "batch_sampler", None)
    for _ in range(3):  # BatchSamplerShard -> BatchSampler -> sampler
        sampler = getattr(bs, "sampler", None)
        if isinstance(sampler, torch.utils.data.RandomSampler):
            return sampler
        bs = getattr(bs, "batch_sampler", None)
    return None


def make_replayable(dataloaders) -> None:
    """Swap :class:`ReplayableRandomSampler` onto each stateful dataloader's plain
    ``RandomSampler`` (exact type only: accelerate's ``SeedableRandomSampler`` is already
    deterministic per epoch). Call before the epoch starts (``enable`` and ``prepare`` do)."""
    for dl in dataloaders:
        if not getattr(dl, "use_stateful_dataloader", False):
            continue
        sampler = _random_sampler(dl)
        if sampler is not None and type(sampler) is torch.utils.data.RandomSampler:
            sampler.__class__ = ReplayableRandomSampler


def dataloader_state(dl) -> dict[str, Any] | None:
    """What resumes ``dl`` where it stopped: the sampler's epoch, accelerate's ``iteration``
    (``set_epoch``), the synchronized shuffle generator and, for a stateful dataloader
    (``use_stateful_dataloader=True``), its ``state_dict()`` (position inside the epoch)."""
    out: dict[str, Any] = {}
    sampler = getattr(getattr(dl, "batch_sampler", None), "sampler", None) or getattr(dl, "sampler", None)
    if sampler is not None and hasattr(sampler, "epoch"):
        out["epoch"] = int(sampler.epoch)
    if isinstance(getattr(dl, "iteration", None), int):
        out["iteration"] = dl.iteration
    gen = getattr(dl, "synchronized_generator", None)
    if gen is not None:
        out["generator"] = gen.get_state()
    if getattr(dl, "use_stateful_dataloader", False):
        out["stateful"] = dl.state_dict()
        sampler = _random_sampler(dl)
        epoch_rng = getattr(sampler, "fastckpt_epoch_rng", None)
        mid_epoch = not out["stateful"].get("_iterator_finished", False) and out["stateful"].get("_num_yielded")
        if epoch_rng is not None and mid_epoch:
            out["epoch_rng"] = epoch_rng.clone()
    return out or None


# -- load ------------------------------------------------------------------------------------------
def resolve_map_location(acc, map_location: Any) -> str:
    """accelerate's rule: ``None`` means ``"on_device"`` with several processes on several
    devices, else ``"cpu"``; ``"on_device"`` is the accelerator's device.

    Returns:
        The device string handed to :func:`fastckpt.load` (``"cpu"``, ``"cuda:0"``, ...).

    Raises:
        TypeError: any other value (accelerate's message and type).
    """
    if map_location not in MAP_LOCATIONS:
        raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, "
                        f"or `'on_device'` (got {map_location!r})")
    if map_location is None:
        multi = acc.num_processes > 1 and getattr(acc, "multi_device", False) \
            and "MULTI_XPU" not in str(acc.distributed_type)
        map_location = "on_device" if multi else "cpu"
    return str(acc.device) if map_location == "on_device" else "cpu"


def load_options(load_kwargs: dict | None) -> dict[str, Any]:
    """The ``load_kwargs`` of ``load_state`` as :func:`fastckpt.load` options.

    Raises:
        TypeError: a key that is neither a :func:`fastckpt.load` option (``threads``, ``verify``,
            ``chunk_bytes``, ``io_backend``) nor a ``torch.load`` option with nothing to do here
            (``weights_only``, ``mmap``).
    """
    out: dict[str, Any] = {}
    for k, v in (load_kwargs or {}).items():
        if k in LOAD_OPTIONS:
            out[k] = v
        elif k not in TORCH_LOAD_ONLY:
            raise TypeError(f"load_state(load_kwargs=...): unknown option {k!r}; fastckpt.load takes "
                            f"{', '.join(LOAD_OPTIONS)} (and accepts torch.load's {', '.join(TORCH_LOAD_ONLY)}, "
                            f"which have nothing to do here: nothing is unpickled or memory-mapped)")
    return out


def _tied_aliases(sd: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """key -> every key of ``sd`` sharing its storage, offset and shape (tied weights)."""
    groups: dict[tuple, set[str]] = {}
    for k, t in sd.items():
        if isinstance(t, torch.Tensor) and t.numel():  # (a module's _extra_state may be any value)
            groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), set()).add(k)
    return {k: g for g in groups.values() for k in g}


def check_model(model, stored: dict[str, torch.Tensor], *, strict: bool, what: str, folder) -> None:
    """Compare stored weights with ``model`` before anything is loaded.

    Tied weights saved once (the plugin keeps the first key of each tied group, as HF does)
    count as present for every key of their group, as ``safetensors.torch.load_model`` does.

    Raises:
        StateDictMismatchError: shapes differ (always: torch refuses those even with
            ``strict=False``), or, with ``strict``, missing or unexpected keys.
    """
    live = model.state_dict()
    aliases = _tied_aliases(live)
    missing = [k for k in live if k not in stored and not (aliases.get(k, set()) & stored.keys())]
    unexpected = [k for k in stored if k not in live]
    mismatched = {k: (tuple(t.shape), tuple(live[k].shape)) for k, t in stored.items()
                  if k in live and isinstance(t, torch.Tensor) and isinstance(live[k], torch.Tensor)
                  and tuple(t.shape) != tuple(live[k].shape)}
    if not mismatched and (not strict or not (missing or unexpected)):
        return

    def some(keys) -> str:
        keys = list(keys)
        return ", ".join(map(repr, keys[:8])) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

    parts = []
    if mismatched:
        parts.append(f"{len(mismatched)} with other shapes (stored vs model: "
                     + ", ".join(f"{k!r} {a} vs {b}" for k, (a, b) in list(mismatched.items())[:8]) + ")")
    if strict and missing:
        parts.append(f"{len(missing)} missing from the checkpoint ({some(missing)})")
    if strict and unexpected:
        parts.append(f"{len(unexpected)} unexpected in the checkpoint ({some(unexpected)})")
    raise StateDictMismatchError(
        f"{Path(folder) / what}: the stored weights do not match {type(model).__name__}: {'; '.join(parts)}. "
        f"Nothing was loaded. Load a checkpoint saved from this model, or pass strict=False to "
        f"load_state to load the matching keys only (shapes must still match)",
        missing=missing if strict else (), unexpected=unexpected if strict else (), mismatched=mismatched)


def restore_dataloader(dl, state: dict[str, Any] | None) -> None:
    """Put back what :func:`dataloader_state` captured (a stateful dataloader resumes mid-epoch)."""
    if not state:
        return
    sampler = getattr(getattr(dl, "batch_sampler", None), "sampler", None) or getattr(dl, "sampler", None)
    if "epoch" in state and sampler is not None and hasattr(sampler, "set_epoch"):
        sampler.set_epoch(state["epoch"])
    if "iteration" in state and hasattr(dl, "set_epoch"):
        dl.set_epoch(state["iteration"])
    if "generator" in state and getattr(dl, "synchronized_generator", None) is not None:
        dl.synchronized_generator.set_state(state["generator"].cpu())
    if "stateful" in state and getattr(dl, "use_stateful_dataloader", False):
        dl.load_state_dict(state["stateful"])
        sampler = _random_sampler(dl)
        if "epoch_rng" in state and isinstance(sampler, ReplayableRandomSampler):
            sampler.fastckpt_replay = state["epoch_rng"].cpu()  # the resumed pass draws the saved epoch's order


def loaded_iteration(snap: dict[str, Any], folder) -> int | None:
    """The automatic-naming iteration a checkpoint was saved under: the stored one, else the
    ``N`` of a ``checkpoint_N`` folder name, else ``None``."""
    it = snap.get("iteration")
    if isinstance(it, int) and not isinstance(it, bool):
        return it
    m = re.fullmatch(r"checkpoint_(\d+)", Path(folder).name)
    return int(m.group(1)) if m else None
