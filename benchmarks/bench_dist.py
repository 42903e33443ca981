"""1 vs 2 ranks writing the same replicated state: bytes written per rank and wall time.

Run: ``python benchmarks/bench_dist.py --mib 512 --dir /path/on/the/tier``

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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastckpt


def _state(mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) // 4 // 16
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(16)}}


def _rank(rank: int, world: int, mib: int, folder: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    state = _state(mib)
    times = []
    for i in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        fut = fastckpt.async_save(state, os.path.join(folder, f"ck{i}"), threads=4)
        fut.result()
        times.append(time.perf_counter() - t0)
    with open(os.path.join(out, f"r{world}-{rank}.json"), "w") as f:
        json.dump({"bytes": fut.bytes_written, "wall_s": min(times), "blocking_s": fut.blocking_s}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--dir", default=None, help="folder on the storage tier (default: a temp folder)")
    a = ap.parse_args()
    base = tempfile.mkdtemp(dir=a.dir)
    try:
        res = {}
        for world in (1, 2):
            folder = tempfile.mkdtemp(dir=base)
            mp.spawn(_rank, args=(world, a.mib, folder, base), nprocs=world, join=True)
            res[world] = [json.load(open(os.path.join(base, f"r{world}-{r}.json"))) for r in range(world)]
            shutil.rmtree(folder)
        for world, rs in res.items():
            wall = max(r["wall_s"] for r in rs)
            per = ", ".join(f"rank {i}: {r['bytes'] / 2**20:.1f} MiB" for i, r in enumerate(rs))
            print(f"{world} rank(s): wall {wall:.2f} s, {a.mib / wall:.0f} MiB/s; {per}")
        print(f"2-rank / 1-rank wall time: {max(r['wall_s'] for r in res[2]) / res[1][0]['wall_s']:.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
