"""Shared pieces of the fastckpt benchmarks: the state, the raw device figure, child runs, tables.

Every contender runs in a fresh ``python`` subprocess (``--child NAME``) so its peak RSS
(``ru_maxrss``) is its own; the child prints one JSON line. Contenders are run in a different
(seeded, shuffled) order on each repetition and medians are quoted (the disk and the 2 cores are shared).
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

GB = 1e9
MiB = 1 << 20
REQ = 4 * MiB
DEPTHS = (1, 4, 16)


# ----------------------------------------------------------------------------- the state
def layout(size_gib: float, seed: int = 0) -> list[tuple[str, int]]:
    """``[(name, numel)]`` of bf16 tensors totalling ``size_gib`` GiB: ~92% in 80-200 MB
    tensors, the rest in many small ones (2 KiB - 1 MiB). Deterministic."""
    import random
    rng = random.Random(seed)
    total = int(size_gib * (1 << 30)) // 2
    big_budget = int(total * 0.92)
    out: list[tuple[str, int]] = []
    used = 0
    i = 0
    while used < big_budget:
        n = min(rng.randint(80_000_000, 200_000_000) // 2, big_budget - used)
        if n < 40_000_000 // 2 and out:  # fold a tiny tail into the previous big tensor
            name, m = out[-1]
            out[-1] = (name, m + n)
        else:
            out.append((f"layers.{i}.mlp.weight", n))
            i += 1
        used += n
    j = 0
    while used < total:
        n = min(int(2 ** rng.uniform(10, 19)), total - used)  # 1 Ki..512 Ki elements = 2 KiB..1 MiB
        out.append((f"layers.{j % max(i, 1)}.small.{j}", n))
        used += n
        j += 1
    rng.shuffle(out)
    return out


def make_state(size_gib: float, seed: int = 0) -> dict:
    """``{"model": {name: bf16 tensor}}`` per :func:`layout`, filled with random bits (touched)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, generator=g)
    model = {}
    for k, (name, n) in enumerate(layout(size_gib, seed)):
        t = torch.empty(n, dtype=torch.bfloat16)
        u8 = t.view(torch.uint8)
        off = (k * 7919 * 4096) % (32 * MiB)
        for a in range(0, u8.numel(), 32 * MiB):
            m = min(32 * MiB, u8.numel() - a)
            u8[a:a + m].copy_(block[off:off + m])
        model[name] = t
    return {"model": model}


def state_bytes(size_gib: float) -> int:
    return sum(n for _, n in layout(size_gib)) * 2


# ----------------------------------------------------------------------------- system
def drop_caches() -> bool:
    """Drop the page cache (root only). Returns whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fsync_path(path: str) -> None:
    """fsync one file or folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under ``path`` (for contenders that do not fsync themselves)."""
    for root, dirs, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))
        fsync_path(root)


def fsync_file(path: str) -> None:
    """fsync a file and its folder."""
    fsync_path(path)
    fsync_tree_dir(os.path.dirname(path) or ".")


def fsync_tree_dir(folder: str) -> None:
    """fsync a folder (so new entries in it are durable)."""
    fsync_path(folder)


def rm(path: str) -> None:
    import shutil
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def warm_file(path: str) -> None:
    """Read ``path`` (or every file under it) through the page cache."""
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    buf = bytearray(16 * MiB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ----------------------------------------------------------------------------- raw device
def _raw_io(path: str, nbytes: int, depth: int, write: bool) -> float:
    """Seconds to write (O_DIRECT + fsync, fresh file) or read (O_DIRECT) ``nbytes`` of ``path``
    in 4 MiB requests with ``depth`` requests in flight (one thread per request)."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    nreq = -(-nbytes // REQ)
    nxt = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(fd: int) -> None:
        buf = mmap.mmap(-1, REQ)
        buf.write(os.urandom(4096) * (REQ // 4096))
        mv = memoryview(buf)
        try:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= nreq:
                    return
                off = i * REQ
                n = min(REQ, nbytes - off)
                if write:
                    done = 0
                    while done < n:
                        done += os.pwrite(fd, mv[done:n], off + done)
                else:
                    os.preadv(fd, [mv[:n]], off)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            mv.release()
            buf.close()

    t0 = time.perf_counter()
    fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        ths = [threading.Thread(target=worker, args=(fd,)) for _ in range(depth)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def raw_gbps(path: str, nbytes: int, depth: int, write: bool) -> float:
    """GB/s of one raw pass over ``path`` (:func:`_raw_io`: O_DIRECT, 4 MiB requests, ``depth`` in
    flight; a write is durable, a read starts from a dropped page cache)."""
    if not write:
        drop_caches()
    return nbytes / _raw_io(path, nbytes, depth, write) / GB


def _fio(path: str, nbytes: int, depth: int, write: bool) -> float | None:
    import shutil
    if not shutil.which("fio"):
        return None
    args = ["fio", "--name=raw", f"--filename={path}", f"--size={nbytes}", "--bs=4M", "--direct=1",
            "--ioengine=libaio", f"--iodepth={depth}", f"--rw={'write' if write else 'read'}",
            "--output-format=json", "--end_fsync=1" if write else "--invalidate=1"]
    try:
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]["write" if write else "read"]
        return nbytes / (job["bw_bytes"]) if job["bw_bytes"] else None
    except (subprocess.CalledProcessError, ValueError, KeyError):
        return None


def raw_device(folder: str, nbytes: int, reps: int, write: bool) -> dict:
    """The raw device figure: median GB/s per depth over ``reps`` (depth order rotated), and the best."""
    path = os.path.join(folder, "raw.bin")
    per: dict[int, list[float]] = {d: [] for d in DEPTHS}
    tool = "python threads, O_DIRECT, 4 MiB requests"
    if not write and not os.path.exists(path):
        _raw_io(path, nbytes, 4, True)
    for r in range(reps):
        order = DEPTHS[r % len(DEPTHS):] + DEPTHS[:r % len(DEPTHS)]
        for d in order:
            if write:
                rm(path)
                os.sync()
            else:
                drop_caches()
            s = _fio(path, nbytes, d, write)
            if s is not None:
                tool = "fio libaio, O_DIRECT, 4 MiB requests"
            else:
                s = _raw_io(path, nbytes, d, write)
            per[d].append(nbytes / s / GB)
    if write:
        rm(path)
    med = {d: statistics.median(v) for d, v in per.items()}
    best = max(med, key=med.get)
    return {"tool": tool, "gbps_by_depth": {str(d): round(v, 3) for d, v in med.items()},
            "samples": {str(d): [round(x, 3) for x in v] for d, v in per.items()},
            "best_depth": best, "gbps": med[best], "seconds": nbytes / med[best] / GB}


# ----------------------------------------------------------------------------- child runs
#: Suffix of a contender run with the fastckpt of another checkout (``--baseline SRC``).
BASELINE = "@baseline"


def run_child(script: str, name: str, args: list[str], timeout: float = 1800, baseline: str | None = None) -> dict:
    """Run ``script --child name args`` in a fresh interpreter; returns its JSON (or an ``error``).

    A ``name`` ending in :data:`BASELINE` runs the same contender (suffix removed) with the
    fastckpt package of the checkout ``baseline`` first on ``PYTHONPATH`` (today's main beside
    the new code, same bytes, same run), and its rows are renamed with the suffix.
    """
    child, checkout = name, os.path.dirname(os.path.dirname(os.path.abspath(script)))
    if name.endswith(BASELINE):
        if not baseline:
            return {"error": f"{name} needs --baseline SRC (a checkout of the code to compare with)"}
        child, checkout = name[:-len(BASELINE)], os.path.abspath(baseline)
    # Both sides get the same kind of environment: their checkout first on PYTHONPATH, the rest as
    # given. Only the baseline used to get one ("SRC:" with an empty PYTHONPATH, so one sys.path entry
    # more): HEAD against a worktree of HEAD, the @baseline row's first async_save blocked 0.25 s and
    # ours 0.37 s, 7 reps of 7; the first fastckpt.save took 0.61 vs 0.77 s. A second PYTHONPATH
    # entry alone does it (PYTHONPATH=SRC vs SRC:/nonexistent, fresh processes alternating); the
    # memcpy child is not affected and the tier arbiter is not the cause (FASTCKPT_TIER=off): the
    # mechanism is not found.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, script, "--child", child, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    res = _child_json(p)
    if child != name and "rows" in res:
        for row in res["rows"]:
            row["name"] += BASELINE
    return res


def _child_json(p: subprocess.CompletedProcess) -> dict:
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


def child_print(d: dict) -> None:
    d.setdefault("maxrss", maxrss_bytes())
    print(json.dumps(d), flush=True)


def rotated(items: list, r: int) -> list:
    """The order of repetition ``r``: ``items`` as given for ``r == 0``, then a different seeded
    shuffle per repetition. A plain rotation kept every contender behind the same neighbour in every
    repetition (a save right after another checkpoint's 1 GB write paid for its page-cache reclaim
    each time): the @baseline rows came out 0.07 s faster in first-save blocking whichever checkout
    was the baseline. Shuffled, each contender follows different ones and the medians even it out."""
    if r == 0:
        return list(items)
    out = list(items)
    random.Random(r).shuffle(out)
    return out


def med(rows: list[dict], key: str) -> float | None:
    v = [x[key] for x in rows if x.get(key) is not None]
    return statistics.median(v) if v else None


# ----------------------------------------------------------------------------- output
def machine() -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "kernel": platform.release(),
            "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
            if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else None}


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Markdown table of ``rows`` with ``cols`` = (header, key, format spec)."""
    lines = [f"### {title}", "", "| " + " | ".join(h for h, _, _ in cols) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) if s == "s" else fmt(r.get(k), s)
                                       for _, k, s in cols) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(path: str, title: str, rows: list[dict], raw_gbps: float, key: str = "gbps") -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    rows = [r for r in rows if r.get(key) is not None]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    names = [r["name"] for r in rows]
    vals = [r[key] for r in rows]
    colors = ["tab:green" if n.startswith("fastckpt") else "tab:gray" for n in names]
    ax.barh(names, vals, color=colors)
    ax.axvline(raw_gbps, color="tab:red", ls="--", label=f"raw device {raw_gbps:.2f} GB/s")
    ax.axvline(0.9 * raw_gbps, color="tab:red", ls=":", label="0.9x raw (target)")
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (median)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
    return True


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"results: {path}")


def memcpy_s(nbytes: int) -> float:
    """Seconds of one plain copy of ``nbytes`` between two already-touched host buffers
    (median of 3): the "one memory copy of the saved state" that blocking targets compare to."""
    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return sorted(times)[1]
