"""Save planning: which tensor goes to which shard file at which byte range. Pure, no I/O.

The plan lays out the data regions of all files one after another in a virtual
*stream* (each region starting at a multiple of ``chunk_bytes``), which is how the
staging buffer is addressed, and cuts every region into *write units* of at most
``chunk_bytes``: the unit of parallel ``pwrite``. Small tensors are packed into the
same unit, so many small tensors cost one large write.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .dtypes import itemsize, str_to_dtype
from .safetensors import INDEX_SUFFIX, encode_header

#: Files of a fastckpt checkpoint folder that the reference writers (``save_pretrained`` of
#: transformers and peft, the Trainer's model files) do not write for the same model, as
#: ``fnmatch`` patterns -> why. Every other file has the reference writer's name and content
#: (same tensor names, dtypes and bytes; JSON files equal once parsed): tests/reference/ diffs the
#: two folders over many model kinds against exactly this list; README.md and docs/FORMAT.md
#: quote it.
REFERENCE_ADDITIONS: dict[str, str] = {
    "manifest.json": "the commit record: written last, it makes the folder a checkpoint; lists every file "
                     "and tensor with its byte range and xxh3 checksum (fastckpt verify, link_from)",
    "state.json": "the JSON skeleton of the saved state (non-tensor values, where each tensor is)",
    "state-*-of-*.safetensors": "tensors that are not model weights (optimizer, scheduler, RNG, ...)",
    "state-rank*.json": "multi-rank saves: each rank's local skeleton",
    "rank*-*-of-*.safetensors": "multi-rank saves: each rank's local tensors",
}

#: Files of the Trainer's own checkpoint that a checkpoint of fastckpt's Trainer callback holds in
#: another form (``fnmatch`` patterns -> where): all are pickles, which fastckpt never writes or reads.
REFERENCE_REPLACED: dict[str, str] = {
    "optimizer.pt": "the optimizer state: state['optimizer'], in the state-*.safetensors files + state.json",
    "scheduler.pt": "the LR scheduler state: state['scheduler'] in state.json",
    "rng_state*.pth": "the RNG states (per process): state['rng'] / state-rank*.json",
    "training_args.bin": "the TrainingArguments: not saved (the resuming run passes its own)",
}

#: File name of peft's adapter weights; a folder holding it (or a sub-folder holding it: a named
#: adapter) is a peft checkpoint.
PEFT_ADAPTER_FILE = "adapter_model.safetensors"

#: What a peft checkpoint holds besides what ``PeftModel.save_pretrained`` writes (and
#: :data:`REFERENCE_ADDITIONS`): the base model, so that the folder alone can be merged, served
#: or loaded by ``from_pretrained`` (which attaches the adapter itself). These files equal the base
#: model's ``save_pretrained`` output except that one shard keeps the sharded name
#: ``model-00001-of-00001.safetensors`` + index: transformers' ``Trainer`` resumes a folder holding
#: ``model.safetensors`` as a full-model checkpoint and would then not load the adapter.
PEFT_BASE_ADDITIONS: dict[str, str] = {
    "model-*-of-*.safetensors": "the base model's weights under transformers' names",
    "model.safetensors.index.json": "the index of the base model's weight files",
    "config.json": "the base model's config, as its save_pretrained writes it",
    "generation_config.json": "the base model's generation config, as its save_pretrained writes it",
}

#: The marker fastckpt's DeepSpeed checkpoint engine writes in a tag folder once every rank committed
#: (the tag's file names and world size, :mod:`fastckpt.integrations.deepspeed.tag`); a tag folder
#: without it is an incomplete save that every load refuses.
ENGINE_TAG_MARKER = "fastckpt_tag.json"

#: Header prefixes are padded to this many bytes so every data region is O_DIRECT aligned.
HEADER_ALIGN = 4096

#: Manifest key prefix of rank ``r``'s local tensors in a multi-rank checkpoint
#: (``RANK_KEY.format(r) + key path``); their files are ``rank0000r-*.safetensors``.
RANK_KEY = "@rank{}/"

#: File stem of the tensors that are not model weights (optimizer, RNG, ...): files only fastckpt
#: reads, ``state-0000k-of-0000n.safetensors`` even as one file.
STATE_STEM = "state"

#: Stems of files only fastckpt reads (:data:`STATE_STEM`, each rank's local ``rank0000r`` files):
#: they keep the ``-0000k-of-0000n`` name even as one file. Every other sharded stem is an HF
#: weights group, named as ``save_pretrained`` names it (:func:`shard_file_names`).
_INTERNAL_STEM = re.compile(r"state|rank\d+")

#: What :func:`shard_file_names` appends to a stem past one file, as a pattern (``-0000k-of-0000n.safetensors``).
_SHARD_SUFFIX = r"-\d{5}-of-\d{5}\.safetensors"

#: Smallest data bytes per file when a stem that several ranks write is cut for its writers
#: (:func:`plan_save` ``writers``): below this, one more file's create and fsync cost more than two
#: ranks taking turns at one file's write lock.
SPLIT_MIN_BYTES = 16 << 20


def shard_file_names(stem: str, n: int, *, peft: bool = False) -> list[str]:
    """The file names of group ``stem`` cut into ``n`` files (``n >= 1``).

    A stem ending in ``.safetensors`` is exactly that one file. An HF weights stem (``"model"``)
    is named as transformers' ``save_pretrained`` names it: one file is ``model.safetensors``
    (no index), more are ``model-0000k-of-0000n.safetensors`` (with ``model.safetensors.index.json``).
    fastckpt's own stems (``state``, ``rank0000r``) are always ``{stem}-0000k-of-0000n.safetensors``,
    and so are the base weights of a peft checkpoint (see :data:`PEFT_BASE_ADDITIONS`).

    Args:
        stem: the group's file stem (:attr:`ArraySpec.group`).
        n: number of files.
        peft: the folder is a peft checkpoint (it also holds :data:`PEFT_ADAPTER_FILE`, at the top
            or in a sub-folder).

    Returns:
        ``n`` file names, in shard order.
    """
    if stem.endswith(".safetensors"):
        return [stem]
    if n == 1 and not _INTERNAL_STEM.fullmatch(stem) and not peft:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


#: Files of a checkpoint folder that only fastckpt writes besides its shards: per-rank skeletons of
#: ``local_keys`` subtrees (``state-rank0000r.json``) and the DCP drop-in's ``dcp_metadata.json``.
_INTERNAL_FILE = re.compile(f"(?:{_INTERNAL_STEM.pattern}){_SHARD_SUFFIX}" + r"|state-rank\d{5}\.json|dcp_metadata\.json")


def internal_stem(stem: str) -> bool:
    """True for a file stem only fastckpt's own files use (``state``, ``rank0000r``: :data:`_INTERNAL_STEM`):
    a weights group under such a stem would merge into them (no HF index, no ``{"format": "pt"}``)."""
    return bool(_INTERNAL_STEM.fullmatch(stem))


def written_by_save(name: str, stems: Iterable[str]) -> bool:
    """True when a save whose weights groups have file stems ``stems`` may write a file called
    ``name`` (a path relative to the checkpoint folder) besides ``manifest.json`` and ``state.json``:
    any of fastckpt's own files, or a weights group's file, shard or index, as
    :func:`shard_file_names` and the index name them. A user's extra file by such a name would
    be overwritten by the save or make the checkpoint unreadable."""
    if _INTERNAL_FILE.fullmatch(name):
        return True
    for stem in stems:
        if stem.endswith(".safetensors"):
            if name == stem:
                return True
        elif name in (f"{stem}.safetensors", stem + INDEX_SUFFIX) or re.fullmatch(re.escape(stem) + _SHARD_SUFFIX, name):
            return True
    return False


@dataclass(frozen=True)
class ArraySpec:
    """One array to write.

    Attributes:
        key: key path in the state (see :mod:`fastckpt.format.tree`).
        name: tensor name inside the safetensors file.
        group: file stem: ``"model"`` -> ``model.safetensors``, or
            ``model-0000k-of-0000n.safetensors`` past one shard (:func:`shard_file_names`); a
            stem ending in ``.safetensors`` -> exactly that single file.
        dtype: safetensors dtype string.
        shape: tuple of ints.
        nbytes: data bytes.
    """

    key: str
    name: str
    group: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class PlannedTensor:
    """An :class:`ArraySpec` placed in a file: absolute file offset and stream offset (bytes)."""

    spec: ArraySpec
    file: str
    file_offset: int
    stream_offset: int


@dataclass(frozen=True)
class FilePlan:
    """One safetensors file: its name, header prefix bytes, total size and data region."""

    name: str
    prefix: bytes
    size: int
    data_offset: int
    stream_offset: int
    tensors: tuple[PlannedTensor, ...]

    @property
    def data_bytes(self) -> int:
        """Bytes of the data region."""
        return self.size - self.data_offset


@dataclass(frozen=True)
class WriteUnit:
    """A contiguous byte range of one file written by one ``pwrite`` (at most ``chunk_bytes``)."""

    file_index: int
    file_offset: int
    stream_offset: int
    nbytes: int


@dataclass(frozen=True)
class SavePlan:
    """The whole write plan.

    Attributes:
        files: every safetensors file, in write order.
        units: every write unit, in stream order.
        stream_bytes: size of the stream (staging bytes needed to hold it all at once).
        data_bytes: bytes of tensor data (excluding headers and stream padding).
        chunk_bytes: unit size in bytes.
        index: tensor name -> file name per group stem cut into files (``stem -> {name: file}``):
            HF weights stems cut into several files (written as ``{stem}.safetensors.index.json``)
            and fastckpt's own stems (never written as an index).
    """

    files: tuple[FilePlan, ...]
    units: tuple[WriteUnit, ...]
    stream_bytes: int
    data_bytes: int
    chunk_bytes: int
    index: dict[str, dict[str, str]]

    @property
    def file_bytes(self) -> int:
        """Total bytes of all safetensors files (headers included)."""
        return sum(f.size for f in self.files)


def _shard(specs: list[ArraySpec], max_shard_bytes: int) -> list[list[ArraySpec]]:
    order = sorted(specs, key=lambda s: -itemsize(str_to_dtype(s.dtype, tensor=s.name)))
    shards: list[list[ArraySpec]] = [[]]
    used = 0
    for s in order:
        if shards[-1] and used + s.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += s.nbytes
    return shards


def _split(stem: str, group: list[ArraySpec], max_shard_bytes: int, writers: int) -> list[list[ArraySpec]]:
    """The files of ``stem``: :func:`_shard` by ``max_shard_bytes``, unless ``writers`` ranks write it and
    it holds ``k >= 2`` x :data:`SPLIT_MIN_BYTES` (``k`` = ``writers`` or fewer): then ``k`` files of
    about equal bytes, each tensor in the file its middle byte falls in (whole tensors, in
    :func:`_shard`'s order; no file left with a small remainder)."""
    total = sum(s.nbytes for s in group)
    k = 1 if writers == 1 or re.fullmatch(r"rank\d+", stem) else min(writers, total // SPLIT_MIN_BYTES)
    if k < 2 or -(-total // k) > max_shard_bytes:
        return _shard(group, max_shard_bytes)
    files: list[list[ArraySpec]] = [[] for _ in range(k)]
    at = 0
    for s in _shard(group, total)[0]:  # one group, in _shard's order
        files[min(k - 1, (2 * at + s.nbytes) * k // (2 * total))].append(s)
        at += s.nbytes
    return [f for f in files if f]


def plan_save(specs: list[ArraySpec], *, max_shard_bytes: int, chunk_bytes: int,
              metadata: dict[str, str] | None = None, writers: int = 1) -> SavePlan:
    """Plan the files, byte ranges and write units for ``specs``.

    Args:
        specs: arrays to write; names must be unique within a group.
        max_shard_bytes: data bytes per shard file before a new shard starts (a larger
            tensor gets a shard of its own). Groups whose stem ends in ``.safetensors``
            are never split. File names: :func:`shard_file_names`.
        chunk_bytes: write-unit size in bytes (a multiple of 4096).
        metadata: ``__metadata__`` for every file (``str -> str``). The files of HF weights
            stems (every stem but fastckpt's own ``state`` / ``rank0000r``) also get
            ``"format": "pt"`` unless ``metadata`` sets ``format``, as transformers and peft
            write it (readers such as transformers check it).
        writers: ranks that write the files together (default 1). A stem that several ranks write
            (every stem but a rank's own ``rank0000r``, and a ``.safetensors`` stem) is cut, by whole
            tensors, at about ``1/k`` of its bytes, ``k`` = ``writers`` or as many
            :data:`SPLIT_MIN_BYTES` (16 MiB) as it holds if fewer (under 32 MiB: not cut), unless
            ``max_shard_bytes`` cuts it finer: a file system serialises the writes into one file (the
            inode lock of tmpfs and of ext4's buffered and unwritten-extent writes, a parallel file
            system's extent locks), and with ``k`` files the ranks, each starting at another file
            (:meth:`fastckpt.saving.pages.PageJob.write`), write different files at once (measured:
            ``benchmarks/bench_dist.py --fsdp2`` on ``/dev/shm``, 2 ranks, 256 MiB: one file 0.85x
            ``dcp.save``, two files 1.03-1.12x). Readers see ordinary sharded weights (an index names
            each tensor's file).

    Returns:
        A frozen :class:`SavePlan`; deterministic for equal inputs.

    Raises:
        ValueError: ``chunk_bytes`` is not a multiple of 4096, or two groups get the same file
            name (e.g. stems ``"model"`` and ``"model.safetensors"``).
    """
    if chunk_bytes % HEADER_ALIGN:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of {HEADER_ALIGN}")
    if writers < 1:
        raise ValueError(f"writers must be a positive int, got {writers!r}")
    groups: dict[str, list[ArraySpec]] = {}
    for s in specs:
        groups.setdefault(s.group, []).append(s)
    peft = any(g == PEFT_ADAPTER_FILE or g.endswith("/" + PEFT_ADAPTER_FILE) for g in groups)  # adapters, any folder
    files: list[FilePlan] = []
    units: list[WriteUnit] = []
    index: dict[str, dict[str, str]] = {}
    stream = 0
    for stem, group in groups.items():
        shards = [group] if stem.endswith(".safetensors") else _split(stem, group, max_shard_bytes, writers)
        names = shard_file_names(stem, len(shards), peft=peft)
        if not stem.endswith(".safetensors") and (len(names) > 1 or names[0] != f"{stem}.safetensors"):
            index[stem] = {}
        taken = [n for n in names if any(f.name == n for f in files)]
        if taken:
            raise ValueError(f"weights stem {stem!r} would write {taken[0]!r}, which another stem already writes: "
                             "give every top-level weights key its own stem")
        meta = metadata if _INTERNAL_STEM.fullmatch(stem) else {"format": "pt", **(metadata or {})}
        for fname, shard in zip(names, shards):
            prefix, infos = encode_header([(s.name, s.dtype, s.shape, s.nbytes) for s in shard], meta,
                                          align=HEADER_ALIGN)
            data_off = len(prefix)
            placed = tuple(PlannedTensor(s, fname, data_off + i.start, stream + i.start)
                           for s, i in zip(shard, infos))
            data = infos[-1].end if infos else 0
            fi = len(files)
            files.append(FilePlan(fname, prefix, data_off + data, data_off, stream, placed))
            for off in range(0, data, chunk_bytes):
                n = min(chunk_bytes, data - off)
                units.append(WriteUnit(fi, data_off + off, stream + off, n))
            if stem in index:
                index[stem].update({s.name: fname for s in shard})
            stream += -(-data // chunk_bytes) * chunk_bytes
    return SavePlan(tuple(files), tuple(units), stream, sum(s.nbytes for s in specs), chunk_bytes, index)
