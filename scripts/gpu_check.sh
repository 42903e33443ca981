#!/usr/bin/env bash
# GPU check for fastckpt's device loaders (issue 4). One prepared script, < 9 minutes worst case (timeouts), no network.
# Runs from the source tree through PYTHONPATH with the machine's own Python/torch build:
#   1. environment: torch/CUDA, pinned memory, kvikio (GDS) status;
#   2. the CUDA tests of tests/loading/test_device.py and test_device_memory.py (skipped on CPU) if pytest is there;
#   3. GB/s into device memory: fastckpt ring (pinned bounce buffers, side-stream copies),
#      kvikio if usable, and safetensors.load_file + .cuda() as the anchor, on GIB GiB (default 2)
#      in 2 files, page cache dropped before each run when we are root (else fadvise DONTNEED);
#   4. peak device memory of load_weights against the bound stated in load_tensors' docstring
#      (issue 15): torch.cuda.max_memory_allocated growth <= R + S with dtype conversion, R without.
# Usage: bash scripts/gpu_check.sh [GIB]     Output: human lines + JSON lines "RESULT {...}", "RESULT_MEM {...}".
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GIB="${1:-2}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/fastckpt-gpu.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

echo "== environment"
"$PY" - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
for m in ("safetensors", "xxhash", "pytest", "kvikio"):
    try:
        importlib.import_module(m); print(m, "ok")
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
from fastckpt.loading.device import kvikio_usable
print("kvikio/GDS usable:", kvikio_usable(torch.device("cuda", 0)) if torch.cuda.is_available() else False)
PY

echo "== CUDA tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/loading/test_device.py \
    tests/loading/test_device_memory.py::test_cuda_peak_device_memory_within_stated_bound || echo "TESTS FAILED"
else
  echo "pytest missing: skipped"
fi

echo "== bandwidth into device memory (${GIB} GiB, 2 files)"
timeout 200 "$PY" - "$WORK" "$GIB" <<'PY' || echo "BANDWIDTH RUN FAILED"
import json, os, resource, subprocess, sys, time
import torch
from fastckpt.loading.device import kvikio_usable, load_weights
from fastckpt.saving.export import plan_shards, write_shards
from fastckpt.loading.tp import Shard

work, gib = sys.argv[1], float(sys.argv[2])
assert torch.cuda.is_available(), "no CUDA device"
n = max(2, int(gib * 4))                      # 256 MiB tensors
entries = [(f"w{i}", "BF16", (8192, 16384), 256 << 20) for i in range(n)]
fill = {e[0]: torch.full((8192, 16384), float(i % 7), dtype=torch.bfloat16) for i, e in enumerate(entries[:1])}
write_shards(plan_shards(entries, (n // 2) * (256 << 20)), lambda names: {k: fill["w0"] for k in names}, work)
files = sorted(os.path.join(work, f) for f in os.listdir(work) if f.endswith(".safetensors"))
total = sum(os.path.getsize(f) for f in files)

def drop():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in files:
            fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
        return "fadvise"

def timed(fn):
    how = drop(); torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    dt = time.perf_counter() - t
    ok = bool(torch.equal(out["w0"][0, :4].cpu(), fill["w0"][0, :4])); del out; torch.cuda.empty_cache()
    return round(total / dt / 1e9, 3), ok, how

res = {"bytes": total}
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
res["ring_GBps"], res["ring_ok"], res["cache"] = timed(lambda: load_weights(work, "cuda:0", use_kvikio=False))
res["ring_rss_growth_MiB"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) // 1024
res["ring_1GiB_GBps"], _, _ = timed(lambda: load_weights(work, "cuda:0", use_kvikio=False, ring_bytes=1 << 30,
                                                        slot_bytes=32 << 20))
res["tp2_rank1_GBps"], _, _ = timed(lambda: load_weights(work, "cuda:0", use_kvikio=False,
                                                         shard=Shard(1, 2, {"*": 1})) | {"w0": fill["w0"]})
if kvikio_usable(torch.device("cuda", 0)):
    res["kvikio_GBps"], res["kvikio_ok"], _ = timed(lambda: load_weights(work, "cuda:0", use_kvikio=True))
try:
    from safetensors.torch import load_file
    res["safetensors_cuda_GBps"], _, _ = timed(lambda: {k: v for f in files for k, v in load_file(f, device="cuda:0").items()})
except ImportError:
    pass
res["ring_vs_safetensors"] = round(res["ring_GBps"] / res["safetensors_cuda_GBps"], 2) if "safetensors_cuda_GBps" in res else None
print("RESULT " + json.dumps(res))
PY

# ---------------------------------------------------------------------------------------------
# 4. Device memory bound (issue 15). Separate from the bandwidth run above; it prints
#    "MEMORY BOUND ok|OVER" per case and one "RESULT_MEM {...}" JSON line; it never stops the script.
# ---------------------------------------------------------------------------------------------
echo "== peak device memory vs stated bound (R + S converting, R otherwise)"
MEMDIR="$WORK/mem"; mkdir -p "$MEMDIR"
timeout 150 "$PY" - "$MEMDIR" <<'PY' || echo "MEMORY CHECK FAILED"
import json, sys
import torch
from safetensors.torch import save_file
from fastckpt.loading.device import kvikio_usable, load_weights
from fastckpt.loading.tp import Shard

d = sys.argv[1]
assert torch.cuda.is_available(), "no CUDA device"
g = torch.Generator().manual_seed(0)
sd = {f"w{i}": torch.randn(4096, 4096, generator=g) for i in range(8)}  # 512 MiB fp32
save_file(sd, f"{d}/f32.safetensors")
save_file({k: v.bfloat16() for k, v in sd.items()}, f"{d}/bf16.safetensors")
RING, SLOT = 64 << 20, 16 << 20
cases = [("plain fp32", "f32", None, None, False), ("fp32->bf16", "f32", torch.bfloat16, None, False),
         ("bf16->fp32", "bf16", torch.float32, None, False), ("tp 1/2 dim1 fp32", "f32", None, 1, False),
         ("tp 1/2 dim1 fp32->bf16", "f32", torch.bfloat16, 1, False)]
if kvikio_usable(torch.device("cuda", 0)):
    cases.append(("kvikio plain fp32", "f32", None, None, True))
res, ok_all = {}, True
for name, src, dt, dim, kv in cases:
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    out = load_weights(f"{d}/{src}.safetensors", "cuda:0", dtype=dt, use_kvikio=kv, ring_bytes=RING,
                       slot_bytes=SLOT, shard=Shard(1, 2, {"*": dim}) if dim is not None else None)
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - base
    r = sum(v.numel() * v.element_size() for v in out.values())
    bound = r + (SLOT if dt is not None else 0) + 512 * len(out)  # + the caching allocator's 512 B rounding
    want = sd["w3"].chunk(2, dim)[1] if dim is not None else sd["w3"]
    want = want.to(dt) if dt is not None else want
    same = bool(torch.equal(out["w3"].cpu(), want if src == "f32" else want.bfloat16().to(want.dtype)))
    ok = grew <= bound and same
    ok_all &= ok
    res[name] = {"grew_MiB": round(grew / 2**20, 1), "bound_MiB": round(bound / 2**20, 1), "values_ok": same}
    print(f"MEMORY BOUND {'ok' if ok else 'OVER'}: {name}: device memory grew {grew / 2**20:.1f} MiB, "
          f"bound {bound / 2**20:.1f} MiB, values {'ok' if same else 'WRONG'}")
    del out
res["all_ok"] = ok_all
print("RESULT_MEM " + json.dumps(res))
PY
