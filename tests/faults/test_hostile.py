"""Hostile input (issue 7, case C5): fuzzed headers, unsafe paths, pickle payloads.

Every byte string handed to the header parser gives a typed error or a valid header, in
bounded time and memory; names from indexes/manifests never leave the folder; no load path
ever unpickles.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastckpt
from fastckpt.cli.main import main as cli_main
from fastckpt.errors import FastCkptError, HeaderError, UnsafePathError
from fastckpt.format.safetensors import parse_header
from fastckpt.storage.model_files import read_header

from faultkit import SAVE_OPTS, make_state

HERE = Path(__file__).parent
FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=list(HealthCheck), derandomize=True)


def parse_file_bytes(data: bytes, tmp: Path):
    """Write ``data`` as a file and run read_header + load on it; return the header or raise."""
    p = tmp / "f.safetensors"
    p.write_bytes(data)
    h = read_header(p)
    out = fastckpt.load(p)
    assert set(out) == set(h.tensors)
    return h


def _typed_or_valid(fn, *args):
    try:
        return fn(*args)
    except FastCkptError:
        return None
    # anything else (KeyError, RecursionError, RuntimeError, MemoryError...) fails the test


@FUZZ
@given(st.binary(max_size=512), st.integers(min_value=0, max_value=2**64 - 1))
def test_fuzz_parse_header_bytes(body, extra):
    t0 = time.perf_counter()
    _typed_or_valid(parse_header, body, 8 + len(body) + extra % 4096)
    assert time.perf_counter() - t0 < 1.0


_dtypes = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "C64", "f32", "", "F32 "])
_ints = st.one_of(st.integers(-2, 64), st.integers(2**31, 2**70), st.sampled_from([2**63 - 1, 2**63, 2**64]))
_entry = st.fixed_dictionaries({
    "dtype": st.one_of(_dtypes, st.integers(), st.none()),
    "shape": st.one_of(st.lists(_ints, max_size=4), st.integers(), st.none()),
    "data_offsets": st.one_of(st.lists(_ints, min_size=0, max_size=3), st.none()),
})
_header = st.dictionaries(st.one_of(st.sampled_from(["a", "b", "__metadata__", ""]), st.text(max_size=4)),
                          st.one_of(_entry, st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3),
                                                                                          st.integers())),
                                    st.none(), st.integers()), max_size=4)


@FUZZ
@given(_header, st.binary(max_size=64), st.integers(0, 2**64 - 1), st.booleans())
def test_fuzz_structured_files(tmp_path_factory, header, data, length, lie):
    """Plausible headers with hostile numbers, written as whole files and loaded."""
    body = json.dumps(header).encode()
    n = length if lie else len(body)
    blob = struct.pack("<Q", n) + body + data
    tmp = tmp_path_factory.mktemp("fz")
    tracemalloc.start()
    try:
        _typed_or_valid(parse_file_bytes, blob, tmp)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated for a {len(blob)}-byte file"


@pytest.mark.parametrize("n", [2**63, 2**64 - 1, 100, 10**9])
def test_length_field_never_sizes_an_allocation(tmp_path, n):
    """C5a/C5b: the length field says n, the file is tiny: typed error, no allocation of n bytes."""
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", n) + b"{}" + b" " * 40)
    tracemalloc.start()
    try:
        with pytest.raises(HeaderError) as ei:
            fastckpt.load(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(n) in str(ei.value) and str(p) in str(ei.value)
    assert peak < 1 << 20


@pytest.mark.parametrize("body", [
    b"[" * 100_000, b'{"a":' * 50_000,
    json.dumps({"a": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}}).encode(),
    json.dumps({"a": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}).encode(),
    json.dumps({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}}).encode(),
    json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": 5}).encode(),
    json.dumps({"__metadata__": {"k": 1}}).encode(), b"\xff\xfe{}", b"{}" + b"\0" * 8,
])
def test_hostile_headers_give_typed_errors(tmp_path, body):
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(FastCkptError):
        fastckpt.load(p)


# ----------------------------------------------------------------------------- unsafe paths
def _edit_manifest(ck: Path, fn) -> None:
    m = json.loads((ck / "manifest.json").read_text())
    fn(m)
    (ck / "manifest.json").write_text(json.dumps(m))


def _all_loaders(path):
    """Every public way to open a checkpoint path; each must raise."""
    yield lambda: fastckpt.load(path)
    yield lambda: fastckpt.load(path, verify=True)
    yield lambda: fastckpt.open_checkpoint(path)
    yield lambda: fastckpt.load(path, keys=["model"])


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "a\0b"])
def test_manifest_naming_outside_is_refused(tmp_path, bad):
    ck = fastckpt.save(make_state(1), tmp_path / "ck", **SAVE_OPTS)
    first = sorted(n for n in os.listdir(ck) if n.endswith(".safetensors"))[0]

    def rename(m):
        m["files"][bad] = m["files"].pop(first)
        for e in m["tensors"].values():
            if e.get("file") == first:
                e["file"] = bad
    _edit_manifest(ck, rename)
    for fn in _all_loaders(ck):
        with pytest.raises(UnsafePathError):
            fn()
    _verify_refuses(ck)


def _verify_refuses(ck):
    # verify reports the unsafe name as a problem (typed, named) and reads nothing; the CLI exits 1
    rep = fastckpt.verify(ck)
    assert not rep.ok and rep.bytes_checked == 0
    assert any(p.startswith("UnsafePathError:") for p in rep.problems), rep.problems
    assert cli_main(["verify", str(ck)]) == 1


def test_symlinked_files_are_read_through_and_still_checked(tmp_path):
    """A file of the folder may be a symlink to anywhere (the hub cache's snapshots/<rev>/ files
    point into blobs/): it is read through, bit-exact, and its checksums still apply; names that
    leave the folder stay refused (test_manifest_naming_outside_is_refused)."""
    from fastckpt.errors import ChecksumMismatchError
    want = make_state(1)
    ck = fastckpt.save(want, tmp_path / "ck", **SAVE_OPTS)
    first = sorted(n for n in os.listdir(ck) if n.endswith(".safetensors"))[0]
    os.rename(ck / first, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", ck / first)
    os.rename(ck / "state.json", tmp_path / "state.json")
    os.symlink(tmp_path / "state.json", ck / "state.json")
    for fn in _all_loaders(ck):
        fn()
    back = fastckpt.load(ck, verify=True)
    for k, v in want["model"].items():
        assert torch.equal(back["model"][k], v), k
    assert fastckpt.verify(ck).ok
    raw = bytearray((tmp_path / "elsewhere.safetensors").read_bytes())
    raw[-1] ^= 0x01  # flip a bit behind the symlink
    (tmp_path / "elsewhere.safetensors").write_bytes(bytes(raw))
    assert not fastckpt.verify(ck).ok
    with pytest.raises(ChecksumMismatchError):
        fastckpt.load(ck, verify=True)


@pytest.mark.parametrize("bad", ["../x.safetensors", "/tmp/x.safetensors"])
def test_hf_index_naming_outside_is_refused(tmp_path, bad):
    from safetensors.torch import save_file
    outside = tmp_path / "x.safetensors"
    save_file({"w": torch.ones(2)}, str(outside))
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"v": torch.ones(2)}, str(folder / "model-00001-of-00001.safetensors"))
    name = bad if bad.startswith("..") else str(outside)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": name, "v": "model-00001-of-00001.safetensors"}}))
    for fn in list(_all_loaders(folder))[:3]:
        with pytest.raises(UnsafePathError):
            fn()


def test_hf_folder_symlinked_shard_is_read_through(tmp_path):
    from safetensors.torch import save_file
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "blob.safetensors"))
    folder = tmp_path / "hf"
    folder.mkdir()
    os.symlink(tmp_path / "blob.safetensors", folder / "model.safetensors")
    assert torch.equal(fastckpt.load(folder)["w"], torch.arange(4.0))


# ----------------------------------------------------------------------------- no code execution
class _Payload:
    """Unpickling this creates the marker file: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _pickle_files(folder: Path, marker: Path) -> None:
    payload = _Payload(str(marker))
    if not (folder / "optimizer.pt").exists():  # a committed one is listed (with checksum) in the manifest
        torch.save({"state": payload}, folder / "optimizer.pt")
    torch.save({"state": payload}, folder / "scheduler.pt")
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(payload))
    (folder / "training_args.bin").write_bytes(pickle.dumps(payload))
    (folder / "rng_state.pth").write_bytes(pickle.dumps(payload))


def test_payload_is_live(tmp_path):
    """Control: the payload really creates the marker when unpickled (so the next test can fail)."""
    marker = tmp_path / "PWNED"
    pickle.loads(pickle.dumps(_Payload(str(marker))))
    assert marker.exists()


def test_loading_never_unpickles(tmp_path, monkeypatch):
    marker = tmp_path / "PWNED"
    # 1. a committed fastckpt checkpoint carrying pickle files (as extra files and loose files)
    ck = fastckpt.save(make_state(1), tmp_path / "run" / "step-1",
                       extra_files={"optimizer.pt": pickle.dumps(_Payload(str(marker)))}, **SAVE_OPTS)
    _pickle_files(ck, marker)
    # 2. an HF-like folder with only pickles, 3. a pickle named .safetensors, 4. an HF folder with both
    only = tmp_path / "only_pickles"
    only.mkdir()
    _pickle_files(only, marker)
    fake = tmp_path / "model.safetensors"
    fake.write_bytes(pickle.dumps(_Payload(str(marker))))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    from safetensors.torch import save_file
    save_file({"w": torch.ones(3)}, str(mixed / "model.safetensors"))
    _pickle_files(mixed, marker)

    calls = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append("pickle.loads"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: calls.append("pickle.load"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append("torch.load"))

    mgr = fastckpt.CheckpointManager(tmp_path / "run")
    assert mgr.load(1) is not None and mgr.load() is not None
    assert fastckpt.load(ck, verify=True) is not None
    assert fastckpt.verify(ck).ok
    assert cli_main(["verify", str(ck)]) == 0 and cli_main(["ls", str(tmp_path / "run")]) == 0
    assert set(fastckpt.load(mixed)) == {"w"}
    for bad in (only, fake, only / "optimizer.pt", only / "pytorch_model.bin"):
        with pytest.raises((FastCkptError, FileNotFoundError)):
            fastckpt.load(bad)
    try:
        from fastckpt.integrations.hf import trainer as hf_trainer
    except ImportError:
        hf_trainer = None
    if hf_trainer is not None and hasattr(hf_trainer, "get_last_checkpoint"):
        hf_trainer.get_last_checkpoint(tmp_path / "run")
    assert calls == [], f"a load path called {calls}"
    assert not marker.exists(), "loading a checkpoint executed code from it"


def test_atheris_header_fuzz():
    """Coverage-guided fuzzing of the header parser (atheris), 3000 runs in a subprocess."""
    pytest.importorskip("atheris")
    r = subprocess.run([sys.executable, str(HERE / "atheris_header.py"), "-runs=3000", "-max_len=256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
