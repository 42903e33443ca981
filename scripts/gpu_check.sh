#!/usr/bin/env bash
# GPU check for fastckpt's device loaders (issue 4) and DTensor saves/loads on CUDA (issue 13). One prepared script,
# no network; each step has a timeout (180 + 200 + 150 + 120 + 300 + 240 s worst case; the whole script took
# 137 s on an H200 machine); step 5 moves 512 MiB, step 6 DT_GIB GiB (default 4), step 7 5 x FIRST_GIB GiB.
# Runs from the source tree through PYTHONPATH with the machine's own Python/torch build:
#   1. environment: torch/CUDA, pinned memory, kvikio (GDS) status;
#   2. the CUDA tests of tests/loading/test_device.py and test_device_memory.py (skipped on CPU) if pytest is there;
#   3. GB/s into device memory: fastckpt ring (pinned bounce buffers, side-stream copies),
#      kvikio if usable, and safetensors.load_file + .cuda() as the anchor, on GIB GiB (default 2)
#      in 2 files, page cache dropped before each run when we are root (else fadvise DONTNEED);
#   4. peak device memory of load_weights against the bound stated in load_tensors' docstring
#      (issue 15): torch.cuda.max_memory_allocated growth <= R + S with dtype conversion, R without;
#   5. 2 ranks with a CUDA DTensor state (issue 13): staging to (pinned) host memory, async_save,
#      load_into bit-exact and its device memory growth against its bound;
#   6. a multi-GB CUDA DTensor state on a 1-rank mesh (issue 21): save / async_save with the sources
#      overwritten after the call, loaded back on the host and on the GPU, compared byte for byte;
#   7. the first async_save of a fresh process (CPU and CUDA states) against one memory copy.
# Usage: [DT_GIB=4] [FIRST_GIB=1] [STEPS="1 2 3 4 5 6 7"] bash scripts/gpu_check.sh [GIB]
# Exit status: 1 when any step failed, else 0 (a summary line says which).
# Output: human lines + JSON lines "RESULT {...}", "RESULT_MEM {...}", "RESULT_DIST {...}", "RESULT_DTENSOR {...}",
# "RESULT_FIRST {...}".
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GIB="${1:-2}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/fastckpt-gpu.XXXXXX)"
LOG="$(mktemp /tmp/fastckpt-gpu-log.XXXXXX)"
trap 'rm -rf "$WORK" "$LOG"' EXIT
exec > >(tee "$LOG") 2>&1  # the summary at the end reads every step's lines from here
# STEPS: the steps to run (default all, "1 2 3 4 5 6 7"), e.g. STEPS="6 7" within a short lease
want() { [[ " ${STEPS:-1 2 3 4 5 6 7} " == *" $1 "* ]]; }

if want 1; then
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
fi

if want 2; then
echo "== CUDA tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/loading/test_device.py \
    tests/loading/test_device_memory.py::test_cuda_peak_device_memory_within_stated_bound || echo "TESTS FAILED"
else
  echo "pytest missing: skipped"
fi
fi

if want 3; then
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
fi

# ---------------------------------------------------------------------------------------------
# 4. Device memory bound (issue 15). Separate from the bandwidth run above; it prints
#    "MEMORY BOUND ok|OVER" per case and one "RESULT_MEM {...}" JSON line; it never stops the script.
# ---------------------------------------------------------------------------------------------
if want 4; then
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
fi

# ---------------------------------------------------------------------------------------------
# 5. Distributed (issue 13): 2 ranks (gloo; one GPU each, or both on cuda:0 when there is one),
#    a Shard(0) DTensor state of 512 MiB fp32 on CUDA:
#    a. FastCkptStager.stage (the snapshot async saves take): GB/s device->host, whether the staged
#       copies are pinned, against a plain copy into pinned memory measured in the same run;
#    b. fastckpt.async_save of the DTensor state: blocking and total seconds; each rank's rows in the
#       safetensors file equal its CUDA shard;
#    c. fastckpt.load_into into zeroed CUDA DTensors: bit-exact, and device memory growth (peak of
#       torch.cuda.max_memory_allocated over the call) against the bound: in place, so at most
#       load_into's buffer_bytes (64 MiB default, were a device-side bounce used).
#    Prints "DIST ok|FAIL: ..." lines and one "RESULT_DIST {...}" JSON line; never stops the script.
#    FASTCKPT_GPU_CHECK_CPU=1 runs the same code on CPU tensors (a dry run of the script's logic).
# ---------------------------------------------------------------------------------------------
if want 5; then
echo "== distributed: DTensor on CUDA staged to host, async_save, load_into device memory bound"
DISTDIR="$WORK/dist"; mkdir -p "$DISTDIR"
cat > "$WORK/dist_check.py" <<'PY'
import json, os, sys, time
import torch
import torch.multiprocessing as mp

CPU = os.environ.get("FASTCKPT_GPU_CHECK_CPU") == "1"
ROWS, COLS, N = 4096, 4096, 8            # 8 x 64 MiB fp32 = 512 MiB, 256 MiB per rank
if CPU:
    ROWS, COLS = 512, 256


def rank(r, d):
    import torch.distributed as dist
    import fastckpt
    from fastckpt.dcp import FastCkptStager
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=r, world_size=2)
    dev = "cpu" if CPU else f"cuda:{r % torch.cuda.device_count()}"
    if not CPU:
        torch.cuda.set_device(dev)
    mesh = init_device_mesh("cpu" if CPU else "cuda", (2,))
    half = ROWS // 2

    def state(fill):
        out = {}
        for i in range(N):
            g = torch.Generator().manual_seed(1000 * i + r)
            t = (torch.randn(half, COLS, generator=g) if fill else torch.zeros(half, COLS)).to(dev)
            out[f"w{i}"] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(ROWS, COLS),
                                              stride=(COLS, 1))
        return {"model": out}

    def sync():
        if not CPU:
            torch.cuda.synchronize()

    s = state(True)
    shard = N * half * COLS * 4
    res = {"rank": r, "shard_MiB": shard >> 20}
    stager = FastCkptStager()
    stager.stage(s); sync()                                   # first call allocates the buffer
    t = time.perf_counter(); staged = stager.stage(s); sync(); dt = time.perf_counter() - t
    res["stage_GBps"] = round(shard / dt / 1e9, 2)
    res["staged_pinned"] = bool(staged["model"]["w0"].to_local().is_pinned()) if not CPU else None
    ref = torch.empty(half, COLS, pin_memory=not CPU)
    t = time.perf_counter()
    for v in s["model"].values():
        ref.copy_(v.to_local(), non_blocking=True)
    sync(); res["pinned_copy_GBps"] = round(shard / (time.perf_counter() - t) / 1e9, 2)
    del staged; stager.close()

    path = os.path.join(d, "ck")
    dist.barrier()
    t = time.perf_counter(); fut = fastckpt.async_save(s, path); res["save_blocking_s"] = round(time.perf_counter() - t, 3)
    fut.result(); res["save_total_s"] = round(time.perf_counter() - t, 3)
    dist.barrier()
    ix = os.path.join(path, "model.safetensors.index.json")  # one shard: model.safetensors, no index
    index = json.load(open(ix))["weight_map"] if os.path.exists(ix) else {k: "model.safetensors" for k in s["model"]}
    same = True
    for k, v in s["model"].items():
        with safe_open(os.path.join(path, index[k]), "pt") as f:
            same &= torch.equal(f.get_slice(k)[r * half:(r + 1) * half], v.to_local().cpu())
    res["file_rows_equal_shard"] = bool(same)

    fresh = state(False); sync()
    if not CPU:
        torch.cuda.empty_cache(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter(); fastckpt.load_into(fresh, path); sync()
    res["load_into_s"] = round(time.perf_counter() - t, 3)
    grew = (torch.cuda.max_memory_allocated() - base) if not CPU else 0
    res["load_into_device_grew_MiB"] = round(grew / 2**20, 1)
    res["load_into_bound_MiB"] = 64
    res["load_into_bit_exact"] = all(torch.equal(fresh["model"][k].to_local(), s["model"][k].to_local()) for k in s["model"])
    dist.barrier()
    with open(os.path.join(d, f"r{r}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    d = sys.argv[1]
    assert CPU or torch.cuda.is_available(), "no CUDA device"
    mp.spawn(rank, args=(d,), nprocs=2, join=True)
    rows = [json.load(open(os.path.join(d, f"r{r}.json"))) for r in range(2)]
    ok_all = True
    for x in rows:
        checks = {"staged copies pinned" + (" (n/a: CPU dry run)" if CPU else ""): x["staged_pinned"] in (True, None),
                  "file rows == CUDA shard": x["file_rows_equal_shard"],
                  "load_into bit-exact": x["load_into_bit_exact"],
                  f"load_into device growth {x['load_into_device_grew_MiB']} MiB <= 64 MiB":
                      x["load_into_device_grew_MiB"] <= x["load_into_bound_MiB"]}
        for name, ok in checks.items():
            ok_all &= bool(ok)
            print(f"DIST {'ok' if ok else 'FAIL'}: rank {x['rank']}: {name}")
    print("RESULT_DIST " + json.dumps({"ranks": rows, "all_ok": ok_all, "cpu_dry_run": CPU}))
PY
# a file, not stdin: the spawned ranks import the script's functions from it
timeout 120 "$PY" "$WORK/dist_check.py" "$DISTDIR" || echo "DISTRIBUTED CHECK FAILED"
fi

# ---------------------------------------------------------------------------------------------
# 6. Multi-GB CUDA DTensor save compared after load (issue 21, the device-copy layer): one process,
#    a 1-rank DeviceMesh on cuda:0 (two ranks cannot share one GPU under torchrun), DT_GIB GiB
#    (default 4) of DTensors (Shard(0) fp32 and bf16, a Replicate() tensor) generated on the GPU
#    from fixed seeds. a. fastckpt.save, then fastckpt.load(verify=True) on the host and on cuda:0:
#    every tensor equals its regenerated source byte for byte; b. fastckpt.async_save, then the
#    sources are overwritten on the GPU as soon as the call returned: the checkpoint still holds the
#    values of the call (the device->host copies completed before async_save returned, and before
#    any byte was hashed or written). Prints "DTENSOR ok|FAIL: ..." lines and one
#    "RESULT_DTENSOR {...}" JSON line; never stops the script. No GPU: skipped (FASTCKPT_GPU_CHECK_CPU=1
#    runs it on CPU with 64 MiB, a dry run of the logic).
# ---------------------------------------------------------------------------------------------
if want 6; then
echo "== 1-rank CUDA DTensor save of ${DT_GIB:-4} GiB, compared after load"
DTDIR="$WORK/dt"; mkdir -p "$DTDIR"
timeout 300 "$PY" - "$DTDIR" "${DT_GIB:-4}" <<'PY' || echo "DTENSOR CHECK FAILED"
import json, os, sys, time
import torch
import torch.distributed as dist

d, gib = sys.argv[1], float(sys.argv[2])
CPU = os.environ.get("FASTCKPT_GPU_CHECK_CPU") == "1"
if not CPU and not torch.cuda.is_available():
    print("DTENSOR skipped: no CUDA device")
    sys.exit(0)
import fastckpt
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

dev = "cpu" if CPU else "cuda:0"
if not CPU:
    torch.cuda.set_device(0)
dist.init_process_group("gloo" if CPU else "cpu:gloo,cuda:nccl", init_method=f"file://{d}/store", rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu" if CPU else "cuda", (1,))
each = (64 << 20) if CPU else (256 << 20)            # bytes per tensor
total = (64 << 20) if CPU else int(gib * (1 << 30))
n = max(3, total // each)
cols = 4096


def make(i):
    """Tensor i, regenerated from its seed on the device (fp32 Shard(0), bf16 Shard(0), fp32 Replicate)."""
    g = torch.Generator(device=dev).manual_seed(i)
    dt = torch.bfloat16 if i % 3 == 1 else torch.float32
    rows = each // (cols * dt.itemsize)
    return torch.randn(rows, cols, generator=g, device=dev, dtype=torch.float32).to(dt)


def state():
    return {"model": {f"w{i}": DTensor.from_local(make(i), mesh, [Replicate() if i % 3 == 2 else Shard(0)],
                                                  run_check=False) for i in range(n)}, "step": 1}


def same(loaded, where):
    bad = []
    for i in range(n):
        got = loaded["model"][f"w{i}"]
        got = got.full_tensor() if isinstance(got, DTensor) else got
        if not torch.equal(got.to(dev).view(torch.uint8), make(i).view(torch.uint8)):
            bad.append(f"w{i}")
    return bad


def sync():
    if not CPU:
        torch.cuda.synchronize()


res, ok_all = {"GiB": round(n * each / 2**30, 2), "tensors": n, "cpu_dry_run": CPU}, True
s = state(); sync()
t = time.perf_counter(); fastckpt.save(s, os.path.join(d, "a")); res["save_s"] = round(time.perf_counter() - t, 2)
del s
for where in dict.fromkeys(("cpu", dev)):
    t = time.perf_counter(); out = fastckpt.load(os.path.join(d, "a"), device=where); sync()
    res[f"load_{where}_s"] = round(time.perf_counter() - t, 2)
    bad = same(out, where); del out
    ok_all &= not bad
    print(f"DTENSOR {'ok' if not bad else 'FAIL'}: save, load(verify) on {where}: {'bytes equal' if not bad else bad}")
s = state(); sync()
t = time.perf_counter(); fut = fastckpt.async_save(s, os.path.join(d, "b"))
res["async_blocking_s"] = round(time.perf_counter() - t, 2)
for v in s["model"].values():             # allowed once async_save returned: overwrite on the device now
    v.to_local().fill_(-1)
fut.result(); res["async_total_s"] = round(time.perf_counter() - t, 2)
del s
bad = same(fastckpt.load(os.path.join(d, "b")), "cpu")
ok_all &= not bad
print(f"DTENSOR {'ok' if not bad else 'FAIL'}: async_save, sources overwritten after the call: "
      f"{'checkpoint holds the call-time bytes' if not bad else bad}")
res["all_ok"] = bool(ok_all)
print("RESULT_DTENSOR " + json.dumps(res))
dist.destroy_process_group()
PY
fi

# ---------------------------------------------------------------------------------------------
# 7. First async_save of a fresh process on a CUDA machine (issue 21: blocking <= 1.5x one memory
#    copy): a CPU state against one copy into fresh memory (no page-locked staging for CPU tensors),
#    a CUDA state against one copy into fresh page-locked memory, and after fastckpt.reserve;
#    CUDA cases compared byte for byte after the sources were overwritten. "FIRST ok|FAIL" lines,
#    one "RESULT_FIRST {...}" line (scripts/gpu_first_save.py).
# ---------------------------------------------------------------------------------------------
if want 7; then
echo "== first async_save of a fresh process (${FIRST_GIB:-1} GiB), blocking vs one memory copy"
timeout 240 "$PY" scripts/gpu_first_save.py --gib "${FIRST_GIB:-1}" --dir "$WORK/first" || echo "FIRST SAVE CHECK FAILED"
fi

# ---------------------------------------------------------------------------------------------
# Summary: exit 1 when any step failed (the steps above never stop the script), 0 otherwise.
# ---------------------------------------------------------------------------------------------
sleep 0.2  # let tee catch up
bad="$(grep -E "FAILED|^MEMORY BOUND OVER|^(DIST|DTENSOR|FIRST) FAIL" "$LOG" || true)"
if [ -n "$bad" ]; then
  echo "== gpu_check: failed:"; echo "$bad" | sed 's/^/   /'
  exit 1
fi
echo "== gpu_check: every step run passed (steps: ${STEPS:-1 2 3 4 5 6 7})"
