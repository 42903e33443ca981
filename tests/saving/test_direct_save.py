"""fastckpt.save writes CPU tensors straight from their memory (fastckpt/saving/direct.py): no staging
copy, the same files as async_save, safetensors reads them bit-exactly, faults and in-place writes
leave nothing committed."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

import fastckpt
from fastckpt.errors import SourceChangedError
from fastckpt.saving import direct
from fastckpt.storage.io import PosixBackend
from fastckpt.storage.staging import StagingPool


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    model = {f"w{i}": torch.randn(n, generator=g).to(dt) for i, (n, dt) in enumerate(
        [(300_001, torch.bfloat16), (7, torch.float32), (40_000, torch.float32), (1 << 20, torch.bfloat16),
         (3, torch.int64), (20_000, torch.float16), (33_333, torch.float32)])}
    model["flag"] = torch.rand(1000, generator=g) > 0.5
    model["view"] = model["w3"][1000:50_000]  # a view into another tensor's storage, own bytes in the file
    return {"model": model,
            "optim": {"m": torch.randn(128, 128, generator=g), "small_t": torch.randn(10, 9, generator=g).t(),
                      "empty": torch.empty(0), "i": torch.arange(5)},
            "step": 3}


def _files(folder) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        data = open(os.path.join(folder, name), "rb").read()
        if name == "manifest.json":
            doc = json.loads(data)
            doc.pop("created_unix_s", None)  # the only field that differs between two saves
            data = json.dumps(doc, sort_keys=True).encode()
        out[name] = data
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _fs_has_o_direct(folder) -> bool:
    try:
        fd = os.open(os.path.join(folder, ".probe"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    os.unlink(os.path.join(folder, ".probe"))
    return True


@pytest.fixture
def acquired(monkeypatch):
    """Bytes asked of any staging pool, one entry per acquire."""
    got: list[int] = []
    real = StagingPool.acquire

    def acquire(self, nbytes, *a, **kw):
        got.append(nbytes)
        return real(self, nbytes, *a, **kw)
    monkeypatch.setattr(StagingPool, "acquire", acquire)
    return got


@pytest.mark.parametrize("o_direct", [None, False])
def test_save_of_cpu_state_copies_nothing_into_staging_and_writes_the_same_files(tmp_path, monkeypatch, acquired,
                                                                                   o_direct):
    """No staging pool; O_DIRECT files: copies only into a buffer of BOUNCE_BYTES per thread; buffered
    (o_direct=False): tensors of DIRECT_MIN_BYTES and more are not copied at all."""
    copied: list[tuple[int, int]] = []  # (source bytes, destination bytes) of every copy the direct writes make
    real_to_host = direct.to_host

    def to_host(dst, src, **kw):
        copied.append((src.numel() * src.element_size(), dst.numel()))
        return real_to_host(dst, src, **kw)
    monkeypatch.setattr(direct, "to_host", to_host)
    state = _state()
    fastckpt.save(state, tmp_path / "a", max_shard_bytes=600_000, o_direct=o_direct)
    assert acquired == []  # no staging memory at all
    assert copied and max(d for _, d in copied) <= direct.BOUNCE_BYTES
    if o_direct is False:
        assert max(n for n, _ in copied) < direct.DIRECT_MIN_BYTES  # only small tensors, through the buffer
    elif _fs_has_o_direct(tmp_path):
        assert max(n for n, _ in copied) >= direct.DIRECT_MIN_BYTES  # pieces of large ones, for O_DIRECT
    fastckpt.async_save(state, tmp_path / "b", max_shard_bytes=600_000).result()
    assert acquired  # async_save stages (the call returns after the copy)
    mine, staged = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert len([n for n in mine if n.startswith("model-")]) > 2  # several shard files
    assert mine == staged  # byte-identical files
    for name in mine:
        if name.endswith(".safetensors"):
            theirs = load_file(str(tmp_path / "a" / name))
            for k, v in theirs.items():
                src = state["model"][k] if name.startswith("model") else None
                if src is not None:
                    assert _raw(v) == _raw(src), k
    assert fastckpt.verify(tmp_path / "a").ok
    back = fastckpt.load(tmp_path / "a")
    for k, v in state["model"].items():
        assert _raw(back["model"][k]) == _raw(v), k
    assert _raw(back["optim"]["small_t"]) == _raw(state["optim"]["small_t"])


def test_save_stages_tensors_it_cannot_write_from_their_memory(tmp_path, acquired):
    """A large strided tensor takes the staged route; files stay the same."""
    state = _state()
    state["optim"]["big_t"] = torch.randn(300, 200).t()  # 240 kB, not contiguous
    fastckpt.save(state, tmp_path / "a")
    assert acquired
    fastckpt.async_save(state, tmp_path / "b").result()
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


class _WritesDuringSave(PosixBackend):
    """Writes the caller's tensor in place (torch op: version counter moves) at the first data write."""

    def __init__(self, t: torch.Tensor):
        self.t, self.done = t, False

    def pwrite(self, fd, data, offset):
        if not self.done and len(data) > 4096:
            self.done = True
            self.t.add_(1)
        return super().pwrite(fd, data, offset)


def test_in_place_write_during_save_fails_it_with_nothing_committed(tmp_path):
    state = _state()
    be = _WritesDuringSave(state["model"]["w3"])
    with pytest.raises(SourceChangedError, match="w3"):
        fastckpt.save(state, tmp_path / "a", io_backend=be)
    assert be.done
    assert not (tmp_path / "a").exists()
    assert [n for n in os.listdir(tmp_path)] == []  # no hidden temporary folder left either
    fastckpt.save(state, tmp_path / "a")  # the next save works
    assert fastckpt.verify(tmp_path / "a").ok


class _FailingWrite(PosixBackend):
    def __init__(self, nth: int):
        self.n, self.nth = 0, nth

    def pwrite(self, fd, data, offset):
        self.n += 1
        if self.n == self.nth:
            raise OSError(28, "No space left on device (injected)")
        return super().pwrite(fd, data, offset)


def test_failed_direct_write_leaves_nothing(tmp_path, acquired):
    with pytest.raises(OSError) as e:
        fastckpt.save(_state(), tmp_path / "a", io_backend=_FailingWrite(3))
    assert e.value.errno == 28
    assert acquired == []  # it was the direct route
    assert os.listdir(tmp_path) == []


def test_direct_writes_run_in_at_most_cpus_plus_one_lanes(tmp_path, monkeypatch, acquired):
    """With 16 I/O threads on a machine of C CPUs, no more than C + 1 direct writes (copy, hash,
    write) run at once, every piece is written (bytes equal the state's) and nothing is staged."""
    monkeypatch.setattr(direct.os, "sched_getaffinity", lambda pid: {0}, raising=False)  # one CPU: 2 lanes
    assert direct.direct_lanes(16) == 2 and direct.direct_lanes(1) == 1
    running, peak, calls = [0], [0], [0]
    real = direct.DirectWrites._write_task

    def task(self, w, t):
        running[0] += 1  # under the GIL: the increments of several threads do not interleave
        peak[0] = max(peak[0], running[0])
        calls[0] += 1
        try:
            time.sleep(0.01)  # long enough for the other lanes to start if they were free to
            return real(self, w, t)
        finally:
            running[0] -= 1
    monkeypatch.setattr(direct.DirectWrites, "_write_task", task)
    g = torch.Generator().manual_seed(9)
    state = {"model": {f"w{i}": torch.randn(600_000, generator=g) for i in range(6)}}  # 2.4 MB each: 1 piece
    fastckpt.save(state, tmp_path / "a", threads=16)
    assert acquired == []
    assert calls[0] >= 6 and peak[0] == 2
    back = fastckpt.load(tmp_path / "a")
    for k, v in state["model"].items():
        assert _raw(back["model"][k]) == _raw(v), k
