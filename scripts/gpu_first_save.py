"""First ``async_save`` of a fresh process on a CUDA machine: blocking time against one memory copy.

Step 7 of ``scripts/gpu_check.sh`` (issue 21's target: a first ``async_save`` blocks <= 1.5x one memory
copy). Every case runs in its own fresh process on the same state (``--gib`` GiB of bf16/fp32
tensors of 64 MiB, generated from fixed seeds):

- ``memcpy``: one copy of the CPU state into fresh memory (``clone``), the reference of a CPU save;
- ``cpu``: ``fastckpt.async_save`` of the CPU state (no page-locked staging: nothing to gain from it);
- ``pinned_memcpy``: one copy of the CUDA state into fresh page-locked memory, the reference of a
  CUDA save (a device -> host copy at full speed needs page-locked memory, which costs its locking);
- ``cuda``: ``fastckpt.async_save`` of the CUDA state, then the sources overwritten at once;
- ``cuda_reserved``: the same after ``fastckpt.reserve(n, background=False)`` (not timed).

The CUDA cases load the checkpoint back and compare every tensor byte for byte with its
regenerated source. Prints ``FIRST ok|FAIL: ...`` lines and one ``RESULT_FIRST {...}`` JSON line.
``FASTCKPT_GPU_CHECK_CPU=1``: a dry run on CPU (the CUDA cases use CPU tensors).

    python3 scripts/gpu_first_save.py [--gib 1] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

EACH = 64 << 20  # bytes per tensor
CPU = os.environ.get("FASTCKPT_GPU_CHECK_CPU") == "1"


def make(i: int, dev: str):
    """Tensor ``i`` from its seed: bf16 for odd ``i``, fp32 otherwise, 64 MiB each."""
    import torch
    g = torch.Generator(device=dev).manual_seed(i)
    dt = torch.bfloat16 if i % 2 else torch.float32
    return torch.randn(EACH // dt.itemsize, generator=g, device=dev, dtype=torch.float32).to(dt)


def child(case: str, gib: float, folder: str) -> dict:
    import torch
    dev = "cpu" if (CPU or case in ("memcpy", "cpu")) else "cuda:0"
    n = max(2, int(gib * (1 << 30)) // EACH)
    state = {"model": {f"w{i}": make(i, dev) for i in range(n)}, "step": 1}
    if dev != "cpu":
        torch.cuda.synchronize()
    res: dict = {"case": case, "bytes": n * EACH}
    if case in ("memcpy", "pinned_memcpy"):
        pin = case == "pinned_memcpy" and not CPU
        t = time.perf_counter()
        out = [torch.empty(v.shape, dtype=v.dtype, pin_memory=pin).copy_(v) for v in state["model"].values()]
        if dev != "cpu":
            torch.cuda.synchronize()
        res["seconds"] = time.perf_counter() - t
        del out
        return res
    import fastckpt
    path = os.path.join(folder, case)
    if case == "cuda_reserved":
        fastckpt.reserve(n * EACH + (64 << 20), background=False)
    t = time.perf_counter()
    fut = fastckpt.async_save(state, path)
    res["blocking_s"] = time.perf_counter() - t
    for v in state["model"].values():  # allowed once async_save returned
        v.fill_(-1)
    fut.result()
    res["seconds"] = time.perf_counter() - t
    back = fastckpt.load(path)
    res["bytes_equal"] = all(torch.equal(back["model"][f"w{i}"].view(torch.uint8), make(i, "cpu" if CPU else dev).cpu()
                                         .view(torch.uint8)) for i in range(n))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print("CHILD " + json.dumps(child(a.case, a.gib, a.dir)))
        return
    folder = a.dir or tempfile.mkdtemp(prefix="fastckpt-first-")
    rows = {}
    for case in ("memcpy", "cpu", "pinned_memcpy", "cuda", "cuda_reserved"):
        p = subprocess.run([sys.executable, __file__, "--case", case, "--gib", str(a.gib), "--dir", folder],
                           capture_output=True, text=True, timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("CHILD ")]
        if p.returncode or not line:
            print(f"FIRST FAIL: case {case} exited {p.returncode}: {p.stderr.strip()[-800:]}")
            continue
        rows[case] = json.loads(line[-1][6:])
    ok_all = True
    for case, ref in (("cpu", "memcpy"), ("cuda", "pinned_memcpy"), ("cuda_reserved", "pinned_memcpy")):
        if case not in rows or ref not in rows:
            ok_all = False
            continue
        r = rows[case]
        r["blocking_over_memcpy"] = round(r["blocking_s"] / rows[ref]["seconds"], 2)
        ok = r["blocking_over_memcpy"] <= 1.5 and r.get("bytes_equal", True)
        ok_all &= ok
        print(f"FIRST {'ok' if ok else 'FAIL'}: {case}: first async_save blocked {r['blocking_s']:.3f} s = "
              f"{r['blocking_over_memcpy']}x one copy ({ref}, {rows[ref]['seconds']:.3f} s); total {r['seconds']:.2f} s"
              + (f"; bytes equal after the sources were overwritten: {r['bytes_equal']}" if "bytes_equal" in r else ""))
    print("RESULT_FIRST " + json.dumps({"rows": rows, "all_ok": ok_all, "cpu_dry_run": CPU}))


if __name__ == "__main__":
    main()
