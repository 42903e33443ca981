"""ModelSnapshotter: the remembered key -> parameter map gives exactly model_snapshot's state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[2]
try:
    from fastckpt.integrations.hf.snapshot import ModelSnapshotter, model_snapshot
    from fastckpt.integrations.hf.models import tiny_llama
except ImportError:  # pyproject mapping not installed: import from the source tree
    sys.path.insert(0, str(REPO))
    from integrations.hf.snapshot import ModelSnapshotter, model_snapshot
    from integrations.hf.models import tiny_llama


def _peft_model():
    return peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _same(a, b, memory=True):
    """Same sections, keys, and each tensor the same bytes (and, with ``memory``, the very same view)."""
    assert a[0].keys() == b[0].keys() and a[1] == b[1] and a[2] == b[2]
    for sec in a[0]:
        assert list(a[0][sec]) == list(b[0][sec]), sec
        for k, t in a[0][sec].items():
            u = b[0][sec][k]
            assert (t.shape, t.stride(), t.dtype) == (u.shape, u.stride(), u.dtype), k
            assert not memory or t.data_ptr() == u.data_ptr(), k
            assert torch.equal(t, u), k


@pytest.mark.parametrize("make", [_peft_model, lambda: tiny_llama(0)], ids=["peft", "plain"])
def test_cached_snapshot_equals_fresh_one_after_training(make):
    model = make()
    snap = ModelSnapshotter()
    _same(snap(model), model_snapshot(model))
    assert snap._plan is not None  # the shortcut is on for HF / peft models
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    again = snap(model)
    _same(again, model_snapshot(model))
    trained = [k for k, t in again[0].get("adapter", again[0]["model"]).items() if t._version > 0]
    assert trained  # detached views share the version counter with the live parameters


def test_replaced_parameter_or_module_rebuilds():
    model = _peft_model()
    snap = ModelSnapshotter()
    snap(model)
    base = model.get_base_model()
    base.model.norm.weight = torch.nn.Parameter(torch.full_like(base.model.norm.weight, 3.0))
    out = snap(model)
    assert torch.equal(out[0]["model"]["model.norm.weight"], torch.full((32,), 3.0))
    _same(out, model_snapshot(model))
    base.model.layers[1].mlp = torch.nn.Identity()  # surgery: keys disappear
    _same(snap(model), model_snapshot(model))


def test_tensor_not_backed_by_a_parameter_turns_the_shortcut_off():
    model = tiny_llama(0)

    def hook(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "extra"] = torch.ones(2)  # computed at every state_dict() call
    model.model.norm._register_state_dict_hook(hook)
    snap = ModelSnapshotter()
    first = snap(model)
    assert snap._plan is None and "model.norm.extra" in first[0]["model"]
    _same(snap(model), model_snapshot(model), memory=False)
