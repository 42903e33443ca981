"""Device loading: the bounce ring (on CPU and a sink device), TP slicing, dtype, ownership, bounded RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastckpt
from fastckpt.loading.device import (ENGINES, Engine, Target, get_engine, load_tensors, load_weights,
                                  plan_pieces)
from fastckpt.errors import ChecksumMismatchError
from fastckpt.format.safetensors import TensorInfo
from fastckpt.loading.resolve import resolve
from fastckpt.loading.tp import Shard, slice_spec

RING = dict(ring_bytes=1 << 16, slot_bytes=1 << 14)  # 4 slots of 16 KiB: every tensor crosses slots


@pytest.fixture()
def weights(tmp_path):
    torch.manual_seed(0)
    sd = {"a": torch.randn(300, 200), "b": torch.randn(7), "c": torch.randn(64, 3000).to(torch.bfloat16),
          "d": torch.arange(10, dtype=torch.int64), "e": torch.randn(4, 8, 6), "empty": torch.randn(0, 3),
          "s": torch.tensor(3.5)}
    p = tmp_path / "m.safetensors"
    save_file(sd, p)
    return p, sd


def test_plan_pieces_bounded_and_cover_every_byte():
    infos = [TensorInfo(f"t{i}", "U8", (n,), 0, n) for i, n in enumerate([10, 20, 5000, 3, 70000])]
    off, targets = 0, []
    for i in infos:
        targets.append(Target(i.name, "f", off, i))
        off += i.nbytes
    pieces = plan_pieces(targets, 4096)
    assert all(p.nbytes <= 4096 for p in pieces)
    covered = {}
    for p in pieces:
        for c in p.copies:
            assert c.src_off + c.nbytes <= p.nbytes
            covered[c.dest] = covered.get(c.dest, 0) + c.nbytes
    assert covered == {i: t.nbytes for i, t in enumerate(targets)}
    assert len(pieces[0].copies) == 2  # adjacent small tensors share one read


def test_plan_dim0_slice_reads_only_its_range():
    info = TensorInfo("w", "F32", (8, 1024), 0, 8 * 1024 * 4)
    t = Target("w", "f", 100, info, slice_spec(info, 0, 1, 4))
    pieces = plan_pieces([t], 1 << 20)
    assert [(p.offset, p.nbytes) for p in pieces] == [(100 + 2 * 4096, 2 * 4096)]


def test_plan_dim1_large_segments_read_alone():
    info = TensorInfo("w", "F32", (4, 1 << 17), 0, 4 * (1 << 19))
    t = Target("w", "f", 0, info, slice_spec(info, 1, 1, 2))
    pieces = plan_pieces([t], 1 << 20)
    assert sum(p.nbytes for p in pieces) == t.nbytes  # only the rank's bytes
    assert [p.offset for p in pieces] == [r * (1 << 19) + (1 << 18) for r in range(4)]


def test_slice_spec_errors():
    info = TensorInfo("w", "F32", (6, 4), 0, 96)
    with pytest.raises(ValueError, match="not divisible"):
        slice_spec(info, 0, 0, 4)
    with pytest.raises(ValueError, match="no dim 2"):
        slice_spec(info, 2, 0, 2)
    with pytest.raises(ValueError):
        Shard(2, 2)


def test_ring_on_cpu_matches_safetensors(weights):
    p, sd = weights
    out = load_weights(p, "cpu", **RING)
    assert out.keys() == sd.keys()
    for k in sd:
        assert torch.equal(out[k], sd[k]), k


def test_dtype_conversion_floats_only(weights):
    p, sd = weights
    out = load_weights(p, "cpu", dtype=torch.float16, **RING)
    assert out["a"].dtype == torch.float16 and out["c"].dtype == torch.float16
    assert out["d"].dtype == torch.int64 and torch.equal(out["d"], sd["d"])
    torch.testing.assert_close(out["a"], sd["a"].half())


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_tp_slices_equal_chunks(weights, ws):
    p, sd = weights
    dims = {"a": 1, "c": -1, "e": 1, "b": 0, "d": 0}
    for r in range(ws):
        sh = Shard(r, ws, {"a": 1, "c": -1, "e": 1, "d*": 0})
        keys = ["a", "c", "e", "b"] + (["d"] if 10 % ws == 0 else [])
        out = load_weights(p, "cpu", shard=sh, keys=keys, **RING)
        for k in keys:
            want = sd[k].chunk(ws, dims[k])[r] if k != "b" else sd["b"]
            assert torch.equal(out[k], want), (k, ws, r)


def test_selected_keys_and_missing_key(weights):
    p, sd = weights
    assert list(load_weights(p, "cpu", keys=["b"], **RING)) == ["b"]
    with pytest.raises(KeyError, match="nope"):
        load_weights(p, "cpu", keys=["nope"])


def test_returned_tensors_own_their_memory(weights):
    p, sd = weights
    r = resolve(p)
    first = load_tensors(r, ["a", "b"], "cpu", **RING)
    ptrs = {first["a"].untyped_storage().data_ptr(), first["b"].untyped_storage().data_ptr()}
    assert len(ptrs) == 2
    load_tensors(r, ["c", "e", "a"], "cpu", **RING)  # a second load reuses nothing of the first
    assert torch.equal(first["a"], sd["a"]) and torch.equal(first["b"], sd["b"])
    assert first["a"].untyped_storage().nbytes() == sd["a"].numel() * 4


def test_verify_catches_flipped_byte_in_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    fastckpt.save({"model": {"w": torch.randn(1000, 50)}}, ck)
    man = json.loads((ck / "manifest.json").read_text())
    e = man["tensors"]["model/w"]
    with open(ck / e["file"], "r+b") as f:
        f.seek(e["offsets"][0] + 4000)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ChecksumMismatchError, match="model/w"):
        load_tensors(resolve(ck), ["model/w"], "cpu", verify=True, **RING)


def test_load_routes_non_cpu_devices_through_the_ring(weights, monkeypatch):
    """`fastckpt.load(device=...)` uses the engine registry: a registered sink device sees every byte."""
    p, sd = weights
    seen = []

    class Recording(Engine):
        def copy(self, dst, src):
            seen.append((src.numel(), int(src.to(torch.int64).sum())))
            super().copy(dst, src)

    monkeypatch.setitem(ENGINES, "meta", lambda dev: Recording(torch.device("cpu")))
    out = fastckpt.load(p, device="meta")
    raw = [t.reshape(-1).view(torch.uint8) for t in sd.values()]
    assert sum(n for n, _ in seen) == sum(r.numel() for r in raw)
    assert sum(s for _, s in seen) == sum(int(r.to(torch.int64).sum()) for r in raw)  # every byte arrived
    for k in sd:
        assert out[k].device.type == "meta" and out[k].shape == sd[k].shape and out[k].dtype == sd[k].dtype


def test_ring_needs_two_slots(weights):
    with pytest.raises(ValueError, match="ring_bytes"):
        load_weights(weights[0], "cpu", ring_bytes=1 << 14, slot_bytes=1 << 14)
    with pytest.raises(ValueError, match="no device engine"):
        get_engine("xla:0")


RSS_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from fastckpt.loading.device import ENGINES, Engine, load_weights

    class Sink(Engine):
        # destinations live on the meta device: only the bounce ring uses host memory
        def empty(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        def copy(self, dst, src):
            self.bytes = getattr(self, "bytes", 0) + src.numel()

    eng = {}
    ENGINES["meta"] = lambda dev: eng.setdefault("e", Sink(dev))
    load_weights(sys.argv[1], "meta", ring_bytes=1 << 20, slot_bytes=1 << 19)  # warm up imports/threads
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    eng.clear()
    out = load_weights(sys.argv[1], "meta", ring_bytes=int(sys.argv[2]), slot_bytes=int(sys.argv[3]), threads=4)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(peak - base, eng["e"].bytes, len(out))
""")


def test_peak_rss_stays_within_ring(tmp_path):
    n_tensors, each = 24, 16 << 20  # 384 MiB of weights, 24x the ring
    ring, slot = 16 << 20, 4 << 20
    p = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.full((each // 4,), float(i)) for i in range(n_tensors)}, p)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(p), str(ring), str(slot)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    grew, copied, count = map(int, res.stdout.split())
    assert copied == n_tensors * each and count == n_tensors
    assert grew <= ring + (32 << 20), f"peak RSS grew by {grew / 2**20:.0f} MiB with a {ring >> 20} MiB ring"


def test_safetensors_round_trip_reference(weights):
    p, sd = weights
    ref = load_file(p)
    out = load_weights(p, "cpu", **RING)
    assert all(torch.equal(ref[k], out[k]) for k in ref)


# --- real accelerators (skipped cleanly without one; run by scripts/gpu_check.sh) -------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
def test_cuda_ring_matches_and_owns_memory(weights):
    p, sd = weights
    out = load_weights(p, "cuda:0", use_kvikio=False, **RING)
    for k in sd:
        assert out[k].device.type == "cuda" and torch.equal(out[k].cpu(), sd[k]), k


@cuda
def test_cuda_tp_and_dtype(weights):
    p, sd = weights
    out = load_weights(p, "cuda:0", shard=Shard(1, 2, {"a": 1}), dtype=torch.bfloat16, keys=["a"], **RING)
    assert torch.equal(out["a"].cpu(), sd["a"].chunk(2, 1)[1].bfloat16())


@cuda
def test_fastckpt_load_to_cuda(weights):
    p, sd = weights
    out = fastckpt.load(p, device="cuda:0")
    assert all(torch.equal(out[k].cpu(), sd[k]) for k in sd)
