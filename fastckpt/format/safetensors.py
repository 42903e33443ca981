"""safetensors headers and HF index files: encode, parse, validate.

Format source: https://github.com/huggingface/safetensors#format ::

    [8 bytes: N, little-endian u64][N bytes: UTF-8 JSON header][data]

The header maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the start of the data region) plus an optional
``"__metadata__"`` map of ``str -> str``. Non-empty tensors tile the data region
exactly (no overlaps, no holes); the header may be padded with spaces.

Everything here is validated before any allocation sized by the file and before
any read past the end of the file (cases C1-C5 of ``shared/cases``).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Callable

from .dtypes import itemsize, str_to_dtype
from ..errors import HeaderError, NotSafetensorsError, UnsafePathError, UnsupportedValueError

#: Largest header accepted, in bytes (the safetensors package uses the same 100 MB cap).
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
#: Dimensions must fit an int64 (torch sizes); a zero-element tensor could otherwise carry any dim.
MAX_DIM = 2**63


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file.

    Attributes:
        name: tensor name in the file.
        dtype: safetensors dtype string (``"BF16"``...).
        shape: tuple of non-negative ints (``()`` for a 0-dim scalar).
        start: first byte, relative to the data region.
        end: one past the last byte, relative to the data region.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Byte length of the tensor's data."""
        return self.end - self.start


@dataclass
class Header:
    """A parsed and validated safetensors header.

    Attributes:
        path: the file it came from.
        data_offset: absolute byte offset of the data region (``8 + N``).
        tensors: name -> :class:`TensorInfo`, in file order of ``start``.
        metadata: the ``__metadata__`` map (``None`` when absent).
        file_size: size of the file in bytes.
    """

    path: str
    data_offset: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None = None
    file_size: int = 0
    extra: dict = field(default_factory=dict)


def check_metadata(metadata: dict | None, *, path: str = "?") -> dict[str, str] | None:
    """Validate a ``__metadata__`` map: keys and values must be ``str``.

    Raises:
        UnsupportedValueError: a key or value is not a string (names the key); convert
            values with ``json.dumps`` first if they are not text.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise UnsupportedValueError(f"{path}: metadata must be a dict of str -> str, got {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise UnsupportedValueError(
                f"{path}: metadata key {k!r} has a {type(v).__name__} value {v!r}; safetensors metadata "
                "values must be strings (encode them, e.g. json.dumps(value))"
            )
    return metadata


def encode_header(
    entries: list[tuple[str, str, tuple[int, ...], int]],
    metadata: dict[str, str] | None = None,
    *,
    align: int = 8,
) -> tuple[bytes, list[TensorInfo]]:
    """Build a safetensors header for tensors laid out back to back in ``entries`` order.

    Args:
        entries: ``(name, dtype_str, shape, nbytes)`` per tensor; ``nbytes`` must equal
            ``prod(shape) * itemsize(dtype)``.
        metadata: optional ``str -> str`` map stored as ``__metadata__``.
        align: the returned prefix (8-byte length + JSON + space padding) is padded to a
            multiple of ``align`` bytes (8 by default, 4096 for O_DIRECT-friendly files).

    Returns:
        ``(prefix_bytes, infos)``: the bytes to write at offset 0 and each tensor's range.

    Raises:
        UnsupportedValueError: a name is ``__metadata__`` or repeated, metadata is not
            ``str -> str``, or ``nbytes`` disagrees with the shape.
    """
    check_metadata(metadata)
    header: dict = {}
    if metadata is not None:
        header[METADATA_KEY] = metadata
    infos: list[TensorInfo] = []
    cursor = 0
    for name, dtype, shape, nbytes in entries:
        if name == METADATA_KEY:
            raise UnsupportedValueError(f"tensor name {METADATA_KEY!r} is reserved by the safetensors format; rename it")
        if name in header:
            raise UnsupportedValueError(f"tensor name {name!r} appears twice in one file")
        want = math.prod(shape) * itemsize(str_to_dtype(dtype, tensor=name))
        if want != nbytes:
            raise UnsupportedValueError(f"tensor {name!r}: shape {list(shape)} {dtype} needs {want} bytes, got {nbytes}")
        info = TensorInfo(name, dtype, tuple(int(s) for s in shape), cursor, cursor + nbytes)
        header[name] = {"dtype": dtype, "shape": list(info.shape), "data_offsets": [info.start, info.end]}
        infos.append(info)
        cursor += nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    total = 8 + len(body)
    padded = -(-total // align) * align
    body += b" " * (padded - total)
    return struct.pack("<Q", len(body)) + body, infos


def _dup_check(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, raw: object, path: str) -> TensorInfo:
    if not isinstance(raw, dict):
        raise HeaderError(f"{path}: entry {name!r} is not an object", path=path, tensor=name)
    dtype, shape, offs = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    dt = str_to_dtype(dtype, tensor=name, path=path)
    if not isinstance(shape, list) or not all(_is_int(s) and 0 <= s < MAX_DIM for s in shape):
        raise HeaderError(f"{path}: tensor {name!r} has invalid shape {str(shape)[:200]} (dims must be ints in "
                          f"[0, 2**63))", path=path, tensor=name)
    if math.prod(d for d in shape if d) >= MAX_DIM:
        raise HeaderError(f"{path}: tensor {name!r} has shape {str(shape)[:200]} whose non-zero dims multiply "
                          "past 2**63 (strides would overflow)", path=path, tensor=name)
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) and o >= 0 for o in offs)):
        raise HeaderError(f"{path}: tensor {name!r} has invalid data_offsets {offs!r}", path=path, tensor=name)
    start, end = offs
    if end < start:
        raise HeaderError(f"{path}: tensor {name!r} has data_offsets [{start}, {end}] with end < begin",
                          path=path, tensor=name)
    want = math.prod(shape) * itemsize(dt)
    if end - start != want:
        raise HeaderError(
            f"{path}: tensor {name!r} is {dtype} {shape} = {want} bytes but data_offsets "
            f"[{start}, {end}] span {end - start} bytes", path=path, tensor=name)
    return TensorInfo(name, dtype, tuple(shape), start, end)


def _check_layout(infos: list[TensorInfo], data_len: int, path: str) -> None:
    """Non-empty ranges must tile ``[0, data_len)``; empty ones must lie inside it."""
    cursor, prev = 0, None
    for t in sorted((i for i in infos if i.nbytes), key=lambda i: i.start):
        if t.start < cursor:
            raise HeaderError(f"{path}: tensor {t.name!r} [{t.start}, {t.end}] overlaps {prev!r} "
                              f"which ends at {cursor}", path=path, tensor=t.name)
        if t.start > cursor:
            raise HeaderError(f"{path}: {t.start - cursor} unindexed bytes [{cursor}, {t.start}) before tensor "
                              f"{t.name!r}", path=path, tensor=t.name)
        cursor, prev = t.end, t.name
    for t in infos:
        if t.end > data_len:
            raise HeaderError(f"{path}: tensor {t.name!r} ends at data byte {t.end} but the file holds only "
                              f"{data_len} data bytes (truncated?)", path=path, tensor=t.name)
    if cursor != data_len:
        raise HeaderError(f"{path}: tensors end at data byte {cursor} but the file holds {data_len} data bytes "
                          f"({data_len - cursor} trailing bytes)", path=path)


def parse_header(body: bytes, file_size: int, *, path: str = "?") -> Header:
    """Parse and validate the JSON header ``body`` (without its 8-byte length).

    Args:
        body: the N header bytes.
        file_size: total file size in bytes, to check that every tensor lies inside it.
        path: file name used in error messages.

    Raises:
        HeaderError: not UTF-8, not a JSON object, duplicate keys, bad entries, overlapping
            or unindexed ranges, ranges past the end of the file, bad ``__metadata__``.
        UnsupportedDtypeError: an entry names an unknown dtype.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"{path}: header is not valid UTF-8 ({e})", path=path) from None
    try:
        raw = json.loads(text, object_pairs_hook=_dup_check)
    except (ValueError, RecursionError) as e:  # RecursionError: hostile nesting depth
        raise HeaderError(f"{path}: header is not valid JSON: {e}", path=path) from None
    if not isinstance(raw, dict):
        raise HeaderError(f"{path}: header is a JSON {type(raw).__name__}, not an object", path=path)
    meta = raw.pop(METADATA_KEY, None)
    if meta is not None:
        if not isinstance(meta, dict):
            raise HeaderError(f"{path}: __metadata__ is not an object", path=path)
        for k, v in meta.items():
            if not isinstance(v, str):
                raise HeaderError(f"{path}: __metadata__ key {k!r} has a non-string value {v!r}", path=path)
    infos = [_parse_entry(name, entry, path) for name, entry in raw.items()]
    data_offset = 8 + len(body)
    _check_layout(infos, file_size - data_offset, path)
    infos.sort(key=lambda i: (i.start, i.end))
    return Header(path, data_offset, {i.name: i for i in infos}, meta, file_size)


def read_header_at(read_at: Callable[[int, int], bytes], size: int, path: str) -> Header:
    """Read and validate the header of a safetensors file of ``size`` bytes through ``read_at``.

    The length field is checked against the file size before the header is read,
    so a hostile length (e.g. 2**63) never sizes an allocation. The file is opened (and found
    to be a regular file) by the caller: :func:`fastckpt.storage.model_files.read_header`.

    Args:
        read_at: ``read_at(offset, n)`` returns up to ``n`` bytes of the file from byte ``offset``.
        size: the file's size in bytes.
        path: the file's name, for messages.

    Raises:
        HeaderError: see :func:`parse_header`; also a file shorter than 8 bytes, or a length
            field larger than the file or than ``MAX_HEADER_BYTES``.
        NotSafetensorsError: (a ``HeaderError``) the file starts like a ``torch.save`` zip
            archive, a pickle or a JSON file (says how to convert it; nothing is unpickled).
    """
    if size < 8:
        raise HeaderError(f"{path}: file is {size} bytes, shorter than the 8-byte header length", path=path)
    first = read_at(0, 8)
    (n,) = struct.unpack("<Q", first)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        _refuse_foreign(first, path)
    if n > size - 8:
        raise HeaderError(f"{path}: header length field says {n} bytes but the file has only {size - 8} "
                          "bytes after it (truncated or not a safetensors file)", path=path)
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit", path=path)
    body = read_at(8, n)
    if len(body) != n:
        raise HeaderError(f"{path}: short read of header ({len(body)} of {n} bytes)", path=path)
    return parse_header(body, size, path=path)


#: First bytes of files often passed where a safetensors file is expected -> what they are. A
#: safetensors file starts with its header length (little-endian u64, far below these values).
_FOREIGN = ((b"PK\x03\x04", "a torch.save file (zip archive)", "torch.save"),
            (b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46", "a torch.save file (legacy format, a pickle)", "torch.save"),
            (b"\x80\x02", "a pickle file (pickle.dump or an old torch.save)", "pickle"),
            (b"\x80\x03", "a pickle file (pickle.dump or an old torch.save)", "pickle"),
            (b"\x80\x04", "a pickle file (pickle.dump or an old torch.save)", "pickle"),
            (b"\x80\x05", "a pickle file (pickle.dump or an old torch.save)", "pickle"),
            (b"{", "a JSON file", "JSON"))


def _refuse_foreign(first: bytes, path: str) -> None:
    """Raise :class:`NotSafetensorsError` if ``first`` (the file's first 8 bytes) starts like a
    ``torch.save`` / pickle / JSON file; nothing of the file is unpickled or parsed."""
    found = next(((what, kind) for magic, what, kind in _FOREIGN if first.startswith(magic)), None)
    if found is None:
        return
    what, kind = found
    if kind == "JSON":
        folder = os.path.dirname(os.path.abspath(path))
        raise NotSafetensorsError(f"{path}: {what}, not a safetensors file; pass the checkpoint or model folder "
                                  f"({folder}) or one of its *.safetensors files", path=path, kind=kind)
    raise NotSafetensorsError(
        f"{path}: {what}, not a safetensors file. fastckpt never unpickles (loading a pickle can run code). "
        f"If you trust the file, convert it once: "
        f"fastckpt.save(torch.load({path!r}, weights_only=True), 'converted') (any nested state), or "
        f"safetensors.torch.save_file(torch.load({path!r}, weights_only=True), 'model.safetensors') "
        f"(a flat dict of tensors)", path=path, kind=kind)


def check_name(folder: str | os.PathLike, name: str) -> str:
    """Join a file ``name`` taken from an index or manifest onto ``folder``, for READING: the
    string checks (the name is relative, has no ``..`` component and no NUL). The check that no
    folder it passes through is a symlink out of ``folder`` needs the store:
    :func:`fastckpt.storage.model_files.safe_join` does both.

    Args:
        folder: the checkpoint or model folder.
        name: a relative file name from an index, manifest or listing (``/``-separated).

    Returns:
        ``os.path.join(folder, name)`` (not resolved: messages keep the name the user knows).

    Raises:
        UnsafePathError: ``name`` is empty, absolute, or contains ``..`` or a NUL.
    """
    folder = os.fspath(folder)
    if not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name) \
            or name.startswith("\\") or ".." in name.replace("\\", "/").split("/"):
        raise UnsafePathError(f"{folder}: file name {name!r} from an index or manifest leaves the folder")
    return os.path.join(folder, name)


INDEX_SUFFIX = ".safetensors.index.json"


def parse_index(data: bytes, index_path: str) -> dict[str, str]:
    """Parse the bytes of an HF ``*.safetensors.index.json`` and return its ``weight_map``
    (tensor -> shard file name). That the shards exist is checked by the caller
    (:func:`fastckpt.storage.model_files.read_index`).

    Raises:
        HeaderError: not JSON, no ``weight_map`` object, or a non-string entry.
        UnsafePathError: a shard name leaves the folder (absolute, ``..``).
    """
    try:
        raw = json.loads(data.decode("utf-8"), object_pairs_hook=_dup_check)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise HeaderError(f"{index_path}: not a valid JSON index: {e}", path=index_path) from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise HeaderError(f"{index_path}: no valid 'weight_map' object", path=index_path)
    folder = os.path.dirname(index_path)
    for shard in sorted(set(wm.values())):
        check_name(folder, shard)
    return wm


def write_index(entries: dict[str, str], total_bytes: int, total_parameters: int | None = None) -> bytes:
    """Encode an HF index as JSON bytes, the keys as transformers' ``save_pretrained`` writes them:
    ``{"metadata": {"total_parameters": P, "total_size": N}, "weight_map": {name: file}}``.

    Args:
        entries: tensor name -> shard file name.
        total_bytes: tensor data bytes over all shards (``total_size``).
        total_parameters: elements of the indexed tensors (``save_pretrained`` writes the model's
            ``num_parameters()``, the same number unless the model has persistent buffers); ``None``
            leaves the key out.
    """
    meta = {"total_parameters": int(total_parameters)} if total_parameters is not None else {}
    meta["total_size"] = int(total_bytes)
    doc = {"metadata": meta, "weight_map": dict(sorted(entries.items()))}
    return json.dumps(doc, indent=2).encode("utf-8")
