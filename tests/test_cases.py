"""Handed cases C1-C5 (shared/cases/README.md): empty tensors, scalars, every dtype, metadata,
corrupt or hostile safetensors files. Inputs are built inside each test; files are small."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fastckpt
import fastckpt.loading.reader
from fastckpt.loading.device import load_weights
from fastckpt.errors import (FastCkptError, HeaderError, UnsupportedDtypeError, UnsupportedValueError)
from fastckpt.format.safetensors import encode_header
from fastckpt.storage.model_files import read_header
from fastckpt.loading.tp import Shard

from fastckpt_testkit import assert_same, assert_tree_same, listing, st_file, write_bytes


def every_load_path(path, keys_subset):
    """Yield (label, flat {name: tensor}) for every way we load a file or checkpoint on this machine."""
    out = fastckpt.load(path)
    yield "load", _flat(out)
    yield "load-threads1-small-chunks", _flat(fastckpt.load(path, threads=1, chunk_bytes=4096))
    yield "device-path-ring", {k.split("/")[-1]: v for k, v in
                               load_weights(path, "cpu", ring_bytes=8192, slot_bytes=4096).items()}
    sel = fastckpt.load(path, keys=[_key(path, k) for k in keys_subset])
    flat = _flat(sel)
    assert set(flat) == set(keys_subset), (set(flat), keys_subset)
    yield "keys", flat


def _key(path, name):
    return name if not os.path.exists(os.path.join(path, "manifest.json")) else f"model/{name}"


def _flat(d):
    return d["model"] if "model" in d else d


# ---------------------------------------------------------------- C1: zero-element tensors

def c1_state():
    return {"a": torch.empty(0, dtype=torch.float32), "b": torch.empty(0, dtype=torch.float32),
            "c": torch.empty(2, 0, dtype=torch.bfloat16), "d": torch.empty(0, 3, dtype=torch.int64),
            "w": torch.arange(16, dtype=torch.float32).reshape(4, 4)}


@pytest.mark.parametrize("writer", ["fastckpt", "safetensors"])
def test_c1_zero_element_tensors(tmp_path, writer):
    ref = c1_state()
    if writer == "fastckpt":
        path = fastckpt.save({"model": ref}, tmp_path / "ck")
        m = json.loads((path / "manifest.json").read_text())
        # empty tensors are stored on their own, never as aliases or views of each other
        for k in "abcd":
            e = m["tensors"][f"model/{k}"]
            assert "alias" not in e and "view" not in e and e["offsets"][0] == e["offsets"][1]
        shard = path / "model.safetensors"
        theirs = load_file(str(shard))
        for k in ref:
            assert_same(ref[k], theirs[k], f"safetensors reads {k}")
    else:
        path = tmp_path / "c1.safetensors"
        save_file(ref, str(path))
    h = read_header(path if writer == "safetensors" else path / "model.safetensors")
    starts = {h.tensors[k].start for k in "abcd"}
    assert all(h.tensors[k].nbytes == 0 for k in "abcd") and len(h.tensors) == 5
    assert len(starts) <= 2  # several empty tensors at the same data offset
    for label, flat in every_load_path(path, ["a", "d", "w"]):
        for k, t in flat.items():
            assert_same(ref[k], t, f"{label}: {k}")


def test_c1_same_empty_tensor_twice_is_not_shared(tmp_path):
    e = torch.empty(0, 5)
    w = torch.ones(3)
    path = fastckpt.save({"x": e, "y": e, "z": e.view(5, 0), "w": w}, tmp_path / "ck")
    m = json.loads((path / "manifest.json").read_text())
    assert not any("alias" in v or "view" in v for k, v in m["tensors"].items() if k in ("x", "y", "z"))
    out = fastckpt.load(path)
    assert out["x"].shape == (0, 5) and out["y"].shape == (0, 5) and out["z"].shape == (5, 0)


# ---------------------------------------------------------------- C2: 0-dim scalars

def c2_state():
    g = torch.Generator().manual_seed(2)
    return {"scale": torch.tensor(0.125, dtype=torch.float32), "step": torch.tensor(-7, dtype=torch.int64),
            "flag": torch.tensor(True), "w": torch.randn(8, 8, generator=g).to(torch.bfloat16)}


@pytest.mark.parametrize("writer", ["fastckpt", "safetensors"])
def test_c2_scalars_stay_0_dim(tmp_path, writer):
    ref = c2_state()
    if writer == "fastckpt":
        path = fastckpt.save({"model": ref}, tmp_path / "ck")
        theirs = load_file(str(path / "model.safetensors"))
        for k in ref:
            assert_same(ref[k], theirs[k], f"safetensors reads {k}")
    else:
        path = tmp_path / "c2.safetensors"
        save_file(ref, str(path))
    for label, flat in every_load_path(path, ["scale", "flag"]):
        for k, t in flat.items():
            assert t.shape == () or k == "w", (label, k, t.shape)
            assert t.numel() == (1 if k != "w" else 64)
            assert_same(ref[k], t, f"{label}: {k}")
    # tensor-parallel partial load: w is split, scalars are replicated whole
    rank1 = load_weights(path, "cpu", shard=Shard(1, 2, {"*w": 0}))
    names = {k.split("/")[-1]: v for k, v in rank1.items()}
    assert_same(ref["w"][4:], names["w"], "w rank 1 of 2")
    for k in ("scale", "step", "flag"):
        assert_same(ref[k], names[k], f"replicated {k}")
    # asking to split a scalar is refused, naming it (it has no dim 0)
    with pytest.raises(ValueError, match="'[a-z/]*step' is a 0-dim scalar"):
        load_weights(path, "cpu", shard=Shard(0, 2, {"*": 0}))


def test_c2_scalar_in_streaming_save_and_views(tmp_path):
    ref = c2_state()
    state = {"model": ref, "big": torch.randn(40_000), "s_alias": ref["scale"]}
    fastckpt.save(state, tmp_path / "ck", staging_bytes=8192, chunk_bytes=4096, max_shard_bytes=70_000)
    out = fastckpt.load(tmp_path / "ck")
    assert_tree_same(state, out)
    assert out["s_alias"].shape == () and out["s_alias"].data_ptr() == out["model"]["scale"].data_ptr()


# ---------------------------------------------------------------- C3: every dtype, raw bytes

def c3_state():
    g = torch.Generator().manual_seed(3)
    bits16 = torch.tensor([0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x3F80],
                          dtype=torch.int32).to(torch.int16)  # +0, -0, NaNs with payloads, inf, -inf, subnormal
    s = {
        "f16": torch.cat([bits16.view(torch.float16), torch.randn(7, generator=g).half()]),
        "bf16": torch.cat([bits16.view(torch.bfloat16), torch.randn(7, generator=g).bfloat16()]),
        "f32": torch.tensor([0x7FC00001, -0x80000000, 0x7F800000, 1], dtype=torch.int32).view(torch.float32),
        "f64": torch.tensor([0x7FF8000000000001, -0x8000000000000000, 3], dtype=torch.int64).view(torch.float64),
        "i8": torch.tensor([-128, 127, 0], dtype=torch.int8), "i16": torch.tensor([-32768, 32767], dtype=torch.int16),
        "i32": torch.tensor([-2**31, 2**31 - 1], dtype=torch.int32),
        "i64": torch.tensor([-2**63, 2**63 - 1], dtype=torch.int64),
        "u8": torch.arange(256, dtype=torch.int32).to(torch.uint8), "bool": torch.tensor([True, False, True]),
        "f8e4m3": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn),
        "f8e5m2": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e5m2).reshape(16, 16),
    }
    # C64 as the safetensors package (0.6+) stores it: (re, im) float32 pairs, NaN payloads and -0.0 kept
    s["c64"] = torch.tensor([0x7FC00001, -0x80000000, 0x3F800000, 0x7F800000, 5, 6], dtype=torch.int32) \
        .view(torch.float32).view(torch.complex64)
    if hasattr(torch, "float8_e8m0fnu"):
        s["f8e8m0"] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    for name in ("uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            s[name] = torch.arange(5, dtype=torch.int64).to(getattr(torch, name))
    return s


def test_c3_every_dtype_raw_bytes(tmp_path):
    ref = c3_state()
    path = fastckpt.save({"model": ref, "other": dict(ref)}, tmp_path / "ck")
    out = fastckpt.load(path)
    for k in ref:
        assert_same(ref[k], out["model"][k], k)
        assert_same(ref[k], out["other"][k], f"other/{k}")
    theirs = {}
    for f in sorted(os.listdir(path)):
        if f.startswith("model") and f.endswith(".safetensors"):
            with safe_open(str(path / f), "pt") as sf:
                theirs.update({k: sf.get_tensor(k) for k in sf.keys()})
    assert theirs.keys() == ref.keys()
    for k in ref:
        assert_same(ref[k], theirs[k], f"safetensors reads {k}")
    # and files written by the safetensors package load identically
    save_file(ref, str(tmp_path / "theirs.safetensors"))
    for label, flat in every_load_path(tmp_path / "theirs.safetensors", ["bf16", "f8e4m3"]):
        for k, t in flat.items():
            assert_same(ref[k], t, f"{label}: {k}")


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_c3_complex128_refused_at_save_naming_tensor(tmp_path, where):
    """complex128 has no safetensors dtype (complex64 has: C64, round-tripped above)."""
    state = {where: {"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}}
    with pytest.raises(UnsupportedDtypeError, match=f"'{where}/z'.*complex128"):
        fastckpt.save(state, tmp_path / "ck")
    assert listing(tmp_path) == []


def test_c3_unknown_dtype_in_file_refused_naming_dtype_tensor_file(tmp_path):
    p = write_bytes(tmp_path / "u.safetensors", st_file(
        {"good": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
         "weird": {"dtype": "F4_E2M1X", "shape": [2], "data_offsets": [4, 8]}}, b"\0" * 8))
    with pytest.raises(UnsupportedDtypeError) as ei:
        fastckpt.load(p)
    msg = str(ei.value)
    assert "'F4_E2M1X'" in msg and "'weird'" in msg and str(p) in msg
    assert isinstance(ei.value, FastCkptError)


# ---------------------------------------------------------------- C4: metadata

@pytest.mark.parametrize("meta, key", [({"epoch": 3}, "epoch"), ({"ok": "1", "lr": 0.5}, "lr"),
                                       ({"cfg": {"a": "b"}}, "cfg"), ({"none": None}, "none")])
def test_c4_non_string_metadata_refused_before_any_file(tmp_path, meta, key):
    with pytest.raises(UnsupportedValueError, match=f"'{key}'"):
        fastckpt.save({"model": {"w": torch.ones(2)}}, tmp_path / "ck", metadata=meta)
    assert listing(tmp_path) == []


def test_c4_string_metadata_in_every_shard(tmp_path):
    meta = {"format": "pt", "json": json.dumps({"epoch": 3, "lr": 0.5, "x": None})}
    path = fastckpt.save({"model": {"a": torch.ones(300), "b": torch.ones(300)}, "s": torch.ones(1)}, tmp_path / "ck",
                         metadata=meta, max_shard_bytes=1000)
    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(shards) == 3
    for n in shards:
        with safe_open(str(path / n), "pt") as f:
            assert f.metadata() == meta
        assert read_header(path / n).metadata == meta


@pytest.mark.parametrize("state", [{"model": {"__metadata__": torch.ones(1)}}, {"__metadata__": torch.ones(1)}])
def test_c4_tensor_named_metadata_refused(tmp_path, state):
    with pytest.raises(UnsupportedValueError, match="__metadata__"):
        fastckpt.save(state, tmp_path / "ck")
    assert listing(tmp_path) == []


def test_c4_metadata_only_file_roundtrips(tmp_path):
    meta = {"a": "1", "b": "two"}
    ours, infos = encode_header([], meta)
    assert infos == []
    p = write_bytes(tmp_path / "ours.safetensors", ours)
    with safe_open(str(p), "pt") as f:
        assert f.metadata() == meta and list(f.keys()) == []
    assert fastckpt.load(p) == {}
    assert read_header(p).metadata == meta
    save_file({}, str(tmp_path / "theirs.safetensors"), metadata=meta)
    assert read_header(tmp_path / "theirs.safetensors").metadata == meta
    assert fastckpt.load(tmp_path / "theirs.safetensors") == {}
    assert fastckpt.open_checkpoint(tmp_path / "theirs.safetensors").headers["theirs.safetensors"].metadata == meta


def test_c4_metadata_kept_by_a_save_without_tensors(tmp_path):
    meta = {"epoch": "3", "note": "no tensors here"}
    p = fastckpt.save({"step": 1, "cfg": {"lr": 0.5}}, tmp_path / "ck", metadata=meta)
    assert not [n for n in os.listdir(p) if n.endswith(".safetensors")]
    assert fastckpt.read_manifest(str(p)).metadata == meta
    assert fastckpt.load(p) == {"step": 1, "cfg": {"lr": 0.5}}


def test_c4_unquoted_integer_in_file_metadata(tmp_path):
    body = b'{"__metadata__": {"epoch": 3, "ok": "x"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    p = write_bytes(tmp_path / "m.safetensors", struct.pack("<Q", len(body)) + body + b"\0" * 4)
    with pytest.raises(HeaderError) as ei:
        fastckpt.load(p)
    assert "'epoch'" in str(ei.value) and str(p) in str(ei.value)


# ---------------------------------------------------------------- C5: corrupt or hostile files

@pytest.fixture
def guarded(monkeypatch):
    """Fail the test if anything allocates a tensor buffer or reads past EOF while loading."""
    allocs = []

    def no_alloc(n, *a, **k):
        allocs.append(n)
        raise AssertionError(f"allocated {n} bytes before validation finished")

    monkeypatch.setattr(fastckpt.loading.reader, "host_buffer", no_alloc)
    real_pread = os.pread

    def pread(fd, n, off):
        size = os.fstat(fd).st_size
        assert off + n <= size, f"read [{off}, {off + n}) past EOF {size}"
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "pread", pread)
    return allocs


def _c5_file(tmp_path, name, data):
    return write_bytes(tmp_path / name, data)


def _expect(path, match, tensor=None, err=HeaderError):
    with pytest.raises(err, match=match) as ei:
        fastckpt.load(path)
    assert str(path) in str(ei.value)
    if tensor is not None:
        assert f"'{tensor}'" in str(ei.value)
        assert getattr(ei.value, "tensor", tensor) == tensor
    return ei.value


def test_c5a_length_100_file_50(tmp_path, guarded):
    p = _c5_file(tmp_path, "a.safetensors", struct.pack("<Q", 100) + b"{" + b" " * 41)
    assert os.path.getsize(p) == 50
    _expect(p, "says 100 bytes but the file has only 42")


def test_c5b_length_2_pow_63(tmp_path, guarded):
    p = _c5_file(tmp_path, "b.safetensors", struct.pack("<Q", 2**63) + b'{"a":1}')
    _expect(p, str(2**63))


def test_c5c_truncated_by_1_mib(tmp_path, guarded):
    ts = {"t0": torch.ones(200_000), "t1": torch.ones(200_000), "t2": torch.ones(200_000)}  # 2.4 MB
    save_file(ts, str(tmp_path / "c.safetensors"))
    size = os.path.getsize(tmp_path / "c.safetensors")
    os.truncate(tmp_path / "c.safetensors", size - (1 << 20))
    e = _expect(tmp_path / "c.safetensors", r"ends at data byte \d+ but the file holds only \d+ data bytes")
    assert e.tensor in ("t1", "t2")
    assert str(1_600_000) in str(e) or str(2_400_000) in str(e)


def test_c5d_offsets_8_4(tmp_path, guarded):
    p = _c5_file(tmp_path, "d.safetensors", st_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}},
                                                    b"\0" * 8))
    _expect(p, r"\[8, 4\]", tensor="x")


def test_c5e_shape_bigger_than_offsets(tmp_path, guarded):
    p = _c5_file(tmp_path, "e.safetensors",
                 st_file({"big": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4]}}, b"\0" * 4))
    _expect(p, r"\[1000, 1000\] = 4000000 bytes but data_offsets \[0, 4\] span 4 bytes", tensor="big")


def test_c5f_overlapping_ranges(tmp_path, guarded):
    p = _c5_file(tmp_path, "f.safetensors", st_file(
        {"p": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]},
         "q": {"dtype": "U8", "shape": [64], "data_offsets": [32, 96]}}, b"\0" * 96))
    _expect(p, r"'q' \[32, 96\] overlaps 'p' which ends at 64", tensor="q")


def test_c5g_unindexed_hole(tmp_path, guarded):
    p = _c5_file(tmp_path, "g.safetensors", st_file(
        {"p": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
         "q": {"dtype": "U8", "shape": [16], "data_offsets": [32, 48]}}, b"\0" * 48))
    _expect(p, r"16 unindexed bytes \[16, 32\)", tensor="q")


def test_c5h_same_key_twice(tmp_path, guarded):
    body = (b'{"k": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, '
            b'"k": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}')
    p = _c5_file(tmp_path, "h.safetensors", struct.pack("<Q", len(body)) + body + b"\0" * 8)
    _expect(p, "duplicate key 'k'")


@pytest.mark.parametrize("body, match", [(b"\xc3\x28\xa0\xa1", "not valid UTF-8"), (b"[1, 2, 3]", "not an object"),
                                         (b'"str"', "not an object"), (b"{'a': 1}", "not valid JSON"),
                                         (b"", "not valid JSON")])
def test_c5i_header_not_utf8_or_not_object(tmp_path, guarded, body, match):
    p = _c5_file(tmp_path, "i.safetensors", struct.pack("<Q", len(body)) + body)
    _expect(p, match)


def test_c5j_two_shards_hold_same_tensor(tmp_path, guarded):
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"model.w": torch.ones(2), "a": torch.ones(1)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"model.w": torch.zeros(2), "b": torch.ones(1)}, str(d / "model-00002-of-00002.safetensors"))
    with pytest.raises(HeaderError, match="'model.w' is stored in both") as ei:
        fastckpt.load(d)
    assert ei.value.tensor == "model.w"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.w": "model-00001-of-00002.safetensors", "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(HeaderError, match="'model.w' is stored in both"):
        fastckpt.load(d)


def test_c5j_index_names_missing_shard(tmp_path, guarded):
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": torch.ones(1)}, str(d / "model-00001-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(HeaderError, match="'model-00002-of-00002.safetensors', which does not exist") as ei:
        fastckpt.load(d)
    assert "model.safetensors.index.json" in str(ei.value)


def test_c5j_index_and_header_disagree(tmp_path, guarded):
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": torch.ones(1)}, str(d / "s1.safetensors"))
    save_file({"b": torch.ones(1)}, str(d / "s2.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "s2.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(HeaderError, match="maps 'a' to 's2.safetensors' but that shard's header lacks it"):
        fastckpt.load(d)


def test_c5_guard_is_live(tmp_path, guarded):
    """The C5 fixture really catches allocations: a valid file trips it."""
    save_file({"a": torch.ones(1)}, str(tmp_path / "ok.safetensors"))
    with pytest.raises(AssertionError, match="allocated"):
        fastckpt.load(tmp_path / "ok.safetensors")
