"""Typed errors of fastckpt.

Every error derives from :class:`FastCkptError` and, where one fits, from the
matching built-in exception, so callers can catch either. Messages name the
file, the tensor and the numbers involved, and say how to fix the problem.
"""

from __future__ import annotations

import os
from typing import Any, Iterable


class FastCkptError(Exception):
    """Base class of every error raised by fastckpt."""


class CheckpointNotFoundError(FastCkptError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointExistsError(FastCkptError, FileExistsError):
    """The target checkpoint folder or step already exists (pass ``overwrite=True``)."""


class InvalidArgumentError(FastCkptError, ValueError, TypeError):
    """An argument or option of a public call has the wrong type or value: a path that is not a
    ``str`` / ``os.PathLike``, ``extra_files`` not a ``dict`` of file name -> bytes, an unknown save
    option. Names the argument (and the key of a dict option), what it got and what is expected.
    Both a ``ValueError`` and a ``TypeError``: ``except`` either one catches it. Raised at the call,
    before anything is written."""

    @staticmethod
    def check_path(path: Any, what: str = "path") -> str:
        """``os.fspath(path)`` as ``str`` (``bytes`` decoded with :func:`os.fsdecode`).

        Raises:
            InvalidArgumentError: ``path`` is not a ``str``, ``bytes`` or ``os.PathLike`` (names
                ``what`` and the type given).
        """
        try:
            return os.fsdecode(os.fspath(path))
        except TypeError:
            raise InvalidArgumentError(f"{what} must be a str or os.PathLike (e.g. pathlib.Path) naming a "
                                       f"checkpoint folder, got {type(path).__name__} {path!r:.80}") from None


class FolderNotWritableError(FastCkptError, PermissionError):
    """A save cannot create its checkpoint: the folder it goes in (or a parent to create) is
    read-only or not writable by this process (``EACCES``, ``EPERM``, ``EROFS``). Names the
    checkpoint path asked for and the folder that refused; nothing was written.

    Attributes:
        path: the checkpoint path the save was asked to write.
        folder: the folder that could not be written.
    """

    def __init__(self, message: str, *, path: str = "", folder: str = "", errno: int | None = None):
        super().__init__(message)
        self.path, self.folder = path, folder
        if errno is not None:
            self.errno = errno


class NotAFolderError(FastCkptError, NotADirectoryError):
    """A path that must be a folder (the parent of a checkpoint to save, a ``CheckpointManager``
    root) is a file. Names the checkpoint path asked for and the file in the way.

    Attributes:
        path: the path asked for.
        file: the existing file where a folder is needed.
    """

    def __init__(self, message: str, *, path: str = "", file: str = ""):
        super().__init__(message)
        self.path, self.file = path, file


class CorruptCheckpointError(FastCkptError, ValueError):
    """A file's bytes do not match its header, index, manifest or checksum.

    Attributes:
        path: the file at fault (``str`` or ``None``).
        tensor: the tensor at fault, when one is known (``str`` or ``None``).
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class HeaderError(CorruptCheckpointError):
    """A safetensors header is malformed, hostile or inconsistent with its file."""


class NotSafetensorsError(HeaderError):
    """A file given where a safetensors file is expected is another format: a ``torch.save``
    file (zip archive or legacy pickle), a plain pickle, or a JSON file. Recognised by its first
    bytes only: nothing of it is unpickled. The message says how to convert it.

    Attributes:
        kind: what the file is (``"torch.save zip archive"``, ``"pickle"``, ``"JSON"``).
    """

    def __init__(self, message: str, *, path: str | None = None, kind: str = ""):
        super().__init__(message, path=path)
        self.kind = kind


class ChecksumMismatchError(CorruptCheckpointError):
    """A tensor's or file's bytes do not match the checksum in the manifest.

    The message ends with how to go on: ``fix`` when the raiser knows better (default :attr:`FIX`:
    ``fastckpt verify``, a copy, an earlier checkpoint).
    """

    FIX = ("the bytes on disk changed after the commit (a failing device, an overwrite, a copy cut short): "
           "`fastckpt verify CHECKPOINT` lists every damaged file; restore them from a copy or load an earlier "
           "checkpoint")

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None,
                 fix: str | None = None):
        super().__init__(f"{message}; {fix or self.FIX}", path=path, tensor=tensor)


class ManifestError(CorruptCheckpointError):
    """A ``manifest.json`` field is missing or malformed (names the file, the key and the value).

    Attributes:
        key: the manifest key at fault, as a path (``tensors/model%2Fw/offsets``).
        value: the value found there (``None`` when missing).
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None, value: object = None,
                 tensor: str | None = None):
        super().__init__(message, path=path, tensor=tensor)
        self.key = key
        self.value = value


class ManifestVersionError(ManifestError):
    """The manifest's ``format_version`` is newer than this fastckpt reads: upgrade fastckpt."""


class UnsupportedValueError(FastCkptError, TypeError):
    """A value in the state cannot be saved (names its key path and type)."""


class UntrustedTypeError(UnsupportedValueError):
    """A checkpoint names a class to rebuild that is not on the reader's allow-list; nothing of
    it was imported or called (names the file and the value)."""


class UnsupportedDtypeError(UnsupportedValueError):
    """A tensor dtype has no safetensors encoding, or a file names an unknown dtype."""


class InsufficientSpaceError(FastCkptError, OSError):
    """The target file system has fewer free bytes than the checkpoint needs."""


class SaveFailedError(FastCkptError, RuntimeError):
    """A save failed; raised only where the original error cannot be re-raised as is."""


class LinkedTensorChangedError(SaveFailedError):
    """A tensor taken as unchanged by ``link_check="version"`` (same storage, same version
    counter) had different bytes when checked before the commit: it was written in a way the
    version counter does not see (``.data``, a NumPy view, another tensor over the same memory).
    The save is not committed; earlier checkpoints are untouched."""


class SourceChangedError(SaveFailedError):
    """A tensor whose staging copy was left to the background thread (``defer`` /
    ``defer_frozen`` of :class:`fastckpt.saving.saver.SaveOptions`) was written in place (its version
    counter moved) after the save call and before it was copied: its call-time bytes are gone.
    Names the key path and both counter values. The save is not committed; earlier
    checkpoints are untouched."""


class PeerFailedError(SaveFailedError):
    """This rank's part of a multi-rank save stopped because another rank failed first (e.g. it
    told this rank, instead of sending the bytes this rank was waiting for, that its call failed).
    The save fails on every rank with :class:`DistributedSaveError`, whose ``failures`` name the
    rank that failed first with its own error.

    Attributes:
        rank: the rank that failed first (its rank in the save's group).
    """

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class UnsafePathError(FastCkptError, ValueError):
    """A file name taken from an index or manifest leaves the checkpoint folder."""


class CheckpointLockedError(FastCkptError, RuntimeError):
    """Another live writer holds the lock of a checkpoint root."""


class SaveConflictError(FastCkptError, RuntimeError):
    """Several processes save one checkpoint path at once with plain calls (no
    ``process_group=``); nothing is committed. Pass ``process_group=`` on every rank to save
    together, or call the save on one rank only."""


class DistributedSaveError(FastCkptError, RuntimeError):
    """One or more ranks failed a collective save.

    Attributes:
        failures: ``dict[int, str]`` mapping each failed rank to its error text.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = dict(failures)


class StoreUnreachableError(FastCkptError, RuntimeError):
    """The process group's key-value store (torchrun's ``TCPStore``, hosted by the torchrun agent
    or rank 0; a ``FileStore``) stopped answering in the middle of a multi-rank operation: the
    host process died (another rank or the agent crashed, was killed, or the job is shutting
    down) or the network to it is gone. A ``RuntimeError`` as torch's ``DistNetworkError`` it
    replaces. Nothing is committed by this rank.

    Attributes:
        rank: this process's rank in the group.
        address: the store's address (``host:port``, a file, or its type).
        what: the operation whose agreement was under way (e.g. ``"multi-rank save"``).
        key: the store key being read or written.
    """

    def __init__(self, message: str, *, rank: int = 0, address: str = "", what: str = "", key: str = ""):
        super().__init__(message)
        self.rank, self.address, self.what, self.key = rank, address, what, key


class RankValuesDifferError(DistributedSaveError, ValueError):
    """A multi-rank save was refused because values it would store once (replicated: not under
    ``local_keys``, not DTensors) differ between ranks, e.g. each rank's RNG state or a per-rank
    counter: storing one of them would silently drop the others. Raised on every rank before any
    file is written. Put the per-rank values under ``local_keys=`` (each rank saves its own and
    ``fastckpt.load_into`` restores each rank's) or make them equal.

    Attributes:
        failures: ``dict[int, str]``: each rank whose values differ from rank 0's, with the keys.
        keys: ``dict[str, list[list[int]]]``: key path -> the ranks grouped by equal value (the
            first group holds rank 0).
    """

    def __init__(self, message: str, keys: dict[str, list[list[int]]], failures: dict[int, str]):
        super().__init__(message, failures)
        self.keys = {k: [list(g) for g in v] for k, v in keys.items()}


class KeysNotFoundError(FastCkptError, KeyError):
    """``load(keys=...)`` names key paths or tensor names that match nothing stored.

    Nothing was read.

    Attributes:
        keys: the keys that match nothing, in the order given.
        path: the checkpoint folder or file.
    """

    def __init__(self, message: str, *, keys: Iterable[str] = (), path: str = ""):
        super().__init__(message)
        self.keys = list(keys)
        self.path = path

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DeviceUnavailableError(FastCkptError, ValueError):
    """``device=`` names a device this process cannot load into: a string torch does not
    parse, a type fastckpt has no engine for, CUDA/NPU not available, or an index past the
    devices present. Raised before any byte is read."""


# --- DTensor / DCP saves (issue 13, save side) ---

class UnsupportedPlannerError(FastCkptError, ValueError):
    """:class:`fastckpt.dcp.FastCkptWriter` got a DCP plan it cannot lay out: a cached plan of DCP's
    ``enable_plan_caching=True``, a planner without ``lookup_object`` (DCP's ``DefaultSavePlanner``
    API) for non-tensor values, or a :class:`fastckpt.dcp.FastCkptSavePlanner` plan written with
    another planner. The message says what to change. Nothing is committed."""


# --- load_into / DCP reader (loading side of issue 13) -----------------------------------------

class StateMismatchError(FastCkptError, ValueError):
    """``load_into(..., strict=True)``: the state to fill and the checkpoint disagree. Raised before
    any tensor of the state is written; the message names each key path, both shapes/dtypes and the
    file, and says how to fix it.

    Attributes:
        path: the checkpoint folder or file.
        missing: key paths of the state that the checkpoint lacks.
        unexpected: key paths of the checkpoint that the state lacks.
        mismatched: ``(key path, what the state has, what the checkpoint has, file)`` tuples.
    """

    def __init__(self, message: str, *, path: str = "", missing: Iterable[str] = (),
                 unexpected: Iterable[str] = (), mismatched: Iterable[tuple] = ()):
        super().__init__(message)
        self.path = path
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class ShardedCheckpointError(FastCkptError, ValueError):
    """Plain ``fastckpt.load`` met a multi-rank value it cannot return whole (shard pieces that do not
    cover the tensor, or a rank-local subtree); names the key path and what to call instead
    (``fastckpt.load_into``). Also a file of DCP's ``HuggingFaceStorageWriter(save_distributed=True)``
    save that was not consolidated (one rank's piece under the full tensor's name)."""


class DCPPlannerError(FastCkptError, TypeError):
    """``FastCkptReader`` was asked for a non-tensor (BYTE_IO) item it cannot serve without unpickling:
    one the checkpoint has no JSON value for, or a planner that overrides ``load_bytes`` (it expects
    the pickled bytes DCP's ``FileSystemReader`` hands out). Raised before any tensor is read."""


class DCPLoadError(FastCkptError, RuntimeError):
    """``fastckpt.dcp.load`` failed inside ``torch.distributed.checkpoint.load`` (whose own
    ``CheckpointException`` derives from ``BaseException``).

    Attributes:
        failures: ``dict[int, str]`` rank -> error text, as DCP reported them.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = dict(failures)


# --- DeepSpeed many ranks and consolidation (deepspeed engineer) ---------------------------------

class IncompleteTagError(CheckpointNotFoundError):
    """A DeepSpeed tag folder written by fastckpt's engine that was never committed as a whole:
    it has no ``fastckpt_tag.json`` (some rank failed the save, or the save was interrupted), or
    the file asked for is not one of the files that marker lists.

    Attributes:
        path: the tag folder.
    """

    def __init__(self, message: str, *, path: str = ""):
        super().__init__(message)
        self.path = path


class NativeCheckpointError(FastCkptError, ValueError):
    """A native DeepSpeed (``*_model_states.pt`` / ``*_optim_states.pt``, pickled) or DCP
    (``.metadata`` + ``*.distcp``, pickled metadata) folder was given where fastckpt reads only
    what it wrote: nothing of it was opened.

    Attributes:
        pickle_file: the pickled file that made fastckpt refuse the folder.
    """

    def __init__(self, message: str, *, pickle_file: str = ""):
        super().__init__(message)
        self.pickle_file = pickle_file


# --- peft / LoRA merge (issue 14) -------------------------------------------------------------
class LoraMergeError(FastCkptError, ValueError):
    """``fastckpt load`` refused a LoRA checkpoint: the base weights or the adapter do not
    fit the model, so transformers/peft would silently re-initialise or skip tensors.

    Nothing appears at ``--to``. Raised for base tensors the model lacks or needs under
    other names (e.g. peft wrapper names such as ``x.original_module.weight``), or adapter
    tensors a fastckpt manifest lists but ``adapter_model.safetensors`` does not hold (checkpoints
    written by fastckpt before every adapter tensor was stored in that file).

    Attributes:
        path: the checkpoint or adapter folder.
        missing: tensor names expected but absent.
        unexpected: tensor names present but unknown to the model.
    """

    def __init__(self, message: str, *, path: str = "", missing: Iterable[str] = (), unexpected: Iterable[str] = ()):
        super().__init__(message)
        self.path = path
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)


# --- Hugging Face Trainer integration (issue 14): where the Trainer raises ValueError, so do we ---
class TrainerCheckpointNotFoundError(CheckpointNotFoundError, ValueError):
    """``Trainer.train(resume_from_checkpoint=True)`` through fastckpt found no committed
    ``checkpoint-N`` folder in ``output_dir`` (the Trainer raises ``ValueError`` there, so this
    is one too). Start without ``resume_from_checkpoint`` or pass a checkpoint folder."""


class ResumeMismatchError(FastCkptError, ValueError):
    """The checkpoint the Trainer resumed from holds another step than the Trainer's
    ``TrainerState`` (its ``trainer_state.json`` was edited or belongs to another folder).
    Resume from an unmodified fastckpt checkpoint folder."""


class UnsupportedTrainerOptionError(FastCkptError, ValueError):
    """A ``TrainingArguments`` option the fastckpt callback does not support (``push_to_hub``);
    the message says what to do instead."""


# -- accelerate plugin (integrations/accelerate/plugin.py): the types accelerate itself raises, plus ours --
class AccelerateStateError(FastCkptError, ValueError):
    """The accelerate plugin refuses a ``save_state``/``load_state`` call where accelerate raises
    ``ValueError`` (so ``except ValueError`` code written for accelerate keeps working): the
    automatic ``checkpoint_<iteration>`` folder already exists, no folder is given while automatic
    naming is off, a folder to load does not exist, or the checkpoint holds fewer objects
    (models, optimizers, schedulers, registered objects) than the accelerator."""


class AccelerateCheckpointNotFoundError(CheckpointNotFoundError, ValueError):
    """``load_state()`` found no committed fastckpt checkpoint at the folder given, or none under
    ``project_dir/checkpoints`` (accelerate raises ``ValueError`` for a missing folder)."""


class StateDictMismatchError(FastCkptError, RuntimeError):
    """``load_state(strict=True)`` (accelerate's default): a stored model's keys or shapes do not
    match the live model's (missing keys, unexpected keys, different shapes). A ``RuntimeError``
    like torch's ``load_state_dict``; raised before any model, optimizer or RNG state changes.

    Attributes:
        missing: keys of the live model absent from the checkpoint.
        unexpected: stored keys the live model does not have.
        mismatched: ``{key: (stored shape, live shape)}``.
    """

    def __init__(self, message: str, *, missing: Iterable[str] = (), unexpected: Iterable[str] = (),
                 mismatched: dict | None = None):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = dict(mismatched or {})


# -- accelerate plugin, FSDP (integrations/accelerate/fsdp2.py) --
class AccelerateFSDP1Error(FastCkptError, NotImplementedError):
    """The accelerate plugin was enabled on, or asked to save, an FSDP1 model
    (``FullyShardedDataParallel``, ``FullyShardedDataParallelPlugin(fsdp_version=1)``). A
    ``NotImplementedError`` as before; FSDP2 (``fsdp_version=2`` / ``fully_shard``) is supported."""


class NotServableError(FastCkptError, ValueError):
    """A model folder that ``vllm serve`` / ``from_pretrained`` would not load as the model its
    ``config.json`` describes: no architecture or dtype named, parameters of that architecture
    missing or of another shape, or tying flags that disagree with the files.

    Attributes:
        path: the folder checked.
        problems: one line per problem (what, which keys, the numbers, how to fix).
        missing: parameter names the architecture has and the folder lacks.
        mismatched: ``{name: (shape expected, shape in the folder)}``.
    """

    def __init__(self, message: str, *, path: str = "", problems: Iterable[str] = (), missing: Iterable[str] = (),
                 mismatched: dict | None = None):
        super().__init__(message)
        self.path = path
        self.problems = list(problems)
        self.missing = sorted(missing)
        self.mismatched = dict(mismatched or {})


class TierFullError(InsufficientSpaceError):
    """The storage tier's shared capacity budget cannot hold a write (see ``fastckpt.storage.tier``).

    Attributes:
        cls: the class that asked (``"checkpoints"``, ``"models"`` or ``"kv"``).
        need: the bytes asked for.
        budget: the tier's budget in bytes.
        used: stored bytes per class. claimed: bytes claimed by writes in flight, per class.
    """

    def __init__(self, message: str, *, cls: str = "", need: int = 0, budget: int = 0,
                 used: dict | None = None, claimed: dict | None = None):
        super().__init__(message)
        self.cls, self.need, self.budget = cls, need, budget
        self.used, self.claimed = dict(used or {}), dict(claimed or {})
