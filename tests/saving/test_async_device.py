"""A fake asynchronous device proves that no byte is hashed or written before its copy completes.

The fake replaces the CPU backend of the device-copy layer (:data:`fastckpt.device.BACKENDS`): every
device -> host copy returns at once and fills its destination 50-200 ms later on another thread,
its completion set only then; every host -> device copy of a load runs later on a worker thread
(in order, like a stream), and ``mark`` completions are set only when the worker got there. A
save that hashed or wrote a staged range before waiting for its copy would commit the staging
buffer's stale bytes with checksums computed from them (they load back "verified" and wrong);
a loader that reused a bounce slot or returned a destination before its copy completed would
return the wrong bytes. Each case loads the checkpoint and compares bytes with the source.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from ranks import RankPool  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.device import BACKENDS, Completion, CopyBackend, CopyStream  # noqa: E402
from fastckpt.loading.device import load_weights  # noqa: E402

DELAY_S = (0.05, 0.2)


class _Later(Completion):
    """Runs ``fn`` on its own thread after ``delay`` seconds; complete only once ``fn`` returned."""

    def __init__(self, fn, delay: float):
        self.ev = threading.Event()
        self.error: BaseException | None = None

        def run():
            time.sleep(delay)
            try:
                fn()
            except BaseException as e:  # surfaced by wait()
                self.error = e
            finally:
                self.ev.set()
        threading.Thread(target=run, daemon=True).start()

    def wait(self) -> None:
        assert self.ev.wait(60), "fake copy never completed"
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.ev.is_set()


class SlowStream(CopyStream):
    """Host -> device copies run in order on one worker thread, each 50-200 ms after the previous."""

    def __init__(self, device, rng: random.Random):
        super().__init__(device)
        self.rng, self.q = rng, queue.Queue()
        self.copies = 0
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            dst, src, delay = item
            time.sleep(delay)
            dst.copy_(src)

    def to_device(self, dst, src):
        self.copies += 1
        self.q.put((dst, src, self.rng.uniform(*DELAY_S) / 10))  # many pieces: 5-20 ms each

    def mark(self) -> Completion:
        ev = threading.Event()
        self.q.put(ev)

        class _Mark(Completion):
            def wait(self):
                assert ev.wait(60), "fake stream never reached its mark"

            def done(self):
                return ev.is_set()
        return _Mark()

    def synchronize(self):
        self.mark().wait()
        self.q.put(None)


class SlowDevice(CopyBackend):
    """The CPU backend, made asynchronous: each copy completes 50-200 ms after the call returned."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.to_host_calls = 0
        self.streams: list[SlowStream] = []

    def to_host(self, dst, src, *, one_thread=False):
        self.to_host_calls += 1
        return _Later(lambda: CopyBackend.to_host(self, dst, src, one_thread=one_thread), self.rng.uniform(*DELAY_S))

    def cat_to_host(self, dst, srcs):
        self.to_host_calls += 1
        return _Later(lambda: CopyBackend.cat_to_host(self, dst, srcs), self.rng.uniform(*DELAY_S))

    def copy_stream(self, device):
        self.streams.append(SlowStream(device, self.rng))
        return self.streams[-1]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(1 << 20, generator=g),                         # 4 MiB: a run of its own
            "big16": torch.randn(1024, 1536, generator=g).bfloat16(),          # 3 MiB
            "strided": torch.randn(700, 900, generator=g).t(),                 # not contiguous
            "small": {f"s{i}": torch.randn(100 + i, generator=g) for i in range(20)},  # one torch.cat run
            "ints": torch.randint(0, 1 << 30, (5000,), generator=g, dtype=torch.int64),
            "step": 7}


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def _assert_same_bytes(loaded: dict, want: dict) -> None:
    lf, wf = _flat(loaded), _flat(want)
    assert sorted(lf) == sorted(wf)
    bad = [k for k in wf if lf[k].dtype != wf[k].dtype or lf[k].shape != wf[k].shape
           or not torch.equal(lf[k].contiguous().view(torch.uint8), wf[k].contiguous().view(torch.uint8))]
    assert not bad, f"tensors loaded with other bytes than saved (stale staging bytes?): {bad}"


@pytest.fixture
def slow(monkeypatch):
    dev = SlowDevice()
    monkeypatch.setitem(BACKENDS, "cpu", dev)
    return dev


@pytest.mark.parametrize("how", ["save", "streaming", "async_overwrite", "defer"])
def test_save_waits_for_every_device_copy(tmp_path, slow, how):
    """Plain state through every staging path: whole-buffer (``save``, writes start while copying),
    ring-buffer streaming (``staging_bytes``), ``async_save`` whose sources are overwritten as soon as
    the call returns, and ``defer`` (copied and hashed on the background thread)."""
    state = _state(seed=hash(how) & 0xFFFF)
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _flat(state).items()}
    path = tmp_path / "ck"
    if how == "save":
        fastckpt.save(state, path)
    elif how == "streaming":
        fastckpt.save(state, path, staging_bytes=1 << 20)
    elif how == "async_overwrite":
        fut = fastckpt.async_save(state, path)
        for v in _flat(state).values():  # allowed once async_save returned: the snapshot is taken
            v.fill_(3)
        fut.result()
    else:
        fastckpt.async_save(state, path, defer=lambda key, trainable: True).result()
    assert slow.to_host_calls > 0, "the save did not copy through the device-copy layer"
    loaded = fastckpt.load(path, verify=True)  # checksums agree with the bytes written ...
    _assert_same_bytes(loaded, want)           # ... and the bytes are the source's


def test_load_waits_for_every_host_to_device_copy(tmp_path, monkeypatch):
    """Loads through the bounce ring: a slot is read into again only after its copies completed,
    and the destinations are returned only once every copy did (2 slots, many pieces)."""
    state = {k.replace("/", "_"): v for k, v in _flat(_state(seed=11)).items()}
    path = tmp_path / "ck"
    fastckpt.save(state, path)  # the real (synchronous) backend
    dev = SlowDevice(seed=1)
    monkeypatch.setitem(BACKENDS, "cpu", dev)
    slot = 256 << 10
    out = load_weights(path, "cpu", ring_bytes=2 * slot, slot_bytes=slot, threads=2)
    assert dev.streams and sum(s.copies for s in dev.streams) > 20
    _assert_same_bytes(out, state)
    conv = load_weights(path, "cpu", keys=["big"], dtype=torch.float64, ring_bytes=2 * slot, slot_bytes=slot)
    assert torch.equal(conv["big"], state["big"].double())


# -- 2-rank DTensor save (gloo, CPU), the copies of the fake device -------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("asyncdev")), world_size=2)
    yield p
    p.close()


def _full() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(513, 257, generator=g), "v": torch.randn(64, 1001, generator=g).half(),
                      "r": torch.randn(3, 3, generator=g).double(), "plain": torch.arange(10)}, "step": 3}


def rank_save_dtensor_slow(folder: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    full = _full()
    place = {"w": [Shard(0)], "v": [Shard(1)], "r": [Replicate()]}
    state = {"model": {k: (distribute_tensor(v, mesh, place[k]) if k in place else v)
                       for k, v in full["model"].items()}, "step": 3}
    dev = SlowDevice(seed=int(os.environ.get("RANK", "0")))
    old = BACKENDS["cpu"]
    BACKENDS["cpu"] = dev
    try:
        fastckpt.save(state, os.path.join(folder, "dt"), timeout_s=60)
    finally:
        BACKENDS["cpu"] = old
    return dev.to_host_calls


def test_dtensor_save_waits_for_every_device_copy(pool, tmp_path):
    """A 2-rank DTensor state (Shard(0), Shard(1), Replicate, a plain tensor) saved while every staging
    copy completes 50-200 ms late: the checkpoint loads back with the full tensors' bytes."""
    calls = pool.run(rank_save_dtensor_slow, folder=str(tmp_path), timeout_s=120)
    assert all(n > 0 for n in calls.values()), calls
    _assert_same_bytes(fastckpt.load(tmp_path / "dt", verify=True)["model"], _full()["model"])


# -- the CUDA/NPU strategy, run on CPU with a recording stand-in for torch.cuda ------------------

class _RecMod:
    """Stand-in for ``torch.cuda``: records the order of copies, event records and waits."""

    log: list = []

    class Event:
        def record(self, stream):
            _RecMod.log.append(("record", stream))

        def synchronize(self):
            _RecMod.log.append(("event.synchronize",))

        def query(self):
            return True

    class Stream:
        def __init__(self, device=None):
            self.device = device

        def wait_stream(self, other):
            _RecMod.log.append(("wait_stream", other))

        def synchronize(self):
            _RecMod.log.append(("stream.synchronize",))

    @staticmethod
    def current_stream(device=None):
        return f"current:{device}"

    @staticmethod
    def stream(s):
        import contextlib
        return contextlib.nullcontext()


def test_accelerator_copies_complete_on_an_event_recorded_after_them(monkeypatch):
    """CUDA/NPU staging: the copy is issued, then an event is recorded on the source device's current
    stream; waiting for the completion synchronizes that event (not before)."""
    from fastckpt.device import EventCompletion, to_host
    from fastckpt.device.copies import AcceleratorBackend
    _RecMod.log = []
    copied = []

    be = AcceleratorBackend(lambda: _RecMod)
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        copied.append(non_blocking)
        _RecMod.log.append(("copy",))
        return real_copy(self, src)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setitem(BACKENDS, "cpu", be)  # CPU tensors take the accelerator strategy here
    src = torch.arange(12, dtype=torch.float32).view(3, 4)
    dst = torch.empty(48, dtype=torch.uint8)
    done = to_host(dst, src)
    assert isinstance(done, EventCompletion) and copied == [True]
    assert _RecMod.log == [("copy",), ("record", "current:cpu")]
    done.wait()
    assert _RecMod.log[-1] == ("event.synchronize",)
    monkeypatch.undo()
    assert torch.equal(dst.view(torch.float32).view(3, 4), src)


def test_npu_support_is_imported_only_for_npu_tensors():
    """``import fastckpt`` and CPU saves never import torch_npu; asking for the npu backend does."""
    import subprocess
    code = ("import sys, torch, fastckpt, fastckpt.device\n"
            "fastckpt.save({'w': torch.ones(3)}, sys.argv[1])\n"
            "assert 'torch_npu' not in sys.modules\n"
            "from fastckpt.device import BACKENDS\n"
            "try:\n    BACKENDS['npu']._module()\nexcept ImportError as e:\n    print('ImportError', e.name)\n")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", code, os.path.join(d, "ck")], capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 0, out.stderr
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        assert out.stdout.strip() == "ImportError torch_npu"
