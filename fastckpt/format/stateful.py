"""Objects with ``state_dict()`` / ``load_state_dict()`` in a state, handled as DCP handles them.

``torch.distributed.checkpoint`` (``state_dict_saver._stateful_to_state_dict`` and
``state_dict_loader.load``) takes a top-level value of the state that is a ``Stateful`` (its
runtime-checkable protocol: the object has a ``state_dict`` and a ``load_state_dict`` attribute;
``nn.Module`` and ``torch.optim.Optimizer`` are ones, as is the DCP tutorial's
``{"app": AppState(model, optimizer)}``) as follows:

* save: the value stored under its key is ``obj.state_dict()``, called at the save;
* load: ``obj.state_dict()`` is the template filled in place, then ``obj.load_state_dict(filled)``
  is called and the object stays in the state.

Only top-level values of a ``dict`` state, as in DCP; nested objects are not called. The check
is two attribute look-ups (no import of ``torch.distributed``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def is_stateful(v: Any) -> bool:
    """True when ``v`` satisfies DCP's ``Stateful`` protocol (has ``state_dict`` and
    ``load_state_dict``); plain containers, tensors and arrays never do."""
    if isinstance(v, (dict, list, tuple, torch.Tensor, np.ndarray)):
        return False
    return hasattr(v, "state_dict") and hasattr(v, "load_state_dict")


def to_state_dicts(state: Any) -> tuple[Any, dict[Any, Any]]:
    """``state`` with each top-level ``Stateful`` value replaced by its ``state_dict()`` (a shallow
    copy of the dict; ``state`` itself is not modified), and ``{key: object}`` of those replaced.

    A state without such values is returned as is (same object) with an empty dict.
    """
    if not isinstance(state, dict):
        return state, {}
    objs = {k: v for k, v in state.items() if is_stateful(v)}
    if not objs:
        return state, objs
    return {k: (v.state_dict() if k in objs else v) for k, v in state.items()}, objs


def load_back(filled: Any, objs: dict[Any, Any]) -> Any:
    """Call ``obj.load_state_dict(filled[key])`` for each object of :func:`to_state_dicts`, in sorted
    key order as DCP does, and return ``filled`` with the objects back in place of their dicts."""
    if not objs:
        return filled
    out = dict(filled)
    for k in sorted(objs, key=str):
        objs[k].load_state_dict(filled[k])
        out[k] = objs[k]
    return out
