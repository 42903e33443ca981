#!/usr/bin/env python
"""Torture run of fastckpt's crash-safety guarantees; prints a table, exits 1 on any failure.

- SIGKILL of a forked writer at random moments (``--iterations``, default 50), then: latest
  commit loads bit-exactly and verifies, nothing uncommitted is latest, leftovers are cleaned
  by the next save or by ``fastckpt prune``;
- ENOSPC on an 8 MiB tmpfs (root only, else skipped), EIO / failed fsync / failed close through
  a faulty backend: typed error, nothing committed, previous checkpoint intact, no leaks;
- fuzzing of the safetensors header parser (hypothesis, and atheris when installed).

Usage: ``python scripts/torture.py [--iterations N] [--quick] [--seed S]``
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAULTS = os.path.join(HERE, "..", "tests", "faults")
sys.path.insert(0, FAULTS)

import faultkit as fk  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.errors import FastCkptError  # noqa: E402
from fastckpt.format.safetensors import parse_header  # noqa: E402


def io_faults(tmp: str, rounds: int) -> tuple[int, int, list[str]]:
    """Injected ENOSPC/EIO/fsync/close failures. Returns (cases, bytes verified, failures)."""
    cases, nbytes, failures = 0, 0, []
    plans = [("pwrite", errno.EIO), ("fsync", errno.EIO), ("close", errno.EIO), ("pwrite", errno.ENOSPC),
             ("open_write", errno.EIO), ("allocate", errno.ENOSPC), ("fsync", errno.ENOSPC)]
    rng = random.Random(5)
    root = os.path.join(tmp, "io")
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, fk.make_state(100), **fk.SAVE_OPTS)
    for i in range(rounds):
        method, err = plans[i % len(plans)]
        be = fk.FaultyBackend(method, nth=rng.randint(1, 4), err=err)
        before = fk.snapshot()
        try:
            mgr.save(200, fk.make_state(200), io_backend=be, **fk.SAVE_OPTS)
            got = None
        except OSError as e:
            got = e
        cases += 1
        problems = []
        if not be.fired:
            cases -= 1
            continue
        if not (isinstance(got, OSError) and got.errno == err):
            problems.append(f"expected errno {err}, got {got!r}")
        if mgr.steps() != [100] or fk.temp_leftovers(root):
            problems.append(f"committed or left something: {mgr.steps()} {fk.temp_leftovers(root)}")
        problems += fk.leaks(before)
        rep = fastckpt.verify(mgr.path(100))
        nbytes += rep.bytes_checked
        if not rep.ok or fk.same_state(fk.make_state(100), mgr.load()) is not None:
            problems.append("step 100 damaged")
        failures += [f"{method}/{errno.errorcode[err]}: {p}" for p in problems]
    return cases, nbytes, failures


def enospc_tmpfs(rounds: int) -> tuple[int, int, list[str], str]:
    """Real ENOSPC mid-shard on a small tmpfs filled by another writer after the space check."""
    cases, nbytes, failures = 0, 0, []
    try:
        ctx = fk.tmpfs("8m")
        d = ctx.__enter__()
    except PermissionError as e:
        return 0, 0, [], f"skipped ({e})"
    try:
        root = os.path.join(d, "run")
        mgr = fastckpt.CheckpointManager(root)
        mgr.save(100, fk.make_state(100), **fk.SAVE_OPTS)
        for i in range(rounds):
            st = os.statvfs(d)
            free = st.f_bavail * st.f_frsize
            ballast = os.path.join(d, "ballast")

            def fill():
                with open(ballast, "wb") as f:
                    f.write(b"\0" * (free - (600 << 10)))
            be = fk.FaultyBackend("open_write", nth=1 + i % 3, err=None, hook=fill, no_allocate=bool(i % 2))
            before = fk.snapshot()
            try:
                mgr.save(200, fk.make_state(200), io_backend=be, **fk.SAVE_OPTS)
                failures.append("ENOSPC save committed")
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    failures.append(f"expected ENOSPC, got {e!r}")
            cases += 1
            os.unlink(ballast)
            if mgr.steps() != [100] or fk.temp_leftovers(root) or fk.leaks(before):
                failures.append(f"after ENOSPC: steps {mgr.steps()}, leftovers {fk.temp_leftovers(root)}")
            rep = fastckpt.verify(mgr.path(100))
            nbytes += rep.bytes_checked
            if not rep.ok:
                failures.append(f"step 100 damaged: {rep.problems}")
    finally:
        ctx.__exit__(None, None, None)
    return cases, nbytes, failures, "ok"


def fuzz(n: int, seed: int) -> tuple[int, list[str]]:
    """Random and mutated headers into parse_header: typed error or valid result, < 1 s each."""
    rng = random.Random(seed)
    seeds = [b'{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"k":"v"}}',
             b'{"b":{"dtype":"BF16","shape":[0,3],"data_offsets":[0,0]}}', b"{}", b"[" * 2000]
    failures, tried = [], 0
    for i in range(n):
        if i % 3 == 0:
            body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        else:
            b = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 4)):
                op = rng.randint(0, 2)
                pos = rng.randint(0, max(len(b) - 1, 0))
                if op == 0 and b:
                    b[pos] = rng.getrandbits(8)
                elif op == 1:
                    b[pos:pos] = rng.choice([b"9" * rng.randint(1, 30), b"-1", b"[", b"]", b'"', b"1e400", b"\xff"])
                elif b:
                    del b[pos]
            body = bytes(b)
        t = time.perf_counter()
        try:
            parse_header(body, 8 + len(body) + rng.choice([0, 16, 2**63]))
        except FastCkptError:
            pass
        except Exception as e:  # noqa: BLE001
            failures.append(f"fuzz input {body[:60]!r}: {type(e).__name__}: {e}")
        if time.perf_counter() - t > 1.0:
            failures.append(f"fuzz input {body[:60]!r} took {time.perf_counter() - t:.1f} s")
        tried += 1
    # the hostile length field in a tiny file
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(struct.pack("<Q", 2**63) + b"{}")
        f.flush()
        try:
            fastckpt.load(f.name)
            failures.append("2**63 length field accepted")
        except FastCkptError:
            pass
        tried += 1
    return tried, failures


def atheris_runs(runs: int) -> tuple[int, list[str]]:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return 0, []
    r = subprocess.run([sys.executable, os.path.join(FAULTS, "atheris_header.py"), f"-runs={runs}",
                        "-max_len=512"], capture_output=True, text=True)
    return runs, ([] if r.returncode == 0 else [f"atheris: {r.stderr[-500:]}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=50, help="SIGKILL iterations (default 50)")
    ap.add_argument("--quick", action="store_true", help="10 kills, fewer I/O and fuzz cases")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    kills = 10 if a.quick else a.iterations
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fastckpt-torture-") as tmp:
        ks = fk.kill_campaign(os.path.join(tmp, "kill"), kills, seed=a.seed)
        io_cases, io_bytes, io_fail = io_faults(tmp, 7 if a.quick else 28)
        sp_cases, sp_bytes, sp_fail, sp_note = enospc_tmpfs(2 if a.quick else 6)
    fz_tried, fz_fail = fuzz(2000 if a.quick else 20000, a.seed)
    at_tried, at_fail = atheris_runs(2000 if a.quick else 20000)
    failures = ks.failures + io_fail + sp_fail + fz_fail + at_fail
    rows = [
        ("kills survived", f"{ks.kills - len(ks.failures)}/{ks.kills}",
         f"{ks.mid_save} mid-save (save ~{ks.save_s * 1e3:.0f} ms, writes paced {fk.KILL_PACE_S * 1e3:g} ms), "
         f"{ks.commits_seen} commits seen, leftovers cleaned: "
         f"{ks.cleaned_by_save} by next save, {ks.cleaned_by_prune} by prune"),
        ("ENOSPC cases (tmpfs)", str(sp_cases), sp_note),
        ("ENOSPC/EIO cases (backend)", str(io_cases), "pwrite, fsync, close, open, fallocate"),
        ("fuzz inputs tried", str(fz_tried + at_tried), f"{fz_tried} random/mutated, {at_tried} atheris"),
        ("bytes verified", str(ks.bytes_verified + io_bytes + sp_bytes), "re-read against xxh3 after faults"),
        ("failures", str(len(failures)), "must be 0"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"| {'check':<{w}} | {'result':>9} | notes")
    print(f"|{'-' * (w + 2)}|{'-' * 11}|------")
    for name, val, note in rows:
        print(f"| {name:<{w}} | {val:>9} | {note}")
    print(f"({time.perf_counter() - t0:.0f} s, seed {a.seed})")
    for f in failures:
        print("FAILURE:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
