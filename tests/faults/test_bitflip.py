"""Bit flips in a committed shard (issue 7): verify and load(verify=True) name the file and the tensor."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random

import pytest

import fastckpt
from fastckpt.cli.main import main as cli_main

from faultkit import SAVE_OPTS, make_state


def _flip(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


@pytest.fixture
def ckpt(tmp_path):
    return fastckpt.save(make_state(3), tmp_path / "ck", metadata={"run": "abcdef"}, **SAVE_OPTS)


def _tensors(p):
    m = fastckpt.read_manifest(p)
    return [(k, e) for k, e in m.tensors.items() if e.file is not None and e.offsets[1] > e.offsets[0]]


def test_flip_in_every_tensor_is_named(ckpt):
    rng = random.Random(1)
    for key, e in _tensors(ckpt):
        fpath = os.path.join(ckpt, e.file)
        off = rng.randrange(*e.offsets)
        bit = rng.randrange(8)
        _flip(fpath, off, bit)
        rep = fastckpt.verify(ckpt)
        assert len(rep.problems) == 1, rep.problems
        assert repr(key) in rep.problems[0] and e.file in rep.problems[0]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["verify", str(ckpt)]) == 1
        assert f"tensor {key!r} in {e.file!r}" in out.getvalue()
        with pytest.raises(fastckpt.ChecksumMismatchError) as ei:
            fastckpt.load(ckpt, verify=True)
        assert ei.value.tensor == key and ei.value.path.endswith(e.file)
        assert e.file in str(ei.value) and key in str(ei.value)
        _flip(fpath, off, bit)  # restore
        assert fastckpt.verify(ckpt).ok


def test_flip_in_header_metadata_is_detected(ckpt):
    """A flip that keeps the header valid JSON (a metadata letter) was invisible before header checksums."""
    shard = sorted(n for n in os.listdir(ckpt) if n.endswith(".safetensors"))[0]
    fpath = os.path.join(ckpt, shard)
    data = open(fpath, "rb").read()
    _flip(fpath, data.index(b"abcdef"), 1)  # 'a' -> 'c'
    rep = fastckpt.verify(ckpt)
    assert not rep.ok and any(shard in p and "header" in p for p in rep.problems), rep.problems


def test_random_flips_anywhere_never_pass(ckpt):
    """200 random single-bit flips over every file of the checkpoint: verify (or resolve) always objects."""
    rng = random.Random(2)
    files = sorted(n for n in os.listdir(ckpt) if n != "manifest.json")
    for _ in range(200):
        name = rng.choice(files)
        fpath = os.path.join(ckpt, name)
        off, bit = rng.randrange(os.path.getsize(fpath)), rng.randrange(8)
        _flip(fpath, off, bit)
        try:
            rep = fastckpt.verify(ckpt)
            assert not rep.ok, f"flip of bit {bit} at byte {off} of {name} went unnoticed"
            assert any(name in p for p in rep.problems), rep.problems
            if name.endswith(".safetensors") or name == "state.json":  # what a load reads: it objects too
                with pytest.raises(fastckpt.CorruptCheckpointError):
                    fastckpt.load(ckpt, verify=True)
        finally:
            _flip(fpath, off, bit)
    assert fastckpt.verify(ckpt).ok


def test_flip_in_state_json_fails_every_load(ckpt):
    """A flip in state.json (a step 5 read as 4, an lr 0.001 as 0.000) loaded silently with checks on
    (only verify named it); load, load_into and load(verify=False) refuse it, verify names it once."""
    path = os.path.join(ckpt, "state.json")
    data = open(path, "rb").read()
    _flip(path, data.index(b'"step":3') + len(b'"step":'), 0)  # '3' -> '2': still valid JSON
    for call in (lambda: fastckpt.load(ckpt), lambda: fastckpt.load(ckpt, verify=False),
                 lambda: fastckpt.load_into(make_state(3), ckpt)):
        with pytest.raises(fastckpt.errors.ChecksumMismatchError, match="state.json"):
            call()
    rep = fastckpt.verify(ckpt)
    assert [p for p in rep.problems if "state.json" in p] == rep.problems and len(rep.problems) == 1, rep.problems


def test_truncated_shard_is_named(ckpt):
    key, e = _tensors(ckpt)[-1]
    fpath = os.path.join(ckpt, e.file)
    size = os.path.getsize(fpath) - 1
    os.truncate(fpath, size)
    rep = fastckpt.verify(ckpt)
    assert not rep.ok and e.file in rep.problems[0]
    # the re-reads name the file's real length (they said 'file ends at byte N' with N the read's start)
    reads = [p for p in rep.problems if "cannot read" in p]
    assert reads and all(f"is {size} bytes long" in p for p in reads), rep.problems
    with pytest.raises(fastckpt.CorruptCheckpointError) as ei:
        fastckpt.load(ckpt)
    assert e.file in str(ei.value)


def test_one_file_of_a_checkpoint_is_checked_against_its_manifest(tmp_path):
    """README's Quick start loads ``CKPT/model.safetensors`` by itself: a flipped bit in it came back
    as a value (``verify=True`` is the default) while ``fastckpt verify FILE`` named it (a README-only
    trial). The file's tensors are now checked against the checkpoint's manifest by load and
    load_into, also for a second adapter's file (``CKPT/second/adapter_model.safetensors``); a file
    replaced by one of another size is named; ``verify=False`` and files no manifest lists read as before."""
    import torch
    from safetensors.torch import save_file
    w = torch.arange(4096, dtype=torch.float32)
    state = {"model": {"w": w}, "second": {"lora_A.weight": w[:64].clone()}, "step": 2}
    ck = fastckpt.save(state, tmp_path / "ck", weights={"model": "model", "second": "second/adapter_model.safetensors"})
    model_file = fastckpt.read_manifest(ck).tensors["model/w"].file  # a peft layout: model-00001-of-00001
    for fname, key, value in ((model_file, "w", w), ("second/adapter_model.safetensors", "lora_A.weight", w[:64])):
        f = os.path.join(ck, fname)
        assert torch.equal(fastckpt.load(f)[key], value)
        e = next(e for e in fastckpt.read_manifest(ck).tensors.values() if e.file == fname)
        _flip(f, e.offsets[0] + 4 * 3, 6)
        with pytest.raises(fastckpt.ChecksumMismatchError, match=key):
            fastckpt.load(f)
        with pytest.raises(fastckpt.ChecksumMismatchError, match=key):
            fastckpt.load_into({key: torch.zeros_like(value)}, f)
        link = tmp_path / "serve" / os.path.basename(fname)  # a serving folder's symlink to it (a README trial)
        link.parent.mkdir(exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(f)
        with pytest.raises(fastckpt.ChecksumMismatchError, match=key):
            fastckpt.load(link)
        assert not torch.equal(fastckpt.load(f, verify=False)[key], value)  # asked not to check: read as stored
        _flip(f, e.offsets[0] + 4 * 3, 6)
    f = os.path.join(ck, model_file)
    save_file({"w": torch.zeros(8)}, f)  # replaced behind the manifest's back
    with pytest.raises(fastckpt.CorruptCheckpointError, match="bytes on disk"):
        fastckpt.load(f)
    plain = tmp_path / "plain.safetensors"  # no manifest: read as any safetensors file
    save_file({"w": w}, str(plain))
    assert torch.equal(fastckpt.load(plain)["w"], w)
