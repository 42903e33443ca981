"""KV-cache tier benchmark: fastckpt's LMCache backend vs LMCache's LocalDiskBackend and fs connector.

Chunks of a realistic shape (default 256 tokens x 32 layers x 8 KV heads x 128 head dim,
bf16, KV_2LTD = 32 MiB), a working set of 2 GiB by default, put and cold get throughput
at 1 and 16 concurrent requests (one request = one chunk), against the raw read
bandwidth of the same files measured in the same run. Both backends allocate their
buffers from the same LMCache LocalCPUBackend. Ratios are the result; absolute GB/s
are noise on shared machines.

Cold cache: ``sync; echo 3 > /proc/sys/vm/drop_caches`` before every read pass (root
only; otherwise the run says "WARM" next to each figure).

Usage::

    python benchmarks/bench_kv.py --dir /mnt/array/kvbench            # issue defaults
    python benchmarks/bench_kv.py --dir /tmp/kvb --working-set-mib 512  # quick run

Prints one line per measurement and a summary with the ratios and the modeled TTFT of
a 29.8K-token session (bytes to read / measured GB/s) against recomputing it.

LMCache's multiprocess (server) mode: ``--l2-depth D`` (default 16) also runs the L2 adapters
side by side, fastckpt's (:mod:`fastckpt.integrations.lmcache.l2`) and LMCache's ``fs_native``
(its C++ file-system connector): the same chunks, the same depth (D load tasks of one chunk
in flight; D I/O threads each: our ``read_threads``, fs_native's ``num_workers``), folders side
by side under ``--dir``, O_DIRECT on or off for both (``--no-o-direct``), ``--l2-rounds``
rounds in alternating order (who goes first rotates), cold page cache before each get pass.
It reports the median over rounds of the get throughput and of each round's p50/p99 get
latency (submit to result of one task), and checks fastckpt / fs_native >= 1.0x and p99 no
worse. ``--l2-only`` skips the in-process backends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

GiB = 1 << 30
MiB = 1 << 20


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False if not permitted."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_read_gbps(files: list[str], threads: int, block: int, direct: bool = False) -> float:
    """Read ``files`` whole with ``threads`` threads in ``block``-byte preads (O_DIRECT if
    ``direct``, into page-aligned buffers); GB/s."""
    import mmap

    jobs = [(f, off, min(block, os.path.getsize(f) - off)) for f in files for off in range(0, os.path.getsize(f), block)]
    bufs = threading.local()

    def one(job):
        b = getattr(bufs, "b", None)
        if b is None:
            b = bufs.b = mmap.mmap(-1, block)
            b.write(bytes(block))  # touched before the clock starts, as any reader's buffers are
        if job is None:
            time.sleep(0.01)  # so that every thread of the pool gets one of the warm-up calls
            return 0
        path, off, n = job
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            return os.preadv(fd, [memoryview(b)[:n]], off)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda _: one(None), range(threads * 4)))  # each thread's buffer, before the clock
        t0 = time.perf_counter()
        total = sum(ex.map(one, jobs))
    return total / (time.perf_counter() - t0) / 1e9


#: The targets of the KV tier the summary checks each ratio against.
TARGET_RAW = 0.8   # fastckpt cold get / best raw read of the same files, c = max
TARGET_DISK = 4.0  # fastckpt cold get / LocalDiskBackend cold get, c = max


def verdict(measured: float, target: float, ceiling: float | None, cold: bool, why_ceiling: str) -> str:
    """Say honestly whether ``measured >= target`` was shown, and if not whether this machine could show it.

    ``ceiling`` is the largest ratio this machine's device allows (None: no bound known).
    """
    if not cold:
        return (f"target >= {target:g}x: NOT SHOWN (warm page cache: this measures memory copies, not the "
                "device; run as root so the caches can be dropped)")
    if measured >= target:
        return f"target >= {target:g}x: met"
    if ceiling is not None and ceiling < target:
        return (f"target >= {target:g}x: CANNOT BE SHOWN on this machine: at most {ceiling:.2f}x is possible "
                f"here ({why_ceiling})")
    return f"target >= {target:g}x: NOT MET" + (f" (this device allows up to {ceiling:.2f}x)" if ceiling else "")


def summary_lines(res: dict, concurrency: list, cold: bool, lmcache_disk: bool = True) -> list[str]:
    """The summary's ratio lines; each target line states what was measured against what was asked."""
    hi = max(concurrency)
    out = []
    ours = res[f"fastckpt.get.c{hi}"]
    raw = max(res["raw.qd16_4MiB"], res["raw.direct_qd16_4MiB"])
    best = max(raw, ours)  # the most this run read from this device, by any reader
    out.append(f"cold get c={hi}: fastckpt / raw (best)    = {ours / raw:.2f}x   "
               + verdict(ours / raw, TARGET_RAW, None, cold, ""))
    if lmcache_disk:
        for c in concurrency:
            got = res[f"fastckpt.get.c{c}"] / res[f"LocalDisk.get.c{c}"]
            line = f"cold get c={c}: fastckpt / LocalDisk      = {got:.2f}x"
            if c == hi:
                disk = res[f"LocalDisk.get.c{c}"]
                ceiling = best / disk  # fastckpt cannot read faster than the device
                line += "   " + verdict(got, TARGET_DISK, ceiling, cold,
                                        f"LocalDisk already reads {disk:.2f} GB/s and the best read of this "
                                        f"device in this run was {best:.2f} GB/s; the {TARGET_DISK:g}x needs a tier "
                                        "where one reader stream gets at most a quarter of the bandwidth, e.g. "
                                        "an NVMe array or a parallel file system")
            out.append(line)
            out.append(f"put      c={c}: fastckpt / LocalDisk      = "
                       f"{res[f'fastckpt.put.c{c}'] / res[f'LocalDisk.put.c{c}']:.2f}x")
    if f"fs-conn.get.c{hi}" in res:
        for c in concurrency:
            out.append(f"cold get c={c}: fastckpt / fs connector   = "
                       f"{res[f'fastckpt.get.c{c}'] / res[f'fs-conn.get.c{c}']:.2f}x")
    return out


class Bench:
    def __init__(self, a):
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.a = a
        self.shape = torch.Size([2, a.layers, a.tokens, a.heads * a.head_dim])
        self.chunk_bytes = self.shape.numel() * 2
        self.n = max(1, a.working_set_mib * MiB // self.chunk_bytes)
        # the sources (up to 16 chunks) stay allocated while every concurrent get holds one more
        # object; LMCache's fs connector allocates inside its event loop with a busy wait, so a pool
        # without room for all of them stalls its gets until blocking_timeout_secs (a "miss")
        cpu_gb = (min(16, self.n) + 2 * max(a.concurrency) + 4) * self.chunk_bytes * 1.3 / GiB
        self.cfg = LMCacheEngineConfig.from_defaults(chunk_size=a.tokens, local_cpu=False,
                                                     max_local_cpu_size=cpu_gb)
        self.meta = LMCacheMetadata(model_name="bench/model", world_size=1, local_world_size=1, worker_id=0,
                                    local_worker_id=0, kv_dtype=torch.bfloat16,
                                    kv_shape=(a.layers, 2, a.tokens, a.heads, a.head_dim))
        self.cpu = LocalCPUBackend(self.cfg, self.meta, "cpu")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        from lmcache.utils import CacheEngineKey

        self.keys = [CacheEngineKey("bench/model", 1, 0, 0x1000 + i, torch.bfloat16) for i in range(self.n)]
        self.src = []
        for i in range(min(16, self.n)):
            o = self.cpu.allocate(self.shape, torch.bfloat16)
            o.tensor.view(torch.int16).random_(-32768, 32767)
            self.src.append(o)

    # ----- backends -------------------------------------------------------------------------
    def ours(self, path: str, threads: int):
        from fastckpt.integrations.lmcache.backend import FastCkptKVBackend

        cfg = self.cfg.from_defaults(chunk_size=self.a.tokens, local_cpu=False,
                                     max_local_cpu_size=self.cfg.max_local_cpu_size,
                                     storage_plugins=["fastckpt"], extra_config={
                                         "storage_plugin.fastckpt.module_path": "fastckpt.integrations.lmcache.backend",
                                         "storage_plugin.fastckpt.class_name": "FastCkptKVBackend",
                                         "storage_plugin.fastckpt.path": path,
                                         "storage_plugin.fastckpt.read_threads": self.a.read_threads,
                                         "storage_plugin.fastckpt.write_threads": threads,
                                         "storage_plugin.fastckpt.o_direct": self.a.o_direct,
                                         "storage_plugin.fastckpt.durable": True})
        return FastCkptKVBackend("cpu", cfg, self.meta, self.cpu, self.loop)

    def local_disk(self, path: str, threads: int):
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        cfg = self.cfg.from_defaults(chunk_size=self.a.tokens, local_cpu=False,
                                     max_local_cpu_size=self.cfg.max_local_cpu_size, local_disk=path,
                                     max_local_disk_size=self.n * self.chunk_bytes * 2 / GiB,
                                     extra_config={"disk_io_threads": threads})
        return LocalDiskBackend(cfg, self.loop, self.cpu, "cpu", None, self.meta)

    def fs_connector(self, path: str, threads: int):
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        cfg = self.cfg.from_defaults(chunk_size=self.a.tokens, local_cpu=False,
                                     max_local_cpu_size=self.cfg.max_local_cpu_size,
                                     remote_storage_plugins=["fs"], remote_serde="naive",
                                     extra_config={"remote_storage_plugin.fs.base_path": path})
        return RemoteBackend(cfg, self.meta, self.loop, self.cpu, "cpu", plugin_name="fs")

    # ----- measurements ---------------------------------------------------------------------
    def put(self, be, conc: int, wait_done) -> float:
        t0 = time.perf_counter()
        if conc == 1:
            for i, k in enumerate(self.keys):
                be.batched_submit_put_task([k], [self.src[i % len(self.src)]])
                wait_done(be, [k])
        else:
            be.batched_submit_put_task(self.keys, [self.src[i % len(self.src)] for i in range(self.n)])
            wait_done(be, self.keys)
        os.sync()
        return self.n * self.chunk_bytes / (time.perf_counter() - t0) / 1e9

    def get(self, be, conc: int) -> float:
        def one(k):
            o = be.get_blocking(k)
            assert o is not None, f"miss for {k}"
            o.ref_count_down()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as ex:
            list(ex.map(one, self.keys))
        return self.n * self.chunk_bytes / (time.perf_counter() - t0) / 1e9


def _wait_ours(be, keys):
    be.flush()


def _wait_disk(be, keys):
    while any(be.exists_in_put_tasks(k) for k in keys) or not all(be.contains(k) for k in keys):
        time.sleep(0.002)


# ----- LMCache multiprocess mode: L2 adapters -----------------------------------------------------
class _Buf:
    """A page-aligned buffer with the ``byte_array`` the L2 adapters read and write."""

    def __init__(self, nbytes: int):
        import mmap

        self.mm = mmap.mmap(-1, nbytes)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.mm)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def l2_adapter(kind: str, path: str, depth: int, o_direct: bool):
    """A fresh L2 adapter of ``kind`` ("fastckpt" or "fs_native") over ``path``, ``depth`` I/O threads."""
    if kind == "fastckpt":
        from fastckpt.integrations.lmcache.l2 import FastCkptL2Adapter

        return FastCkptL2Adapter({"path": path, "read_threads": depth, "write_threads": depth,
                                  "o_direct": o_direct, "durable": True})
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import FSNativeL2AdapterConfig

    return create_l2_adapter(FSNativeL2AdapterConfig.from_dict(
        {"base_path": path, "num_workers": depth, "use_odirect": o_direct}))


def l2_run(adapter, keys: list, bufs: list, depth: int, load: bool) -> tuple[float, list[float]]:
    """Store (``load`` False) or load every key, one key per task, ``depth`` tasks in flight.

    Returns:
        (GB/s, per-task seconds from submit to result). Raises AssertionError on a failed task.
    """
    import select

    from lmcache.v1.platform import consume_fd

    fd = adapter.get_load_event_fd() if load else adapter.get_store_event_fd()
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    inflight: dict = {}
    lat: list[float] = []
    nbytes = 0
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(keys) or inflight:
        while nxt < len(keys) and len(inflight) < depth:
            buf = bufs[nxt % len(bufs)]
            tid = (adapter.submit_load_task if load else adapter.submit_store_task)([keys[nxt]], [buf])
            inflight[tid] = time.perf_counter()
            nxt += 1
        poll.poll(1000)
        try:
            consume_fd(fd)
        except BlockingIOError:
            pass
        now = time.perf_counter()
        if load:
            for tid in list(inflight):
                bm = adapter.query_load_result(tid)
                if bm is not None:
                    assert bm.test(0), f"L2 load task {tid} missed"
                    lat.append(now - inflight.pop(tid))
        else:
            for tid, r in adapter.pop_completed_store_tasks().items():
                assert int(r) >= 0, f"L2 store task {tid} failed"
                lat.append(now - inflight.pop(tid))
        nbytes = len(lat) * len(bufs[0].byte_array)
    return nbytes / (time.perf_counter() - t0) / 1e9, lat


def l2_bench(a, chunk_bytes: int, n: int, res: dict, tag: str) -> list[str]:
    """fastckpt's L2 adapter vs LMCache's fs_native, ``a.l2_rounds`` rounds in rotating order; summary lines."""
    from lmcache.v1.distributed.api import ObjectKey

    d = a.l2_depth
    keys = [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(0x1000 + i), model_name="bench/model", kv_rank=0)
            for i in range(n)]
    src = []
    for i in range(min(d, n)):
        b = _Buf(chunk_bytes)
        g = torch.Generator().manual_seed(i)
        b.byte_array[:] = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=g).numpy().data
        src.append(b)
    dst = [_Buf(chunk_bytes) for _ in range(d)]
    zeros = bytes(chunk_bytes)
    for b in dst:  # touched once, as L1's buffers are: no page faults inside the first measured run
        b.byte_array[:] = zeros
    per: dict = {"fastckpt": [], "fs_native": []}
    raw: list[float] = []
    paired: dict = {"first": [], "second": []}  # fastckpt / fs_native get GB/s of each round, by fastckpt's place
    for r in range(a.l2_rounds):
        order = ["fastckpt", "fs_native"] if r % 2 == 0 else ["fs_native", "fastckpt"]
        for kind in order:
            path = os.path.join(a.dir, f"l2-{kind}")
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            ad = l2_adapter(kind, path, d, a.o_direct)
            try:
                put, _ = l2_run(ad, keys, src, d, load=False)
                os.sync()
                drop_caches()
                get, lat = l2_run(ad, keys, dst, d, load=True)
            finally:
                ad.close()
            if kind == "fastckpt":  # the device's ceiling: the same files, one whole-file O_DIRECT read each
                files = [os.path.join(r_, f) for r_, _, fs in os.walk(path) for f in fs
                         if f.endswith(".safetensors")]
                drop_caches()
                raw.append(raw_read_gbps(files, d, chunk_bytes + 4096, direct=a.o_direct))
                print(f"L2 raw read of the same files, depth {d}: {raw[-1]:6.2f} GB/s{tag}", flush=True)
            shutil.rmtree(path, ignore_errors=True)
            p50, p99 = _pct(lat, 50) * 1e3, _pct(lat, 99) * 1e3
            per[kind].append((put, get, p50, p99))
            print(f"L2 {kind:9s} round {r} depth {d}: put {put:6.2f} GB/s   cold get {get:6.2f} GB/s   "
                  f"get p50 {p50:7.1f} ms  p99 {p99:7.1f} ms{tag}", flush=True)
        paired["first" if order[0] == "fastckpt" else "second"].append(per["fastckpt"][-1][1] / per["fs_native"][-1][1])
    res[f"L2.get_ratio_first.d{d}"], res[f"L2.get_ratio_second.d{d}"] = paired["first"], paired["second"]
    med = {k: [statistics.median(x[i] for x in v) for i in range(4)] for k, v in per.items()}
    for k, (put, get, p50, p99) in med.items():
        res.update({f"L2.{k}.put.d{d}": put, f"L2.{k}.get.d{d}": get, f"L2.{k}.get_p50_ms.d{d}": p50,
                    f"L2.{k}.get_p99_ms.d{d}": p99})
    res[f"L2.raw.get.d{d}"] = statistics.median(raw)
    return l2_summary_lines(res, d, a.l2_rounds, cold=not tag)


#: The targets of the L2 adapter against LMCache's fs_native at the same depth.
TARGET_L2_GET = 1.0  # fastckpt cold get GB/s / fs_native's
TARGET_L2_P99 = 1.0  # fastckpt p99 get latency / fs_native's, at most


def l2_summary_lines(res: dict, depth: int, rounds: int, cold: bool) -> list[str]:
    """The L2 comparison's summary (medians in ``res``); each target line says met, NOT MET or NOT SHOWN."""
    def k(name, what):
        return res[f"L2.{name}.{what}.d{depth}"]

    warm = "NOT SHOWN (warm page cache: run as root so the caches can be dropped)"
    ratio = k("fastckpt", "get") / k("fs_native", "get")
    first, second = res.get(f"L2.get_ratio_first.d{depth}") or [], res.get(f"L2.get_ratio_second.d{depth}") or []
    how = f"medians of {rounds} rounds"
    order_line = []
    if first and second:  # an adapter's place in the round moved its rate 6-11%, either way by the run: cancel it
        a_, b_ = statistics.median(first), statistics.median(second)
        ratio = (a_ * b_) ** 0.5
        how = (f"balanced for order: fastckpt read first {a_:.2f}x, second {b_:.2f}x (medians of {len(first)} and "
               f"{len(second)} rounds), geometric mean; median GB/s")
        order_line = [f"L2 order effect: the adapter that reads first in a round reads {(a_ / b_) ** 0.5:.2f}x "
                      "the other (whichever it is: the disk's state, not the code; cancelled above)"]
    p99, ref99 = k("fastckpt", "get_p99_ms"), k("fs_native", "get_p99_ms")
    raw = res.get(f"L2.raw.get.d{depth}")
    ceiling = max(raw, k("fastckpt", "get"), k("fs_native", "get")) / k("fs_native", "get") if raw else None
    got = verdict(ratio, TARGET_L2_GET, ceiling, cold,
                  f"fs_native already reads {k('fs_native', 'get'):.2f} GB/s and the raw read of the same files "
                  f"was {raw or 0:.2f} GB/s")
    lat = "met" if p99 <= TARGET_L2_P99 * ref99 else "NOT MET"
    raw_note = f"; raw read {raw:.2f} GB/s" if raw else ""
    return [f"L2 cold get depth {depth}: fastckpt / fs_native = {ratio:.2f}x   {got}  ({how}: "
            f"{k('fastckpt', 'get'):.2f} vs {k('fs_native', 'get'):.2f} GB/s{raw_note})", *order_line,
            f"L2 get p99 depth {depth}: fastckpt {p99:.1f} ms, fs_native {ref99:.1f} ms   target no worse: "
            f"{lat if cold else warm}  (p50 {k('fastckpt', 'get_p50_ms'):.1f} vs "
            f"{k('fs_native', 'get_p50_ms'):.1f} ms)",
            f"L2 put depth {depth}: fastckpt / fs_native = {k('fastckpt', 'put') / k('fs_native', 'put'):.2f}x  "
            f"({k('fastckpt', 'put'):.2f} vs {k('fs_native', 'put'):.2f} GB/s; ours fsyncs every chunk before its "
            "rename, fs_native renames without fsync)"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="bench_out/kv", help="folder on the tier under test (emptied first)")
    p.add_argument("--working-set-mib", type=int, default=2048, help="bytes of KV chunks, MiB (default 2048)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument("--concurrency", default="1,16", help="comma list of concurrent requests")
    p.add_argument("--read-threads", type=int, default=16)
    p.add_argument("--no-o-direct", dest="o_direct", action="store_false",
                   help="our backend uses buffered I/O (default: O_DIRECT where the file system allows)")
    p.add_argument("--skip-lmcache-disk", action="store_true")
    p.add_argument("--skip-fs-connector", action="store_true")
    p.add_argument("--session-tokens", type=int, default=29_800)
    p.add_argument("--session-bytes", type=float, default=7.15e9, help="KV bytes of the session (480B FP8)")
    p.add_argument("--recompute-tokens-per-s", type=float, default=800.0,
                   help="assumed prefill throughput for recomputing the session (tokens/s)")
    p.add_argument("--l2-depth", type=int, default=16,
                   help="LMCache server mode: L2 load tasks in flight and I/O threads per adapter (0 skips it)")
    p.add_argument("--l2-rounds", type=int, default=4,
                   help="rounds of the L2 comparison (order rotates; an even number puts each adapter first equally "
                        "often, default 4)")
    p.add_argument("--l2-only", action="store_true", help="run only the L2 adapter comparison")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    shape = [2, a.layers, a.tokens, a.heads * a.head_dim]
    chunk_bytes = math.prod(shape) * 2
    n = max(1, a.working_set_mib * MiB // chunk_bytes)
    print(f"chunk {shape} bf16 = {chunk_bytes / MiB:.0f} MiB, {n} chunks = "
          f"{n * chunk_bytes / GiB:.2f} GiB working set, dir {a.dir}")
    res: dict = {}
    cold = drop_caches()
    tag = "" if cold else " (WARM: cannot drop caches)"
    if not a.l2_only:
        in_process(a, res, cold, tag)
    if a.l2_depth > 0:
        lines = l2_bench(a, chunk_bytes, n, res, tag)
        print("\nsummary, LMCache server mode (L2 adapters)" + tag)
        for line in lines:
            print("  " + line)
    res["cold"] = cold
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def in_process(a, res: dict, cold: bool, tag: str) -> None:
    """The in-process backends (StoragePluginInterface and LMCache's own), as before the L2 comparison."""
    b = Bench(a)

    def run(name, make, wait_done):
        for conc in a.concurrency:
            path = os.path.join(a.dir, f"{name}-c{conc}")
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            be = make(path, conc)
            res[f"{name}.put.c{conc}"] = put = b.put(be, conc, wait_done)
            drop_caches()
            res[f"{name}.get.c{conc}"] = get = b.get(be, conc)
            print(f"{name:11s} c={conc:<3d} put {put:6.2f} GB/s   cold get {get:6.2f} GB/s{tag}", flush=True)
            be.close()
            if name == "fastckpt" and conc == max(a.concurrency):
                files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".safetensors")]
                for label, th, direct in (("raw.qd1_4MiB", 1, False), ("raw.qd16_4MiB", 16, False),
                                          ("raw.direct_qd16_4MiB", 16, True)):
                    drop_caches()
                    res[label] = raw_read_gbps(files, th, 4 * MiB, direct)
                    print(f"{label:24s} {res[label]:6.2f} GB/s{tag}", flush=True)
            shutil.rmtree(path, ignore_errors=True)

    run("fastckpt", b.ours, _wait_ours)
    if not a.skip_lmcache_disk:
        run("LocalDisk", b.local_disk, _wait_disk)
    if not a.skip_fs_connector:
        try:
            run("fs-conn", b.fs_connector, _wait_disk)
        except Exception as e:  # the connector's setup varies between LMCache releases
            print(f"fs connector: not measured ({type(e).__name__}: {e})")

    hi = max(a.concurrency)
    print("\nsummary" + tag)
    for line in summary_lines(res, a.concurrency, cold, lmcache_disk=not a.skip_lmcache_disk):
        print("  " + line)
    recompute = a.session_tokens / a.recompute_tokens_per_s
    print(f"  modeled TTFT, {a.session_tokens} tokens = {a.session_bytes / 1e9:.2f} GB of KV "
          f"(recompute at {a.recompute_tokens_per_s:.0f} tok/s: {recompute:.1f} s):")
    for name in ("fastckpt", "LocalDisk", "fs-conn"):
        if f"{name}.get.c{hi}" not in res:
            continue
        g = res[f"{name}.get.c{hi}"]
        print(f"    {name:10s} {a.session_bytes / 1e9 / g:7.2f} s  ({recompute / (a.session_bytes / 1e9 / g):.1f}x "
              f"faster than recompute)")
    for o in b.src:
        o.ref_count_down()


if __name__ == "__main__":
    sys.exit(main())
