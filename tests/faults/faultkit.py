"""Fault-injection kit shared by ``tests/faults`` and ``scripts/torture.py``.

Everything here builds its input itself: deterministic states, a faulty I/O backend, a
SIGKILL harness (forked writer processes, so no interpreter start-up per kill), resource
snapshots (threads, file descriptors, RSS) and a tmpfs helper.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

import fastckpt
from fastckpt.storage import commit as cm
from fastckpt.cli.main import main as cli_main
from fastckpt.storage.io import PosixBackend

#: Save options of the fault tests: several shards and write units per save.
SAVE_OPTS = {"max_shard_bytes": 1 << 20, "chunk_bytes": 256 << 10, "threads": 4}

#: Sleep (s) before each ``pwrite`` and ``fsync`` of the kill campaign's writers (:class:`PacedBackend`).
#: A save of :func:`make_state` then lasts tens of milliseconds of wall time whatever the disk
#: (O_DIRECT, page cache) and the CPU load, so a random kill lands inside a save most of the time
#: instead of between saves.
KILL_PACE_S = 0.004


# ----------------------------------------------------------------------------- states
def make_state(step: int, scale: int = 1) -> dict:
    """A deterministic training-like state for ``step`` (~2.3 MiB * ``scale``), several dtypes."""
    g = torch.Generator().manual_seed(1000 + step)
    n = 256 * scale
    return {
        "model": {
            "embed": torch.randn(n, 512, generator=g),
            "layers.0.w": torch.randn(n, 1024, generator=g).to(torch.bfloat16),
            "layers.0.b": torch.randn(1024, generator=g).to(torch.float16),
            "norm": torch.full((512,), float(step)),
            "scale": torch.tensor(float(step)),
            "empty": torch.zeros(0, 3, dtype=torch.int64),
        },
        "optimizer": {"state": {"0": {"exp_avg": torch.randn(n, 256, generator=g), "step": torch.tensor(step)}},
                      "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "mask": torch.rand(64, generator=g) > 0.5,
        "step": step,
    }


def raw(t: torch.Tensor) -> bytes:
    """Raw bytes of ``t`` in row-major order."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_state(a, b, path: str = "") -> str | None:
    """``None`` if ``a`` and ``b`` are identical (tensors bit-exact, same dtype/shape), else where they differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or raw(a) != raw(b):
            return f"{path}: tensor differs ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            d = same_state(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = same_state(x, y, f"{path}/{i}")
            if d:
                return d
        return None
    return None if (type(a) is type(b) and a == b) else f"{path}: {a!r} vs {b!r}"


def state_bytes(state) -> int:
    """Tensor bytes in a nested state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


# ----------------------------------------------------------------------------- faulty backend
class FaultyBackend(PosixBackend):
    """A POSIX backend that fails (or runs a hook) on the ``nth`` call of one method.

    Args:
        method: ``"open_write"``, ``"allocate"``, ``"pwrite"``, ``"fsync"`` or ``"close"``.
        nth: 1-based call number that fails (later calls fail too when ``sticky``).
        err: errno raised as ``OSError`` (``None``: only run ``hook``).
        hook: callable run just before the failing call (e.g. fill the disk, remove a folder).
        no_allocate: skip ``posix_fallocate`` so that ENOSPC surfaces in ``pwrite`` mid-shard.
    """

    def __init__(self, method: str, nth: int = 1, err: int | None = errno.EIO, hook=None,
                 sticky: bool = True, no_allocate: bool = False):
        self.method, self.nth, self.err, self.hook = method, nth, err, hook
        self.sticky, self.no_allocate = sticky, no_allocate
        self.calls = 0
        self.fired = 0
        self._mu = threading.Lock()

    def _maybe_fail(self, method: str) -> None:
        if method != self.method:
            return
        with self._mu:
            self.calls += 1
            hit = self.calls == self.nth or (self.sticky and self.calls > self.nth)
            first = self.calls == self.nth
            if hit:
                self.fired += 1
        if hit and first and self.hook is not None:
            self.hook()
        if hit and self.err is not None:
            raise OSError(self.err, f"injected {errno.errorcode.get(self.err, self.err)} in {method} "
                                    f"(call {self.calls})")

    def open_write(self, path, o_direct=False):
        self._maybe_fail("open_write")
        return super().open_write(path, o_direct)

    def allocate(self, fd, nbytes):
        self._maybe_fail("allocate")
        if not self.no_allocate:
            super().allocate(fd, nbytes)

    def pwrite(self, fd, data, offset):
        self._maybe_fail("pwrite")
        return super().pwrite(fd, data, offset)

    def fsync(self, fd):
        self._maybe_fail("fsync")
        super().fsync(fd)

    def close(self, fd):
        try:
            self._maybe_fail("close")
        finally:
            super().close(fd)


class KillBackend(PosixBackend):
    """Backend that SIGKILLs its own process on the ``nth`` call of ``method`` (deterministic kill points)."""

    def __init__(self, method: str, nth: int):
        self.method, self.nth, self.calls = method, nth, 0
        self._mu = threading.Lock()

    def _tick(self, method: str) -> None:
        if method == self.method:
            with self._mu:
                self.calls += 1
                if self.calls == self.nth:
                    os.kill(os.getpid(), signal.SIGKILL)

    def pwrite(self, fd, data, offset):
        self._tick("pwrite")
        return super().pwrite(fd, data, offset)

    def fsync(self, fd):
        self._tick("fsync")
        super().fsync(fd)

    def close(self, fd):
        self._tick("close")
        super().close(fd)


class PacedBackend(PosixBackend):
    """Backend that sleeps ``delay_s`` before every ``pwrite`` and ``fsync`` (a slow, but correct, disk).

    The sleep happens before the real call, so a kill during it leaves exactly what a kill
    between two write units (or before an fsync) of a real slow disk leaves. Stateless, so it
    is safe to share across ``fork``.
    """

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def pwrite(self, fd, data, offset):
        time.sleep(self.delay_s)
        return super().pwrite(fd, data, offset)

    def fsync(self, fd):
        time.sleep(self.delay_s)
        super().fsync(fd)


# ----------------------------------------------------------------------------- resources
@dataclass
class Resources:
    """Threads, open fds and RSS of this process at one moment."""

    threads: set
    fds: set
    rss_bytes: int


def _fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def snapshot() -> Resources:
    """Current threads (by ident), open fds and RSS."""
    return Resources({t.ident for t in threading.enumerate()}, _fds(), _rss())


def leaks(before: Resources, wait_s: float = 3.0) -> list[str]:
    """What is still open compared with ``before`` (threads, fds), after waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        extra_t = [t for t in threading.enumerate() if t.ident not in before.threads]
        now = _fds()
        extra_fd = []
        for fd in now - before.fds:
            try:
                extra_fd.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                pass  # the fd of the listdir itself
        if (not extra_t and not extra_fd) or time.monotonic() > deadline:
            return [f"thread {t.name}" for t in extra_t] + [f"fd {x}" for x in extra_fd]
        time.sleep(0.02)


def temp_leftovers(root: str) -> list[str]:
    """Names of fastckpt temporaries (folders and ``latest`` temp files) under ``root``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if cm.TMP_MARK in n or (n.startswith(".latest.") and n.endswith(".tmp")))


# ----------------------------------------------------------------------------- tmpfs
@contextlib.contextmanager
def tmpfs(size: str = "8m"):
    """Mount a fresh tmpfs of ``size`` (root only); yields its path, unmounts afterwards.

    Raises:
        PermissionError: not root or mount refused (callers skip).
    """
    d = tempfile.mkdtemp(prefix="fastckpt-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        raise PermissionError(f"cannot mount tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["mount", "-o", "remount,rw", d], capture_output=True)
        subprocess.run(["umount", "-l", d], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(d)


def remount(d: str, mode: str) -> None:
    """Remount the tmpfs ``d`` ``ro`` or ``rw``."""
    subprocess.run(["mount", "-o", f"remount,{mode}", d], check=True, capture_output=True)


# ----------------------------------------------------------------------------- checks
def check_root(root: str, expect_at_least: int | None, started: set[int], *, cli: bool = False) -> dict:
    """Check what a crash left: latest committed loads bit-exactly and verifies; nothing uncommitted is latest.

    Args:
        root: manager root.
        expect_at_least: the newest step the writer reported as committed (``None``: none).
        started: every step whose save was started.
        cli: run ``fastckpt verify`` through the CLI entry point (in process) as well.

    Returns:
        ``{"latest", "bytes_verified", "leftovers"}``.

    Raises:
        AssertionError: naming what is wrong.
    """
    mgr = fastckpt.CheckpointManager(root)
    latest = mgr.latest()
    if expect_at_least is not None:
        assert latest is not None and latest >= expect_at_least, \
            f"latest {latest} is older than the reported commit of step {expect_at_least}"
    if latest is None:
        return {"latest": None, "bytes_verified": 0, "leftovers": temp_leftovers(root)}
    assert latest in started, f"latest {latest} was never saved (started: {sorted(started)})"
    nbytes = 0
    for s in mgr.steps():
        assert fastckpt.is_committed(mgr.path(s))
        rep = fastckpt.verify(mgr.path(s))
        assert rep.ok, f"step {s}: verify failed: {rep.problems}"
        nbytes += rep.bytes_checked
    got = mgr.load()
    diff = same_state(make_state(latest), got)
    assert diff is None, f"latest step {latest} does not load bit-exactly: {diff}"
    if cli:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            assert cli_main(["verify", str(mgr.path(latest))]) == 0
    skipped = {n for n, _ in mgr.skipped()}
    unreported = [n for n in temp_leftovers(root) if cm.TMP_MARK in n and n not in skipped]
    assert not unreported, f"`fastckpt ls` does not report the leftovers {unreported}"
    return {"latest": latest, "bytes_verified": nbytes, "leftovers": temp_leftovers(root)}


# ----------------------------------------------------------------------------- SIGKILL harness
def _writer_child(root: str, first_step: int, wfd: int, backend) -> None:
    """Body of a forked writer: save steps forever, reporting 'S step' before and 'C step' after."""
    torch.set_num_threads(1)
    mgr = fastckpt.CheckpointManager(root, keep_last=2, lock_timeout_s=5.0)
    step = first_step
    while True:
        state = make_state(step)
        os.write(wfd, f"S {step}\n".encode())
        mgr.save(step, state, io_backend=backend, **SAVE_OPTS)
        os.write(wfd, f"C {step}\n".encode())
        step += 1


def fork_writer(root: str, first_step: int, backend=None) -> tuple[int, int]:
    """Fork a writer process; returns ``(pid, read fd of its progress pipe)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller's stack (pytest)
        code = 0
        try:
            os.close(r)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _writer_child(root, first_step, w, backend)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def read_progress(rfd: int) -> tuple[set[int], set[int]]:
    """Drain a writer's pipe; returns ``(started steps, committed steps)``."""
    started, committed = set(), set()
    buf = b""
    while True:
        ready, _, _ = select.select([rfd], [], [], 0)
        if not ready:
            break
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        buf += chunk
    os.close(rfd)
    for line in buf.decode().splitlines():
        kind, s = line.split()
        (started if kind == "S" else committed).add(int(s))
    return started, committed


@dataclass
class KillStats:
    """Counters of a kill campaign."""

    kills: int = 0
    mid_save: int = 0
    commits_seen: int = 0
    bytes_verified: int = 0
    cleaned_by_save: int = 0
    cleaned_by_prune: int = 0
    save_s: float = 0.0  #: calibrated duration of one (paced) save, the time scale of the kills
    failures: list = field(default_factory=list)


def calibrate_save_s(root: str, backend=None) -> float:
    """Seconds one save of :func:`make_state` takes under ``root`` through ``backend`` (median of 3)."""
    ts = []
    for i in range(3):
        t = time.perf_counter()
        fastckpt.save(make_state(0), os.path.join(root, f"calib-{i}"), io_backend=backend, **SAVE_OPTS)
        ts.append(time.perf_counter() - t)
    for i in range(3):
        shutil.rmtree(os.path.join(root, f"calib-{i}"), ignore_errors=True)
    return sorted(ts)[1]


def _wait_readable(rfd: int, timeout_s: float) -> bool:
    """Wait until the writer's pipe has data (its first 'S' line) or EOF; False on timeout."""
    ready, _, _ = select.select([rfd], [], [], timeout_s)
    return bool(ready)


def kill_campaign(root: str, iterations: int, seed: int = 0, save_s: float | None = None,
                  pace_s: float = KILL_PACE_S, start_timeout_s: float = 60.0) -> KillStats:
    """SIGKILL forked writers at random moments, ``iterations`` times, checking the root after each kill.

    Each writer saves step after step through a :class:`PacedBackend` (``pace_s`` per write
    unit and fsync; 0: the plain backend). The kill comes at a random time, uniform in
    ``[0, 3 * save_s)``, counted from the writer's report that its first save started (so the
    fork and the writer's start-up, whose cost does not shrink with faster saves, do not eat
    the window). ``save_s`` defaults to the measured duration of one save through the same
    backend, so the kills cover about three save cycles whatever the machine speed.

    After each kill: the latest committed step is one that was saved, at least the newest
    reported commit, loads bit-exactly and verifies (every committed step verifies). Leftovers
    are then cleaned alternately by the next save (a ``CheckpointManager.save`` in this
    process) or by ``fastckpt prune``, and must be gone afterwards.
    """
    rng = random.Random(seed)
    st = KillStats()
    backend = PacedBackend(pace_s) if pace_s > 0 else None
    save_s = save_s or calibrate_save_s(root, backend)
    st.save_s = save_s
    started_all: set[int] = set()
    committed_max: int | None = None
    next_step = 1
    for it in range(iterations):
        pid, rfd = fork_writer(root, next_step, backend=backend)
        if _wait_readable(rfd, start_timeout_s):
            time.sleep(rng.uniform(0.0, 3.0 * save_s))
        else:
            st.failures.append(f"iteration {it}: the writer started no save within {start_timeout_s:.0f} s")
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        started, committed = read_progress(rfd)
        st.kills += 1
        if not os.WIFSIGNALED(status):
            st.failures.append(f"iteration {it}: writer exited with status {status} before the kill")
            continue
        started_all |= started
        st.commits_seen += len(committed)
        if committed:
            committed_max = max(committed)
        if started - committed:
            st.mid_save += 1
        try:
            res = check_root(root, committed_max, started_all, cli=(it % 5 == 0))
            st.bytes_verified += res["bytes_verified"]
            latest = res["latest"]
            next_step = max([next_step - 1, *started_all]) + 1
            left = res["leftovers"]
            if it % 2 == 0:
                with contextlib.redirect_stdout(open(os.devnull, "w")):
                    assert cli_main(["prune", root, "--keep", "2"]) == 0
                st.cleaned_by_prune += len(left)
            else:
                mgr = fastckpt.CheckpointManager(root, keep_last=2)
                mgr.save(next_step, make_state(next_step), **SAVE_OPTS)
                started_all.add(next_step)
                committed_max = next_step
                next_step += 1
                st.cleaned_by_save += len(left)
            after = temp_leftovers(root)
            assert not after, f"leftovers not cleaned: {after} (latest {latest})"
        except AssertionError as e:
            st.failures.append(f"iteration {it}: {e}")
    return st
