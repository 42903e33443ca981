"""Page-locked staging only where CUDA tensors are staged.

Page-locking host memory costs about 0.3-1 s per GiB. On the H200 machine (torch 2.11+cu130) the
first ``async_save`` of a 1 GiB *CPU* state blocked 0.93 s, 13.6x one copy into fresh memory
(``benchmarks/bench_save.py``), because the staging buffer was pinned whenever CUDA was present.
These tests run on CPU: CUDA's presence is faked, and any page-locking is recorded.
"""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt.dcp import FastCkptStager
from fastckpt.storage import memory, staging
from fastckpt.storage.memory import host_buffer, needs_pinned
from fastckpt.storage.staging import StagingPool


@pytest.fixture
def cuda_present(monkeypatch):
    """CUDA reported present; every page-locking request recorded (and served with ordinary pages)."""
    pinned: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def pin_memory(self, *a, **kw):
        pinned.append(self.numel() * self.element_size())
        return self.clone()

    def pinned_buffer(nbytes):
        pinned.append(nbytes)
        return host_buffer(nbytes)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(memory, "pinned_buffer", pinned_buffer)
    monkeypatch.setattr(staging, "pinned_buffer", pinned_buffer)
    for mod in ("fastckpt.saving.dcp_writer",):
        m = __import__(mod, fromlist=["x"])
        if hasattr(m, "pinned_buffer"):
            monkeypatch.setattr(m, "pinned_buffer", pinned_buffer)
    return pinned


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(7, generator=g)}, "step": 3}


def test_cpu_state_is_never_page_locked_with_cuda_present(tmp_path, cuda_present):
    state = _state()
    s = fastckpt.Saver()
    s.async_save(state, tmp_path / "a").result()
    s.save(state, tmp_path / "b", o_direct=False)
    FastCkptStager().stage(state)
    assert cuda_present == []
    back = fastckpt.load(tmp_path / "a")
    assert torch.equal(back["model"]["w"], state["model"]["w"])


def test_pool_pins_only_on_request_and_keeps_a_pinned_buffer(cuda_present):
    pool = StagingPool()
    pool.acquire(4 << 20)
    pool.release()
    assert cuda_present == []
    pool.acquire(4 << 20, pinned=True)  # a buffer of ordinary pages is replaced for CUDA tensors
    pool.release()
    assert cuda_present == [4 << 20]
    pool.acquire(3 << 20)  # a CPU state takes the page-locked buffer as it is
    pool.release()
    pool.acquire(4 << 20, pinned=True)
    pool.release()
    assert cuda_present == [4 << 20]


def test_reserve_pins_where_cuda_is_present_unless_told(cuda_present):
    s = fastckpt.Saver()
    s.reserve(4 << 20, background=False, pinned=False)
    assert cuda_present == []
    s.reserve(4 << 20, background=False)
    assert cuda_present == [4 << 20]


def test_needs_pinned_only_for_cuda_tensors():
    assert not needs_pinned([torch.zeros(2), 3, "x", None])
    assert needs_pinned([torch.zeros(2), torch.empty(2, device="meta").to("meta")]) is False
    assert needs_pinned([]) is False
