"""Durable save throughput: fastckpt vs torch.save, safetensors, DCP, torchsnapshot, raw device.

    python benchmarks/bench_save.py [--size-gib 2] [--reps 3] [--dir /tmp/fastckpt-bench] [--plot]

Every contender runs in a fresh subprocess on the same state (bf16 tensors of mixed sizes under
``state["model"]``) and includes fsync of its files (durable). Order is shuffled per repetition;
medians are quoted. Results: ``benchmarks/results/save.json`` (``--plot``: ``save.png``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

CONTENDERS = ["fastckpt.save", "fastckpt.async_save", "memcpy", "raw.write", "torch.save", "safetensors.save_file",
              "dcp.save(thread_count=1)", "dcp.save(thread_count=2)", "dcp.async_save",
              "torchsnapshot.take", "torchsnapshot.async_take"]
ANCHORS = {"torch.save", "safetensors.save_file", "dcp.save(thread_count=1)", "dcp.save(thread_count=2)",
           "dcp.async_save", "torchsnapshot.take", "torchsnapshot.async_take"}


# ----------------------------------------------------------------------------- child side
def child(name: str, folder: str, size_gib: float) -> dict:
    import torch
    state = C.make_state(size_gib)
    base = C.maxrss_bytes()
    out = os.path.join(folder, "ckpt")
    C.rm(out)
    os.sync()
    rows = []

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    if name == "fastckpt.save":
        import fastckpt
        rows.append({"name": name, "seconds": timed(lambda: fastckpt.save(state, out))})
    elif name == "fastckpt.async_save":
        import fastckpt
        s = fastckpt.Saver()  # a saver of its own (the same in older checkouts)
        for label, path in (("first", out), ("repeat, pool reused", out + "2")):
            t0 = time.perf_counter()
            fut = s.async_save(state, path)
            blocking = time.perf_counter() - t0
            fut.result()
            total = time.perf_counter() - t0
            rows.append({"name": f"fastckpt.async_save ({label})", "seconds": total, "blocking_s": blocking})
            C.rm(path)
            os.sync()
    elif name == "memcpy":
        src = list(state["model"].values())
        t0 = time.perf_counter()
        dst = [t.clone() for t in src]
        fresh = time.perf_counter() - t0
        t0 = time.perf_counter()
        for d, t in zip(dst, src):
            d.copy_(t)
        touched = time.perf_counter() - t0
        rows += [{"name": "memcpy into fresh memory (clone)", "seconds": fresh, "memory": True},
                 {"name": "memcpy into touched memory (copy_)", "seconds": touched, "memory": True}]
    elif name == "raw.write":  # the reference of a first save: the same bytes, one os.write each, fsync
        def f():
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in state["model"].values():
                    mv = memoryview(t.view(torch.uint8).numpy())
                    while mv:
                        mv = mv[os.write(fd, mv):]
                os.fsync(fd)
            finally:
                os.close(fd)
            C.fsync_tree_dir(folder)
        rows.append({"name": "raw os.write + fsync", "seconds": timed(f)})
    elif name == "torch.save":
        def f():
            with open(out, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            C.fsync_tree_dir(folder)
        rows.append({"name": name, "seconds": timed(f)})
    elif name == "safetensors.save_file":
        from safetensors.torch import save_file

        def f():
            save_file(state["model"], out)
            C.fsync_file(out)
        rows.append({"name": name, "seconds": timed(f)})
    elif name.startswith("dcp.save"):
        import torch.distributed.checkpoint as dcp
        n = int(name.split("=")[1].rstrip(")"))

        def f():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(out, thread_count=n, sync_files=True),
                     no_dist=True)
            C.fsync_tree_dir(out)
        rows.append({"name": name, "seconds": timed(f)})
    elif name == "dcp.async_save":
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(out, thread_count=2, sync_files=True),
                             no_dist=True)
        blocking = time.perf_counter() - t0
        fut.result()
        C.fsync_tree_dir(out)
        rows.append({"name": "dcp.async_save(thread_count=2)", "seconds": time.perf_counter() - t0,
                     "blocking_s": blocking})
    elif name.startswith("torchsnapshot"):
        import torchsnapshot
        app = {"model": torchsnapshot.StateDict(**state["model"])}
        t0 = time.perf_counter()
        if name.endswith("async_take"):
            pending = torchsnapshot.Snapshot.async_take(out, app_state=app)
            blocking = time.perf_counter() - t0
            pending.wait()
        else:
            torchsnapshot.Snapshot.take(out, app_state=app)
            blocking = None
        C.fsync_tree(out)  # torchsnapshot does not fsync
        rows.append({"name": name, "seconds": time.perf_counter() - t0, "blocking_s": blocking})
    else:
        raise SystemExit(f"unknown contender {name}")
    C.rm(out)
    return {"rows": rows, "base_rss": base, "maxrss": C.maxrss_bytes()}


# ----------------------------------------------------------------------------- parent side
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/fastckpt-bench-save")
    ap.add_argument("--only", default=None, help="comma-separated contender names (default: all)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "save.json"))
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--baseline", default=None, metavar="SRC",
                    help="checkout of another fastckpt (e.g. `git worktree add /tmp/base main`): its "
                         "fastckpt contenders run beside ours in the same run, named NAME@baseline")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    if a.child:
        C.child_print(child(a.child, a.dir, a.size_gib))
        return
    nbytes = C.state_bytes(a.size_gib)
    names = a.only.split(",") if a.only else list(CONTENDERS)
    if a.baseline and not a.only:
        names += [n + C.BASELINE for n in CONTENDERS if n.startswith("fastckpt")]
    print(f"state: {nbytes / C.GB:.3f} GB of bf16 tensors under state['model']; {a.reps} reps; dir {a.dir}",
          flush=True)
    raw = C.raw_device(a.dir, nbytes, a.reps, write=True)
    print(f"raw device write ({raw['tool']}): {raw['gbps_by_depth']} GB/s by depth -> {raw['gbps']:.3f} GB/s",
          flush=True)
    samples: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    for r in range(a.reps):
        for name in C.rotated(names, r):
            if name in skipped:
                continue
            res = C.run_child(__file__, name, baseline=a.baseline, args=["--dir", a.dir, "--size-gib", str(a.size_gib)])
            if "error" in res:
                skipped[name] = res["error"]
                print(f"  skip {name}: {res['error']}", flush=True)
                continue
            for row in res["rows"]:
                row.update(maxrss=res["maxrss"], extra_rss=res["maxrss"] - res["base_rss"], group=name)
                samples.setdefault(row["name"], []).append(row)
                print(f"  rep {r}: {row['name']}: {row['seconds']:.2f} s"
                      + (f", blocking {row['blocking_s']:.2f} s" if row.get("blocking_s") else ""), flush=True)
    rows = []
    for rn, ss in samples.items():
        s = C.med(ss, "seconds")
        rows.append({"name": rn, "group": ss[0]["group"], "seconds": s, "gbps": nbytes / s / C.GB,
                     "blocking_s": C.med(ss, "blocking_s"), "peak_rss_gb": C.med(ss, "maxrss") / C.GB,
                     "extra_rss_gb": C.med(ss, "extra_rss") / C.GB, "memory": ss[0].get("memory", False),
                     "samples_s": [round(x["seconds"], 3) for x in ss]})
    disk = [r for r in rows if not r["memory"]]
    anchors = [r for r in disk if r["group"] in ANCHORS]
    best_anchor = max(anchors, key=lambda r: r["gbps"]) if anchors else None
    memfresh = next((r["seconds"] for r in rows if r["name"].startswith("memcpy into fresh")), None)
    memtouched = next((r["seconds"] for r in rows if r["name"].startswith("memcpy into touched")), None)
    rawwrite = next((r["seconds"] for r in rows if r["name"] == "raw os.write + fsync"), None)
    for r in rows:
        if r["memory"]:
            r["gbps_note"] = "memory"
            continue
        r["x_raw"] = r["gbps"] / raw["gbps"]
        r["x_best_anchor"] = r["gbps"] / best_anchor["gbps"] if best_anchor else None
        r["x_raw_write"] = rawwrite / r["seconds"] if rawwrite else None
        if r.get("blocking_s") and r["name"].startswith("fastckpt"):
            ref = memtouched if "repeat" in r["name"] else memfresh
            r["blocking_x_memcpy"] = r["blocking_s"] / ref if ref else None
    rows.sort(key=lambda r: (r["memory"], not r["name"].startswith("fastckpt"), -r["gbps"]))
    table = C.print_table(
        f"Save, durable (fsync included), {nbytes / C.GB:.2f} GB, median of {a.reps}; raw device write "
        f"{raw['gbps']:.2f} GB/s (depth {raw['best_depth']}); best anchor "
        f"{best_anchor['name'] if best_anchor else '-'}",
        rows, [("contender", "name", "s"), ("GB/s", "gbps", ".2f"), ("seconds", "seconds", ".2f"),
               ("blocking s", "blocking_s", ".2f"), ("blocking / memcpy", "blocking_x_memcpy", ".2f"),
               ("peak RSS GB", "peak_rss_gb", ".2f"), ("RSS over state GB", "extra_rss_gb", ".2f"),
               ("x raw", "x_raw", ".2f"), ("x raw.write", "x_raw_write", ".2f"), ("x best anchor", "x_best_anchor", ".2f")])
    print("(memcpy rows: plain copy of the state in memory, the reference for async_save blocking time; "
          "first save vs fresh memory, repeat vs touched memory; x raw.write: the 'raw os.write + fsync' "
          "row's seconds over the row's, every contender in a fresh process)")
    for n, e in skipped.items():
        print(f"skipped {n}: {e}")
    data = {"bench": "save", "state_bytes": nbytes, "reps": a.reps, "dir": a.dir, "machine": C.machine(),
            "raw_write": raw, "best_anchor": best_anchor["name"] if best_anchor else None, "rows": rows,
            "skipped": skipped, "table_md": table, "unix_time": time.time()}
    C.write_json(a.out, data)
    if a.plot:
        C.plot(os.path.splitext(a.out)[0] + ".png", f"Durable save, {nbytes / C.GB:.2f} GB bf16",
               [r for r in rows if not r["memory"]], raw["gbps"])


if __name__ == "__main__":
    main()
