"""One tier, three workloads side by side: KV gets, a checkpoint flush, a weight load.

The design's shapes scaled to this machine: a serving process reads 16 MiB KV chunks (a 29.8K-token
session's 7.15 GB of KV is ~450 such chunks; here a working set of 32) from the project's KV store,
one get every ``--get-interval-ms`` (default 100 ms), each read cold (O_DIRECT, its pieces in parallel as the LMCache
backend does); another process flushes a ~4 GiB checkpoint with ``fastckpt.save`` (the 65.6 GB LoRA
snapshot scaled down); a third loads a 1 GiB model with ``fastckpt.load`` (its files dropped from the
page cache first). Every workload runs in its own process, as in production.

Measured, with the tier arbiter on (the default) and off (``FASTCKPT_TIER=off``), rotated over
``--rounds`` rounds (medians):

* the raw device at the start of each round (a durable 512 MiB O_DIRECT write and its cold read);
* KV get p50 / p99 idle, during the flush, during the load;
* checkpoint time idle vs under the KV load, load time idle vs under the KV load.

Targets (arbiter on): KV get p99 during a flush <= 1.5x idle; checkpoint under KV <= 1.3x idle;
load under KV <= 1.3x idle.

Usage::

    python benchmarks/bench_tier.py --dir /mnt/array/tierbench           # defaults: 4 GiB flush, 3 rounds
    python benchmarks/bench_tier.py --dir /tmp/tb --ckpt-gib 0.5 --rounds 1   # quick run

Prints one line per run and a summary table; ``--out FILE`` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

MiB = 1 << 20
GiB = 1 << 30
SPAWN = mp.get_context("spawn")


def _key(i: int) -> str:
    return f"bench/model@1@0@{i:x}@bfloat16"


def _store(root: str):
    from fastckpt.kv import KVFileStore, KVStoreOptions as StoreOptions
    return KVFileStore(StoreOptions(path=root, durable=True))


def fill_kv(root: str, n: int, chunk: int) -> None:
    """Put ``n`` chunks of ``chunk`` bytes (random bytes) into the KV store at ``root``."""
    from fastckpt.kv import chunk_name
    st = _store(root)
    buf = mmap.mmap(-1, chunk)
    for i in range(n):
        buf[:] = os.urandom(64) * (chunk // 64)
        st.write(chunk_name(_key(i)), _key(i), "KV_2LTD", [("BF16", (chunk // 2,), chunk)], memoryview(buf))
    st.close()


def kv_getter(root: str, n: int, chunk: int, interval_s: float, ready, stop, out) -> None:
    """Get chunks round robin (cold: O_DIRECT into an aligned buffer), one every ``interval_s``;
    report ``[(unix time at start, seconds)]`` of every get."""
    from fastckpt.kv import chunk_name
    st = _store(root)
    buf = mmap.mmap(-1, chunk)
    mv = memoryview(buf)
    pool = ThreadPoolExecutor(8)
    lat = []
    i = 0
    ready.set()
    while not stop.is_set():
        t0, w0 = time.perf_counter(), time.time()
        h = st.open_chunk(chunk_name(_key(i % n)))
        list(pool.map(lambda p: st.read_piece(h, mv, p[0], p[1]), h.pieces()))
        st.close_chunk(h)
        lat.append((w0, time.perf_counter() - t0))
        i += 1
        time.sleep(max(0.0, interval_s - (time.perf_counter() - t0)))
    out.put(("kv", lat))


def saver(path: str, size_gib: float, ready, go, out) -> None:
    """Build a ~``size_gib`` GiB state, save it once (a process's first save pays for its staging
    memory), then save it each time ``go`` is set (twice: idle, then under the KV load, as a
    training process saves again and again); report each save's window."""
    import torch

    import fastckpt
    from fastckpt.storage.tier import tier_for
    n = int(size_gib * GiB) // 2
    per = 128 * MiB // 2
    state = {f"layers.{i}.weight": torch.empty(min(per, n - i * per), dtype=torch.bfloat16).random_()
             for i in range(-(-n // per))}
    fastckpt.save(state, f"{path}-first")
    ready.set()
    for i in range(2):
        go.wait(600)
        go.clear()
        t = tier_for(os.path.dirname(path))
        paced0 = t.slot.paced_ns / 1e9 if t.enabled else 0.0
        w0, t0 = time.time(), time.perf_counter()
        fastckpt.save(state, f"{path}-{i}")
        el = time.perf_counter() - t0
        paced = (t.slot.paced_ns / 1e9 if t.enabled else 0.0) - paced0
        out.put(("save", {"start": w0, "end": w0 + el, "s": el, "paced_s": paced}))


def loader(path: str, ready, go, out) -> None:
    """Drop the model's files from the page cache, then load it once ``go`` is set; report the window."""
    import fastckpt
    for f in os.listdir(path):
        fd = os.open(os.path.join(path, f), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    ready.set()
    go.wait(600)
    w0, t0 = time.time(), time.perf_counter()
    sd = fastckpt.load(path)
    el = time.perf_counter() - t0
    out.put(("load", {"start": w0, "end": w0 + el, "s": el, "bytes": sum(v.nbytes for v in sd.values())}))


def _once(target, *args) -> dict:
    """Run one saver/loader process: wait until it is ready, let it go, return its report."""
    ready, go, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    p = SPAWN.Process(target=target, args=(*args, ready, go, out))
    p.start()
    if not ready.wait(600):
        raise RuntimeError(f"{target.__name__} did not start")
    go.set()
    _, rep = out.get(timeout=900)
    p.join(60)
    return rep


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


#: Bytes of the raw device probe at the start of each round, and its requests in flight.
RAW_BYTES = 512 * MiB
RAW_DEPTH = 8


def raw_probe(folder: str) -> dict:
    """The device as this round finds it: GB/s of a durable O_DIRECT write and a cold O_DIRECT read of
    :data:`RAW_BYTES` (``common.raw_gbps``); this shared disk's rates swing several-fold between rounds."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common as C
    path = os.path.join(folder, "raw.bin")
    try:
        return {"raw_write_gbps": C.raw_gbps(path, RAW_BYTES, RAW_DEPTH, write=True),
                "raw_read_gbps": C.raw_gbps(path, RAW_BYTES, RAW_DEPTH, write=False)}
    finally:
        os.unlink(path)


def one_round(a, mode: str, r: int) -> dict:
    """One round in one mode: the raw device, idle checkpoint and load, then the same under a KV get stream."""
    os.environ["FASTCKPT_TIER"] = "off" if mode == "off" else ""
    os.environ["FASTCKPT_TIER_DIR"] = os.path.join(a.dir, "tier-state")
    ck = os.path.join(a.dir, "ck")
    res: dict = {"mode": mode, "round": r, **raw_probe(a.dir)}
    sready, sgo, sout = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    sp = SPAWN.Process(target=saver, args=(os.path.join(ck, f"{mode}-{r}"), a.ckpt_gib, sready, sgo, sout))
    sp.start()
    if not sready.wait(600):
        raise RuntimeError("saver did not start")
    sgo.set()
    res["ckpt_idle_s"] = sout.get(timeout=900)[1]["s"]
    res["load_idle_s"] = _once(loader, os.path.join(a.dir, "model"))["s"]
    ready, stop, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    kv = SPAWN.Process(target=kv_getter, args=(os.path.join(a.dir, "kv"), a.kv_chunks, a.kv_chunk_mib * MiB,
                                               a.get_interval_ms / 1000, ready, stop, out))
    kv.start()
    ready.wait(600)
    time.sleep(1.0)
    idle0 = time.time()
    time.sleep(a.idle_s)
    idle1 = time.time()
    sgo.set()
    sv = sout.get(timeout=900)[1]
    sp.join(60)
    time.sleep(0.5)
    ld = _once(loader, os.path.join(a.dir, "model"))
    time.sleep(0.5)
    stop.set()
    _, lat = out.get(timeout=600)
    kv.join(60)
    shutil.rmtree(ck, ignore_errors=True)

    def window(a0, a1):
        return [s for w, s in lat if a0 <= w <= a1]

    for name, (a0, a1) in (("idle", (idle0, idle1)), ("flush", (sv["start"], sv["end"])),
                           ("load", (ld["start"], ld["end"]))):
        xs = window(a0, a1)
        res[f"kv_{name}_lat_s"] = xs
        res[f"kv_{name}_n"] = len(xs)
        res[f"kv_{name}_p50_ms"] = _pct(xs, 0.5) * 1e3
        res[f"kv_{name}_p99_ms"] = _pct(xs, 0.99) * 1e3
    res["ckpt_kv_s"], res["ckpt_paced_s"], res["load_kv_s"] = sv["s"], sv["paced_s"], ld["s"]
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_lat_s")}), flush=True)
    return res


def summary(runs: list[dict]) -> list[str]:
    """The summary table and the targets. KV get percentiles pool every get of the mode's rounds
    (a flush lasts a few seconds: a few dozen gets per round); times are medians over rounds and
    the time ratios medians of each round's ratio (its idle and loaded runs are back to back)."""
    keys = ["ckpt_idle_s", "ckpt_kv_s", "ckpt_paced_s", "load_idle_s", "load_kv_s"]
    med = {m: {k: statistics.median([r[k] for r in runs if r["mode"] == m]) for k in keys}
           for m in ("on", "off") if any(r["mode"] == m for r in runs)}
    for m, v in med.items():
        for w in ("idle", "flush", "load"):
            xs = [x for r in runs if r["mode"] == m for x in r[f"kv_{w}_lat_s"]]
            v[f"kv_{w}_n"] = len(xs)
            v[f"kv_{w}_p50_ms"], v[f"kv_{w}_p99_ms"] = _pct(xs, 0.5) * 1e3, _pct(xs, 0.99) * 1e3
    out = [f"{'arbiter':<8} {'KV get p50/p99 ms: idle':>24} {'flush':>14} {'load':>14} "
           f"{'ckpt s: idle':>13} {'under KV':>9} {'load s: idle':>13} {'under KV':>9}"]
    for m, v in med.items():
        out.append(f"{m:<8} {v['kv_idle_p50_ms']:>11.1f} / {v['kv_idle_p99_ms']:>9.1f} "
                   f"{v['kv_flush_p50_ms']:>6.1f} / {v['kv_flush_p99_ms']:>5.1f} "
                   f"{v['kv_load_p50_ms']:>6.1f} / {v['kv_load_p99_ms']:>5.1f} "
                   f"{v['ckpt_idle_s']:>13.2f} {v['ckpt_kv_s']:>9.2f} {v['load_idle_s']:>13.2f} {v['load_kv_s']:>9.2f}")
    raw = [(r["raw_write_gbps"], r["raw_read_gbps"]) for r in runs if "raw_write_gbps" in r]
    if raw:
        out.append(f"device at each round's start (raw O_DIRECT, {RAW_BYTES >> 20} MiB, {RAW_DEPTH} in flight): write "
                   f"{min(w for w, _ in raw):.2f}-{max(w for w, _ in raw):.2f} GB/s (durable), read "
                   f"{min(x for _, x in raw):.2f}-{max(x for _, x in raw):.2f} GB/s (cold)")
    for m, v in med.items():
        # each ratio is taken within a round (its idle and loaded runs are back to back), then the median
        mine = [r for r in runs if r["mode"] == m]
        f = v["kv_flush_p99_ms"] / v["kv_idle_p99_ms"]
        c = statistics.median([r["ckpt_kv_s"] / r["ckpt_idle_s"] for r in mine])
        lo = statistics.median([r["load_kv_s"] / r["load_idle_s"] for r in mine])
        def ok(x: float, t: float) -> str:  # a verdict needs 3 rounds: the times swing 10-50% from round to round
            word = "met" if x <= t else "NOT MET"
            return word if len(mine) >= 3 else f"{word} in {len(mine)} round(s): indicative only, 3+ to judge"
        few = v["kv_flush_n"] < 50  # a p99 of fewer gets is their maximum (or next to it): too few to judge
        out.append(f"arbiter {m}: KV p99 during flush / idle = {f:.2f}x ({v['kv_flush_n']} and {v['kv_idle_n']} gets; "
                   f"target <= 1.5x: {'too few gets to judge (more --rounds)' if few else ok(f, 1.5)}); "
                   f"checkpoint under KV / idle = {c:.2f}x (<= 1.3x: {ok(c, 1.3)}, {v['ckpt_paced_s']:.2f} s "
                   f"paced); load under KV / idle = {lo:.2f}x (<= 1.3x: {ok(lo, 1.3)})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a folder on the tier under test; the checkpoints written there are removed, the model, "
                        "the KV chunks and the tier state stay for the next run (remove the folder when done)")
    p.add_argument("--ckpt-gib", type=float, default=4.0,
                   help="checkpoint size, GiB (default 4: 3 rounds' flush windows hold ~90 gets, so their p99 is "
                        "not their maximum)")
    p.add_argument("--model-gib", type=float, default=1.0, help="model to load, GiB (default 1)")
    p.add_argument("--kv-chunk-mib", type=int, default=16, help="KV chunk size, MiB (default 16)")
    p.add_argument("--kv-chunks", type=int, default=32, help="KV working set in chunks (default 32)")
    p.add_argument("--get-interval-ms", type=float, default=100.0,
                   help="one KV get every this many ms (default 100: ~170 MB/s of KV, a serving stream)")
    p.add_argument("--idle-s", type=float, default=8.0, help="seconds of KV gets with nothing else (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode, rotated on/off (default 3)")
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    a = p.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    os.environ["FASTCKPT_TIER_DIR"] = os.path.join(a.dir, "tier-state")
    os.makedirs(os.environ["FASTCKPT_TIER_DIR"], exist_ok=True)
    import torch

    import fastckpt
    model = os.path.join(a.dir, "model")
    if not os.path.exists(model):
        n = int(a.model_gib * GiB) // 2
        per = 64 * MiB // 2
        fastckpt.save({f"w{i}": torch.empty(min(per, n - i * per), dtype=torch.bfloat16).random_()
                       for i in range(-(-n // per))}, model)
    if not os.path.exists(os.path.join(a.dir, "kv")):
        fill_kv(os.path.join(a.dir, "kv"), a.kv_chunks, a.kv_chunk_mib * MiB)
    runs = []
    for r in range(a.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            runs.append(one_round(a, mode, r))
    print(f"\nbench_tier: {a.ckpt_gib:g} GiB flush, {a.model_gib:g} GiB load, {a.kv_chunk_mib} MiB KV gets every "
          f"{a.get_interval_ms:g} ms, {a.rounds} rounds per mode (medians); dir {a.dir}")
    for line in summary(runs):
        print(line)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "runs": runs, "summary": summary(runs)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
