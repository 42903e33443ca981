"""Shared helpers of the core tests: raw-byte comparison, hand-made safetensors files, faulty backends."""

from __future__ import annotations

import errno
import json
import os
import struct
import sys
import threading

import torch

from fastckpt.storage.io import PosixBackend

#: LMCache's own L2 adapter tests run from a copy of this folder inside .venv-lmcache
#: (tests/integrations/test_lmcache_l2.py); its conftest imports lmcache, absent here.
collect_ignore = ["integrations/lmcache_l2_suite"]

# Test modules import these helpers as ``fastckpt_testkit``: other folders under tests/ have
# their own conftest.py, so the plain name ``conftest`` may point at another file.
sys.modules.setdefault("fastckpt_testkit", sys.modules[__name__])


def raw(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` in logical (row-major) order, whatever its strides and dtype."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and raw bytes (NaN payloads and -0.0 included)."""
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (what, a.shape, b.shape)
    assert raw(a) == raw(b), f"{what}: bytes differ"


def assert_tree_same(a, b, path: str = "") -> None:
    """Deep comparison: same container types, key types, tensors bit-exact."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert_same(a, b, path)
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], (path, list(a), list(b))
        for k in a:
            assert_tree_same(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def st_file(header: dict, data: bytes = b"", *, length: int | None = None, pad: bytes = b"") -> bytes:
    """Hand-made safetensors bytes: 8-byte length (``length`` overrides it), JSON header, data."""
    body = json.dumps(header).encode() + pad
    n = len(body) if length is None else length
    return struct.pack("<Q", n) + body + data


def write_bytes(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
    return path


def listing(folder) -> list[str]:
    """All entries of ``folder`` including hidden ones, sorted."""
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def no_temps(folder) -> bool:
    """True when no hidden fastckpt temporary folder is left in ``folder``."""
    return not [n for n in listing(folder) if n.startswith(".") and "fastckpt-tmp" in n]


class FaultyBackend(PosixBackend):
    """Posix backend that fails on demand.

    Args:
        fail_pwrite_after: raise ``OSError(err)`` once this many bytes went through ``pwrite``.
        fail_fsync: raise ``OSError(err)`` from ``fsync``.
        err: errno to raise (default EIO).
    """

    def __init__(self, *, fail_pwrite_after: int | None = None, fail_fsync: bool = False,
                 err: int = errno.EIO):
        self.fail_pwrite_after = fail_pwrite_after
        self.fail_fsync = fail_fsync
        self.err = err
        self.written = 0
        self.raised: list[OSError] = []
        self._lock = threading.Lock()

    def _raise(self, what: str):
        e = OSError(self.err, f"injected {os.strerror(self.err)} in {what}")
        with self._lock:
            self.raised.append(e)
        raise e

    def pwrite(self, fd, data, offset):
        if self.fail_pwrite_after is not None:
            with self._lock:
                over = self.written + len(data) > self.fail_pwrite_after
                if not over:
                    self.written += len(data)
            if over:
                # write part of the data first: the failure is really mid-shard
                half = max(0, min(len(data), self.fail_pwrite_after - self.written) // 2)
                if half:
                    os.pwrite(fd, data[:half], offset)
                self._raise("pwrite")
        return super().pwrite(fd, data, offset)

    def fsync(self, fd):
        if self.fail_fsync:
            self._raise("fsync")
        super().fsync(fd)


def spawn_bounded(fn, args: tuple, nprocs: int, timeout_s: float = 240.0) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with a bound: ranks still running after
    ``timeout_s`` seconds are killed and the test fails naming them (a hung multi-rank save must
    not stall the whole run)."""
    import time

    import pytest
    import torch.multiprocessing as mp
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"ranks {alive} still running after {timeout_s:g} s (hung multi-rank operation?)")


# The tier arbiter's shared state (fastckpt.storage.tier) of this test run lives in a folder of its own,
# not in the machine's /dev/shm: saves and loads of the tests never pace or count against the
# real processes of the host (tests of the arbiter itself set their own folder).
if "FASTCKPT_TIER_DIR" not in os.environ:
    import atexit as _atexit
    import shutil as _shutil
    import tempfile as _tempfile

    os.environ["FASTCKPT_TIER_DIR"] = _tempfile.mkdtemp(prefix="fastckpt-tier-tests-")
    _atexit.register(_shutil.rmtree, os.environ["FASTCKPT_TIER_DIR"], True)
