"""1 vs 2 ranks writing the same replicated state: bytes written per rank and wall time.

Run: ``python benchmarks/bench_dist.py --mib 512 --dir /path/on/the/tier`` (add ``PYTHONPATH=SRC`` to run
another checkout's fastckpt, e.g. today's main, for a side-by-side figure)

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="saves of each kind per world size (default 3; medians)")
    ap.add_argument("--dir", default=None, help="folder on the storage tier (default: a temp folder)")
    a = ap.parse_args()
    base = tempfile.mkdtemp(dir=a.dir)
    try:
        res = {}
        for world in (1, 2):
            folder = tempfile.mkdtemp(dir=base)
            mp.spawn(_rank, args=(world, a.mib, folder, base, a.reps), nprocs=world, join=True)
            res[world] = [json.load(open(os.path.join(base, f"r{world}-{r}.json"))) for r in range(world)]
            shutil.rmtree(folder)
        med = statistics.median
        walls = {}
        for world, rs in res.items():
            for kind in ("full", "linked"):
                wall = med([max(r[kind][i]["wall_s"] for r in rs) for i in range(a.reps)])
                walls[world, kind] = wall
                per = ", ".join(f"rank {i}: {med([x['bytes'] for x in r[kind]]) / 2**20:.1f} MiB written"
                                for i, r in enumerate(rs))
                label = "full save" if kind == "full" else "link_from the previous (only the optimizer changed)"
                print(f"{world} rank(s), {label}: wall {wall:.2f} s (median of {a.reps}), {a.mib / wall:.0f} MiB/s "
                      f"of state; {per}")
        print(f"2-rank / 1-rank wall time, full save: {walls[2, 'full'] / walls[1, 'full']:.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
