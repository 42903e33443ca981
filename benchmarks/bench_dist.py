"""1 vs 2 ranks writing the same replicated state: bytes written per rank and wall time.

Run: ``python benchmarks/bench_dist.py --mib 512 --dir /path/on/the/tier [--baseline SRC]``
(``--baseline``: another checkout's fastckpt, e.g. today's main, measured in the same run, rounds
rotated; wall time is the slowest rank's, durable; GB/s are of the state, against the raw device
write measured in the same run)

Model of the scaling (N ranks, M independent storage links, e.g. one NIC/NVMe path per node):
each rank writes S/N bytes; the time of the write phase is

    T(N, M) = S / min(N * b_rank, M * b_link, B_tier) + t_coord(N)

with b_rank the bandwidth one rank can drive (threads x request size, staging copy included),
b_link one link's bandwidth, B_tier the storage tier's aggregate limit and t_coord(N) the store
round trips (3 all-gathers + the commit, ~ms each, growing ~linearly in N on a TCPStore).
On one machine (M = 1, here one local disk and 2 cores), N = 2 helps only while one rank
cannot saturate the disk; with one rank per node on N nodes and M = N links, the write phase
shrinks ~1/N until B_tier is reached. The saving in staging (each rank copies only ~S/N from
device to host) applies in every case.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastckpt


def _state(mib: int, step: int) -> dict:
    """~``mib`` MiB of replicated weights plus a small optimizer part that changes every step."""
    g = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) // 4 // 16
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(16)},
            "optimizer": {"m": torch.full((n // 64,), float(step))}, "step": step}


def _rank(rank: int, world: int, mib: int, folder: str, out: str, reps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    pg = dist.group.WORLD if world > 1 else None  # one rank: the plain single-process save
    rows = {"full": [], "linked": []}
    for i in range(reps):
        for kind in ("full", "linked"):
            state = _state(mib, i * 2 + (kind == "linked"))
            path = os.path.join(folder, f"ck{i}-{kind}")
            opts = {"link_from": os.path.join(folder, f"ck{i}-full")} if kind == "linked" else {}
            dist.barrier()
            t0 = time.perf_counter()
            fut = fastckpt.async_save(state, path, threads=4, process_group=pg, **opts)
            blocking = time.perf_counter() - t0
            fut.result()
            by_rank = getattr(fut, "bytes_by_rank", None)  # older checkouts: this rank's own bytes
            rows[kind].append({"wall_s": time.perf_counter() - t0, "blocking_s": blocking,
                               "bytes": by_rank[rank] if by_rank else fut.bytes_written})
        dist.barrier()
        if rank == 0:
            for kind in ("full", "linked"):
                shutil.rmtree(os.path.join(folder, f"ck{i}-{kind}"), ignore_errors=True)
    with open(os.path.join(out, f"r{world}-{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def _measure(mib: int, reps: int, folder_root: str | None) -> dict:
    """Median wall time (max over ranks) and bytes written per rank, per world size and kind."""
    base = tempfile.mkdtemp(dir=folder_root)
    try:
        res = {}
        for world in (1, 2):
            folder = tempfile.mkdtemp(dir=base)
            mp.spawn(_rank, args=(world, mib, folder, base, reps), nprocs=world, join=True)
            rs = [json.load(open(os.path.join(base, f"r{world}-{r}.json"))) for r in range(world)]
            shutil.rmtree(folder)
            for kind in ("full", "linked"):
                res[f"{world}/{kind}"] = {
                    "wall_s": statistics.median([max(r[kind][i]["wall_s"] for r in rs) for i in range(reps)]),
                    "bytes_by_rank": [statistics.median([x["bytes"] for x in r[kind]]) for r in rs]}
        return res
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="rounds (default 3; medians); variants rotate each round")
    ap.add_argument("--dir", default=None, help="folder on the storage tier (default: a temp folder)")
    ap.add_argument("--baseline", default=None, metavar="SRC",
                    help="checkout of another fastckpt (e.g. `git worktree add /tmp/base main`), run beside ours")
    ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_json:
        with open(a.child_json, "w") as f:
            json.dump(_measure(a.mib, 1, a.dir), f)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common as C
    nbytes = a.mib << 20
    raw = C.raw_device(a.dir or tempfile.gettempdir(), nbytes, a.reps, write=True)
    print(f"raw device write: {raw['gbps']:.3f} GB/s (best depth {raw['best_depth']})", flush=True)
    variants = ["this checkout"] + (["baseline"] if a.baseline else [])
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(a.reps):
        for v in C.rotated(variants, r):
            out = tempfile.mktemp(suffix=".json")
            env = dict(os.environ)
            if v == "baseline":
                env["PYTHONPATH"] = os.path.abspath(a.baseline) + os.pathsep + env.get("PYTHONPATH", "")
            subprocess.run([sys.executable, __file__, "--mib", str(a.mib), "--child-json", out]
                           + (["--dir", a.dir] if a.dir else []), env=env, check=True)
            runs[v].append(json.load(open(out)))
            os.unlink(out)
    print(f"\n{a.mib} MiB replicated state, durable, median of {a.reps}; raw device write {raw['gbps']:.2f} GB/s\n")
    print("| code | ranks | save | wall s | GB/s | x raw | MiB written per rank |")
    print("|---|---:|---|---:|---:|---:|---|")
    for v in variants:
        for key in ("1/full", "2/full", "1/linked", "2/linked"):
            wall = statistics.median([x[key]["wall_s"] for x in runs[v]])
            per = [statistics.median([x[key]["bytes_by_rank"][i] for x in runs[v]]) / 2**20
                   for i in range(len(runs[v][0][key]["bytes_by_rank"]))]
            gbps = nbytes / wall / C.GB
            label = "full" if key.endswith("full") else "link_from (optimizer changed)"
            print(f"| {v} | {key[0]} | {label} | {wall:.2f} | {gbps:.2f} | {gbps / raw['gbps']:.2f} | "
                  f"{', '.join(f'{m:.1f}' for m in per)} |")


if __name__ == "__main__":
    main()
