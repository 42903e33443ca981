"""The shared KV capacity across processes (issue 15): exact accounting, crashes, a stress run.

The protocol (see ``fastckpt/kv/folder_index.py``): every file created, renamed or unlinked in
the folder is changed under the folder lock, and that lock section adds exactly the size change
it made; a process killed inside the lock leaves its pid in the header and the next section
recounts. So the counter equals the folder's bytes at every lock release and the folder never
holds more than ``max_bytes``. No LMCache needed; chunks are raw bytes (the workers import no
torch of their own beyond what fastckpt pulls in).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest

from fastckpt.errors import CorruptCheckpointError, InsufficientSpaceError
from fastckpt.kv import KVFileStore, KVStoreOptions, audit, chunk_name
from fastckpt.kv.folder_index import TMP_RE, KVFolderIndex

PIECE = 8 << 10
HEADER = 4096
TOKENS = (32, 48, 64)  # three chunk sizes: [2, 1 layer, tokens, 128] bf16 = 16, 24, 32 KiB of data
KEYS = 48


def _data_bytes(i: int) -> int:
    return 2 * 1 * TOKENS[i % len(TOKENS)] * 128 * 2


MAX_CHUNK = max(_data_bytes(i) for i in range(len(TOKENS))) + HEADER


def _key(i: int) -> str:
    return f"stress@1@0@{i:x}@bfloat16"


def _payload(i: int) -> bytes:
    return random.Random(i).randbytes(_data_bytes(i))


def _store(path, **kw) -> KVFileStore:
    kw.setdefault("piece_bytes", PIECE)
    kw.setdefault("durable", False)
    return KVFileStore(KVStoreOptions(path=str(path), **kw))


def _put(st: KVFileStore, i: int) -> bool:
    buf = memoryview(_payload(i))
    n = len(buf)
    return st.write(chunk_name(_key(i)), _key(i), "KV_2LTD", [("BF16", (2, 1, n // 512, 128), n)], buf)


def _get(st: KVFileStore, i: int) -> bytes | None:
    h = st.open_chunk(chunk_name(_key(i)))
    if h is None:
        return None
    out = bytearray(h.nbytes)
    mv = memoryview(out)
    try:
        for s, n in h.pieces():
            st.read_piece(h, mv, s, n)
    except CorruptCheckpointError as e:
        st.drop_corrupt(h, str(e))
        raise
    finally:
        st.close_chunk(h)
    return bytes(out)


def _worker(root: str, seed: int, ready, go, seconds: float, out: str, opts: dict) -> None:
    """Random puts, gets (content checked), removes, rescans and pins for ``seconds`` after ``go``."""
    st = _store(root, **opts)
    rng = random.Random(seed)
    n = dict(puts=0, gets=0, hits=0, removes=0, rescans=0, full=0, mismatches=0, corrupt=0)
    pinned: list[str] = []
    ready.set()
    if not go.wait(120):
        return
    deadline = time.time() + seconds
    while time.time() < deadline:
        i, r = rng.randrange(KEYS), rng.random()
        try:
            if r < 0.55:
                n["puts"] += _put(st, i)
            elif r < 0.90:
                n["gets"] += 1
                got = _get(st, i)
                if got is not None:
                    n["hits"] += 1
                    n["mismatches"] += got != _payload(i)
            elif r < 0.97:
                n["removes"] += st.remove(chunk_name(_key(i)))
            else:
                st.rescan()
                n["rescans"] += 1
        except InsufficientSpaceError:
            n["full"] += 1
        except CorruptCheckpointError:
            n["corrupt"] += 1
        if pinned and rng.random() < 0.3:
            st.unpin(pinned.pop())
        elif not pinned and rng.random() < 0.05 and st.contains(chunk_name(_key(i))):
            st.pin(chunk_name(_key(i)))
            pinned.append(chunk_name(_key(i)))
    n.update(evictions=st.stats.evictions, evicted_bytes=st.stats.evicted_bytes, repairs=st.stats.repairs)
    st.close()
    with open(out, "w") as f:
        json.dump(n, f)


def test_three_processes_one_killed_keep_the_capacity_and_the_accounting(tmp_path):
    root = tmp_path / "kv"
    cap = 10 * MAX_CHUNK
    writers = 4  # three that run to the end and one that is SIGKILLed mid-run
    observer = _store(root, max_bytes=cap)  # opened before the run: it must repair, not re-open
    ctx = mp.get_context("spawn")
    seconds = 6.0
    ready, go = [ctx.Event() for _ in range(writers)], ctx.Event()  # the run starts together, after imports
    opts = [dict(max_bytes=cap, min_rescan_interval_s=0.0),
            dict(max_bytes=cap, min_rescan_interval_s=1.0),
            dict(max_bytes=cap, min_rescan_interval_s=0.2, o_direct=False),
            dict(max_bytes=cap, min_rescan_interval_s=0.5, durable=True)]  # the victim: slower writes
    outs = [str(tmp_path / f"w{k}.json") for k in range(writers)]
    ps = [ctx.Process(target=_worker, args=(str(root), 100 + k, ready[k], go, seconds + (30 if k == 3 else 0),
                                            outs[k], opts[k])) for k in range(writers)]
    for p in ps:
        p.start()
    victim = ps[3]

    samples, bad = [], []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                a = audit(str(root))  # under the folder lock: a consistent view of counter and files
            except Exception as e:  # noqa: BLE001  (reported by the assertion on bad)
                bad.append(("audit raised", repr(e)))
                time.sleep(0.01)
                continue
            samples.append(a)
            if a["disk"] > cap:  # stricter than max_bytes + one chunk per writer: never above max_bytes
                bad.append(("over capacity", a))
            if a["holder"] == 0 and a["counter"] != a["disk"]:
                bad.append(("counter != disk at a clean lock release", a))
            if a["holder"] not in (0, victim.pid):
                bad.append(("lock left dirty by a live process", a))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for r in ready:
            assert r.wait(120), "a worker did not start"
        go.set()
        time.sleep(0.5 + random.Random().random() * 2.0)
        assert victim.is_alive(), f"victim exited early ({victim.exitcode})"
        os.kill(victim.pid, signal.SIGKILL)
        end = time.time() + seconds + 30
        for p in ps:
            p.join(max(1.0, end - time.time()))
    finally:
        stop.set()
        sampler.join(10)
        for p in ps:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ps] == [0, 0, 0, -signal.SIGKILL]
    stats = [json.load(open(o)) for o in outs[:3]]
    during = [s for s in samples if s["disk"]]
    assert not bad, bad[:5]
    assert len(during) >= 50, f"only {len(during)} samples during the run"
    assert sum(s["puts"] for s in stats) >= 30 and sum(s["evictions"] for s in stats) >= 10, stats
    assert sum(s["hits"] for s in stats) >= 10, stats
    assert sum(s["mismatches"] + s["corrupt"] + s["full"] for s in stats) == 0, stats
    assert max(s["disk"] for s in samples) <= cap

    # after the run: exact, or (the victim died inside the lock) exact after the next lock section
    after = audit(str(root))
    assert after["holder"] in (0, victim.pid)
    if after["holder"] == 0:
        assert after["counter"] == after["disk"], after
    assert observer.used_bytes() == observer.disk_bytes() <= cap  # any section repairs a dirty header
    fixed = audit(str(root))
    assert fixed["holder"] == 0 and fixed["counter"] == fixed["disk"] <= cap, fixed
    assert observer.stats.repairs == int(after["holder"] == victim.pid)

    # the next process: the victim's temp file (if it died writing) goes, the rest is intact
    fresh = _store(root, max_bytes=cap)
    final = audit(str(root))
    assert final["temps"] == 0 and final["holder"] == 0 and final["counter"] == final["disk"] <= cap, final
    assert fresh.used_bytes() == fresh.disk_bytes() == final["disk"]
    for i in range(KEYS):
        got = _get(fresh, i)
        assert got is None or got == _payload(i)
    print(f"samples {len(samples)}, max disk {max(s['disk'] for s in samples)} of {cap}, "
          f"victim died inside the lock: {after['holder'] == victim.pid}, temps left by it: {after['temps']}, "
          f"stats {stats}")


def test_eviction_subtracts_only_what_it_removed(tmp_path):
    """Two processes know the same chunk; one removes it, the other's eviction must not count it again."""
    one = _data_bytes(2) + HEADER
    a = _store(tmp_path, max_bytes=3 * one, min_rescan_interval_s=3600)
    for i in (2, 5, 8):  # same size (tokens index 2)
        _put(a, i)
    b = _store(tmp_path, max_bytes=3 * one, min_rescan_interval_s=3600)  # a second process's view
    gone, *rest = [chunk_name(_key(i)) for i in (2, 5, 8)]
    for n in rest:
        b.touch(n)
    assert b.names()[0] == gone  # b evicts this one first
    assert a.remove(gone)
    _put(b, 11)
    _put(b, 14)  # needs an eviction: b's first candidate is already gone
    for st in (a, b):
        assert st.used_bytes() == st.disk_bytes() <= 3 * one
    assert len([n for n in (chunk_name(_key(i)) for i in range(20)) if b.contains(n)]) == 3


def _die_inside_the_lock(root: str, where: str) -> None:
    st = _store(root)
    _put(st, 2)

    def killed(self, delta):
        os.kill(os.getpid(), signal.SIGKILL)

    KVFolderIndex._adjust_used = killed
    if where == "unlink":
        st.remove(chunk_name(_key(2)))  # the file goes, the counter is never told
    else:
        _put(st, 5)  # the temp file appears, the counter is never told


@pytest.mark.parametrize("where", ["unlink", "create"])
def test_killed_inside_the_lock_is_recounted_by_the_next_section(tmp_path, where):
    observer = _store(tmp_path)  # opened before: no start-up scan can hide the damage
    p = mp.get_context("spawn").Process(target=_die_inside_the_lock, args=(str(tmp_path), where))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    a = audit(str(tmp_path))
    assert a["holder"] == p.pid and a["counter"] != a["disk"], a  # the damage is there, and marked
    assert observer.used_bytes() == observer.disk_bytes()  # the next lock section recounts
    assert observer.stats.repairs == 1
    b = audit(str(tmp_path))
    assert b["holder"] == 0 and b["counter"] == b["disk"] and b["temps"] == 0, b  # dead writer's temp deleted
    assert observer.contains(chunk_name(_key(2))) is (where == "create")


def test_counter_stays_exact_without_preallocation(tmp_path, monkeypatch):
    """Where posix_fallocate is a no-op the temp file still has its full size from the start."""
    from fastckpt.storage.io import PosixBackend

    monkeypatch.setattr(PosixBackend, "allocate", lambda self, fd, n: None)
    seen = []
    real = KVFileStore._write_data

    def check(self, w, buf, offset):
        (tmp,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if TMP_RE.match(f)]
        seen.append(os.path.getsize(tmp))
        real(self, w, buf, offset)

    monkeypatch.setattr(KVFileStore, "_write_data", check)
    st = _store(tmp_path)
    _put(st, 1)
    assert seen == [_data_bytes(1) + HEADER] and st.used_bytes() == st.disk_bytes() == seen[0]


def test_an_old_or_clobbered_lock_header_is_recounted(tmp_path):
    st = _store(tmp_path)
    _put(st, 0)
    with open(tmp_path / ".fckv.lock", "r+b") as f:
        f.write(b"FCKVLCK1" + bytes(16))  # the previous layout
    assert audit(str(tmp_path))["counter"] is None
    assert st.used_bytes() == st.disk_bytes() == _data_bytes(0) + HEADER


def test_temp_file_of_a_reused_pid_is_stale_and_a_live_writers_is_kept(tmp_path):
    """The scan removes a temp file whose pid now belongs to a process started after the file
    was written (the storage layer's stale-owner check: pid reuse), and keeps one whose writer
    is alive and older than the file; both are younger than ``stale_tmp_s``."""
    import subprocess
    import sys

    st = _store(tmp_path, stale_tmp_s=1e9)
    name = chunk_name(_key(0))
    newcomer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        own = st.temp_path_for(name)  # this host, this process: rewrite the pid part
        head, pid, tail = os.path.basename(own).rsplit(".", 2)
        assert int(pid) == os.getpid()
        os.makedirs(os.path.dirname(own), exist_ok=True)
        reused = os.path.join(os.path.dirname(own), f"{head}.{newcomer.pid}.{tail}")
        live = os.path.join(os.path.dirname(own), f"{head}.{os.getppid()}.{tail}1")
        for p in (reused, live):
            with open(p, "wb") as f:
                f.write(b"x" * 100)
        hour_ago = time.time() - 3600  # written before the newcomer started
        os.utime(reused, (hour_ago, hour_ago))
        assert TMP_RE.match(os.path.basename(reused)) and TMP_RE.match(os.path.basename(live))
        st.rescan()
        assert not os.path.exists(reused)
        assert os.path.exists(live)
        assert audit(str(tmp_path))["disk"] == audit(str(tmp_path))["counter"] == 100
    finally:
        newcomer.kill()
        newcomer.wait()
        st.close()


def test_a_live_writers_temp_file_is_never_stale_by_age(tmp_path):
    """The age rule ran before the liveness checks: a scan deleted live writers' temp files, this
    process's own in-flight ones too, and with stale_tmp_s=0 59 of 80 puts failed with a bare
    FileNotFoundError (an LMCache KV-tier probe). Age now applies only to other hosts' files."""
    st = _store(tmp_path, stale_tmp_s=0)
    try:
        name = chunk_name(_key(0))
        own = st.temp_path_for(name)
        head, _, tail = os.path.basename(own).rsplit(".", 2)
        live = os.path.join(os.path.dirname(own), f"{head}.{os.getppid()}.{tail}1")  # another live process here
        other_host = os.path.join(os.path.dirname(own), os.path.basename(live).replace(
            TMP_RE.match(os.path.basename(live)).group(2), "0" * len(TMP_RE.match(os.path.basename(live)).group(2))))
        os.makedirs(os.path.dirname(own), exist_ok=True)
        for p, age in ((live, 1), (other_host, 3600)):  # the live one written after its writer started
            with open(p, "wb") as f:
                f.write(b"x" * 100)
            os.utime(p, (time.time() - age, time.time() - age))
        time.sleep(0.05)  # older than stale_tmp_s=0 either way
        st.rescan()
        assert os.path.exists(live)  # its writer lives: kept, however old
        assert not os.path.exists(other_host)  # another host's, older than stale_tmp_s: removed
        assert audit(str(tmp_path))["disk"] == audit(str(tmp_path))["counter"] == 100
    finally:
        st.close()
