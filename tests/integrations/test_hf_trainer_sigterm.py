"""The Trainer callback's SIGTERM handler never waits for the callback's lock: a SIGTERM that
lands while the training thread holds it (inside one of the callback's critical sections)
returns as soon as the save in flight is committed, then passes the signal on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
try:
    from fastckpt.integrations.hf import trainer as hf_trainer
except ImportError:  # pyproject mapping not installed: import from the source tree
    sys.path.insert(0, str(REPO))
    from integrations.hf import trainer as hf_trainer

import fastckpt
from fastckpt.storage import PosixBackend

pytest.importorskip("transformers")


class SlowFsync(PosixBackend):
    """Every fsync takes ``delay_s``: a save that is still in flight when the signal comes."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def fsync(self, fd):
        time.sleep(self.delay_s)
        super().fsync(fd)


def start_save(cb, path: Path, step: int = 1, delay_s: float = 0.3):
    """Leave ``cb`` as its ``_save_now`` does: a save in flight, pending and in ``_inflight``."""
    fut = cb._saver.async_save({"w": torch.arange(1 << 16, dtype=torch.float32)}, path,
                               io_backend=SlowFsync(delay_s))
    cb._inflight = fut
    now = time.perf_counter()
    cb._pending = (fut, step, path, 0.0, now, now, None)  # None: no TrainerState (no on_save to fire)
    return fut


@pytest.fixture
def sigterm_restored():
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def test_handler_with_lock_held_by_another_thread_returns_promptly(tmp_path, sigterm_restored):
    cb = hf_trainer.FastCkptCallback()
    calls = []
    cb._prev_sigterm = lambda s, f: calls.append(s)
    fut = start_save(cb, tmp_path / "c")
    held, release = threading.Event(), threading.Event()

    def holder():
        with cb._lock:
            held.set()
            release.wait(60)

    th = threading.Thread(target=holder, daemon=True)
    th.start()
    assert held.wait(10)
    t = time.perf_counter()
    cb._on_sigterm(signal.SIGTERM, None)
    dt = time.perf_counter() - t
    release.set()
    th.join(10)
    assert dt < 20, f"the SIGTERM handler waited {dt:.1f} s for the lock"
    assert fut.done() and fastckpt.load(tmp_path / "c")["w"].numel() == 1 << 16  # committed before returning
    assert calls == [signal.SIGTERM]  # the previous handler ran
    assert cb._pending is not None  # not collected under someone else's lock...
    assert cb.wait() is True and [r["step"] for r in cb.records] == [1]  # ...the training thread does it


def test_handler_with_lock_free_collects_the_save(tmp_path, sigterm_restored):
    cb = hf_trainer.FastCkptCallback()
    calls = []
    cb._prev_sigterm = lambda s, f: calls.append(s)
    fut = start_save(cb, tmp_path / "c")
    cb._on_sigterm(signal.SIGTERM, None)
    assert fut.done() and cb._pending is None and [r["step"] for r in cb.records] == [1]
    assert calls == [signal.SIGTERM]


CHILD = r"""
import json, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import test_hf_trainer_sigterm as t
cb = t.hf_trainer.FastCkptCallback()
calls = []
signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))  # what the callback chains to
cb._install_sigterm()
fut = t.start_save(cb, Path(sys.argv[1]), delay_s=0.3)
with cb._lock:  # the training thread inside a critical section of the callback
    done_before = fut.done()
    t0 = time.perf_counter()
    signal.raise_signal(signal.SIGTERM)  # the handler runs here, in this thread
    dt = time.perf_counter() - t0
    done_after = fut.done()
print(json.dumps({"dt": dt, "calls": calls, "done_before": done_before, "done_after": done_after,
                  "collected_by_wait": cb.wait(), "records": len(cb.records)}))
"""


def test_real_sigterm_inside_the_lock_does_not_deadlock(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "c"), str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["calls"] == [signal.SIGTERM], res
    assert res["done_after"] and res["dt"] < 60, res  # waited for the save, not for the lock
    assert res["collected_by_wait"] is True and res["records"] == 1, res
    assert fastckpt.load(tmp_path / "c")["w"].numel() == 1 << 16
