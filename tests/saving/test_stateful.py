"""Objects with ``state_dict()`` / ``load_state_dict()`` (DCP's ``Stateful``) at the top of a state are
saved and loaded as ``torch.distributed.checkpoint`` does: the PyTorch DCP tutorial's
``{"app": AppState(model, optimizer)}`` goes through ``fastckpt.save`` / ``fastckpt.load_into`` and through
``dcp.save`` / ``dcp.load`` with ``FileSystemWriter`` / ``FileSystemReader``; both restore the same values
and call the same methods in the same order."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import fastckpt
from fastckpt.errors import UnsupportedValueError


class AppState(Stateful):
    """The DCP tutorial's wrapper: model and optimizer state through get_state_dict / set_state_dict."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer, self.calls = model, optimizer, []

    def state_dict(self):
        self.calls.append("state_dict")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        self.calls.append("load_state_dict")
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _snapshot(model, optim) -> dict:
    sd, osd = get_state_dict(model, optim)
    return {"model": {k: v.clone() for k, v in sd.items()},
            "optim": {"state": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in s.items()}
                                for k, s in osd["state"].items()},
                      "param_groups": [dict(g) for g in osd["param_groups"]]}}


def _assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, (path, a, b)


def test_app_state_saves_and_loads_as_dcp_does(tmp_path):
    model, optim = _trained(0)
    want = _snapshot(model, optim)
    app = AppState(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save({"app": app, "step": 7}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    fastckpt.save({"app": app, "step": 7}, tmp_path / "fck")
    assert app.calls == ["state_dict", "state_dict"]  # each save called it once

    # what is stored under "app" is the object's state_dict(), as DCP stores it
    stored = fastckpt.load(tmp_path / "fck")
    _assert_same(stored["app"], want)
    assert stored["step"] == 7

    results = {}
    for via in ("dcp", "fastckpt"):
        m2, o2 = _trained(1)  # other values, same structure (the optimizer has state to fill)
        app2 = AppState(m2, o2)
        state = {"app": app2, "step": 0}
        if via == "dcp":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
            out = state
        else:
            out = fastckpt.load_into(state, tmp_path / "fck")
        assert out["app"] is app2  # the object stays in the state, filled through load_state_dict
        assert app2.calls == ["state_dict", "load_state_dict"]
        results[via] = (_snapshot(m2, o2), out["step"])
        _assert_same(results[via][0], want, via)
    assert results["dcp"][1] == results["fastckpt"][1] == 7
    _assert_same(results["fastckpt"][0], results["dcp"][0])


def test_module_at_top_level_is_saved_as_its_state_dict(tmp_path):
    model, _ = _trained(0)  # nn.Module satisfies the protocol: DCP saves model.state_dict()
    fastckpt.save({"model": model}, tmp_path / "ck")
    _assert_same(fastckpt.load(tmp_path / "ck")["model"], {k: v.detach() for k, v in model.state_dict().items()})
    other, _ = _trained(1)
    out = fastckpt.load_into({"model": other}, tmp_path / "ck")
    assert out["model"] is other
    _assert_same(other.state_dict(), model.state_dict())


def test_manager_saves_stateful_once(tmp_path):
    model, optim = _trained(0)
    app = AppState(model, optim)
    mgr = fastckpt.CheckpointManager(tmp_path / "run")
    mgr.save(3, {"app": app})
    assert app.calls == ["state_dict"]
    m2, o2 = _trained(1)
    app2 = AppState(m2, o2)
    mgr.load_into({"app": app2})
    assert app2.calls == ["state_dict", "load_state_dict"]
    _assert_same(_snapshot(m2, o2), _snapshot(model, optim))


def test_nested_objects_are_still_refused(tmp_path):
    model, _ = _trained(0)  # DCP calls state_dict() on top-level values only
    with pytest.raises(UnsupportedValueError, match="inner/model"):
        fastckpt.save({"inner": {"model": model}}, tmp_path / "ck")
