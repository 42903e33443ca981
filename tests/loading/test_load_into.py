"""load_into in one process: in-place fills, strict errors that leave the state untouched, verify,
bounded buffers, non-tensor leaves, and peak RSS against a 200 MB model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import fastckpt
from fastckpt.errors import ChecksumMismatchError, StateMismatchError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from into_helpers import CountingBackend, mismatches  # noqa: E402


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
                      "ids": torch.arange(4, dtype=torch.int64) + seed},
            "optim": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(6, 5, generator=g)}},
                      "param_groups": [{"lr": 0.1 * (seed + 1), "betas": (0.9, 0.99), "params": [0]}]},
            "step": seed, "arr": np.arange(3, dtype=np.float32) * seed}


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_zeros_like(v) for v in state)
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    return state


def _snapshot(state) -> list[bytes]:
    out = []
    for v in (state.values() if isinstance(state, dict) else state):
        if isinstance(v, (dict, list, tuple)):
            out += _snapshot(v)
        elif isinstance(v, torch.Tensor):
            out.append(v.view(torch.uint8).numpy().tobytes() if v.dim() else v.numpy().tobytes())
    return out


@pytest.fixture
def ck(tmp_path):
    return fastckpt.save(_state(1), tmp_path / "ck")


def test_fills_in_place_and_returns_checkpoint_values(ck):
    want = _state(1)
    dst = _zeros_like(_state(0))
    ids = {id(t) for t in (dst["model"]["w"], dst["model"]["b"], dst["optim"]["state"][0]["exp_avg"])}
    arr = dst["arr"]
    out = fastckpt.load_into(dst, ck, verify=True)
    assert {id(out["model"]["w"]), id(out["model"]["b"]), id(out["optim"]["state"][0]["exp_avg"])} == ids
    assert mismatches(dst["model"], want["model"]) == []  # the caller's tensors hold the checkpoint's bytes
    assert out["step"] == 1 and dst["step"] == 0  # returned tree: checkpoint values; input dict unchanged
    assert out["optim"]["param_groups"] == [{"lr": 0.2, "betas": (0.9, 0.99), "params": [0]}]
    assert np.array_equal(arr, want["arr"])  # an ndarray leaf is filled in place too


def test_non_contiguous_destination_goes_through_a_small_buffer(ck):
    dst = _zeros_like(_state(0))
    dst["model"]["w"] = torch.zeros(5, 6).t()  # strided view
    fastckpt.load_into(dst, ck, buffer_bytes=20)  # one row (20 bytes) per block
    assert torch.equal(dst["model"]["w"], _state(1)["model"]["w"])


def _expect_mismatch(ck, dst, *needles, strict=None):
    before = _snapshot(dst)
    with pytest.raises(StateMismatchError) as ei:
        fastckpt.load_into(dst, ck, strict=strict)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    assert _snapshot(dst) == before, "a refused load_into wrote into the state"
    return ei.value


def test_strict_shape_mismatch_names_key_shapes_file_and_writes_nothing(ck):
    dst = _state(0)
    dst["model"]["w"] = torch.full((6, 4), 7.0)
    e = _expect_mismatch(ck, dst, "'model/w'", "[6, 4]", "[6, 5]", "model.safetensors")
    assert e.mismatched and e.mismatched[0][0] == "model/w"


def test_dtype_mismatch_is_cast_as_dcp_casts(ck):
    # issue 20: cast like DCP's FileSystemReader (target.copy_(stored)), never refused or reinterpreted
    dst = _zeros_like(_state(0))
    dst["model"]["b"] = dst["model"]["b"].float()
    fastckpt.load_into(dst, ck, strict=True)
    assert torch.equal(dst["model"]["b"], _state(1)["model"]["b"].float())


def test_strict_missing_and_unexpected_keys(ck):
    dst = _state(0)
    dst["model"]["extra"] = torch.ones(2)
    del dst["model"]["ids"]
    e = _expect_mismatch(ck, dst, "missing from the checkpoint: 'model/extra'", "not in the state: 'model/ids'",
                         strict=True)
    assert e.missing == ["model/extra"] and e.unexpected == ["model/ids"]
    assert isinstance(e, ValueError) and isinstance(e, fastckpt.FastCkptError)


def test_non_strict_skips_missing_keys_but_never_other_shapes(ck):
    # issue 20: strict=False leaves missing keys untouched (reported); a shape mismatch is still refused
    dst = _zeros_like(_state(0))
    dst["model"]["extra"] = torch.ones(2)
    rep = fastckpt.LoadIntoReport()
    fastckpt.load_into(dst, ck, strict=False, report=rep)
    assert torch.equal(dst["model"]["extra"], torch.ones(2)) and rep.missing_keys == ["model/extra"]
    assert torch.equal(dst["model"]["ids"], _state(1)["model"]["ids"])
    dst["model"]["w"] = torch.zeros(2, 2)
    _expect_mismatch(ck, dst, "'model/w'", "[2, 2]", "[6, 5]", strict=False)


def test_verify_catches_a_flipped_byte_naming_the_tensor(ck):
    m = fastckpt.read_manifest(ck)
    e = m.tensors["model/w"]
    with open(os.path.join(ck, e.file), "r+b") as f:
        f.seek(e.offsets[0] + 9)
        b = f.read(1)
        f.seek(e.offsets[0] + 9)
        f.write(bytes([b[0] ^ 0x10]))
    dst = _zeros_like(_state(0))
    fastckpt.load_into(dst, ck, verify=False)  # without verify: loads the damaged bytes
    with pytest.raises(ChecksumMismatchError, match="model/w"):
        fastckpt.load_into(dst, ck)  # verify is the default (issue 20)


def test_plain_hf_safetensors_file_by_name(tmp_path):
    from safetensors.torch import save_file
    t = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(3)}
    save_file(t, str(tmp_path / "model.safetensors"))
    dst = {"layer.weight": torch.zeros(4, 3), "layer.bias": torch.zeros(3)}
    counter = CountingBackend()
    fastckpt.load_into({"model": dst}, tmp_path, io_backend=counter)  # prefix "model" dropped
    assert all(torch.equal(dst[k], t[k]) for k in t)
    assert counter.bytes == 4 * 3 * 4 + 3 * 4
    with pytest.raises(StateMismatchError, match="missing from the checkpoint: 'other'"):
        fastckpt.load_into({"other": torch.zeros(1), **dst}, tmp_path)


RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch, fastckpt
    n, path = int(sys.argv[1]), sys.argv[2]
    state = {"model": {f"layer{i}": torch.zeros(n // 8 // 4) for i in range(8)}}
    for t in state["model"].values():
        t.fill_(1.0)                    # fault every page of the model in
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fastckpt.load_into(state, path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ok = all(float(t[0]) == i + 0.5 for i, t in enumerate(state["model"].values()))
    print(json.dumps({"base": base, "peak": peak, "ok": ok}))
""")


def test_peak_rss_stays_at_model_size(tmp_path):
    n = 200 << 20
    ck = tmp_path / "big"
    fastckpt.save({"model": {f"layer{i}": torch.full((n // 8 // 4,), i + 0.5) for i in range(8)}}, ck)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(n), str(ck)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"]
    growth = r["peak"] - r["base"]
    assert growth < 0.5 * n, f"peak RSS grew by {growth / 2**20:.0f} MiB loading a {n >> 20} MiB model in place"


def test_tied_weights_stored_once_fill_through_their_tie(tmp_path):
    """safetensors.torch.save_model drops a tied duplicate (and save_pretrained a tied lm_head); the
    reference loaders (load_model strict=True, from_pretrained) accept the file, the tie filling it.
    load_into(strict=True) does too when the state's tensor shares memory with the one filled; an
    untied state still reports the key missing."""
    from safetensors.torch import load_model, save_model

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    src = M()
    f = tmp_path / "m.safetensors"
    save_model(src, str(f))
    ref = M()
    load_model(ref, str(f), strict=True)  # the reference accepts it
    mine = M()
    rep = fastckpt.LoadIntoReport()
    fastckpt.load_into(mine.state_dict(), f, strict=True, report=rep)
    assert torch.equal(mine.emb.weight, ref.emb.weight) and torch.equal(mine.head.weight, ref.head.weight)
    assert mine.head.weight.data_ptr() == mine.emb.weight.data_ptr() and rep.missing_keys == []
    untied = {"emb.weight": torch.zeros(8, 4), "head.weight": torch.zeros(8, 4)}
    with pytest.raises(fastckpt.errors.StateMismatchError, match="head.weight"):
        fastckpt.load_into(untied, f, strict=True)


def test_an_untied_checkpoint_into_tied_weights_fills_the_last_key_as_load_state_dict(tmp_path, caplog):
    """A checkpoint holding different values for two keys the state ties (an untied model's
    embed/lm_head into a tied model) is valid: torch's load_state_dict copies each key in turn and
    the last stays. load_into raised ChecksumMismatchError (both filled into one memory from two
    threads, then checked against each key's checksum) while `fastckpt verify` passed; now it fills
    the last key once, with a WARNING naming the tie, and equal values stay silent."""
    class M(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 32)
            self.head = torch.nn.Linear(32, 64, bias=False)
            if tied:
                self.head.weight = self.emb.weight

    torch.manual_seed(0)
    untied = M(tied=False)
    ck = tmp_path / "untied"
    fastckpt.save({"model": untied.state_dict()}, ck)
    assert fastckpt.verify(ck).ok
    ref = M(tied=True)
    ref.load_state_dict(untied.state_dict())  # the reference: the last key (head.weight) wins
    for form in ("state_dict", "module"):
        mine = M(tied=True)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fastckpt"):
            fastckpt.load_into({"model": mine.state_dict() if form == "state_dict" else mine}, ck)
        assert torch.equal(mine.emb.weight, ref.emb.weight) and torch.equal(mine.emb.weight, untied.head.weight)
        assert mine.head.weight.data_ptr() == mine.emb.weight.data_ptr()
        assert any("ties" in r.message and "model/head.weight" in r.message for r in caplog.records), caplog.text
    same = tmp_path / "tied"  # a tied model's own checkpoint: one value, no warning
    src = M(tied=True)
    fastckpt.save({"model": {"emb.weight": src.emb.weight, "head.weight": src.emb.weight.clone()}}, same)
    mine = M(tied=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastckpt"):
        fastckpt.load_into({"model": mine.state_dict()}, same)
    assert torch.equal(mine.emb.weight, src.emb.weight) and not caplog.records, caplog.text


def test_a_module_itself_is_filled_like_load_model(tmp_path):
    """load_into(model, file) fills the module as safetensors.torch.load_model(model, file) does (it
    returned the module unfilled, 'missing: ""'); strict applies to its state_dict's keys."""
    from safetensors.torch import load_model, save_model
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    f = tmp_path / "m.safetensors"
    save_model(src, str(f))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    load_model(ref, str(f))
    mine = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    assert fastckpt.load_into(mine, f, strict=True) is mine
    for (k, a), b in zip(mine.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(fastckpt.errors.StateMismatchError, match="3.weight"):  # a module the file lacks
        fastckpt.load_into(torch.nn.Sequential(torch.nn.Linear(4, 3, bias=True), torch.nn.ReLU(),
                                               torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)), f, strict=True)


def test_module_prefixed_flat_keys_drop_their_prefix_as_nested_ones_do(tmp_path):
    """A sentence-transformers model's state_dict() names its transformer ``0.auto_model.<HF name>``
    in one flat key; its HF folder (save_pretrained of the inner model) stores ``<HF name>``. load_into
    matched suffixes per nested key only, so every key was reported missing; now the dotted parts are
    matched, and the values are from_pretrained's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "hf")
    ref = transformers.BertModel.from_pretrained(tmp_path / "hf")

    class Transformer(torch.nn.Module):  # sentence_transformers.models.Transformer's attribute name
        def __init__(self):
            super().__init__()
            self.auto_model = transformers.BertModel(cfg)

    torch.manual_seed(1)
    st = torch.nn.Sequential(Transformer())
    rep = fastckpt.LoadIntoReport()
    fastckpt.load_into(st.state_dict(), tmp_path / "hf", strict=True, report=rep)
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    for k, v in ref.state_dict().items():
        assert torch.equal(st.state_dict()["0.auto_model." + k], v), k


@pytest.mark.parametrize("form", ["state_dicts", "stateful"])
def test_fresh_optimizer_takes_the_stored_state_as_torch_load_gives_it(tmp_path, form):
    """A fresh AdamW's state_dict() has ``state: {}`` (no step yet): load_into said 'missing from the
    checkpoint: optim/state' although the checkpoint holds it. The reference is torch.save/torch.load +
    load_state_dict: the same optimizer state, and the same parameters after the next step."""
    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    def step(m, o):
        o.zero_grad()
        m(torch.ones(2, 4)).square().sum().backward()
        o.step()

    m, o = make(0)
    step(m, o)
    fastckpt.save({"model": m.state_dict(), "optim": o.state_dict()}, tmp_path / "ck")
    torch.save({"model": m.state_dict(), "optim": o.state_dict()}, tmp_path / "ref.pt")
    ref_m, ref_o = make(1)
    blob = torch.load(tmp_path / "ref.pt", weights_only=True)
    ref_m.load_state_dict(blob["model"])
    ref_o.load_state_dict(blob["optim"])
    mine_m, mine_o = make(2)
    assert mine_o.state_dict()["state"] == {}
    if form == "state_dicts":
        out = fastckpt.load_into({"model": mine_m.state_dict(), "optim": mine_o.state_dict()}, tmp_path / "ck",
                                 strict=True)
        mine_o.load_state_dict(out["optim"])
    else:
        assert fastckpt.load_into({"model": mine_m, "optim": mine_o}, tmp_path / "ck", strict=True)["optim"] is mine_o
    for i, st in ref_o.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(mine_o.state_dict()["state"][i][k], v), (i, k)
    step(ref_m, ref_o)
    step(mine_m, mine_o)
    for (k, a), b in zip(mine_m.state_dict().items(), ref_m.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_strided_view_is_filled_as_load_reads_it(tmp_path):
    """A checkpoint holding strided views of one storage (a transpose, a slice) saved from a state
    that `fastckpt.save` accepts: load_into refused the whole checkpoint ('stored as a strided view')
    even under keys the state does not name, then (a format differential probe) still refused a
    state naming them, where fastckpt.load reads them. Each is read whole and copied (cast as copy_,
    a shape mismatch named before anything is written); the keys the state does not name are
    unexpected, as any other."""
    base = torch.arange(20.0).reshape(4, 5)
    fastckpt.save({"model": {"w": torch.ones(3)}, "extra": {"t": base.t(), "s": base[1:3, 2:]}}, tmp_path / "ck")
    dst = {"model": {"w": torch.zeros(3)}}
    fastckpt.load_into(dst, tmp_path / "ck")
    assert torch.equal(dst["model"]["w"], torch.ones(3))
    with pytest.raises(fastckpt.errors.StateMismatchError, match="extra/t"):
        fastckpt.load_into({"model": {"w": torch.zeros(3)}}, tmp_path / "ck", strict=True)
    dst = {"model": {"w": torch.zeros(3)}, "extra": {"t": torch.zeros(5, 4), "s": torch.zeros(2, 3, dtype=torch.float64)}}
    fastckpt.load_into(dst, tmp_path / "ck", strict=True)
    assert torch.equal(dst["extra"]["t"], base.t()) and torch.equal(dst["extra"]["s"], base[1:3, 2:].double())
    assert torch.equal(fastckpt.load(tmp_path / "ck")["extra"]["t"], base.t())
    keep = torch.zeros(3)
    with pytest.raises(fastckpt.errors.StateMismatchError, match="extra/t"):
        fastckpt.load_into({"model": {"w": keep}, "extra": {"t": torch.zeros(4, 5)}}, tmp_path / "ck")
    assert torch.equal(keep, torch.zeros(3))  # nothing written before the mismatch was found


def test_a_stored_tensor_fills_one_key_only_as_torch_finds_the_rest_missing(tmp_path):
    """A state key whose dotted suffix names a stored tensor that another key of the state names itself
    (``1.0.weight`` vs the file's ``0.weight``, the state's own ``0.weight``) was filled with that
    tensor, strict=True, exit 0; torch's load_state_dict(strict=True) and safetensors' load_model find
    ``1.0.weight`` / ``1.0.bias`` missing. Keys tying for one stored tensor are missing too."""
    from safetensors.torch import load_model, save_file
    torch.manual_seed(0)
    small = torch.nn.Sequential(torch.nn.Linear(4, 4))
    save_file(small.state_dict(), tmp_path / "small.safetensors")
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(RuntimeError, match="1.0.weight"):  # the reference
        load_model(big, tmp_path / "small.safetensors")
    sd = big.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    with pytest.raises(StateMismatchError) as ei:
        fastckpt.load_into(sd, tmp_path / "small.safetensors", strict=True)
    assert sorted(ei.value.missing) == ["1.0.bias", "1.0.weight"], ei.value.missing
    assert all(torch.equal(sd[k], before[k]) for k in sd)  # nothing written
    got = fastckpt.load_into(sd, tmp_path / "small.safetensors", strict=False)
    assert torch.equal(got["0.weight"], small.state_dict()["0.weight"]) and torch.equal(got["1.0.weight"], before["1.0.weight"])
    two = {"a": {"0.weight": torch.zeros(4, 4)}, "b": {"0.weight": torch.zeros(4, 4)}}  # both drop one part
    with pytest.raises(StateMismatchError) as ei:
        fastckpt.load_into(two, tmp_path / "small.safetensors", strict=True)
    assert sorted(ei.value.missing) == ["a/0.weight", "b/0.weight"], ei.value.missing


@pytest.mark.parametrize("saved_with", ["module.", ""])
def test_a_wrapper_prefix_is_named_in_the_mismatch(tmp_path, saved_with):
    """A checkpoint of a DDP-wrapped model ('module.0.weight') loaded into the plain model, or the
    reverse: the default-mode error listed only the missing keys ('build the state from the same
    config'); it now shows what the checkpoint holds and names the prefix and the fix."""
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    sd = {saved_with + k: v for k, v in m.state_dict().items()}
    fastckpt.save({"model": sd}, tmp_path / "ck")
    want = {("module." if not saved_with else "") + k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(StateMismatchError) as ei:
        fastckpt.load_into({"model": want}, tmp_path / "ck")
    msg = str(ei.value)
    assert "the checkpoint holds instead" in msg and "'module.'" in msg, msg
    assert ("without the prefix" if saved_with else "with the prefix 'module.' added") in msg, msg


def test_float_into_an_integer_state_is_cast_as_copy_does_with_a_warning(tmp_path, caplog):
    """torch's copy_ (load_state_dict, DCP) casts a float read into an int tensor, truncating; load_into
    does the same, and now says so at WARNING (it was an INFO line only: every weight 0, silently)."""
    import logging
    fastckpt.save({"model": {"w": torch.tensor([0.25, 1.75, -2.5])}}, tmp_path / "ck")
    state = {"model": {"w": torch.zeros(3, dtype=torch.int64)}}
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        got = fastckpt.load_into(state, tmp_path / "ck")
    want = torch.zeros(3, dtype=torch.int64).copy_(torch.tensor([0.25, 1.75, -2.5]))  # the reference
    assert torch.equal(got["model"]["w"], want)
    assert any("values truncated" in r.getMessage() and "'model/w'" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_a_meta_tensor_in_the_state_is_a_typed_error_naming_the_key(tmp_path):
    """A state tensor on the meta device (a model built under torch.device("meta") and not allocated)
    raised a plain ValueError; it is an InvalidArgumentError (still a ValueError) naming the key and
    saying to allocate it."""
    from fastckpt.errors import InvalidArgumentError
    ck = fastckpt.save({"m": {"w": torch.ones(2, 3)}}, tmp_path / "ck")
    with pytest.raises(InvalidArgumentError, match=r"'m/w'.*meta device.*to_empty") as ei:
        fastckpt.load_into({"m": {"w": torch.empty(2, 3, device="meta")}}, ck)
    assert isinstance(ei.value, ValueError)
