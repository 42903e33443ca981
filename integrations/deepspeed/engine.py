"""DeepSpeed checkpoint engine that writes and reads through fastckpt (DeepSpeed 0.19 API).

DeepSpeed has no registry for third-party engines; install on an initialized engine with
one line::

    engine, *_ = deepspeed.initialize(...)
    fastckpt.integrations.deepspeed.engine.install(engine)   # then save_checkpoint/load_checkpoint as usual

Call order (DeepSpeed ``save_checkpoint``, every rank): ``create(info)`` -> ``makedirs`` ->
``save(state_dict, path)`` for each file this rank owns (``mp_rank_00_model_states.pt`` on the
model writer for ZeRO-1/2, ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` on every rank for
ZeRO-3, ``zero_pp_rank_{r}_..._optim_states.pt`` on every ZeRO rank) -> ``commit(info)`` ->
rank 0 writes ``save_dir/latest``. Each ``path`` becomes a fastckpt checkpoint *folder* of that
name (safetensors + JSON), written first under a hidden name beside it (``.NAME.fastckpt-new``);
``save`` only stages (async). ``commit`` is a vote of every rank
(:mod:`fastckpt.integrations.deepspeed.tag`): once every rank's new files are durable, rank 0
removes the tag's ``fastckpt_tag.json``, every rank renames its new files into place (replacing a
previous save of the same tag), and rank 0 writes the marker again; ``commit`` returns after that.
If any rank failed to write, it raises :class:`~fastckpt.errors.DistributedSaveError` on every
rank, each rank removes its new files, and DeepSpeed never writes ``latest`` (which keeps naming
the previous, complete tag; a tag saved again, a rolling ``tag="last"``, keeps its previous files
and marker). ``load(path)`` reads such a folder back (no unpickling), only from a tag whose
marker lists it. ``fastckpt load SAVE_DIR --to DIR`` turns such a tag into an HF folder
(:mod:`fastckpt.loading.zero`).

Values DeepSpeed puts in its states that are not tensors or JSON (``torch.Size``, ``set``, ``frozenset``,
``ZeroStageEnum``, ``LossScaler``, ``fragment_address``) are stored as tagged JSON (``{"__ds_size__":
[...]}``...); a dict of the caller's with a key of the tags' form as ``{"__ds_dict__": [[key, value],
...]}``, so it comes back as a dict. Dicts come back as ``dict`` (an ``OrderedDict`` too: equal, in order;
a ``defaultdict`` too, with fastckpt's WARNING that its ``default_factory`` is not kept). Loading
rebuilds only the classes named in :data:`ALLOWED_TYPES`: a checkpoint cannot make the loader
import or call anything else (a type name outside the list is refused with
:class:`~fastckpt.errors.UntrustedTypeError`, before any object is built).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import os
import shutil
from typing import Any

import torch

import fastckpt
from . import tag
from fastckpt.errors import CheckpointNotFoundError, StateMismatchError, UnsupportedValueError, UntrustedTypeError
from fastckpt.format.tree import tell_plain_container
from fastckpt.storage.commit import commit_dir
from fastckpt.storage.model_files import is_inside

#: The only classes :func:`decode` rebuilds (``module:qualname``): those DeepSpeed 0.19 puts in
#: its ZeRO-1/2/3 model and optimizer states. Saving refuses every other class (names its path),
#: so whatever this engine wrote, it reads back.
ALLOWED_TYPES = frozenset({
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.utils.tensor_fragment:fragment_address",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
})
_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.device)

try:  # the base class, when DeepSpeed is installed; the engine also works through its interface alone
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine as _Base
except ImportError:  # pragma: no cover - exercised where deepspeed is absent
    _Base = object


def _qual(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def encode(v: Any, path: str = "") -> Any:
    """Replace non-JSON, non-tensor values DeepSpeed uses by tagged dicts (see module docstring).

    Raises:
        UnsupportedValueError: a value of a class outside :data:`ALLOWED_TYPES` (names its path).
    """
    if isinstance(v, enum.Enum) and _qual(type(v)) in ALLOWED_TYPES:  # before the plain types: an IntEnum is an int
        return {"__ds_enum__": _qual(type(v)), "value": encode(v.value, path)}
    if isinstance(v, _PLAIN) or (isinstance(v, type(torch.float32))):
        return v
    if isinstance(v, torch.Size):
        return {"__ds_size__": list(v)}
    if isinstance(v, (set, frozenset)):
        out = {"__ds_set__": [encode(x, path) for x in sorted(v, key=repr)]}
        return {**out, "frozen": True} if isinstance(v, frozenset) else out
    if isinstance(v, dict):
        if type(v) not in (dict, collections.OrderedDict):  # a caller's defaultdict: its factory is not kept
            tell_plain_container(v, path, dict)
        items = {k: encode(x, f"{path}/{k}") for k, x in v.items()}
        if any(isinstance(k, str) and k.startswith("__ds_") for k in v):  # a caller's dict of the tags' form
            return {"__ds_dict__": [[k, x] for k, x in items.items()]}        # is not read back as a tag
        return items
    if isinstance(v, list):
        return [encode(x, f"{path}/{i}") for i, x in enumerate(v)]
    if isinstance(v, tuple) and type(v) is tuple:
        return tuple(encode(x, f"{path}/{i}") for i, x in enumerate(v))
    cls = type(v)
    if hasattr(v, "__array__") or cls.__module__ == "numpy":
        return v
    if _qual(cls) not in ALLOWED_TYPES:
        raise UnsupportedValueError(f"DeepSpeed state at {path or '<root>'!r} holds a {_qual(cls)}; the fastckpt "
                                    f"DeepSpeed engine stores only tensors, JSON values and {sorted(ALLOWED_TYPES)} "
                                    "(nothing is pickled); convert it to one of those before saving")
    if isinstance(v, tuple):  # namedtuple
        return {"__ds_obj__": _qual(cls), "fields": [encode(x, path) for x in v]}
    state = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)} if dataclasses.is_dataclass(v) else vars(v)
    return {"__ds_obj__": _qual(cls), "state": encode(dict(state), path)}


def _cls(name: Any, source: str) -> type:
    """The class ``name`` (``module:qualname``) if it is in :data:`ALLOWED_TYPES`; nothing is
    imported for any other name."""
    if not isinstance(name, str) or name not in ALLOWED_TYPES:
        raise UntrustedTypeError(f"{source}: the checkpoint asks to rebuild {name!r}, which is not one of the "
                                 f"DeepSpeed types fastckpt rebuilds ({sorted(ALLOWED_TYPES)}); refusing to load "
                                 "it (a checkpoint must not choose code to run); re-save it with this engine")
    mod, _, qual = name.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def decode(v: Any, source: str = "<state>") -> Any:
    """Inverse of :func:`encode`.

    Args:
        v: a tree read from a checkpoint written by :class:`FastCkptCheckpointEngine`.
        source: the checkpoint path, named in errors.

    Raises:
        UntrustedTypeError: a tagged value names a class outside :data:`ALLOWED_TYPES`
            (names ``source`` and the value); nothing of it is imported or called.
    """
    if isinstance(v, dict):
        if "__ds_dict__" in v:
            return {k: decode(x, source) for k, x in v["__ds_dict__"]}
        if "__ds_size__" in v:
            return torch.Size(v["__ds_size__"])
        if "__ds_set__" in v:
            items = {decode(x, source) for x in v["__ds_set__"]}
            return frozenset(items) if v.get("frozen") else items
        if "__ds_enum__" in v:
            return _cls(v["__ds_enum__"], source)(decode(v["value"], source))
        if "__ds_obj__" in v:
            cls = _cls(v["__ds_obj__"], source)
            if "fields" in v:
                return cls(*[decode(x, source) for x in v["fields"]])
            obj = cls.__new__(cls)
            obj.__dict__.update(decode(v["state"], source))
            return obj
        return {k: decode(x, source) for k, x in v.items()}
    if isinstance(v, list):
        return [decode(x, source) for x in v]
    if isinstance(v, tuple):
        return tuple(decode(x, source) for x in v)
    return v


def _new_name(path: str) -> str:
    """Where :meth:`FastCkptCheckpointEngine.save` writes file ``path`` of a tag until :meth:`~FastCkptCheckpointEngine.commit`
    renames it into place: a hidden sibling (``.NAME.fastckpt-new``), which no load, marker or listing counts."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.fastckpt-new")


class FastCkptCheckpointEngine(_Base):
    """``deepspeed.runtime.checkpoint_engine.CheckpointEngine`` writing fastckpt folders.

    With several ranks, ``commit`` is a collective vote (:mod:`fastckpt.integrations.deepspeed.tag`):
    a tag counts only once every rank's files are durable and rank 0 wrote ``fastckpt_tag.json``;
    a failure on any rank makes ``save_checkpoint`` raise on every rank before DeepSpeed writes
    ``latest``. A failing ``save`` is therefore not raised at once but kept for ``commit`` (which
    every rank reaches, so no rank is left waiting in a collective).

    Args:
        config_params: DeepSpeed passes its config here (unused).
        threads: I/O threads per file save (default: fastckpt's default).
        **save_options: further :class:`fastckpt.SaveOptions` / :class:`fastckpt.IOTuning` keywords
            for every file (e.g. ``io_backend=``, ``o_direct=``).
    """

    def __init__(self, config_params: Any = None, threads: int | None = None, **save_options: Any):
        if _Base is not object:
            super().__init__(config_params)
        self.name = "FastCkptCheckpointEngine"
        self.threads = threads
        self.save_options = dict(save_options)
        self._pending: list = []
        self._paths: list[str] = []
        self._error: BaseException | None = None
        self._saver = fastckpt.Saver()  # this engine's own (one rank's files, written by this process alone)

    def create(self, info: Any) -> None:
        """Start of a tag (``info.tag``, ``info.save_dir``). Nothing of a previous save of the tag is
        touched before every rank's new files are durable (:meth:`commit`); an export through the
        engine (``save_16bit_model``: a file in ``save_dir`` under the next step's tag name) never
        touches the tag."""
        self._pending, self._paths, self._error = [], [], None
        self._tag_now, self._exports = self._tag_dir(info), []

    @staticmethod
    def _tag_dir(info: Any) -> str | None:
        save_dir, name = getattr(info, "save_dir", None), getattr(info, "tag", None)
        return os.path.join(str(save_dir), str(name)) if save_dir and name is not None else None

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create ``path`` (the tag folder that will hold one fastckpt folder per file)."""
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Stage ``state_dict`` and write it in the background as the fastckpt folder ``path``.

        A failure (e.g. :class:`~fastckpt.UnsupportedValueError` for a value fastckpt cannot store
        without pickle, or an ``OSError`` of the disk) is kept and raised by :meth:`commit`, on
        every rank; later ``save`` calls of the same tag then write nothing.
        """
        tag_dir = getattr(self, "_tag_now", None)
        if tag_dir is not None and not is_inside(os.path.abspath(path), os.path.abspath(tag_dir)):  # save_16bit_model's export file
            self._export(state_dict, path)
            return
        self._paths.append(path)
        if self._error is not None:
            return
        try:
            self._wait_pending()  # one staging buffer at a time, as fastckpt.async_save
            opts = dict(self.save_options, **({"threads": self.threads} if self.threads else {}))
            self._pending.append(self._saver.async_save({"ds": encode(state_dict)}, _new_name(path), overwrite=True,
                                                        weights={}, **opts))
        except Exception as e:  # raised by commit, after every rank voted
            self._error = e

    def _export(self, state_dict: Any, path: str) -> None:
        """Write ``save_16bit_model``'s file as DeepSpeed's own engine writes it (``torch.save``, the
        ``pytorch_model.bin`` that ``from_pretrained`` and ``torch.load`` read): an export for
        other tools, not a checkpoint fastckpt reads back. A failure is raised by :meth:`commit`."""
        self._exports.append(path)
        if self._error is not None:
            return
        try:
            torch.save(state_dict, path)
        except Exception as e:  # raised by commit, after every rank voted
            self._error = e

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def wait_all(self) -> None:
        """Wait for every staged file; re-raise the first failure (of ``save`` or of a background
        write) with its own type."""
        try:
            self._wait_pending()
        except Exception as e:
            self._error = self._error or e
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def commit(self, info: Any) -> bool:
        """Return once every rank's files of ``info.tag`` are durable, in place and listed by the
        tag's marker.

        Collective: every rank calls it (DeepSpeed does, from ``save_checkpoint``). Four votes
        (:func:`~fastckpt.integrations.deepspeed.tag.vote`): every new file durable under its hidden
        name; rank 0 removed the marker; every rank renamed its new files into place (each an atomic
        exchange with a previous save's folder of that name); rank 0 wrote the marker.

        Raises:
            DistributedSaveError: some rank failed (``failures`` maps each failed rank to its error
                text; on the failing rank chained from its own error). Failed before the renames:
                every rank removed its new files; a previous save of the tag keeps its files and
                marker, and DeepSpeed does not write ``latest``. Failed during the renames: the tag
                has no marker (a load refuses it, naming it) and the message says so. In a single
                process (no group, or a group of one) the failure itself is raised (e.g.
                ``OSError``, :class:`~fastckpt.UnsupportedValueError`).
        """
        paths = list(self._paths)
        exports, self._exports = list(getattr(self, "_exports", [])), []
        tag_dir = self._tag_dir(info) or (os.path.dirname(os.path.abspath(paths[0])) if paths else None)
        if exports and not paths:
            tag_dir = None  # save_16bit_model: no tag to mark (ranks without a file vote alike)
        self._paths = []
        rank, world = tag.world()
        own: BaseException | None = None

        def step(fn: Any, what: str = "") -> dict[int, str]:  # run fn on this rank, then every rank votes
            nonlocal own
            if own is None:
                try:
                    fn()
                except Exception as e:
                    own = e
            return tag.vote(None if own is None else f"{type(own).__name__}: {own}{what}")

        failures = step(self.wait_all)
        if not failures:
            marked = tag_dir is not None and rank == 0
            failures = step(lambda: tag.remove_marker(tag_dir) if marked else None, f" (removing {tag.MARKER})")
        if failures:
            for p in paths:
                shutil.rmtree(_new_name(p), ignore_errors=True)
            for p in exports:
                if os.path.isfile(p):
                    os.unlink(p)
            if world == 1 and own is not None:
                raise own  # one process: its own error, with its own type
            tag.raise_failures(failures, tag_dir or "<no files>", own)
        failures = step(lambda: [commit_dir(_new_name(p), p, overwrite=True) for p in paths], " (renaming into place)")
        if not failures and tag_dir is not None and rank == 0:
            failures = step(lambda: tag.write_marker(tag_dir, world), f" (writing {tag.MARKER})")
        elif not failures:
            failures = step(lambda: None)
        if failures:
            for p in paths:
                shutil.rmtree(_new_name(p), ignore_errors=True)
            if world == 1 and own is not None:
                raise own
            tag.raise_failures(failures, tag_dir or "<no files>", own, renamed=True)
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read the fastckpt folder ``path`` (as written by :meth:`save`).

        Raises:
            IncompleteTagError: the tag folder of ``path`` was never committed by every rank (no
                ``fastckpt_tag.json``), or that marker does not list ``path``.
            CheckpointNotFoundError: ``path`` is not a committed fastckpt folder (e.g. a plain
                ``torch.save`` file: load it with DeepSpeed's own engine).
            StateMismatchError: a ZeRO-3 model-states file saved by another data-parallel world size
                (:func:`_refuse_zero3_resize`).
        """
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"{path}: does not exist")
        if os.path.isfile(path):
            raise CheckpointNotFoundError(
                f"{path}: not a committed fastckpt checkpoint but a file of DeepSpeed's torch engine (a tag saved "
                "without fastckpt's engine, or a universal checkpoint of ds_to_universal, which this engine does "
                "not read); load it with DeepSpeed's own engine (without install()), or consolidate a fastckpt "
                "tag with `fastckpt load SAVE_DIR --to DIR` to change the world size")
        tag.check_listed(path)
        if not fastckpt.is_committed(path):
            raise CheckpointNotFoundError(f"{path}: not a committed fastckpt checkpoint")
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        state = decode(fastckpt.load(path, device=device)["ds"], path)
        _refuse_zero3_resize(state, path)
        return state

    def is_decoupled(self) -> bool:
        """DeepSpeed's synchronous protocol: ``commit`` is called inside ``save_checkpoint``."""
        return False

    def preserves_storage_sharing(self) -> bool:
        """fastckpt keeps views that share storage (stored once, rebuilt sharing)."""
        return True

    def cleanup(self) -> None:
        """Wait for anything still pending (a failure is raised as by :meth:`wait_all`)."""
        self.wait_all()


def _refuse_zero3_resize(state: Any, path: str) -> None:
    """Refuse a ZeRO-3 model-states file saved by another data-parallel world size than this one.

    DeepSpeed 0.19 refuses such a load only with ``load_optimizer_states``; with
    ``load_module_only=True`` (or ``load_optimizer_states=False``) each rank takes the fp32 partition
    of the rank of its number in the old world (``stage3.py``'s rigid load): the weights come back
    wrong, silently. ZeRO-1/2 merge their partitions elastically and are not refused.

    Raises:
        StateMismatchError: naming the file, both world sizes and the offline consolidation to use.
    """
    if not isinstance(state, dict) or "dp_world_size" not in state:
        return
    zero = (state.get("ds_config") or {}).get("zero_optimization") or {}
    stage = zero.get("stage") if isinstance(zero, dict) else None
    stage = getattr(stage, "value", stage)
    mp = state.get("mp_world_size") or 1
    saved, now = state["dp_world_size"], tag.world()[1] // mp
    if stage == 3 and isinstance(saved, int) and saved != now:
        raise StateMismatchError(
            f"{path}: a ZeRO-3 checkpoint saved by {saved} data-parallel ranks, loaded by {now}: DeepSpeed "
            f"cannot re-split ZeRO-3 partitions (with load_module_only each rank would take the partition "
            f"of the old rank of its number: wrong weights). Load it with {saved} ranks, or consolidate "
            f"it (`fastckpt load {os.path.dirname(os.path.dirname(os.path.abspath(path)))} --to DIR`) and "
            "load DIR's weights into the model before deepspeed.initialize", path=path,
            mismatched=[("dp_world_size", now, saved, path)])


def install(engine: Any, **kwargs: Any) -> FastCkptCheckpointEngine:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` go through fastckpt.

    Args:
        engine: an initialized ``deepspeed.DeepSpeedEngine``.
        **kwargs: :class:`FastCkptCheckpointEngine` arguments.

    Returns:
        The installed checkpoint engine.
    """
    ce = FastCkptCheckpointEngine(getattr(engine, "_config", None), **kwargs)
    engine.checkpoint_engine = ce
    opt = getattr(engine, "optimizer", None)
    if opt is not None and hasattr(opt, "checkpoint_engine"):
        opt.checkpoint_engine = ce
    return ce
