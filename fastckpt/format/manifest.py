"""The manifest (``manifest.json``, docs/FORMAT.md): typed, parsed with validation, serialised.

A fastckpt checkpoint is committed iff its folder holds a ``manifest.json`` that :func:`parse`
accepts. This module is the one home of the format: the version constant, the fields, what a
valid value is, and the JSON bytes a writer produces. Reading the file from disk stays in
:mod:`fastckpt.storage.commit` (``read_manifest``), writing it in :mod:`fastckpt.saving.metadata`.

* :class:`Manifest`: the whole document; :class:`FileEntry` per file, :class:`TensorEntry` per
  key path (a stored tensor, an ``alias`` or a ``view``), :class:`TensorChunk` per format-2 chunk,
  :class:`Distributed` for multi-rank saves.
* :func:`parse` (bytes or a dict) raises :class:`~fastckpt.errors.ManifestError` naming the file,
  the key and the value; :meth:`Manifest.to_json` gives the bytes written to disk.
* :class:`RangeCheck`: one checksummed range of a file (a small file, a safetensors header, a
  tensor, or one chunk of a tensor): :meth:`Manifest.checks` lists them for readers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..errors import ManifestError, ManifestVersionError

#: ``"format"`` of every manifest.
FORMAT_NAME = "fastckpt"
#: Newest ``format_version`` this library reads and writes. A manifest records the lowest version
#: that describes it: 2 only when a tensor has per-chunk checksums (``chunks``), else 1, so
#: version-1 readers keep reading every checkpoint without chunks (docs/FORMAT.md).
FORMAT_VERSION = 2
#: ``"checksum"``: the hash of every ``xxh3`` field (xxh3-64, lowercase hex).
CHECKSUM = "xxh3_64"

#: An element box of a tensor: ``(offsets, shape)``, one int per dimension.
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class FileEntry:
    """One file of the checkpoint.

    Attributes:
        bytes: its size in bytes.
        xxh3: xxh3-64 hex of the whole file (small files: JSON, extra files), or ``None``.
        header_bytes: length of a safetensors file's header (8-byte length + JSON + padding), or ``None``.
        header_xxh3: xxh3-64 hex of those header bytes, or ``None``.
    """

    bytes: int
    xxh3: str | None = None
    header_bytes: int | None = None
    header_xxh3: str | None = None


@dataclass
class TensorChunk:
    """A format-2 chunk of a tensor written in pieces by several ranks.

    Attributes:
        offsets: global element index of the chunk's first element, one int per dimension.
        shape: the chunk's shape.
        xxh3: xxh3-64 hex of the chunk's elements in row-major order (``full[box].contiguous()``).
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    xxh3: str

    @property
    def box(self) -> Box:
        """``(offsets, shape)``."""
        return self.offsets, self.shape


@dataclass
class TensorEntry:
    """The manifest entry of one key path: exactly one of a stored tensor (``file`` set), an
    ``alias`` of another key path, or a ``view`` into a stored ``%storage/N`` byte blob.

    Attributes:
        file, name: the safetensors file and the tensor's name in it (stored tensors).
        dtype: safetensors dtype string (stored tensors and views).
        shape: shape in elements (stored tensors and views).
        offsets: absolute byte range ``[start, end)`` in ``file`` (stored tensors).
        xxh3: xxh3-64 hex of the whole tensor's bytes, or ``None`` when ``chunks`` are given.
        chunks: format-2 per-chunk checksums that tile the tensor, sorted by offsets (else ``None``).
        placement: informational ``{"mesh_shape", "placements"}`` of a DTensor (else ``None``).
        alias: key path this one is an identical view of (else ``None``).
        view: key path of the byte blob this one views (else ``None``); ``offset`` (bytes into
            the blob) and ``stride`` (elements) with it.
        ndarray: the value was a NumPy array (stored as a tensor of the same dtype).
    """

    file: str | None = None
    name: str | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    offsets: tuple[int, int] | None = None
    xxh3: str | None = None
    chunks: list[TensorChunk] | None = None
    placement: dict | None = None
    alias: str | None = None
    view: str | None = None
    offset: int | None = None
    stride: tuple[int, ...] | None = None
    ndarray: bool = False

    @property
    def stored(self) -> bool:
        """True for a tensor stored under its own key (``file`` set)."""
        return self.file is not None

    @property
    def target(self) -> str | None:
        """The key path whose bytes this entry reads (``alias`` or ``view``), ``None`` if stored."""
        return self.alias or self.view

    def to_dict(self) -> dict:
        """The entry as written in ``manifest.json`` (field order as the writers produce it)."""
        if self.alias is not None:
            d: dict[str, Any] = {"alias": self.alias}
        elif self.view is not None:
            d = {"view": self.view, "offset": self.offset, "dtype": self.dtype, "shape": list(self.shape or ()),
                 "stride": list(self.stride or ())}
        else:
            d = {"file": self.file, "name": self.name, "dtype": self.dtype, "shape": list(self.shape or ()),
                 "offsets": list(self.offsets or ())}
            if self.xxh3 is not None:
                d["xxh3"] = self.xxh3
        if self.ndarray:
            d["ndarray"] = True
        if self.chunks is not None:
            d["chunks"] = [{"offsets": list(c.offsets), "shape": list(c.shape), "xxh3": c.xxh3} for c in self.chunks]
        if self.placement is not None:
            d["placement"] = self.placement
        return d


@dataclass
class Distributed:
    """The ``distributed`` section of a multi-rank save (docs/FORMAT.md, "Multi-rank").

    Attributes:
        mode: ``"rename"`` or ``"marker"``.
        node: this node's name (marker mode), else ``None``. nodes: every node of the save.
        written_by: file name -> ranks that wrote bytes of it.
        bytes_by_rank: rank -> bytes it wrote.
        rank_local_keys: top-level keys saved rank-locally (``local_keys``).
        rank_local_skeletons: rank -> its ``state-rank*.json`` file.
        planner: ``"dcp"`` for DTensor saves (DCP's planner decided the writes), else ``None``.
    """

    mode: str = "rename"
    node: str | None = None
    nodes: list[str] = field(default_factory=list)
    written_by: dict[str, list[int]] = field(default_factory=dict)
    bytes_by_rank: dict[int, int] = field(default_factory=dict)
    rank_local_keys: list[str] = field(default_factory=list)
    rank_local_skeletons: dict[int, str] = field(default_factory=dict)
    planner: str | None = None

    def to_dict(self) -> dict:
        """The section as written in ``manifest.json``."""
        d: dict[str, Any] = {
            "mode": self.mode, "node": self.node, "nodes": list(self.nodes),
            "written_by": {k: list(v) for k, v in self.written_by.items()},
            "bytes_by_rank": {str(r): b for r, b in self.bytes_by_rank.items()},
            "rank_local": {"keys": list(self.rank_local_keys),
                           "skeletons": {str(r): n for r, n in self.rank_local_skeletons.items()}}}
        if self.planner is not None:
            d["planner"] = self.planner
        return d


@dataclass(frozen=True)
class RangeCheck:
    """One checksummed range of a checkpoint file: its bytes must hash to ``xxh3`` (xxh3-64 hex).

    The whole file, a safetensors header or a whole tensor is the byte range ``[start, end)``
    (``box`` is ``None``). A format-2 chunk is the element box ``box`` of the tensor stored at
    ``[start, end)`` (shape ``shape``, dtype ``dtype``): its elements in row-major order hash to
    ``xxh3`` (one byte range when the box is a run of whole rows, several otherwise).

    Attributes:
        what: names the range in messages (``"tensor 'model/w' chunk at offsets [4, 0]"``).
        file: the file name as the manifest lists it.
        start, end: absolute byte range in ``file`` (of the whole tensor for a chunk).
        xxh3: the checksum.
        key: the tensor's key path (``None`` for files and headers).
        box: the chunk's element box, or ``None``.
        shape, dtype: the whole tensor's shape and dtype string (``None`` for files and headers).
    """

    what: str
    file: str
    start: int
    end: int
    xxh3: str
    key: str | None = None
    box: Box | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def elements(self) -> Box:
        """The element box this check covers: ``box``, or the whole tensor's box when ``box`` is ``None``.

        Raises:
            ValueError: a file or header range (no ``shape``).
        """
        if self.box is not None:
            return self.box
        if self.shape is None:
            raise ValueError(f"{self.what}: a byte range of {self.file!r}, not a tensor's elements")
        return (0,) * len(self.shape), tuple(self.shape)


@dataclass
class Manifest:
    """A parsed ``manifest.json`` (docs/FORMAT.md).

    Attributes:
        files: file name -> :class:`FileEntry` (every file but the manifest itself).
        tensors: key path -> :class:`TensorEntry`.
        step: training step of the save, or ``None``.
        world_size: ranks of the save (1: one process).
        metadata: the save's ``metadata`` option (``str -> str``) or ``None``.
        weights: top-level key -> file stem of each weights group (``{"model": "model"}``).
        created_unix_s: commit time (seconds since the epoch), ``None`` in manifests that lack it.
        distributed: the multi-rank section, or ``None``.
        format_version: the version read from the file; ``None`` for a manifest being written
            (then :attr:`version` derives it: 2 with chunks, else 1).
        bytes_total: sum of the files' sizes (derived when ``None``).
    """

    files: dict[str, FileEntry] = field(default_factory=dict)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    step: int | None = None
    world_size: int = 1
    metadata: dict[str, str] | None = None
    weights: dict[str, str] = field(default_factory=lambda: {"model": "model"})
    created_unix_s: float | None = None
    distributed: Distributed | None = None
    format_version: int | None = None
    bytes_total: int | None = None

    @property
    def version(self) -> int:
        """``format_version`` as read, or the lowest version that describes this manifest."""
        if self.format_version is not None:
            return self.format_version
        return FORMAT_VERSION if any(e.chunks is not None for e in self.tensors.values()) else 1

    def to_dict(self) -> dict:
        """The document as written in ``manifest.json`` (key order as fastckpt writes it)."""
        d: dict[str, Any] = {"format": FORMAT_NAME, "format_version": self.version, "checksum": CHECKSUM}
        if self.created_unix_s is not None:
            d["created_unix_s"] = self.created_unix_s
        d.update({"step": self.step, "world_size": self.world_size, "metadata": self.metadata,
                  "weights": self.weights,
                  "bytes_total": self.bytes_total if self.bytes_total is not None
                  else sum(f.bytes for f in self.files.values()),
                  "files": {n: _file_dict(f) for n, f in self.files.items()},
                  "tensors": {k: e.to_dict() for k, e in self.tensors.items()}})
        if self.distributed is not None:
            d["distributed"] = self.distributed.to_dict()
        return d

    def to_json(self) -> bytes:
        """The bytes of ``manifest.json`` (``json.dumps(..., indent=1)``, UTF-8)."""
        return json.dumps(self.to_dict(), indent=1).encode()

    def resolve(self, key: str) -> tuple[str, TensorEntry]:
        """``(key, entry)`` of the entry whose bytes ``key`` reads: aliases followed (views are not).

        Raises:
            KeyError: ``key`` (or an alias target) is not in :attr:`tensors`.
        """
        e = self.tensors[key]
        seen = {key}
        while e.alias is not None:
            key, e = e.alias, self.tensors[e.alias]
            if key in seen:  # parse refuses cycles; a hand-built manifest may not
                raise KeyError(f"alias cycle at {key!r}")
            seen.add(key)
        return key, e

    def checks(self, file: str | None = None) -> Iterator[RangeCheck]:
        """Every checksummed range the manifest lists (of ``file`` only when given): whole small
        files, safetensors headers, whole tensors and format-2 chunks, in manifest order."""
        for name, f in self.files.items():
            if file is not None and name != file:
                continue
            if f.xxh3 is not None:
                yield RangeCheck(f"file {name!r}", name, 0, f.bytes, f.xxh3)
            if f.header_xxh3 is not None and f.header_bytes is not None:
                yield RangeCheck(f"header of {name!r}", name, 0, f.header_bytes, f.header_xxh3)
        for key, e in self.tensors.items():
            if not e.stored or (file is not None and e.file != file):
                continue
            assert e.file is not None and e.offsets is not None and e.shape is not None
            if e.xxh3 is not None:
                yield RangeCheck(f"tensor {key!r}", e.file, e.offsets[0], e.offsets[1], e.xxh3, key, None,
                                 e.shape, e.dtype)
            for c in e.chunks or ():
                yield RangeCheck(f"tensor {key!r} chunk at offsets {list(c.offsets)} of shape {list(c.shape)}",
                                 e.file, e.offsets[0], e.offsets[1], c.xxh3, key, c.box, e.shape, e.dtype)


def _file_dict(f: FileEntry) -> dict:
    d: dict[str, Any] = {"bytes": f.bytes}
    if f.header_bytes is not None:
        d["header_bytes"] = f.header_bytes
    if f.header_xxh3 is not None:
        d["header_xxh3"] = f.header_xxh3
    if f.xxh3 is not None:
        d["xxh3"] = f.xxh3
    return d


# ---------------------------------------------------------------- parsing


class _Parser:
    """Validating reader of one manifest document; every refusal names ``path``, the key and the value."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, key: str, value: Any, want: str, tensor: str | None = None) -> ManifestError:
        shown = repr(value)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        return ManifestError(
            f"{self.path}: manifest key {key!r} is {shown}, expected {want}; the manifest is damaged or not "
            "written by fastckpt: run `fastckpt verify` on the checkpoint, restore it from a copy or save it again",
            path=self.path, key=key, value=value, tensor=tensor)

    def get(self, d: dict, name: str, where: str, want: str, ok, *, optional: bool = False,
            tensor: str | None = None) -> Any:
        key = f"{where}.{name}" if where else name
        if name not in d:
            if optional:
                return None
            raise self.fail(key, None, want + " (missing)", tensor)
        v = d[name]
        if optional and v is None:
            return None
        if not ok(v):
            raise self.fail(key, v, want, tensor)
        return v

    def ints(self, d: dict, name: str, where: str, *, n: int | None = None, tensor: str | None = None,
             optional: bool = False) -> tuple[int, ...] | None:
        want = "a list of non-negative integers" + (f" of length {n}" if n is not None else "")
        v = self.get(d, name, where, want, lambda x: isinstance(x, list) and all(_nat(i) for i in x)
                     and (n is None or len(x) == n), optional=optional, tensor=tensor)
        return None if v is None else tuple(v)

    def manifest(self, m: Any) -> Manifest:
        if not isinstance(m, dict):
            raise ManifestError(f"{self.path}: the manifest is a JSON {type(m).__name__}, not an object; it is not a "
                                "fastckpt manifest: restore the checkpoint from a copy or save it again",
                                path=self.path, key="", value=m)
        if m.get("format") != FORMAT_NAME:
            raise self.fail("format", m.get("format"), f"{FORMAT_NAME!r} (not a fastckpt manifest)")
        version = m.get("format_version")
        if not _nat(version) or version < 1:
            raise self.fail("format_version", version, f"an integer from 1 to {FORMAT_VERSION}")
        if version > FORMAT_VERSION:
            raise ManifestVersionError(
                f"{self.path}: format_version {version} is newer than this fastckpt understands "
                f"(it reads 1 to {FORMAT_VERSION}); upgrade fastckpt to read this checkpoint",
                path=self.path, key="format_version", value=version)
        self.get(m, "checksum", "", f"{CHECKSUM!r}", lambda x: x == CHECKSUM, optional=True)
        files = self.get(m, "files", "", "an object (file name -> entry)", lambda x: isinstance(x, dict))
        tensors = self.get(m, "tensors", "", "an object (key path -> entry)", lambda x: isinstance(x, dict))
        out = Manifest(
            files={n: self.file(n, f) for n, f in files.items()},
            tensors={k: self.tensor(k, e) for k, e in tensors.items()},
            step=self.get(m, "step", "", "an integer or null", _integer, optional=True),
            world_size=self.get(m, "world_size", "", "a positive integer", lambda x: _nat(x) and x >= 1,
                                optional=True) or 1,
            metadata=self.get(m, "metadata", "", "an object of strings or null", _str_map, optional=True),
            weights=self.get(m, "weights", "", "an object of strings", _str_map, optional=True) or {"model": "model"},
            created_unix_s=self.get(m, "created_unix_s", "", "a number (seconds since the epoch)", _num,
                                    optional=True),
            format_version=version,
            bytes_total=self.get(m, "bytes_total", "", "a non-negative integer", _nat, optional=True))
        for k, e in out.tensors.items():
            if e.target is not None:
                self.target(out, k, e)
        if m.get("distributed") is not None:
            out.distributed = self.distributed(m["distributed"])
        return out

    def file(self, name: str, f: Any) -> FileEntry:
        where = f"files[{name!r}]"
        if not isinstance(f, dict):
            raise self.fail(where, f, "an object with 'bytes'")
        return FileEntry(bytes=self.get(f, "bytes", where, "a non-negative integer", _nat),
                         xxh3=self.get(f, "xxh3", where, "an xxh3 hex string", _is_digest, optional=True),
                         header_bytes=self.get(f, "header_bytes", where, "a non-negative integer", _nat, optional=True),
                         header_xxh3=self.get(f, "header_xxh3", where, "an xxh3 hex string", _is_digest, optional=True))

    def tensor(self, key: str, e: Any) -> TensorEntry:
        where = f"tensors[{key!r}]"
        if not isinstance(e, dict):
            raise self.fail(where, e, "an object (a stored tensor, an 'alias' or a 'view')", key)
        nd = bool(self.get(e, "ndarray", where, "true or false", lambda x: isinstance(x, bool), optional=True))
        if "alias" in e:
            return TensorEntry(alias=self.get(e, "alias", where, "a key path", _str, tensor=key), ndarray=nd)
        if "view" in e:
            shape = self.ints(e, "shape", where, tensor=key)
            assert shape is not None
            return TensorEntry(view=self.get(e, "view", where, "a key path", _str, tensor=key),
                               offset=self.get(e, "offset", where, "a non-negative integer", _nat, tensor=key),
                               dtype=self.get(e, "dtype", where, "a dtype string", _str, tensor=key), shape=shape,
                               stride=self.ints(e, "stride", where, n=len(shape), tensor=key), ndarray=nd)
        te = TensorEntry(file=self.get(e, "file", where, "a file name", _str, tensor=key),
                         name=self.get(e, "name", where, "a tensor name", _str, tensor=key),
                         dtype=self.get(e, "dtype", where, "a dtype string", _str, tensor=key),
                         shape=self.ints(e, "shape", where, tensor=key),
                         offsets=self.ints(e, "offsets", where, n=2, tensor=key),  # type: ignore[arg-type]
                         xxh3=self.get(e, "xxh3", where, "an xxh3 hex string", _is_digest, optional=True, tensor=key),
                         placement=self.get(e, "placement", where, "an object", lambda x: isinstance(x, dict),
                                            optional=True, tensor=key),
                         ndarray=nd)
        assert te.offsets is not None and te.shape is not None
        if te.offsets[0] > te.offsets[1]:
            raise self.fail(f"{where}.offsets", list(te.offsets), "[start, end] with start <= end", key)
        if "chunks" in e:
            te.chunks = self.chunks(key, e["chunks"], te.shape, f"{where}.chunks")
        if te.xxh3 is None and te.chunks is None:
            raise self.fail(f"{where}.xxh3", None, "an xxh3 hex string, or 'chunks' (missing both)", key)
        return te

    def chunks(self, key: str, cs: Any, shape: tuple[int, ...], where: str) -> list[TensorChunk]:
        if not isinstance(cs, list):
            raise self.fail(where, cs, "a list of chunks", key)
        out = []
        for i, c in enumerate(cs):
            w = f"{where}[{i}]"
            if not isinstance(c, dict):
                raise self.fail(w, c, "an object with 'offsets', 'shape', 'xxh3'", key)
            ch = TensorChunk(self.ints(c, "offsets", w, n=len(shape), tensor=key),  # type: ignore[arg-type]
                       self.ints(c, "shape", w, n=len(shape), tensor=key),  # type: ignore[arg-type]
                       self.get(c, "xxh3", w, "an xxh3 hex string", _is_digest, tensor=key))
            if any(o + n > m for o, n, m in zip(ch.offsets, ch.shape, shape)):
                raise self.fail(w, c, f"a chunk inside the tensor's shape {list(shape)}", key)
            out.append(ch)
        total = sum(math.prod(c.shape) for c in out)
        if total != math.prod(shape):
            raise self.fail(where, f"{len(out)} chunks of {total} elements",
                            f"chunks that tile the tensor of shape {list(shape)} ({math.prod(shape)} elements)", key)
        for i, a in enumerate(out):
            for b in out[i + 1:]:
                if _boxes_overlap(a.box, b.box):
                    raise self.fail(where, f"chunks at offsets {list(a.offsets)} and {list(b.offsets)} overlap",
                                    "chunks that do not overlap", key)
        return out

    def target(self, m: Manifest, key: str, e: TensorEntry) -> None:
        seen = {key}
        k, cur = key, e
        while cur.target is not None:
            k = cur.target
            nxt = m.tensors.get(k)
            if nxt is None or k in seen:
                what = "alias" if cur.alias is not None else "view"
                raise self.fail(f"tensors[{key!r}].{what}", k, "the key path of another tensor entry "
                                + ("(not a cycle)" if nxt is not None else "(no such entry)"), key)
            seen.add(k)
            cur = nxt

    def distributed(self, d: Any) -> Distributed:
        w = "distributed"
        if not isinstance(d, dict):
            raise self.fail(w, d, "an object")
        rl = self.get(d, "rank_local", w, "an object", lambda x: isinstance(x, dict), optional=True) or {}
        # a pre-release folder may hold an empty "shards" (format-1 Shard values, removed): ignored
        self.get(d, "shards", w, "an empty object (format-1 Shard values are no longer read: save the state "
                 "again with DTensors)", lambda x: x == {}, optional=True)
        return Distributed(
            mode=self.get(d, "mode", w, "'rename' or 'marker'", lambda x: x in ("rename", "marker")),
            node=self.get(d, "node", w, "a string or null", _str, optional=True),
            nodes=self.get(d, "nodes", w, "a list of strings", lambda x: isinstance(x, list) and all(map(_str, x)),
                           optional=True) or [],
            written_by=self.get(d, "written_by", w, "an object (file -> list of ranks)",
                                lambda x: isinstance(x, dict) and all(isinstance(v, list) and all(map(_nat, v))
                                                                      for v in x.values()), optional=True) or {},
            bytes_by_rank={int(r): b for r, b in (self.get(
                d, "bytes_by_rank", w, "an object (rank -> bytes)",
                lambda x: isinstance(x, dict) and all(_rank(r) and _nat(b) for r, b in x.items()),
                optional=True) or {}).items()},
            rank_local_keys=self.get(rl, "keys", f"{w}.rank_local", "a list of strings",
                                     lambda x: isinstance(x, list) and all(map(_str, x)), optional=True) or [],
            rank_local_skeletons={int(r): n for r, n in (self.get(
                rl, "skeletons", f"{w}.rank_local", "an object (rank -> file name)",
                lambda x: isinstance(x, dict) and all(_rank(r) and _str(n) for r, n in x.items()),
                optional=True) or {}).items()},
            planner=self.get(d, "planner", w, "a string", _str, optional=True))


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nat(x: Any) -> bool:
    return _integer(x) and x >= 0


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _str(x: Any) -> bool:
    return isinstance(x, str)


def _is_digest(x: Any) -> bool:
    return isinstance(x, str)


def _rank(x: Any) -> bool:
    return isinstance(x, str) and x.isdigit()


def _str_map(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in x.items())


def _boxes_overlap(a: Box, b: Box) -> bool:
    return all(max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1])) \
        and math.prod(a[1]) > 0 and math.prod(b[1]) > 0


def parse(data: bytes | str | dict, path: str = "manifest.json") -> Manifest:
    """Parse and validate a manifest.

    Args:
        data: the bytes of ``manifest.json`` (UTF-8 JSON), or the document already decoded.
        path: the manifest's path, named in every error.

    Returns:
        The :class:`Manifest`.

    Raises:
        ManifestVersionError: ``format_version`` is newer than :data:`FORMAT_VERSION` (upgrade fastckpt).
        ManifestError: not JSON, not a fastckpt manifest, or a field that is missing or malformed
            (names the key and the value), including format-2 chunks that do not tile their tensor
            and an ``alias`` / ``view`` naming no entry.
    """
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        try:
            doc = json.loads(bytes(data).decode("utf-8") if not isinstance(data, str) else data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ManifestError(f"{path}: manifest is not valid JSON: {e}; the manifest is damaged: restore the "
                                "checkpoint from a copy or save it again", path=path) from None
    else:
        doc = data
    return _Parser(path).manifest(doc)


def parse_distributed(section: dict, path: str = "manifest.json") -> Distributed:
    """Parse and validate a ``distributed`` section given as its JSON object (see :func:`parse`).

    Raises:
        ManifestError: a missing or malformed field (names the key and the value).
    """
    return _Parser(path).distributed(section)
