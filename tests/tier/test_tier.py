"""The tier arbiter (issue 22): processes on one tier share bandwidth and one capacity budget.

Every test runs real processes (spawned, bounded waits) on one file system, with the shared state
in a folder of the test (``FASTCKPT_TIER_DIR``): a checkpoint writer is paced while a KV reader or
a loader reads, within its bound; KV evicts for a checkpoint and the budget is never exceeded on
disk; a SIGKILLed (or frozen) participant stops counting within seconds; a shared state this
process cannot write gives one warning and no arbitration.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings

import pytest

from fastckpt.storage.tier import snapshot, tier_for
from fastckpt.storage.tier.shared import TTL_S

MiB = 1 << 20
SPAWN = mp.get_context("spawn")


@pytest.fixture
def tier_dir(tmp_path, monkeypatch):
    d = tmp_path / "tier-state"
    d.mkdir()
    monkeypatch.setenv("FASTCKPT_TIER_DIR", str(d))
    monkeypatch.delenv("FASTCKPT_TIER", raising=False)
    monkeypatch.delenv("FASTCKPT_TIER_BUDGET_BYTES", raising=False)
    monkeypatch.setenv("FASTCKPT_TIER_PROBE_S", "0.05")  # small saves: measure the unhindered rate quickly
    return d


def _mine(path: str) -> dict:
    """This process's entry in the tier's snapshot."""
    return next(p for p in snapshot(path)["participants"] if p["pid"] == os.getpid())


# ----- workers (spawned) ------------------------------------------------------------------------

def _hold_read(path: str, ready, stop) -> None:
    """A latency-critical read that lasts until ``stop`` (a reader that waits on a slow tier)."""
    t = tier_for(path)
    with t.reading():
        ready.set()
        stop.wait(120)


def _save(path: str, nbytes: int, go, out) -> None:
    """Save ``nbytes`` with fastckpt once ``go`` is set (after a first save that tells the arbiter this
    process's write rate, as a training process saves again and again); report the second save's
    time and pacing."""
    import torch

    import fastckpt
    state = {"w": torch.arange(nbytes // 4, dtype=torch.int32)}
    t0 = time.monotonic()
    fastckpt.save(state, path + ".first", chunk_bytes=4 * MiB)
    first = time.monotonic() - t0
    before = _mine(path)
    go.wait(120)
    t0 = time.monotonic()
    fastckpt.save(state, path, chunk_bytes=4 * MiB)
    el = time.monotonic() - t0
    me = _mine(path)
    out.put({"elapsed": el, "paced_s": me["paced_s"] - before["paced_s"], "waits": me["pace_waits"] - before["pace_waits"],
             "written": me["write_bytes"] - before["write_bytes"], "first_s": first})


def _kv_store(root: str, chunk: int, **kw):
    from fastckpt.kv import KVFileStore, KVStoreOptions as StoreOptions
    return KVFileStore(StoreOptions(path=root, piece_bytes=1 * MiB, durable=False, **kw))


def _kv_put(st, i: int, chunk: int) -> bool:
    from fastckpt.kv import chunk_name
    key = f"tier@1@0@{i:x}@bfloat16"
    buf = memoryview(bytes([i % 251]) * chunk)
    return st.write(chunk_name(key), key, "KV_2LTD", [("BF16", (chunk // 2,), chunk)], buf)


def _kv_get(st, i: int, buf) -> bool:
    from fastckpt.kv import chunk_name
    h = st.open_chunk(chunk_name(f"tier@1@0@{i:x}@bfloat16"))
    if h is None:
        return False
    try:
        for s, n in h.pieces():
            st.read_piece(h, buf, s, n)
    finally:
        st.close_chunk(h)
    return True


def _kv_reader(root: str, n: int, chunk: int, ready, stop, out) -> None:
    """Put ``n`` chunks, then get them round robin until ``stop``; report gets and read bytes."""
    st = _kv_store(root, chunk)
    for i in range(n):
        _kv_put(st, i, chunk)
    buf = memoryview(bytearray(chunk))
    ready.set()
    gets = 0
    while not stop.is_set():
        gets += _kv_get(st, gets % n, buf)
    out.put({"kv_gets": gets, "kv_read": _mine(root)["read_bytes"]})


def _loader(path: str, ready, stop, out) -> None:
    """Load the checkpoint ``path`` again and again until ``stop``; report loads and bytes read."""
    import fastckpt
    fastckpt.load(path)
    ready.set()
    loads = 0
    while not stop.is_set():
        fastckpt.load(path)
        loads += 1
    out.put({"loads": loads, "load_read": _mine(path)["read_bytes"]})


def _kv_filler(root: str, chunk: int, n: int, ready, stop, out) -> None:
    """Put ``n`` chunks (more than the budget holds: KV evicts its own), then keep serving (and
    evicting for others) until ``stop``; then put ``n`` more, and one chunk larger than what
    checkpoints leave of the budget (a typed error)."""
    from fastckpt.errors import TierFullError
    st = _kv_store(root, chunk)
    filled = sum(_kv_put(st, i, chunk) for i in range(n))
    ev0 = st.stats.evictions
    ready.set()
    stop.wait(120)
    more = sum(_kv_put(st, i, chunk) for i in range(n, 2 * n))
    try:
        _kv_put(st, 10 * n, 40 * MiB)
        err = ""
    except TierFullError as e:
        err = str(e)
    out.put({"filled": filled, "evicted_while_filling": ev0, "error": err, "more": more,
             "evictions": st.stats.evictions, "kv_stored": st.used_bytes()})


def _claim_and_hang(path: str, ready) -> None:
    """Claim 32 MiB for a checkpoint and start a read, then hang (the test kills or stops us)."""
    t = tier_for(path)
    t.claim("checkpoints", 32 * MiB, path)
    t.begin_read()
    ready.set()
    time.sleep(600)


def _warn_count(state_dir: str, save_to: str, out) -> None:
    """Use a tier whose shared state this process cannot write; report warnings and the save."""
    import torch

    import fastckpt
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t1 = tier_for(save_to)
        fastckpt.save({"x": torch.arange(1000)}, os.path.join(save_to, "a"))
        fastckpt.save({"x": torch.arange(1000)}, os.path.join(save_to, "b"))
        back = fastckpt.load(os.path.join(save_to, "b"))
        t2 = tier_for(save_to)
    msgs = [str(x.message) for x in w if "shared state" in str(x.message)]
    out.put({"enabled": [t1.enabled, t2.enabled], "warnings": msgs, "ok": bool(torch.equal(back["x"], torch.arange(1000)))})


def _start(target, *args):
    p = SPAWN.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _join_all(*procs, timeout=180):
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"{p.name} exit code {p.exitcode}"


# ----- bandwidth --------------------------------------------------------------------------------

def test_writer_paced_while_another_process_reads_within_its_bound(tier_dir, tmp_path):
    """Two processes: a waiting reader holds back the writer (its pace counters move), and the
    time held back stays within (factor - 1) x its writing time; with no reader, no pacing."""
    ready, stop, go = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    out = SPAWN.Queue()
    base = _start(_save, str(tmp_path / "ck" / "alone"), 96 * MiB, go, out)
    go.set()
    alone = out.get(timeout=180)
    _join_all(base)
    assert alone["paced_s"] == 0 and alone["waits"] == 0, alone

    go.clear()
    reader = _start(_hold_read, str(tmp_path), ready, stop)
    assert ready.wait(120)
    writer = _start(_save, str(tmp_path / "ck" / "paced"), 96 * MiB, go, out)
    go.set()
    got = out.get(timeout=180)
    stop.set()
    _join_all(writer, reader)
    assert got["waits"] >= 1 and got["paced_s"] > 0, got  # held back for the reader
    # the 1.3x bound (default factor) of the save's unhindered time: the process's earlier save
    assert got["paced_s"] <= 0.3 * max(got["first_s"], alone["elapsed"]) + 0.05, (got, alone)
    assert got["written"] >= 96 * MiB


def test_three_processes_kv_reader_loader_and_writer(tier_dir, tmp_path):
    """KV gets and weight loads in two processes, a checkpoint in a third: the writer is paced,
    the readers' bytes are counted on the tier, and everything completes with the right bytes."""
    import torch

    import fastckpt
    model = str(tmp_path / "model")
    fastckpt.save({"w": torch.arange(4 * MiB, dtype=torch.int32)}, model)  # 16 MiB to load
    kv_ready, ld_ready, stop, go = SPAWN.Event(), SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    out = SPAWN.Queue()
    kv = _start(_kv_reader, str(tmp_path / "kv"), 8, 4 * MiB, kv_ready, stop, out)
    ld = _start(_loader, model, ld_ready, stop, out)
    assert kv_ready.wait(120) and ld_ready.wait(120)
    seen = {"readers": 0}

    def watch():
        while not stop.is_set():
            seen["readers"] = max(seen["readers"], snapshot(str(tmp_path))["waiting_readers"])
            time.sleep(0.005)

    w = threading.Thread(target=watch)
    w.start()
    writer = _start(_save, str(tmp_path / "ck" / "step-1"), 128 * MiB, go, out)
    go.set()
    res = {}
    res.update(out.get(timeout=180))
    stop.set()
    for _ in range(2):
        res.update(out.get(timeout=120))
    w.join(30)
    _join_all(writer, kv, ld)
    assert res["waits"] >= 1 and res["paced_s"] > 0, res
    assert res["paced_s"] <= 0.3 * res["first_s"] + 0.05, res
    assert res["kv_gets"] > 0 and res["kv_read"] >= res["kv_gets"] * 4 * MiB, res
    assert res["loads"] >= 0 and res["load_read"] >= 16 * MiB, res
    assert seen["readers"] >= 1
    back = fastckpt.load(str(tmp_path / "ck" / "step-1"))
    assert torch.equal(back["w"], torch.arange(32 * MiB, dtype=torch.int32))


def test_background_yields_and_pacing_is_bounded_in_process(tier_dir, tmp_path):
    """One process: the pacer never holds a write back beyond (factor - 1) x the time spent writing,
    and background work waits while a read runs (bounded by max_wait_s)."""
    t = tier_for(str(tmp_path))
    with t.reading():
        p = t.writer()
        t0 = time.monotonic()
        for _ in range(40):
            p.pace(MiB)
            time.sleep(0.01)  # "writing"
        el = time.monotonic() - t0
        p.close()
        assert p.waits >= 1 and p.delayed_s > 0
        assert p.delayed_s <= 0.3 * (el - p.delayed_s) + 0.01, (p.delayed_s, el)
        bg = t.background(max_wait_s=0.2)
        t1 = time.monotonic()
        bg.pace()
        assert 0.19 <= time.monotonic() - t1 < 2.0
        bg.close()
    bg = t.background(max_wait_s=5)
    t1 = time.monotonic()
    bg.pace()  # nobody reads or writes now: no wait
    assert time.monotonic() - t1 < 0.1
    bg.close()


# ----- capacity ---------------------------------------------------------------------------------

def _disk_bytes(*roots) -> int:
    n = 0
    for r in roots:
        for d, _, fs in os.walk(r):
            for f in fs:
                try:
                    n += os.stat(os.path.join(d, f)).st_size
                except FileNotFoundError:
                    pass
    return n


def test_capacity_shared_kv_evicts_for_checkpoint_never_exceeded(tier_dir, tmp_path):
    """One budget for KV and checkpoints: KV fills it, a checkpoint still fits (KV in another
    process evicts for it), KV then makes room among its own chunks only; the bytes on disk never
    exceed the budget; a checkpoint that cannot fit even without KV gets a typed error."""
    import torch

    import fastckpt
    from fastckpt.cli.main import main
    from fastckpt.errors import TierFullError
    budget = 48 * MiB
    assert main(["tier", str(tmp_path), "--budget", str(budget)]) == 0
    kv_root, ck_root = tmp_path / "kv", tmp_path / "ck"
    ck_root.mkdir()
    ready, stop = SPAWN.Event(), SPAWN.Event()
    out = SPAWN.Queue()
    kv = _start(_kv_filler, str(kv_root), 1 * MiB, 60, ready, stop, out)
    assert ready.wait(120)
    peak = {"max": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            n = _disk_bytes(kv_root, ck_root)
            if n > peak["max"]:
                peak["max"] = n
                peak["at"] = (_disk_bytes(kv_root), _disk_bytes(ck_root), snapshot(str(tmp_path))["classes"])
            time.sleep(0.002)

    s = threading.Thread(target=sample)
    s.start()
    try:
        state = {"w": torch.arange(4 * MiB, dtype=torch.int32)}  # 16 MiB
        fastckpt.save(state, str(ck_root / "step-1"), chunk_bytes=4 * MiB)
        snap = snapshot(str(tmp_path))
        assert snap["classes"]["checkpoints"]["stored_bytes"] >= 16 * MiB
        stop.set()
        res = out.get(timeout=120)
        _join_all(kv)
        with pytest.raises(TierFullError) as ei:
            fastckpt.save({"w": torch.zeros(40 * MiB // 4, dtype=torch.int32)}, str(ck_root / "step-2"))
    finally:
        done.set()
        s.join(30)
    assert res["filled"] == 60 and res["evicted_while_filling"] > 0, res  # KV filled the budget first...
    assert res["more"] == 60 and res["evictions"] > res["evicted_while_filling"], res  # ...made room among its own
    assert res["kv_stored"] <= budget - 16 * MiB, res
    assert "kv" in res["error"] and str(budget) in res["error"], res  # larger than checkpoints leave
    assert torch.equal(fastckpt.load(str(ck_root / "step-1"))["w"], state["w"])  # never the reverse
    assert peak["max"] <= budget + 1 * MiB, (peak, budget)  # the manifest's small files are not claimed
    e = ei.value
    assert e.cls == "checkpoints" and e.budget == budget and e.need >= 40 * MiB
    assert "checkpoints" in str(e) and "kv" in str(e) and str(budget) in str(e)
    assert not (ck_root / "step-2").exists() and [p.name for p in ck_root.iterdir()] == ["step-1"]


def test_checkpoint_removed_by_hand_is_recounted_before_a_save_is_refused(tier_dir, tmp_path, capsys):
    """A checkpoint deleted with rm -r (not by retention or prune) stays counted until the budget is
    tight: then the tier recounts its folders from disk and the save goes ahead; a tier full for real
    still refuses, naming the bytes counted from disk."""
    import shutil

    import torch

    import fastckpt
    from fastckpt.cli.main import main
    from fastckpt.errors import TierFullError
    assert main(["tier", str(tmp_path), "--budget", str(24 * MiB)]) == 0
    root = tmp_path / "run"
    big = {"w": torch.zeros(4 * MiB, dtype=torch.int32)}  # 16 MiB
    fastckpt.save(big, root / "step-1")
    assert snapshot(str(tmp_path))["classes"]["checkpoints"]["stored_bytes"] >= 16 * MiB
    shutil.rmtree(root / "step-1")  # by hand: the count still says 16 MiB
    assert snapshot(str(tmp_path))["classes"]["checkpoints"]["stored_bytes"] >= 16 * MiB
    fastckpt.save(big, root / "step-2")  # 16 + 16 > 24 MiB on the counts, 16 on disk: recounted, saved
    stored = snapshot(str(tmp_path))["classes"]["checkpoints"]["stored_bytes"]
    on_disk = sum(p.stat().st_size for p in (root / "step-2").glob("*.safetensors"))
    assert stored == on_disk, (stored, on_disk)
    with pytest.raises(TierFullError, match="counted from disk") as err:
        fastckpt.save(big, root / "step-3")  # 16 MiB on disk for real: refused
    assert f"writing under {root}" in str(err.value)  # names where the refused save was going
    with pytest.raises(TierFullError, match="the write alone is larger than the whole budget"):
        fastckpt.save({"w": torch.zeros(8 * MiB, dtype=torch.int32)}, root / "step-4")  # 32 MiB > 24 MiB
    assert not (root / "step-3").exists()
    assert torch.equal(fastckpt.load(root / "step-2")["w"], big["w"])
    shutil.rmtree(root / "step-2")  # and `fastckpt tier --recount` does it on demand
    capsys.readouterr()
    assert main(["tier", str(tmp_path)]) == 0  # the report says so first
    assert "16.8 MB counted in 1 folder(s) are no longer on disk" in capsys.readouterr().out
    assert main(["tier", str(tmp_path), "--recount"]) == 0
    assert snapshot(str(tmp_path))["classes"]["checkpoints"]["stored_bytes"] == 0
    assert main(["tier", str(tmp_path)]) == 0
    assert "no longer on disk" not in capsys.readouterr().out


# ----- faults -----------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_dead_or_frozen_participant_stops_counting_within_seconds(tier_dir, tmp_path, how):
    """A participant's claim and waiting read stop counting within seconds of a SIGKILL (its pid is
    gone) or a SIGSTOP (its heartbeat stops, TTL_S); a writer is then not held back by it."""
    ready = SPAWN.Event()
    p = _start(_claim_and_hang, str(tmp_path), ready)
    try:
        assert ready.wait(120)
        s = snapshot(str(tmp_path))
        assert s["classes"]["checkpoints"]["claimed_bytes"] == 32 * MiB and s["waiting_readers"] == 1
        os.kill(p.pid, getattr(signal, how))
        t0 = time.monotonic()
        while time.monotonic() - t0 < TTL_S + 5:
            s = snapshot(str(tmp_path))
            if s["classes"]["checkpoints"]["claimed_bytes"] == 0 and s["waiting_readers"] == 0:
                break
            time.sleep(0.05)
        gone = time.monotonic() - t0
        assert s["classes"]["checkpoints"]["claimed_bytes"] == 0 and s["waiting_readers"] == 0, s
        assert gone <= TTL_S + 1.5, gone
        pacer = tier_for(str(tmp_path)).writer()
        t1 = time.monotonic()
        pacer.pace(MiB)
        assert time.monotonic() - t1 < 0.05 and pacer.waits == 0
        pacer.close()
    finally:
        p.kill()
        p.join(30)


def test_read_only_shared_state_one_warning_no_arbitration(tier_dir, tmp_path):
    """A shared state this process cannot write: one warning, no arbitration, saves and loads work."""
    from fastckpt.storage.tier.shared import state_path, tier_name
    sp = state_path(tier_name(str(tmp_path)))
    with open(sp, "wb") as f:  # created by another user, not writable by the worker
        f.write(b"\0" * 4096)
    os.chmod(sp, 0o444)
    immutable = False
    if os.geteuid() == 0:  # root writes any mode 0444 file; an immutable one (chattr +i) it cannot open for writing
        import shutil
        import subprocess
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", sp], capture_output=True).returncode:
            pytest.skip(f"running as root and {sp} cannot be made immutable (chattr +i): no read-only state to test")
        immutable = True
    save_to = tmp_path / "saves"
    save_to.mkdir()
    try:
        out = SPAWN.Queue()
        p = _start(_warn_count, str(tier_dir), str(save_to), out)
        res = out.get(timeout=180)
        _join_all(p)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", sp], capture_output=True)
    assert res["enabled"] == [False, False] and res["ok"], res
    assert len(res["warnings"]) == 1, res
    assert sp in res["warnings"][0] and "FASTCKPT_TIER_DIR" in res["warnings"][0]


# ----- the command ------------------------------------------------------------------------------

def test_cli_text_json_prometheus(tier_dir, tmp_path, capsys):
    """``fastckpt tier PATH``: per class stored / claimed / allowed, bandwidth, readers, pacing."""
    from prometheus_client.parser import text_string_to_metric_families

    from fastckpt.cli.main import main
    t = tier_for(str(tmp_path))
    assert main(["tier", str(tmp_path), "--budget", "1GiB"]) == 0
    c = t.claim("models", 5 * MiB, str(tmp_path / "m"))
    t.publish("kv", str(tmp_path / "kv"), 7 * MiB)
    with t.reading(), t.reading(kv=True):
        capsys.readouterr()
        assert main(["tier", str(tmp_path), "--json"]) == 0
        js = json.loads(capsys.readouterr().out)
        assert main(["tier", str(tmp_path)]) == 0
        text = capsys.readouterr().out
        assert main(["tier", str(tmp_path), "--prometheus"]) == 0
        prom = capsys.readouterr().out
    c.settle()
    assert js["budget_bytes"] == 1 << 30 and js["waiting_readers"] == 2 and js["kv_gets"] == 1
    assert js["classes"]["models"]["claimed_bytes"] == 5 * MiB and js["classes"]["kv"]["stored_bytes"] == 7 * MiB
    assert js["classes"]["checkpoints"]["allowed_bytes"] == (1 << 30) - 5 * MiB  # KV would be evicted for it
    assert js["classes"]["kv"]["allowed_bytes"] == (1 << 30) - 5 * MiB
    for word in ("checkpoints", "models", "kv", "waiting readers: 2 (KV gets: 1)", "pacing", "bandwidth"):
        assert word in text
    fams = {f.name: f for f in text_string_to_metric_families(prom)}
    stored = {s.labels["class"]: s.value for s in fams["fastckpt_tier_stored_bytes"].samples}
    assert stored["kv"] == 7 * MiB
    assert [s.value for s in fams["fastckpt_tier_waiting_readers"].samples] == [2.0]
    assert [s.value for s in fams["fastckpt_tier_kv_gets"].samples] == [1.0]
    assert fams["fastckpt_tier_fs_free_bytes"].samples[0].value == js["fs_free_bytes"] > 0
    assert snapshot(str(tmp_path))["classes"]["models"]["stored_bytes"] == 5 * MiB


def test_refused_export_holds_no_bytes_of_the_budget(tier_dir, tmp_path):
    """`fastckpt load --to` that the servability gate refuses (no config.json) writes its shards into a
    temporary folder and removes them: the tier's "models" class must not keep counting them."""
    import torch

    import fastckpt
    from fastckpt.cli.main import main
    ck = fastckpt.save({"model": {"w": torch.ones(4096)}}, str(tmp_path / "run" / "step-1"))
    for out in ("out1", "out2"):
        assert main(["load", str(ck), "--to", str(tmp_path / out), "-q"]) == 2
        assert not (tmp_path / out).exists()
    classes = snapshot(str(tmp_path))["classes"]
    assert classes["models"]["stored_bytes"] == 0 and classes["models"]["claimed_bytes"] == 0, classes
    assert classes["checkpoints"]["stored_bytes"] > 0, classes  # the save itself is counted


def test_committed_export_counts_its_bytes_as_models(tier_dir, tmp_path):
    """A `fastckpt load --to` that passes the gate and commits counts its tensor bytes under "models"."""
    transformers = pytest.importorskip("transformers")
    from fastckpt.cli.main import main
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "src"))
    assert main(["load", str(tmp_path / "src"), "--to", str(tmp_path / "out"), "-q"]) == 0
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        nbytes = sum(f.get_tensor(k).nbytes for k in f.keys())
    models = snapshot(str(tmp_path))["classes"]["models"]
    assert models["stored_bytes"] == nbytes and models["claimed_bytes"] == 0, models


def test_retention_keeps_the_checkpoint_count_equal_to_the_shard_bytes_on_disk(tier_dir, tmp_path):
    """Saves claim their shard files; retention subtracts the shard files it frees (not manifests, not
    files another folder still links): after many saves and deletes the count is what is on disk."""
    import torch

    import fastckpt
    root = tmp_path / "run"
    mgr = fastckpt.CheckpointManager(root, keep_last=1, link_unchanged=True)
    frozen = torch.arange(50_000, dtype=torch.float32)
    for step in range(1, 7):
        mgr.save(step, {"model": {"frozen": frozen, "w": torch.full((40_000,), float(step))}, "step": step})
    mgr.wait() if hasattr(mgr, "wait") else None
    on_disk = {}
    for f in root.rglob("*.safetensors"):
        st = f.stat()
        on_disk[(st.st_dev, st.st_ino)] = st.st_size  # a hard-linked file once
    stored = snapshot(str(root))["classes"]["checkpoints"]["stored_bytes"]
    assert mgr.steps() == [6] and stored == sum(on_disk.values()), (stored, on_disk)


def test_a_missing_state_folder_is_created(tmp_path, monkeypatch):
    """``FASTCKPT_TIER_DIR`` naming a folder that does not exist yet: created, arbitration on, no warning."""
    import torch

    import fastckpt
    d = tmp_path / "new" / "state"
    monkeypatch.setenv("FASTCKPT_TIER_DIR", str(d))
    monkeypatch.delenv("FASTCKPT_TIER", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastckpt.save({"x": torch.arange(10)}, str(tmp_path / "ck"))
        assert tier_for(str(tmp_path)).enabled
    assert d.is_dir() and any(d.iterdir())


def test_overwriting_a_checkpoint_keeps_the_count_equal_to_the_shard_bytes_on_disk(tier_dir, tmp_path):
    """``overwrite=True`` (Lightning's ``last``) five times: the count is one checkpoint, not five
    (a fresh-user trial saw 4.2 -> 21.0 MB with 4.2 MB on disk)."""
    import torch

    import fastckpt
    for i in range(5):
        fastckpt.save({"w": torch.full((100_000,), float(i))}, tmp_path / "last", overwrite=True)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "last").glob("*.safetensors"))
    stored = snapshot(str(tmp_path))["classes"]["checkpoints"]["stored_bytes"]
    assert stored == on_disk, (stored, on_disk)


def test_recount_counts_a_nested_run_folder_once(tier_dir, tmp_path):
    """Checkpoints saved under ``ckpt/`` and under ``ckpt/run/``: two counted folders, one nested; a
    recount must not count ``run``'s files in ``ckpt`` too (the trial saw 12.6 MB for 8.4 MB on disk)."""
    import shutil

    import torch

    import fastckpt
    from fastckpt.storage.tier import tier_for
    big = {"w": torch.zeros(1 << 20, dtype=torch.int32)}  # 4 MiB
    fastckpt.save(big, tmp_path / "ckpt" / "a")
    fastckpt.save(big, tmp_path / "ckpt" / "b")
    fastckpt.save(big, tmp_path / "ckpt" / "run" / "step-1")
    shutil.rmtree(tmp_path / "ckpt" / "b")  # by hand: ckpt/ must drop to one checkpoint
    tier_for(str(tmp_path)).recount()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "ckpt").rglob("*.safetensors"))
    stored = snapshot(str(tmp_path))["classes"]["checkpoints"]["stored_bytes"]
    assert stored == on_disk, (stored, on_disk)


# ----- weight loads yield to KV gets ------------------------------------------------------------

def _hold_kv_get(path: str, ready, stop) -> None:
    """A KV get that lasts until ``stop`` (a get that waits on a slow tier)."""
    t = tier_for(path)
    with t.reading(kv=True):
        ready.set()
        stop.wait(120)


@pytest.mark.parametrize("kv", [True, False])
def test_load_reads_yield_to_another_process_kv_get_within_their_bound(tier_dir, tmp_path, kv):
    """A KV get in another process holds a weight load's reads back, never beyond the load's bound
    (stalled at most (factor - 1) x its time reading, plus the grace); another load (a
    latency-critical read that is not a KV get) does not."""
    from fastckpt.storage.tier.arbiter import LOAD_GRACE_S
    ready, stop = SPAWN.Event(), SPAWN.Event()
    other = _start(_hold_kv_get if kv else _hold_read, str(tmp_path), ready, stop)
    try:
        assert ready.wait(120)
        p = tier_for(str(tmp_path)).loader()
        t0 = time.monotonic()
        for _ in range(40):
            with p.read(MiB):
                time.sleep(0.01)  # "reading"
        el = time.monotonic() - t0
        p.close()
    finally:
        stop.set()
        _join_all(other)
    if kv:
        assert p.waits >= 1 and p.delayed_s > 0.01, (p.waits, p.delayed_s)
        assert p.delayed_s <= 0.3 * (el - p.delayed_s + LOAD_GRACE_S) + 0.03, (p.delayed_s, el)  # one late wake-up
    else:
        assert p.waits == 0 and p.delayed_s == 0, (p.waits, p.delayed_s)


def test_load_reads_run_inside_the_tier_load_pacer(tier_dir, tmp_path, monkeypatch):
    """``fastckpt.load`` (threads of buffered reads) and the device ring (``load_tensors``, which
    streams to CUDA / NPU through the same ring it runs here for ``"cpu"``) read every byte of the
    checkpoint inside the load pacer (:meth:`LoadPacer.run`), so KV gets on the tier can go first."""
    import torch

    import fastckpt
    from fastckpt.storage.tier import LoadPacer
    seen = []
    orig = LoadPacer._enter  # every paced read request passes here (LoadPacer.read and .run)

    def spy(self, nbytes):
        seen.append(nbytes)
        return orig(self, nbytes)
    monkeypatch.setattr(LoadPacer, "_enter", spy)
    sd = {"a": torch.arange(3 * MiB, dtype=torch.int32), "b": torch.ones(5, 7), "c": torch.zeros(0)}
    path = str(tmp_path / "ck")
    fastckpt.save(sd, path)
    back = fastckpt.load(path)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert sum(seen) == sum(v.nbytes for v in sd.values()), seen
    from fastckpt.loading.device import load_tensors
    from fastckpt.loading.resolve import resolve
    seen.clear()
    ring = load_tensors(resolve(path), list(sd), "cpu", slot_bytes=MiB, ring_bytes=4 * MiB)
    assert all(torch.equal(ring[k], sd[k]) for k in sd)
    assert sum(seen) >= sum(v.nbytes for v in sd.values()) and len(seen) >= 12, seen


def test_tier_off_saves_and_loads_through_the_null_pacers(tmp_path, monkeypatch):
    """``FASTCKPT_TIER=off``: no shared state is created, and a save, a load and a ring load go
    through the null pacers (same bytes back)."""
    import torch

    import fastckpt
    from fastckpt.loading.device import load_tensors
    from fastckpt.loading.resolve import resolve
    from fastckpt.storage.tier import NullTier
    state_dir = tmp_path / "tier-state"
    monkeypatch.setenv("FASTCKPT_TIER_DIR", str(state_dir))
    monkeypatch.setenv("FASTCKPT_TIER", "off")
    assert isinstance(tier_for(str(tmp_path)), NullTier)
    sd = {"a": torch.arange(MiB, dtype=torch.int32), "b": torch.randn(3, 5)}
    fastckpt.save(sd, str(tmp_path / "ck"))
    back = fastckpt.load(str(tmp_path / "ck"))
    ring = load_tensors(resolve(str(tmp_path / "ck")), list(sd), "cpu")
    assert all(torch.equal(back[k], sd[k]) and torch.equal(ring[k], sd[k]) for k in sd)
    assert not state_dir.exists() or not any(state_dir.iterdir())


def test_cli_refuses_a_negative_budget_and_a_missing_path_and_says_when_off(tier_dir, tmp_path, capsys, monkeypatch):
    """``--budget -5`` is a usage error (it crashed with ``struct.error``), ``Tier.set_budget`` refuses
    it typed, a mistyped path is an error naming it (it showed another tier's figures), and with
    ``FASTCKPT_TIER=off`` the report says so on stderr; the budget set before stays."""
    from fastckpt.cli.main import main
    from fastckpt.errors import InvalidArgumentError
    assert main(["tier", str(tmp_path), "--budget", "1GiB"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["tier", str(tmp_path), "--budget", "-5"])
    assert e.value.code == 2
    assert "not a byte size: '-5'" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="budget -1"):
        tier_for(str(tmp_path)).set_budget(-1)
    missing = tmp_path / "no-such-folder"
    assert main(["tier", str(missing)]) == 2
    assert f"{missing}: no such file or folder" in capsys.readouterr().err
    assert snapshot(str(tmp_path))["budget_bytes"] == 1 << 30
    monkeypatch.setenv("FASTCKPT_TIER", "off")
    assert main(["tier", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr()
    assert "FASTCKPT_TIER=off in this environment" in out.err and json.loads(out.out)["budget_bytes"] == 1 << 30
