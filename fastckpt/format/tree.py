"""Nested state <-> (JSON skeleton, flat table of arrays), exact and unambiguous.

A state is a nested ``dict`` / ``list`` / ``tuple`` of tensors, NumPy arrays and
plain values. :func:`flatten` turns it into a JSON-able skeleton in which every
tensor or array is replaced by a reference to its *key path*, plus the list of
those arrays. :func:`unflatten` is the exact inverse (key types, tuples, NaN/inf,
NumPy scalars, ``torch.dtype`` values all come back as they were).

Key paths join segments with ``/``. In a segment, ``%`` and ``/`` are
percent-encoded; a ``str`` key that looks like a decimal integer has its first
character percent-encoded so that it cannot be confused with an ``int`` key or a
list index. So ``{"a.b": t}`` is ``a.b`` while ``{"a": {"b": t}}`` is ``a/b``,
and ``{0: t}`` is ``0`` while ``{"0": t}`` is ``%30``. See docs/FORMAT.md.
"""

from __future__ import annotations

import base64
import collections
import logging
import math
import pathlib
from typing import Any, Callable

import numpy as np
import torch

from ..errors import CorruptCheckpointError, InvalidArgumentError, UnsupportedValueError

logger = logging.getLogger("fastckpt")
_PLAIN = (bool, int, float, str)  # JSON values as they are
_told: set[type] = set()  # subclasses of plain types already named in a WARNING (once per process)

_TAGS = ("__tensor__", "__ndarray__", "__dict__", "__tuple__", "__float__", "__dtype__",
         "__np__", "__bytes__", "__device__")


def encode_segment(key: str | int) -> str:
    """Encode one dict key or list index as a key-path segment (see module docstring)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    s = key.replace("%", "%25").replace("/", "%2F")
    if s and (s.isdigit() or (s[0] == "-" and s[1:].isdigit())):
        s = "%{:02X}".format(ord(s[0])) + s[1:]
    return s


def join(prefix: str, key: str | int) -> str:
    """Key path of ``key`` under ``prefix`` (``""`` at the root)."""
    seg = encode_segment(key)
    return f"{prefix}/{seg}" if prefix else seg


def path_segments(tree: Any, path: str) -> list:
    """The keys / indices leading to key path ``path`` in ``tree`` (``"t/1"`` -> ``["t", 1]``).

    Raises:
        CorruptCheckpointError: a segment of ``path`` is not in ``tree`` (a tree read back from a
            checkpoint that should hold it).
    """
    out, node = [], tree
    for raw in path.split("/"):
        seg = next((k for k in (node.keys() if isinstance(node, dict) else range(len(node))) if join("", k) == raw),
                   None)
        if seg is None:
            raise CorruptCheckpointError(f"key path {path!r}: {raw!r} not found while reading it back")
        out.append(seg)
        node = node[seg]
    return out


def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"__float__": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def flatten(state: Any, on_array: Callable[[str, Any], None]) -> Any:
    """Return the JSON skeleton of ``state``; call ``on_array(key_path, value)`` per tensor/ndarray.

    Args:
        state: nested dict (``str``/``int`` keys) / list / tuple of ``torch.Tensor``,
            ``numpy.ndarray``, NumPy scalars, ``None``, ``bool``, ``int``, ``float``, ``str``,
            ``bytes``, ``torch.dtype``, ``torch.device``, ``pathlib`` paths (read back as ``pathlib.Path``).
        on_array: callback receiving each tensor or array with its key path.

    Raises:
        UnsupportedValueError: a value or dict key of another type (names its key path).
    """
    return _enc(state, "", on_array)


def _as_plain(v: Any, path: str, plain: Any) -> Any:
    """``plain``: the plain value of ``v``, a subclass of a plain type (``IntEnum``, a ``str``-mixin
    ``Enum``, a ``str`` subclass, ``bytearray``), stored as ``json.dumps`` writes it and read back as
    the plain type: no class named by a checkpoint is ever instantiated on load (DCP's pickle
    restores the class). Said in a WARNING once per class and process, naming a key path."""
    t = type(v)
    if t not in _told:
        _told.add(t)
        logger.warning("fastckpt: state value at key path %r is a %s.%s, stored as its plain %s value %.60r and "
                       "read back as one (fastckpt never instantiates a class named by a checkpoint); convert it "
                       "back after loading (e.g. MyEnum(value)) where the type matters", path or "<root>",
                       t.__module__, t.__qualname__, type(plain).__name__, plain)
    return plain


#: Container classes read back as what they subclass with no WARNING: an OrderedDict (every
#: ``state_dict()``; its order is kept), a Counter (kept as one), ``torch.Size`` (a tuple of ints).
_PLAIN_CONTAINERS = (dict, list, tuple, collections.OrderedDict, collections.Counter, torch.Size)


def tell_plain_container(v: Any, path: str, plain: type) -> None:
    """WARNING, once per class and process, that container ``v`` (a ``defaultdict``, a namedtuple, a
    user's ``dict``/``list`` subclass) is stored as a plain ``plain`` and read back as one: its class
    and what only the class holds (a ``default_factory``, field names) are not stored."""
    t = type(v)
    if t not in _told:
        _told.add(t)
        logger.warning("fastckpt: state value at key path %r is a %s.%s, stored as a plain %s and read back as one "
                       "(its default_factory or field names are lost: fastckpt never instantiates a class named "
                       "by a checkpoint); rebuild it after loading (e.g. defaultdict(int, d), MyTuple(*t)) where "
                       "the type matters", path or "<root>", t.__module__, t.__qualname__, plain.__name__)


def _enc(v: Any, path: str, on_array: Callable[[str, Any], None]) -> Any:
    if type(v) in _PLAIN or v is None:
        return _float(v) if type(v) is float else v
    if isinstance(v, torch.Tensor):
        on_array(path, v)
        return {"__tensor__": path}
    if isinstance(v, np.ndarray):
        on_array(path, v)
        return {"__ndarray__": path}
    if isinstance(v, np.generic):
        return {"__np__": v.dtype.str, "v": _enc(v.item(), path, on_array)}
    if isinstance(v, str):  # subclasses of the plain types (bool has none)
        return _as_plain(v, path, str.__str__(v))
    if isinstance(v, int):
        return _as_plain(v, path, int.__int__(v))
    if isinstance(v, float):
        return _float(_as_plain(v, path, float.__float__(v)))
    if isinstance(v, (dict, list, tuple)) and type(v) not in _PLAIN_CONTAINERS:
        tell_plain_container(v, path, dict if isinstance(v, dict) else list if isinstance(v, list) else tuple)
    if isinstance(v, dict):
        return _enc_dict(v, path, on_array)
    if isinstance(v, list):
        return [_enc(x, join(path, i), on_array) for i, x in enumerate(v)]
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x, join(path, i), on_array) for i, x in enumerate(v)]}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).replace("torch.", "")}
    if isinstance(v, torch.device):
        return {"__device__": str(v)}
    if isinstance(v, (bytes, bytearray)):
        if type(v) is not bytes:
            _as_plain(v, path, bytes(v))
        return {"__bytes__": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, pathlib.PurePath):  # a hyperparameter (Lightning's hparams, a config dataclass's dict)
        return {"__path__": str(v)}
    raise UnsupportedValueError(
        f"state value at key path {path or '<root>'!r} has type {type(v).__module__}.{type(v).__qualname__}, "
        "which fastckpt cannot store without pickle; convert it to tensors, arrays or JSON-able values")


def _enc_dict(d: dict, path: str, on_array: Callable[[str, Any], None]) -> Any:
    for k in d:
        if not (isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool))):
            raise UnsupportedValueError(
                f"dict at key path {path or '<root>'!r} has a key {k!r} of type {type(k).__name__}; "
                "only str and int keys are supported")
    keys = [k if type(k) in (str, int) else _as_plain(k, join(path, k), str.__str__(k) if isinstance(k, str)
                                                       else int.__int__(k)) for k in d]  # IntEnum / str-Enum keys
    pairs = [[k, _enc(x, join(path, k), on_array)] for k, x in zip(keys, d.values())]
    if isinstance(d, collections.Counter):  # an LR scheduler's milestones (MultiStepLR): its methods are used
        return {"__dict__": pairs, "__counter__": True}
    if all(isinstance(k, str) and not k.startswith("__") for k in d):
        return dict(pairs)
    return {"__dict__": pairs}


def unflatten(skel: Any, get_array: Callable[[str, str], Any], keep: Callable[[str], bool] | None = None) -> Any:
    """Rebuild the state from its skeleton.

    Args:
        skel: the JSON skeleton written by :func:`flatten`.
        get_array: ``(key_path, kind)`` -> the tensor (``kind="tensor"``) or ndarray.
        keep: optional predicate on key paths; subtrees for which it is false are left out
            (used for ``load(keys=...)``). Ancestors of kept paths are kept.
    """
    return _dec(skel, "", get_array, keep)


_DROP = object()


def _dec(v: Any, path: str, get: Callable[[str, str], Any], keep: Callable[[str], bool] | None) -> Any:
    if keep is not None and path and not keep(path):
        return _DROP
    if isinstance(v, list):
        out = [_dec(x, join(path, i), get, keep) for i, x in enumerate(v)]
        return [x for x in out if x is not _DROP]
    if not isinstance(v, dict):
        return v
    if "__tensor__" in v:
        return get(v["__tensor__"], "tensor")
    if "__ndarray__" in v:
        return get(v["__ndarray__"], "ndarray")
    if "__float__" in v:
        return float(v["__float__"])
    if "__dtype__" in v:
        return getattr(torch, v["__dtype__"])
    if "__device__" in v:
        return torch.device(v["__device__"])
    if "__bytes__" in v:
        return base64.b64decode(v["__bytes__"])
    if "__path__" in v:
        return pathlib.Path(v["__path__"])
    if "__np__" in v:
        return np.dtype(v["__np__"]).type(_dec(v["v"], path, get, None))
    if "__tuple__" in v:
        out = [_dec(x, join(path, i), get, keep) for i, x in enumerate(v["__tuple__"])]
        return tuple(x for x in out if x is not _DROP)
    items = v["__dict__"] if "__dict__" in v else list(v.items())
    res = collections.Counter() if v.get("__counter__") is True and "__dict__" in v else {}
    for k, x in items:
        y = _dec(x, join(path, k), get, keep)
        if y is not _DROP:
            res[k] = y
    return res


def key_filter(keys: list[str] | tuple[str, ...] | str | None) -> Callable[[str], bool] | None:
    """Predicate for ``load(keys=...)``: a path is kept if it equals a key, lies under one
    (``keys=["optimizer"]`` keeps ``optimizer/state/0/exp_avg``) or is an ancestor of one.

    Raises:
        InvalidArgumentError: ``keys`` is neither a str nor an iterable of str (names what it got).
    """
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    try:
        keys = list(keys)
    except TypeError:
        keys = [keys]  # not iterable: refused below
    if not all(isinstance(k, str) for k in keys):
        raise InvalidArgumentError(f"keys must be a key path / tensor name (str) or a list of them, e.g. "
                                   f"keys=['model'] or keys='optimizer/state', got {keys!r:.80}")
    ks = [k.rstrip("/") for k in keys]

    def keep(path: str) -> bool:
        return any(path == k or path.startswith(k + "/") or k.startswith(path + "/") for k in ks)

    return keep
