"""Values a multi-rank save stores once must be equal on every rank: compared through the store.

A multi-rank save (a state holding DTensors, or ``process_group=``) stores each value that is not a
DTensor or under ``local_keys`` once: it is *replicated*, taken as equal
on every rank. A value that differs between ranks (each rank's RNG state, a per-rank counter, a
per-rank data-loader position) would be taken from whichever rank writes it, silently. So every
rank digests its replicated values and the ranks compare the digests in the save's first store
exchange, before any file exists:

* JSON leaves of the state (ints, floats, strings, ...): a SHA-256 of each leaf of the small JSON
  skeleton the save builds anyway;
* plain tensors and NumPy arrays: xxh3-64 of their bytes (see the callers for which ones: the
  DTensor route hashes every plain tensor from its staging copy; ``process_group=`` saves hash
  those of at most :data:`CHECK_BYTES` at the call, see docs/DISTRIBUTED.md).

One combined digest per rank travels with the exchange the save makes anyway; only when two ranks'
digests differ, a second exchange of the per-key digests names the keys and the ranks, and every
rank raises :class:`~fastckpt.errors.RankValuesDifferError` (the same on every rank).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
import xxhash

from ..coordination import Session
from ..errors import RankValuesDifferError
from ..format.tree import join

#: ``process_group=`` saves compare replicated tensors of at most this many bytes on every rank at the
#: call (RNG states: 5 KiB; counters: bytes). Larger ones (model weights, optimizer moments, which DDP
#: keeps equal) are not hashed on every rank: that would be a second pass over the whole state.
CHECK_BYTES = 1 << 20

_SCALAR_TAGS = ("__float__", "__dtype__", "__np__", "__bytes__", "__device__", "__path__")


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def json_leaves(skeleton: Any) -> dict[str, str]:
    """``{key path: digest}`` of every non-array leaf of a JSON skeleton (:func:`fastckpt.format.tree.flatten`);
    empty containers are leaves too. Tensor and array references are left out (compared by their bytes)."""
    out: dict[str, str] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, join(path, i))
            if not v:
                out[path] = _short("[]")
            return
        if not isinstance(v, dict):
            out[path] = _short(json.dumps(v, sort_keys=True))
            return
        if "__tensor__" in v or "__ndarray__" in v:
            return
        if any(t in v for t in _SCALAR_TAGS):
            out[path] = _short(json.dumps(v, sort_keys=True))
            return
        if "__tuple__" in v:
            items = list(enumerate(v["__tuple__"]))
        elif "__dict__" in v:
            items = [(k, x) for k, x in v["__dict__"]]
        else:
            items = list(v.items())
        for k, x in items:
            walk(x, join(path, k))
        if not items:
            out[path] = _short(json.dumps(v, sort_keys=True))
    walk(skeleton, "")
    return out


def array_digest(v: Any) -> str:
    """xxh3-64 of the bytes of a tensor (any device, any strides) or NumPy array, with its dtype and shape."""
    if isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        data, kind = a.reshape(-1).view(np.uint8), f"{a.dtype.str}{list(a.shape)}"
    else:
        t = v.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        kind = f"{t.dtype}{list(t.shape)}"
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return f"{xxhash.xxh3_64(data).hexdigest()}:{kind}"


def combined(digests: dict[str, str]) -> str:
    """One digest of a rank's ``{key path: digest}``."""
    return _short(json.dumps(sorted(digests.items())))


def differing(per_rank: list[dict[str, str]]) -> dict[str, list[list[int]]]:
    """Key paths whose digest is not the same on every rank -> the ranks grouped by equal value (rank
    order of first appearance: the first group holds rank 0)."""
    keys = sorted({k for d in per_rank for k in d})
    out: dict[str, list[list[int]]] = {}
    for k in keys:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(per_rank):
            groups.setdefault(d.get(k, "<missing>"), []).append(r)
        if len(groups) > 1:
            out[k] = list(groups.values())
    return out


def refusal(path: Any, diff: dict[str, list[list[int]]]) -> RankValuesDifferError:
    """The :class:`~fastckpt.errors.RankValuesDifferError` naming each key of ``diff`` and its rank groups."""
    shown = list(diff.items())[:8]
    lines = "; ".join(f"{k!r}: ranks " + " | ".join(str(g) for g in groups) for k, groups in shown)
    more = f" (and {len(diff) - len(shown)} more keys)" if len(diff) > len(shown) else ""
    tops = sorted({k.split("/", 1)[0] for k in diff})
    failures: dict[int, list[str]] = {}
    for k, groups in diff.items():
        for g in groups[1:]:
            for r in g:
                failures.setdefault(r, []).append(k)
    return RankValuesDifferError(
        f"multi-rank save of {path} refused: values stored once (not DTensors, not under local_keys) differ "
        f"between ranks, so one rank's would be kept and the others' silently dropped: {lines}{more}. Pass "
        f"local_keys={tuple(tops)!r} to save them per rank (fastckpt.load_into restores each rank's own), or make "
        "them equal on every rank. Nothing was written",
        diff, {r: f"differs from rank 0 at {ks[:8]}" for r, ks in sorted(failures.items())})


def check_agreement(sess: Session, digests: dict[str, str], combos: list[str], path: Any, what: str) -> None:
    """Every rank, after an exchange that carried each rank's :func:`combined` digest (``combos``, rank
    order): return when all are equal; else exchange the per-key ``digests`` and raise.

    Raises:
        RankValuesDifferError: on every rank, naming the keys and the ranks (nothing written yet).
        DistributedSaveError: a rank did not arrive for the second exchange within the session's timeout.
    """
    if len(set(combos)) <= 1:
        return
    per_rank = sess.all_gather("values-by-key", digests, what)
    diff = differing(per_rank)
    if not diff:  # the combined digests differed but no key did: cannot happen unless a rank lied
        diff = {"<state>": [[r for r, c in enumerate(combos) if c == combos[0]],
                            [r for r, c in enumerate(combos) if c != combos[0]]]}
    raise refusal(path, diff)
