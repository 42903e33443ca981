"""The differential harness of reference equivalence (issue 20, item 1).

:func:`diff_folders` compares a folder the reference writer wrote (``save_pretrained`` of
transformers or peft, ``merge_and_unload().save_pretrained()``) with the folder fastckpt wrote for
the same model, file by file, sub-folders included:

* same file names, except fastckpt's own files listed in
  :data:`fastckpt.format.layout.REFERENCE_ADDITIONS` (the one list README.md and docs/FORMAT.md
  quote; for a peft checkpoint also ``PEFT_BASE_ADDITIONS``, the base model);
* ``*.safetensors``: same tensor names, dtypes, shapes and raw bytes, same ``__metadata__``
  (both read with the ``safetensors`` package's ``safe_open``);
* ``*.json``: equal once parsed (key order and indentation may differ);
* any other file (peft's ``README.md``): the same bytes.

It returns every difference as a sentence, so a failing test names them all.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import torch
from safetensors import safe_open

from fastckpt.format.layout import REFERENCE_ADDITIONS


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def is_addition(name: str, additions=REFERENCE_ADDITIONS) -> bool:
    """True when ``name`` (``/``-separated, relative to the folder) matches a pattern of ``additions``."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in additions)


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _diff_safetensors(ref: Path, ours: Path, name: str) -> list[str]:
    out = []
    with safe_open(str(ref), "pt") as a, safe_open(str(ours), "pt") as b:
        ka, kb = set(a.keys()), set(b.keys())
        if ka - kb:
            out.append(f"{name}: tensors only the reference writes: {sorted(ka - kb)}")
        if kb - ka:
            out.append(f"{name}: tensors only fastckpt writes: {sorted(kb - ka)}")
        if (a.metadata() or {}) != (b.metadata() or {}):
            out.append(f"{name}: __metadata__ {a.metadata()} (reference) != {b.metadata()} (fastckpt)")
        for k in sorted(ka & kb):
            x, y = a.get_tensor(k), b.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape:
                out.append(f"{name}: {k}: {x.dtype}{list(x.shape)} (reference) != {y.dtype}{list(y.shape)} (fastckpt)")
            elif _raw(x) != _raw(y):
                out.append(f"{name}: {k}: same dtype and shape, different bytes")
    return out


def diff_folders(ref: str | Path, ours: str | Path, additions: dict[str, str] = REFERENCE_ADDITIONS,
                 replaced: dict[str, str] | None = None) -> list[str]:
    """Every difference between the reference folder ``ref`` and fastckpt's folder ``ours``.

    Args:
        additions: the files ``ours`` may hold besides ``ref``'s (``fnmatch`` patterns): fastckpt's
            own, plus, for a peft checkpoint, :data:`~fastckpt.format.layout.PEFT_BASE_ADDITIONS`.
        replaced: files of ``ref`` that ``ours`` holds in another form (``fnmatch`` patterns):
            for the Trainer's own checkpoint, :data:`~fastckpt.format.layout.REFERENCE_REPLACED`.

    Returns:
        Sentences naming the file (and tensor or JSON key); empty when ``ours`` is ``ref`` plus
        only :data:`~fastckpt.format.layout.REFERENCE_ADDITIONS`.
    """
    ref, ours = Path(ref), Path(ours)
    fa, fb = _files(ref), _files(ours)
    out = [f"{n}: written by the reference writer, missing from fastckpt's folder" for n in sorted(fa - fb)
           if not is_addition(n, replaced or {})]
    out += [f"{n}: written by fastckpt only, and not a documented addition (REFERENCE_ADDITIONS)"
            for n in sorted(fb - fa) if not is_addition(n, additions)]
    for n in sorted(fa & fb):
        a, b = ref / n, ours / n
        if n.endswith(".safetensors"):
            out += _diff_safetensors(a, b, n)
        elif n.endswith(".json"):
            ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
            if ja != jb:
                if isinstance(ja, dict) and isinstance(jb, dict):
                    keys = sorted(k for k in set(ja) | set(jb) if ja.get(k, "<absent>") != jb.get(k, "<absent>"))
                    out += [f"{n}: {k!r}: {ja.get(k, '<absent>')!r} (reference) != {jb.get(k, '<absent>')!r} "
                            "(fastckpt)" for k in keys]
                else:
                    out.append(f"{n}: JSON differs")
        elif a.read_bytes() != b.read_bytes():
            out.append(f"{n}: bytes differ")
    return out
