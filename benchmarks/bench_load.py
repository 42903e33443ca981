"""Load throughput, cold and warm page cache: fastckpt vs safetensors, torch.load, DCP, runai, fastsafetensors.

    python benchmarks/bench_load.py [--size-gib 2] [--reps 3] [--dir /tmp/fastckpt-bench-load] [--plot]

The same state (bf16 tensors of mixed sizes under ``state["model"]``) is written once in each
format; every load then runs in a fresh subprocess that ends with every tensor in memory it owns
(mmap-backed loaders are copied out). Cold runs drop the page cache (``/proc/sys/vm/drop_caches``,
root) right before the timed load; warm runs read the files through the page cache first.
Order is shuffled per repetition; medians are quoted. Results: ``benchmarks/results/load.json``.

``fastckpt.load`` and ``fastckpt.load_into`` check every tensor's xxh3 by default; the
``(verify=False)`` rows skip it, so the pair measures the cost of the check (``fastckpt.load_into``
fills a preallocated state, its allocation timed, as ``dcp.load``)::

    python benchmarks/bench_load.py --size-gib 1 --reps 3 --modes warm \
        --only "fastckpt.load,fastckpt.load(verify=False),fastckpt.load_into,fastckpt.load_into(verify=False)"

``fastckpt.load_weights(dtype=fp32)`` loads the same bf16 file converted to fp32 on the way
(``fastckpt.loading.device.load_weights``, CPU, default 256 MiB ring / 16 MiB slots): its loaded
size is twice the state. GB/s counts the bytes read (the state), as for every row; "RSS growth /
loaded" divides by what the load returns; the row's stated bound (``R + B + S`` of
``load_tensors``' docstring) is printed under the table. ``--only fastckpt.load_weights(dtype=fp32)``
runs it alone; with ``--baseline SRC`` it also runs with another checkout's fastckpt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

CONTENDERS = ["fastckpt.load", "fastckpt.load(verify=False)", "fastckpt.load_into", "fastckpt.load_into(verify=False)",
              "fastckpt.load(foreign .safetensors)", "safetensors.load_file(mmap)+copy",
              "safetensors.load_file(backend=pread)", "torch.load(mmap=True)+copy", "dcp.load",
              "runai-model-streamer", "fastsafetensors(nogds)", "fastckpt.load_weights(dtype=fp32)"]
SOURCE = {"fastckpt.load": "fastckpt", "fastckpt.load(verify=False)": "fastckpt", "fastckpt.load_into": "fastckpt",
          "fastckpt.load_into(verify=False)": "fastckpt", "fastckpt.load(foreign .safetensors)": "model.safetensors",
          "safetensors.load_file(mmap)+copy": "model.safetensors",
          "safetensors.load_file(backend=pread)": "model.safetensors", "torch.load(mmap=True)+copy": "model.pt",
          "dcp.load": "dcp", "runai-model-streamer": "model.safetensors",
          "fastsafetensors(nogds)": "model.safetensors", "fastckpt.load_weights(dtype=fp32)": "model.safetensors"}
#: Contenders that return another dtype: name -> (bytes returned per byte stored, bound on RSS growth
#: in bytes as a function of the returned bytes R: load_tensors' docstring, R + ring + slot, CPU).
CONVERTS = {"fastckpt.load_weights(dtype=fp32)": (2, lambda r: r + (256 << 20) + (16 << 20))}


def prepare(folder: str, size_gib: float) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import fastckpt
    state = C.make_state(size_gib)
    for name in ("fastckpt", "model.safetensors", "model.pt", "dcp"):
        C.rm(os.path.join(folder, name))
    fastckpt.save(state, os.path.join(folder, "fastckpt"))
    save_file(state["model"], os.path.join(folder, "model.safetensors"))
    torch.save(state, os.path.join(folder, "model.pt"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(folder, "dcp"), thread_count=2), no_dist=True)
    os.sync()
    return {"rows": []}


def child(name: str, folder: str, size_gib: float, mode: str) -> dict:
    import torch
    src = os.path.join(folder, SOURCE[name])
    shapes = None
    if name == "dcp.load" or name.startswith("fastckpt.load_into"):  # into a preallocated state: allocation timed
        shapes = C.layout(size_gib)
    if name == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer
    if name == "fastsafetensors(nogds)":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    if name.startswith("fastckpt"):
        import fastckpt
        from fastckpt.loading.device import load_weights
    if name.startswith("safetensors"):
        from safetensors.torch import load_file
    if name == "dcp.load":
        import torch.distributed.checkpoint as dcp
    if mode == "cold":
        dropped = C.drop_caches()
    else:
        dropped = None
        C.warm_file(src)
    base = C.maxrss_bytes()
    t0 = time.perf_counter()
    if name == "fastckpt.load":
        out = fastckpt.load(src)["model"]  # checksums checked (the default)
    elif name == "fastckpt.load(verify=False)":
        out = fastckpt.load(src, verify=False)["model"]
    elif name.startswith("fastckpt.load_into"):
        out = {n: torch.empty(k, dtype=torch.bfloat16) for n, k in shapes}
        fastckpt.load_into({"model": out}, src, verify=name == "fastckpt.load_into")
    elif name == "fastckpt.load(foreign .safetensors)":
        out = fastckpt.load(src)
    elif name == "fastckpt.load_weights(dtype=fp32)":
        out = load_weights(src, "cpu", dtype=torch.float32)
    elif name == "safetensors.load_file(mmap)+copy":
        out = {k: v.clone() for k, v in load_file(src).items()}
    elif name == "safetensors.load_file(backend=pread)":
        out = load_file(src, backend="pread")
    elif name == "torch.load(mmap=True)+copy":
        sd = torch.load(src, mmap=True, weights_only=True)
        out = {k: v.clone() for k, v in sd["model"].items()}
        del sd
    elif name == "dcp.load":
        out = {n: torch.empty(k, dtype=torch.bfloat16) for n, k in shapes}
        dcp.load({"model": out}, storage_reader=dcp.FileSystemReader(src), no_dist=True)
    elif name == "runai-model-streamer":
        out = {}
        with SafetensorsStreamer() as s:
            s.stream_file(src)
            for k, v in s.get_tensors():
                out[k] = v
    elif name == "fastsafetensors(nogds)":
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
        loader.add_filenames({0: [src]})
        bufs = loader.copy_files_to_device()
        out = {k: bufs.get_tensor(k) for k in loader.get_keys()}
        bufs.close()
        loader.close()
    else:
        raise SystemExit(f"unknown contender {name}")
    seconds = time.perf_counter() - t0
    got = sum(v.numel() * v.element_size() for v in out.values())
    want = C.state_bytes(size_gib) * CONVERTS.get(name, (1,))[0]
    if got != want or len(out) != len(C.layout(size_gib)):
        raise SystemExit(f"{name}: loaded {got} bytes in {len(out)} tensors, expected {want}")
    return {"rows": [{"name": name, "seconds": seconds, "dropped": dropped, "loaded": got}], "base_rss": base,
            "maxrss": C.maxrss_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/fastckpt-bench-load")
    ap.add_argument("--only", default=None, help="comma-separated contender names (default: all)")
    ap.add_argument("--modes", default="cold,warm")
    ap.add_argument("--no-prepare", action="store_true", help="reuse the files of a previous run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "load.json"))
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--baseline", default=None, metavar="SRC",
                    help="checkout of another fastckpt (e.g. `git worktree add /tmp/base main`): its "
                         "fastckpt contenders run beside ours in the same run, named NAME@baseline")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="cold", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    if a.child:
        C.child_print(prepare(a.dir, a.size_gib) if a.child == "prepare" else
                      child(a.child, a.dir, a.size_gib, a.mode))
        return
    nbytes = C.state_bytes(a.size_gib)
    names = a.only.split(",") if a.only else list(CONTENDERS)
    if a.baseline and not a.only:
        names += [n + C.BASELINE for n in CONTENDERS if n.startswith("fastckpt")]
    modes = a.modes.split(",")
    print(f"state: {nbytes / C.GB:.3f} GB of bf16 tensors under state['model']; {a.reps} reps; dir {a.dir}",
          flush=True)
    if not a.no_prepare:
        res = C.run_child(__file__, "prepare", ["--dir", a.dir, "--size-gib", str(a.size_gib)])
        if "error" in res:
            raise SystemExit(f"prepare failed: {res['error']}")
    can_drop = C.drop_caches()
    if not can_drop:
        print("WARNING: cannot drop the page cache (not root?): 'cold' runs are NOT cold", flush=True)
    raw = C.raw_device(a.dir, nbytes, a.reps, write=False)
    print(f"raw device read ({raw['tool']}): {raw['gbps_by_depth']} GB/s by depth -> {raw['gbps']:.3f} GB/s",
          flush=True)
    samples: dict[tuple[str, str], list[dict]] = {}
    skipped: dict[str, str] = {}
    for r in range(a.reps):
        for name in C.rotated(names, r):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                if name in skipped:
                    continue
                res = C.run_child(__file__, name, baseline=a.baseline, args=["--dir", a.dir, "--size-gib", str(a.size_gib), "--mode", mode])
                if "error" in res:
                    skipped[name] = res["error"]
                    print(f"  skip {name}: {res['error']}", flush=True)
                    continue
                row = res["rows"][0]
                row.update(maxrss=res["maxrss"], extra_rss=res["maxrss"] - res["base_rss"])
                samples.setdefault((name, mode), []).append(row)
                print(f"  rep {r}: {name} [{mode}]: {row['seconds']:.2f} s, "
                      f"peak RSS {res['maxrss'] / C.GB:.2f} GB", flush=True)
    rows = []
    for (name, mode), ss in samples.items():
        s = C.med(ss, "seconds")
        loaded = ss[0].get("loaded", nbytes)
        rows.append({"name": name, "mode": mode, "seconds": s, "gbps": nbytes / s / C.GB,
                     "peak_rss_gb": C.med(ss, "maxrss") / C.GB, "extra_rss_gb": C.med(ss, "extra_rss") / C.GB,
                     "extra_rss_x_state": C.med(ss, "extra_rss") / nbytes, "loaded_gb": loaded / C.GB,
                     "extra_rss_x_loaded": C.med(ss, "extra_rss") / loaded,
                     "cache_dropped": all(x.get("dropped") for x in ss) if mode == "cold" else None,
                     "samples_s": [round(x["seconds"], 3) for x in ss]})
    best_anchor = {}
    for mode in modes:
        an = [r for r in rows if r["mode"] == mode and not r["name"].startswith("fastckpt")]
        best_anchor[mode] = max(an, key=lambda r: r["gbps"]) if an else None
    for r in rows:
        r["x_raw"] = r["gbps"] / raw["gbps"]
        b = best_anchor.get(r["mode"])
        r["x_best_anchor"] = r["gbps"] / b["gbps"] if b else None
    rows.sort(key=lambda r: (modes.index(r["mode"]), not r["name"].startswith("fastckpt"), -r["gbps"]))
    table = C.print_table(
        f"Load, {nbytes / C.GB:.2f} GB, median of {a.reps}; raw device read {raw['gbps']:.2f} GB/s "
        f"(O_DIRECT, depth {raw['best_depth']}); cold = page cache dropped before each run"
        + ("" if can_drop else " (COULD NOT DROP: not cold)"),
        rows, [("contender", "name", "s"), ("cache", "mode", "s"), ("GB/s", "gbps", ".2f"),
               ("seconds", "seconds", ".2f"), ("peak RSS GB", "peak_rss_gb", ".2f"),
               ("RSS growth GB", "extra_rss_gb", ".2f"), ("RSS growth / state", "extra_rss_x_state", ".2f"),
               ("loaded GB", "loaded_gb", ".2f"), ("RSS growth / loaded", "extra_rss_x_loaded", ".2f"),
               ("x raw", "x_raw", ".2f"), ("x best anchor", "x_best_anchor", ".2f")])
    print("(peak RSS: whole process incl. ~0.2 GB of python+torch; RSS growth: peak minus RSS before the load)")
    for r in rows:
        conv = CONVERTS.get(r["name"].removesuffix(C.BASELINE))
        if conv:
            bound = conv[1](r["loaded_gb"] * C.GB) / C.GB
            r["rss_bound_gb"] = bound
            print(f"{r['name']} [{r['mode']}]: RSS growth {r['extra_rss_gb']:.3f} GB, stated bound R + ring + slot = "
                  f"{bound:.3f} GB: {'within' if r['extra_rss_gb'] <= bound else 'OVER'}")
    for n, e in skipped.items():
        print(f"skipped {n}: {e}")
    data = {"bench": "load", "state_bytes": nbytes, "reps": a.reps, "dir": a.dir, "machine": C.machine(),
            "raw_read": raw, "caches_dropped": can_drop,
            "best_anchor": {m: (b["name"] if b else None) for m, b in best_anchor.items()},
            "rows": rows, "skipped": skipped, "table_md": table, "unix_time": time.time()}
    C.write_json(a.out, data)
    if a.plot:
        cold = [dict(r, name=f"{r['name']} [{r['mode']}]") for r in rows]
        C.plot(os.path.splitext(a.out)[0] + ".png", f"Load, {nbytes / C.GB:.2f} GB bf16", cold, raw["gbps"])


if __name__ == "__main__":
    main()
