"""Unchanged files are hard-linked from the previous committed checkpoint instead of rewritten.

A LoRA run snapshots the whole model every save, but the frozen base weights never change:
rewriting them is most of the bytes and most of the time. When a save is given
``link_from=<previous committed checkpoint>``, each planned safetensors file whose bytes would
be identical to the file of the same name there (same header bytes, same xxh3-64 of every
tensor, same size) is hard-linked into the new checkpoint instead of written. The new folder is
still complete and self-contained (a hard link is the same file under another name; deleting
the old checkpoint leaves it intact) and is committed the same way. Where links are impossible
(another file system, EXDEV/EPERM), the file is written as usual.

This module is pure decision logic plus one ``os.link``; the saver calls it.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import torch
import xxhash

from ..storage.commit import read_manifest_shared
from ..storage.store import LOCAL
from ..errors import CorruptCheckpointError, LinkedTensorChangedError
from ..format.layout import FilePlan
from ..format.manifest import Manifest

logger = logging.getLogger(__name__)


def previous_manifest(link_from: str | os.PathLike | None) -> Manifest | None:
    """The manifest of ``link_from`` if it is a committed checkpoint, else ``None`` (never raises: the
    save writes every file then, and a WARNING says why nothing was linked)."""
    if link_from is None:
        return None
    try:
        return read_manifest_shared(os.fspath(link_from))
    except (OSError, CorruptCheckpointError) as e:
        logger.warning("fastckpt: link_from=%s is not a committed checkpoint (%s): nothing hard-linked, every file "
                       "written", os.fspath(link_from), e)
        return None


def candidate_files(files: tuple[FilePlan, ...], prev: Manifest | None) -> set[str]:
    """Files whose name, size and header bytes match the previous checkpoint (hashes still to check)."""
    if prev is None:
        return set()
    out = set()
    for f in files:
        info = prev.files.get(f.name)
        if info is None or info.bytes != f.size or info.header_bytes != len(f.prefix):
            continue
        if info.header_xxh3 == xxhash.xxh3_64(f.prefix).hexdigest():
            out.add(f.name)
    return out


def identical(f: FilePlan, hashes: dict[str, str], prev: Manifest) -> bool:
    """True when every tensor of ``f`` has the same xxh3 as the same-named entry in ``prev``."""
    tensors = prev.tensors
    for t in f.tensors:
        old = tensors.get(t.spec.key)
        if old is None or old.file != f.name or old.xxh3 is None or old.xxh3 != hashes.get(t.spec.key) \
                or old.offsets != (t.file_offset, t.file_offset + t.spec.nbytes):
            return False
    return True


def link_file(prev_dir: str | os.PathLike, tmp_dir: str, name: str) -> bool:
    """Hard-link ``prev_dir/name`` to ``tmp_dir/name``; False where the file system refuses links."""
    try:
        return LOCAL.link(LOCAL.join(os.fspath(prev_dir), name), LOCAL.join(tmp_dir, name))
    except FileNotFoundError:
        return False


def source_hash(t) -> str | None:
    """xxh3-64 (hex) of a contiguous CPU tensor's bytes, as the saver would compute it; ``None``
    for device or non-contiguous tensors (those are staged and written, never linked)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    if t.numel() == 0:
        return xxhash.xxh3_64(b"").hexdigest()
    return xxhash.xxh3_64(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


#: :meth:`HashCache.lookup` result for a tracked tensor written since its hash was taken.
CHANGED = "changed"


class HashCache:
    """xxh3-64 of CPU tensors seen by earlier saves, valid while their memory is provably unchanged.

    Used by ``link_check="version"``: a later save takes a tensor as unchanged, without hashing
    it at the call, when it is backed by the very same storage object (held by a weak reference,
    so the cache never keeps memory alive and a freed-and-reused address never matches) with the
    same dtype, shape, storage offset and autograd version counter (``Tensor._version``, bumped by
    every in-place op that goes through torch, including optimizer steps under ``no_grad``).
    Writes that bypass the counter (``.data``, NumPy views) are caught by the saver's background
    re-hash before the commit (:class:`fastckpt.errors.LinkedTensorChangedError`).

    One cache belongs to one :class:`fastckpt.saving.saver.Saver`; entries are keyed by key path.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[weakref.ref, tuple, str]] = {}

    @staticmethod
    def ident(t: torch.Tensor) -> tuple[weakref.ref, tuple] | None:
        """``(storage weakref, (dtype, shape, storage_offset, version))`` of a contiguous CPU
        tensor, or ``None`` where it cannot be tracked (device, non-contiguous, inference tensor)."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        try:
            return weakref.ref(t.untyped_storage()), (t.dtype, tuple(t.shape), t.storage_offset(), t._version)
        except (RuntimeError, TypeError):  # inference tensors have no version counter
            return None

    def lookup(self, key: str, t: torch.Tensor) -> str | None:
        """The recorded hash of ``key`` if ``t`` is provably the tensor it was computed from, unchanged;
        :data:`CHANGED` if ``t`` is that tensor but written in place since (version counter moved);
        ``None`` if there is no record for this memory."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        ref, sig, digest = entry
        now = self.ident(t)
        if now is None or ref() is not t.untyped_storage():
            return None
        return digest if now[1] == sig else CHANGED

    def record(self, key: str, ident: tuple[weakref.ref, tuple] | None, digest: str) -> None:
        """Remember ``digest`` (xxh3-64 hex of the bytes at the time ``ident`` was taken)."""
        if ident is None:
            self.forget(key)
        else:
            self._entries[key] = (ident[0], ident[1], digest)

    def forget(self, key: str) -> None:
        """Drop the record of ``key`` (proven stale): the next save hashes it again."""
        self._entries.pop(key, None)


class LinkUnchanged:
    """The ``link_from`` half of :class:`~fastckpt.saving.job.SaveJob`: at the call, hard-link the
    files whose bytes equal the previous checkpoint's; in the background, re-hash what was linked on
    its version counter alone (``link_check="version"``) and record hashes for the next save."""

    def link_unchanged(self, col) -> None:
        """Hard-link files whose bytes equal the previous checkpoint's (see :mod:`fastckpt.saving.dedupe`)."""
        sources = col.sources
        prev = previous_manifest(self.cons.link_from)
        cands = candidate_files(self.plan.files, prev)
        for i, f in enumerate(self.plan.files):
            keys = [t.spec.key for t in f.tensors]
            if f.name not in cands or any(k not in sources for k in keys):
                continue  # changed, or another rank's local file
            known: dict[str, str | None] = dict.fromkeys(keys)
            if self.cache is not None:
                if any(k in col.trainable for k in keys) or not any(k in col.frozen for k in keys):
                    continue  # no frozen weights to link, or an optimizer steps them: stage
                for k in keys:
                    if k in col.frozen:
                        known[k] = self.cache.lookup(k, sources[k])
                        self.idents[k] = HashCache.ident(sources[k])
                if CHANGED in known.values():
                    continue  # written in place since the last save: stage it
            todo = [k for k in keys if known[k] is None]  # hashed in parallel: xxhash releases the GIL
            hashes = {**known, **self.batched(todo, lambda k: sources[k].numel() * sources[k].element_size(),
                                              lambda k: source_hash(sources[k]))}
            if identical(f, hashes, prev) and link_file(self.cons.link_from, self.tmp, f.name):
                self.linked.add(i)
                self.hashes.update(hashes)
                self.to_verify += [(k, sources[k], known[k], sources[k]._version) for k in keys if known[k]]

    def start_verify(self) -> None:
        """Background half of ``link_check="version"``, started before the writes (it overlaps
        them): re-hash every tensor linked on its version counter alone."""
        items, self.to_verify = self.to_verify, []

        self.verifying = self.batched(items, lambda it: it[1].numel() * it[1].element_size(), _changed,
                                      wait=False)

    def verify_links(self) -> None:
        """Raise :class:`LinkedTensorChangedError` where :meth:`start_verify` found bytes that
        differ although the version counter did not move (a write that bypassed it)."""
        found, self.verifying = self.verifying, {}
        suspects = [it for it, res in found.items() if res.result()]
        # an in-place op running right now bumps the counter only when it is done: look again
        for pause in (0.001, 0.01, 0.1, 1.0):
            if not suspects:
                break
            time.sleep(pause)
            suspects = [it for it in suspects if _changed(it)]
        bad = [it[0] for it in suspects]
        if bad:
            for k in bad:
                self.cache.forget(k)
            raise LinkedTensorChangedError(
                f"{len(bad)} tensor(s) hard-linked as unchanged from {self.cons.link_from} (same storage "
                f"and version counter as at the last save) have different bytes, e.g. {bad[0]!r}: they "
                "were written without the version counter seeing it (.data, a NumPy view); nothing was "
                "committed; save with link_check='hash'")

    def record_hashes(self) -> None:
        """Give the cache the hash of every tensor this save hashed, for the next save."""
        if self.cache is None:
            return
        for k, ident in self.idents.items():
            h = self.hashes.get(k)
            if isinstance(h, str):
                self.cache.record(k, ident, h)


def _changed(item: tuple) -> bool:
    """True if a ``(key, tensor, xxh3, version at the call)`` item now hashes differently while
    its version counter has not moved."""
    _, t, want, version = item
    return t._version == version and source_hash(t) != want
