"""Peak memory of device.py's load paths: the bound stated in `load_tensors`' docstring, measured.

CPU bound (bytes): host RSS grows by at most ``R + B + S`` (``R``: bytes of the returned tensors,
in the returned dtype; ``B``: ring_bytes; ``S``: slot_bytes). Each measurement runs in a fresh
subprocess: import torch and fastckpt, one tiny warm-up load with the same options (thread pool,
OpenMP workers, lazily imported modules: one-time costs that are not the load's), then the load;
growth = ``ru_maxrss`` after the load minus the resident set right before it (VmRSS, which is <=
the ``ru_maxrss`` baseline, so this never under-counts). The child is forked by ``sh``, not
exec'd from pytest: ``ru_maxrss`` keeps the high-water mark of the process that exec'd, and the
child checks that its baseline high-water mark is its own.

ALLOW (8 MiB) is the fixed slack: per-allocation page rounding of the destinations (< 4 KiB
each, 40 tensors here), Python objects of the returned dict and the plan, malloc arena growth
of the ring's worker threads and their touched stack pages. Measured here, every case stays
under ``R + B + S`` itself (plain 96 MiB fp32: 104.0 MiB of a 106 MiB bound); the regression this
guards against (a stored-dtype twin of each tensor, as before per-piece conversion) measured
152 MiB for fp32->bf16 (bound 58), 150 MiB for bf16->fp32 (bound 106), 80 MiB for TP+bf16 (bound 34).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from fastckpt.format.safetensors import TensorInfo
from fastckpt.loading import device as dev
from fastckpt.loading.device import ENGINES, AcceleratorEngine, Target, load_weights, plan_pieces
from fastckpt.loading.tp import Shard, slice_spec
from fastckpt.storage.memory import host_buffer

MiB = 1 << 20
RING, SLOT = 8 * MiB, 2 * MiB
ALLOW = 8 * MiB


# --- correctness of per-piece conversion -----------------------------------------------------

def _write_raw(path, tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file with tensors packed in the given order (offsets need not be aligned)."""
    header, off = {}, 0
    for name, dt, shape, data in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(t[3] for t in tensors))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture()
def misaligned(tmp_path):
    """F32/BF16/F64 tensors at file offsets that are not multiples of their element size."""
    torch.manual_seed(1)
    sd = {"pad": torch.arange(3, dtype=torch.uint8), "w": torch.randn(96, 130),
          "h": torch.randn(33, 70).bfloat16(), "pad2": torch.arange(1, dtype=torch.uint8),
          "d": torch.randn(40, 64, dtype=torch.float64)}
    codes = {torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16", torch.float64: "F64"}
    p = tmp_path / "mis.safetensors"
    _write_raw(p, [(k, codes[v.dtype], tuple(v.shape), _raw(v)) for k, v in sd.items()])
    return p, sd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("slot", [1 << 12, 4098, 1000])
def test_conversion_per_piece_equals_whole_tensor_conversion(misaligned, dtype, slot):
    p, sd = misaligned
    out = load_weights(p, "cpu", dtype=dtype, ring_bytes=4 * slot, slot_bytes=slot)
    for k, v in sd.items():
        want = v.to(dtype) if v.dtype.is_floating_point else v
        assert out[k].dtype == want.dtype and torch.equal(out[k], want), (k, dtype, slot)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float64])
def test_tp_slices_with_conversion_misaligned(misaligned, dtype):
    p, sd = misaligned
    dims = {"w": 1, "h": 1, "d": 0}
    for r in range(2):
        out = load_weights(p, "cpu", dtype=dtype, shard=Shard(r, 2, dims), keys=list(dims),
                           ring_bytes=1 << 14, slot_bytes=1 << 12)
        for k, d in dims.items():
            want = sd[k].chunk(2, d)[r]
            want = want.to(dtype) if dtype is not None else want
            assert torch.equal(out[k], want), (k, r, dtype)


def test_plan_cuts_tensors_at_element_boundaries():
    infos = [TensorInfo("a", "F32", (1000,), 0, 4000), TensorInfo("b", "F64", (300,), 4000, 6400)]
    targets = [Target(i.name, "f", 3 + i.start, i) for i in infos]
    for slot in (1001, 1003, 4098):
        for p in plan_pieces(targets, slot):
            assert p.nbytes <= slot
            for c in p.copies:
                isz = 4 if c.dest == 0 else 8
                assert c.dst_off % isz == 0 and c.nbytes % isz == 0, (slot, c)
    rows = TensorInfo("r", "F32", (4, 1 << 17), 0, 4 * (1 << 19))  # per-row segments
    t = Target("r", "f", 0, rows, slice_spec(rows, 1, 1, 2))
    assert all(c.nbytes % 4 == 0 for p in plan_pieces([t], 1001) for c in p.copies)
    with pytest.raises(ValueError, match="smaller than one element"):
        plan_pieces(targets, 6)


class _FakeMod:
    """Stands in for ``torch.cuda`` on CPU: streams and events are no-ops (copies are synchronous)."""

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    class Event:
        def record(self, stream):
            pass

        def synchronize(self):
            pass

    @staticmethod
    def stream(s):
        import contextlib
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device):
        return None


def test_accelerator_engine_converts_through_one_reserved_scratch(misaligned, monkeypatch):
    """The CUDA/NPU code path (reserve + convert on the side stream), run on CPU with a fake module."""
    p, sd = misaligned
    seen = {}

    class Fake(AcceleratorEngine):
        def host_slot(self, nbytes):
            return host_buffer(nbytes)  # not pinned: no accelerator here

        def reserve(self, nbytes):
            seen["reserve"] = seen.get("reserve", 0) + 1
            seen["scratch"] = nbytes
            super().reserve(nbytes)

        def empty(self, nbytes):
            seen["dest"] = seen.get("dest", 0) + nbytes
            return super().empty(nbytes)

    monkeypatch.setitem(ENGINES, "meta", lambda d: Fake(torch.device("cpu"), _FakeMod))
    slot = 4096
    out = load_weights(p, "meta", dtype=torch.bfloat16, ring_bytes=4 * slot, slot_bytes=slot,
                       shard=Shard(1, 2, {"w": 1}))
    assert seen["reserve"] == 1 and 0 < seen["scratch"] <= slot
    assert seen["dest"] == sum(v.numel() * v.element_size() for v in out.values())  # R, nothing more
    assert torch.equal(out["w"], sd["w"].chunk(2, 1)[1].bfloat16())
    assert torch.equal(out["d"], sd["d"].bfloat16()) and torch.equal(out["pad"], sd["pad"])


# --- measured peak RSS against the stated bound ----------------------------------------------

CHILD = textwrap.dedent("""
    import json, resource, sys, torch
    from fastckpt.loading.device import load_weights
    from fastckpt.loading.tp import Shard
    path, tiny, ring, slot, dt, shard = sys.argv[1:7]
    kw = dict(ring_bytes=int(ring), slot_bytes=int(slot), threads=4,
              dtype=getattr(torch, dt) if dt != "none" else None,
              shard=Shard(1, 2, {"w*": 1, "v*": 0, "u*": 1}) if shard == "tp" else None)
    load_weights(tiny, "cpu", **kw)  # warm-up: threads, OpenMP pool, lazy imports
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) * 1024
    base = rss()
    hw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert hw <= base + (8 << 20), f"ru_maxrss {hw >> 20} MiB >> RSS {base >> 20} MiB: inherited high-water mark"
    out = load_weights(path, "cpu", **kw)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"grew": peak - base, "result": sum(v.numel() * v.element_size() for v in out.values()),
                      "dtypes": sorted({str(v.dtype) for v in out.values()})}))
""")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    torch.manual_seed(0)
    # 96 MiB of fp32: 12 row-split (dim 1) and 12 dim-0-split 2 MiB tensors, and 8 of 6 MiB
    sd = {f"w{i}": torch.randn(512, 1024) for i in range(12)}
    sd |= {f"v{i}": torch.randn(512, 1024) for i in range(12)}
    sd |= {f"u{i}": torch.randn(1536, 1024) for i in range(8)}
    save_file(sd, d / "f32.safetensors")
    save_file({k: v.bfloat16() for k, v in sd.items()}, d / "bf16.safetensors")
    save_file({"w0": torch.randn(8, 16), "v0": torch.randn(8, 16)}, d / "tiny32.safetensors")
    save_file({"w0": torch.randn(8, 16).bfloat16(), "v0": torch.randn(8, 16).bfloat16()},
              d / "tiny16.safetensors")
    return d


def _measure(files, src: str, dtype: str, shard: str) -> dict:
    tiny = files / ("tiny16.safetensors" if src.startswith("bf16") else "tiny32.safetensors")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    # Started through sh, which forks it: Linux carries the RSS high-water mark of the exec'ing
    # process into ru_maxrss, so a child exec'd straight from pytest would report pytest's own peak.
    res = subprocess.run(["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c", CHILD, str(files / src),
                          str(tiny), str(RING), str(SLOT), dtype, shard],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("src,dtype,shard,result_mib,out_dtype", [
    ("f32.safetensors", "none", "none", 96, "torch.float32"),       # plain load
    ("f32.safetensors", "bfloat16", "none", 48, "torch.bfloat16"),  # fp32 -> bf16
    ("bf16.safetensors", "float32", "none", 96, "torch.float32"),   # bf16 -> fp32
    ("f32.safetensors", "none", "tp", 48, "torch.float32"),         # TP slice, rank 1 of 2
    ("f32.safetensors", "bfloat16", "tp", 24, "torch.bfloat16"),    # TP slice + conversion
])
def test_peak_rss_within_stated_bound(files, src, dtype, shard, result_mib, out_dtype):
    m = _measure(files, src, dtype, shard)
    assert m["result"] == result_mib * MiB and m["dtypes"] == [out_dtype]
    bound = m["result"] + RING + SLOT  # load_tensors' docstring: R + B + S on cpu
    assert m["grew"] <= bound + ALLOW, (
        f"{src} dtype={dtype} shard={shard}: peak RSS grew {m['grew'] / MiB:.1f} MiB, bound "
        f"R + B + S = {bound / MiB:.0f} MiB (+{ALLOW // MiB} MiB allowance)")
    assert m["grew"] >= m["result"] // 2  # the measurement sees the result itself (not a no-op)


def test_default_ring_is_the_documented_one():
    assert (dev.DEFAULT_RING_BYTES, dev.DEFAULT_SLOT_BYTES) == (256 * MiB, 16 * MiB)
    assert "R + B + S" in dev.load_tensors.__doc__ and "R + S" in dev.load_tensors.__doc__


# --- CUDA device memory (skipped without CUDA; scripts/gpu_check.sh runs a larger check) -----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("src,dtype,shard", [("f32.safetensors", None, False), ("f32.safetensors", "bfloat16", False),
                                             ("bf16.safetensors", "float32", False), ("f32.safetensors", "bfloat16", True)])
def test_cuda_peak_device_memory_within_stated_bound(files, src, dtype, shard):
    """Device bound of load_tensors: R + S when converting, R otherwise (+ the allocator's 512 B rounding)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = load_weights(files / src, "cuda:0", use_kvikio=False, ring_bytes=RING, slot_bytes=SLOT,
                       dtype=getattr(torch, dtype) if dtype else None,
                       shard=Shard(1, 2, {"w*": 1, "v*": 0, "u*": 1}) if shard else None)
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - base
    r = sum(v.numel() * v.element_size() for v in out.values())
    bound = r + (SLOT if dtype else 0)
    assert grew <= bound + 512 * len(out), f"device memory grew {grew / MiB:.1f} MiB, bound {bound / MiB:.1f} MiB"
