"""One save engine for 1..N ranks (issue 12): multi-rank saves on a pool of 3 spawned gloo ranks.

The rule under test: a save is multi-rank only when ``process_group`` is given (every rank of
that group calls it); a call without it saves from this process alone, even when
torch.distributed is initialized. Every save option means the same for 1..N ranks: the
safetensors files of a 3-rank save are byte-identical to a one-process save of the same state
with the same options. Waits are bounded (``timeout_s``), failures name the ranks, nothing
partial is committed, and a failed save leaves the process (and the group) usable.

Functions named ``rank_*`` run in the pool's processes (:mod:`ranks`): ``pool`` holds 3 ranks of
one gloo group, ``solo`` one plain process without a group (single-process saves that could
hang run there, so a hang fails the test instead of blocking pytest). A test that fails gets
fresh processes for the next test, so one broken save does not cascade.
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.storage.io import PosixBackend
from ranks import RankError, RankPool, RankTimeout, describe

CHUNK = 64 << 10
SAVE_TIMEOUT_S = 20  # timeout_s of every multi-rank save here: a coordination bug fails in bounded time
REPO = Path(__file__).resolve().parents[2]
TMP_MARK = ".fastckpt-tmp-"


# -- pools ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("pool")), world_size=3)
    yield p
    p.close()


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("solo")), world_size=1, distributed=False)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _fresh_pools_after_a_failure(request, pool, solo):
    """A failed test may leave a rank mid-save: the next test starts on fresh processes."""
    before = request.session.testsfailed
    yield
    if request.session.testsfailed > before:
        pool.kill()
        solo.kill()


# -- states and comparisons -----------------------------------------------------------------

def make_state(version: int = 0, *, frozen: bool = False) -> dict:
    """~1.4 MiB, the same on every rank: HF-named weights, a LoRA pair, an optimizer-like tree,
    ints. ``version`` changes only the optimizer and ``step`` (the weights stay equal)."""
    g = torch.Generator().manual_seed(1234)
    model = {f"layers.{i}.weight": torch.randn(96, 256, generator=g) for i in range(10)}
    model["layers.0.bias"] = torch.randn(256, generator=g).to(torch.bfloat16)
    model["embed.ids"] = torch.arange(3000, dtype=torch.int64)
    if frozen:
        model = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in model.items()}
    lora = {"a": torch.randn(8, 256, generator=g), "b": torch.randn(256, 8, generator=g)}
    opt = {"state": {i: {"exp_avg": torch.randn(96, 256, generator=g) + version,
                         "exp_avg_sq": torch.rand(96, 256, generator=g),
                         "step": torch.tensor(7.0 + version)} for i in range(2)},
           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}]}
    return {"model": model, "lora": lora, "optimizer": opt, "step": 7 + version, "epoch": 2,
            "flags": [True, None, "x"]}


def empty_state(which: str) -> dict:
    if which == "all_empty_tensors":  # DeepSpeed ZeRO-3 model-states files hold only these
        return {"model": {"a": torch.empty(0), "b": torch.zeros(0, 3, dtype=torch.bfloat16)}, "opt": {}}
    if which == "non_tensor_only":
        return {"step": 3, "lr": [0.1]}
    assert which == "empty_dict"
    return {}


EMPTY_STATES = ("all_empty_tensors", "non_tensor_only", "empty_dict")


def raw(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return b"" if t.numel() == 0 else t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tree(got, want, path: str = "state") -> None:
    """Same structure and key types; tensors equal in dtype, shape and raw bytes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (path, type(got))
        assert got.dtype == want.dtype, (path, got.dtype, want.dtype)
        assert tuple(got.shape) == tuple(want.shape), (path, got.shape, want.shape)
        assert raw(got) == raw(want), f"{path}: bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict), (path, type(got))
        key = lambda k: (type(k).__name__, k)  # noqa: E731
        assert sorted(map(key, got)) == sorted(map(key, want)), (path, list(got), list(want))
        for k in want:
            assert_same_tree(got[k], want[k], f"{path}/{k!r}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (path, got, want)
        for i, (x, y) in enumerate(zip(got, want)):
            assert_same_tree(x, y, f"{path}/{i}")
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


def data_files(folder) -> list[str]:
    """The safetensors and HF index files of a checkpoint folder, sorted."""
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") or n.endswith(".index.json"))


def temps_in(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(TMP_MARK)]


def assert_nothing_committed(ck: Path) -> None:
    assert not fastckpt.is_committed(ck), f"{ck} was committed by a failed save"
    assert not temps_in(ck.parent), f"temporary folders left: {temps_in(ck.parent)}"


def assert_loads(ck, want) -> None:
    assert fastckpt.is_committed(ck), f"{ck} is not committed"
    assert_same_tree(fastckpt.load(ck), want)


def inode(p) -> int:
    return os.stat(p).st_ino


# -- rank-side helpers (run inside pool processes) -------------------------------------------

class SpyBackend(PosixBackend):
    """Counts bytes written, and the part written through O_DIRECT file descriptors."""

    def __init__(self):
        self.bytes = 0
        self.direct_bytes = 0
        self._lock = threading.Lock()

    def pwrite(self, fd, data, offset):
        n = super().pwrite(fd, data, offset)
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
        with self._lock:
            self.bytes += n
            self.direct_bytes += n if direct else 0
        return n


class FailPwrite(PosixBackend):
    def pwrite(self, fd, data, offset):
        raise OSError(errno.EIO, "injected EIO")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _defer_all(key: str, trainable: bool) -> bool:
    return True


def _save(pg, state, path, **opts) -> dict:
    """``async_save`` + ``wait_staged`` + ``result`` (bounded); multi-rank when ``pg`` is given."""
    kw = dict(opts)
    if pg is not None:
        kw.update(process_group=pg, timeout_s=SAVE_TIMEOUT_S)
    fut = fastckpt.async_save(state, path, **kw)
    staged = fut.wait_staged(60)
    fut.result(timeout_s=60)
    return {"staged": staged, "bytes_written": fut.bytes_written, "bytes_linked": fut.bytes_linked}


#: Cases of the option parity test; those in LINKED save a previous checkpoint first and link from it.
OPTION_CASES = {
    "plain": {},
    "o_direct": {"o_direct": True, "chunk_bytes": CHUNK},
    "staging_bytes": {"staging_bytes": 4 * CHUNK, "chunk_bytes": CHUNK},
    "early_writes": {"early_writes": True},
    "defer": {"defer": "all"},  # replaced by _defer_all on the rank (a lambda does not pickle)
    "defer_frozen": {"defer_frozen": True, "link_check": "version"},
    "link_from": {"max_shard_bytes": 300_000},
    "link_check_version": {"link_check": "version", "max_shard_bytes": 300_000},
    "overwrite": {"overwrite": True},
    "weights": {"weights": {"model": "model", "lora": "adapter_model.safetensors"}},
    "extra_files": {"extra_files": {"config.json": b"{}"}},
    "metadata": {"metadata": {"a": "b"}},
    "step": {"step": 5},
    "max_shard_bytes": {"max_shard_bytes": 300_000},
    "chunk_bytes": {"chunk_bytes": CHUNK},
    "threads": {"threads": 2},
    "combo": {"o_direct": True, "staging_bytes": 4 * CHUNK, "chunk_bytes": CHUNK, "threads": 2,
              "max_shard_bytes": 300_000, "metadata": {"a": "b"}, "step": 5, "early_writes": True,
              "extra_files": {"config.json": b"{}"}},
}
LINKED = ("link_from", "link_check_version", "combo")
FROZEN = ("link_check_version", "defer_frozen")


def rank_save_case(folder: str, case: str, multi: bool) -> dict:
    """Save ``make_state`` with the options of ``case`` to ``{folder}/ck`` (all ranks or one process)."""
    pg = dist.group.WORLD if multi else None
    opts = dict(OPTION_CASES[case])
    if opts.get("defer") == "all":
        opts["defer"] = _defer_all
    spy = None
    if opts.get("o_direct"):
        spy = opts["io_backend"] = SpyBackend()
    ck = os.path.join(folder, "ck")
    state = make_state(1 if case in LINKED else 0, frozen=case in FROZEN)
    if case == "overwrite":
        _save(pg, {"model": {"old": torch.ones(5)}, "old": 1}, ck)
    if case == "defer_frozen":
        fastckpt.prime_hashes(state, background=False)
    if case in LINKED:
        prev = make_state(0, frozen=case in FROZEN)
        state["model"] = prev["model"]  # the same (frozen) parameters: link_check="version" may trust them
        _save(pg, prev, os.path.join(folder, "prev"), **opts)
        opts["link_from"] = os.path.join(folder, "prev")
    out = _save(pg, state, ck, **opts)
    if spy is not None:
        out.update(spy_bytes=spy.bytes, direct_bytes=spy.direct_bytes)
    return out


def rank_save_split(folder: str) -> int:
    """A replicated multi-rank save; returns the bytes this rank wrote."""
    spy = SpyBackend()
    _save(dist.group.WORLD, make_state(0), os.path.join(folder, "ck"), chunk_bytes=CHUNK, io_backend=spy)
    return spy.bytes


def rank_save_local_keys(folder: str) -> None:
    rank = dist.get_rank()
    state = make_state(0)
    state["optimizer"] = {"exp_avg": torch.full((20_000,), float(rank)), "rank": rank}
    _save(dist.group.WORLD, state, os.path.join(folder, "ck"), local_keys=("optimizer",), chunk_bytes=CHUNK)


def rank_manager_steps(folder: str) -> None:
    mgr = fastckpt.CheckpointManager(os.path.join(folder, "run"), keep_last=2, link_unchanged=True,
                                     process_group=dist.group.WORLD)
    opts = {"max_shard_bytes": 300_000, "chunk_bytes": CHUNK, "timeout_s": SAVE_TIMEOUT_S}
    for step in (1, 2):
        mgr.save(step, make_state(step), **opts)
    mgr.async_save(3, make_state(3), **opts).result(timeout_s=60)


def rank_save_alone(folder: str, tag: str) -> dict:
    """Plain calls (no process_group) from this process: save, async_save, a manager's save.
    Returns the seconds each took."""
    rank, took = _rank(), {}
    t = time.monotonic()
    fastckpt.save(make_state(0), os.path.join(folder, f"{tag}-save-r{rank}"), chunk_bytes=CHUNK)
    took["save"] = time.monotonic() - t
    t = time.monotonic()
    fastckpt.async_save(make_state(1), os.path.join(folder, f"{tag}-async-r{rank}")).result(timeout_s=60)
    took["async_save"] = time.monotonic() - t
    t = time.monotonic()
    fastckpt.CheckpointManager(os.path.join(folder, f"{tag}-mgr-r{rank}")).save(4, make_state(4))
    took["manager"] = time.monotonic() - t
    return took


def assert_saved_alone(folder: Path, tag: str, ranks, took: dict) -> None:
    for r in ranks:
        for what, s in took[r].items():
            assert s < 10, f"rank {r}: plain {what} took {s:.1f} s (it must not wait for other ranks)"
        for name, version in ((f"{tag}-save-r{r}", 0), (f"{tag}-async-r{r}", 1), (f"{tag}-mgr-r{r}/step-4", 4)):
            assert_loads(folder / name, make_state(version))
            assert fastckpt.read_manifest(str(folder / name)).world_size == 1, name


def rank_subgroup_then_world(folder: str, rounds: int) -> list[str]:
    rank = dist.get_rank()
    sub = dist.new_group([0, 1])  # every rank must call new_group
    done = []
    for i in range(rounds):
        if rank in (0, 1):
            fastckpt.save(make_state(i), os.path.join(folder, f"sub{i}"), process_group=sub,
                          timeout_s=SAVE_TIMEOUT_S, chunk_bytes=CHUNK)
            done.append(f"sub{i}")
        fastckpt.save(make_state(10 + i), os.path.join(folder, f"world{i}"), process_group=dist.group.WORLD,
                      timeout_s=SAVE_TIMEOUT_S, chunk_bytes=CHUNK)
        done.append(f"world{i}")
    return done


def rank_plain_same_path(folder: str) -> dict:
    g = torch.Generator().manual_seed(5)
    big = {"model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(4)}}  # 4 MiB
    dist.barrier()
    t = time.monotonic()
    try:
        fastckpt.save(big, os.path.join(folder, "ck"))
        err = None
    except Exception as e:
        err = describe(e)
    return {"error": err, "elapsed": time.monotonic() - t}


def rank_world_save_outcome(folder: str, name: str, save_timeout_s: float, bad_on: int = -1,
                            eio_on: int = -1) -> dict:
    """An ``async_save`` on the world group; returns where it failed ("call", "result" or "ok")."""
    rank, state = dist.get_rank(), make_state(0)
    if rank == bad_on:
        state["extra"] = {"bad": object()}
    t, phase = time.monotonic(), "call"
    try:
        fut = fastckpt.async_save(state, os.path.join(folder, name), process_group=dist.group.WORLD,
                                  timeout_s=save_timeout_s, chunk_bytes=CHUNK,
                                  io_backend=FailPwrite() if rank == eio_on else None)
        phase = "result"
        fut.result(timeout_s=60)
        phase, err = "ok", None
    except Exception as e:
        err = describe(e)
    return {"phase": phase, "error": err, "elapsed": time.monotonic() - t}


def rank_save_world(folder: str, name: str, version: int = 0) -> None:
    _save(dist.group.WORLD, make_state(version), os.path.join(folder, name), chunk_bytes=CHUNK)


class SlowPwrite(PosixBackend):
    """Each write takes ``delay_s`` longer (a rank whose disk is slow)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def pwrite(self, fd, data, offset):
        time.sleep(self.delay_s)
        return super().pwrite(fd, data, offset)


def rank_slow_rank0(folder: str, where: str) -> dict:
    """Rank 0 is slow (its writes, or its commit) beyond the others' timeout_s; returns the outcome."""
    from fastckpt.saving import committer
    rank, t0 = dist.get_rank(), time.monotonic()
    if rank == 0 and where == "commit":
        real = committer.write_metadata
        committer.write_metadata = lambda *a, **k: (time.sleep(2.5), real(*a, **k))[1]  # > 1 window, < 4
    try:
        fut = fastckpt.async_save(make_state(0), os.path.join(folder, "ck"), process_group=dist.group.WORLD,
                                  timeout_s=1.5, chunk_bytes=CHUNK, threads=1,
                                  io_backend=SlowPwrite(1.0) if rank == 0 and where == "writes" else None)
        fut.result(timeout_s=60)
        err = None
    except Exception as e:
        err = describe(e)
    finally:
        if rank == 0 and where == "commit":
            committer.write_metadata = real
    return {"error": err, "elapsed": time.monotonic() - t0}


def rank_store_keys_around_saves(folder: str) -> dict:
    """Keys in the group's store before and after a world save, a subgroup save and a plain save."""
    from torch.distributed import distributed_c10d as c10d
    store, rank = c10d._get_default_store(), dist.get_rank()
    sub = dist.new_group([0, 1])
    dist.barrier()
    before = store.num_keys()
    _save(dist.group.WORLD, make_state(0), os.path.join(folder, "world"), chunk_bytes=CHUNK)
    if rank in (0, 1):
        _save(sub, make_state(1), os.path.join(folder, "sub"), chunk_bytes=CHUNK)
    _save(None, make_state(2), os.path.join(folder, f"alone{rank}"), chunk_bytes=CHUNK)
    dist.barrier()
    time.sleep(0.2)  # the last rank to leave a session deletes its keys just after its result()
    dist.barrier()
    return {"before": before, "after": store.num_keys()}


def rank_save_empty(folder: str, which: str, multi: bool) -> None:
    pg = dist.group.WORLD if multi else None
    mgr = fastckpt.CheckpointManager(os.path.join(folder, "run"), process_group=pg)
    mgr.save(1, empty_state(which), **({"timeout_s": SAVE_TIMEOUT_S} if multi else {}))  # a new saver's first save
    _save(pg, empty_state(which), os.path.join(folder, "ck"))


def rank_fail_then_two_saves(folder: str, kind: str) -> dict:
    """One process: a failing (or, for "all_empty", a once-broken) save, then two saves."""
    first = os.path.join(folder, "first")
    try:
        if kind == "eio":
            fastckpt.async_save(make_state(0), first, io_backend=FailPwrite()).result(timeout_s=60)
        elif kind == "bad_input":
            fastckpt.save({"model": make_state(0)["model"], "extra": {"bad": object()}}, first)
        else:
            fastckpt.save(empty_state("all_empty_tensors"), first)
        err = None
    except Exception as e:
        err = describe(e)
    fastckpt.save(make_state(1), os.path.join(folder, "second"))
    fastckpt.async_save(make_state(2), os.path.join(folder, "third")).result(timeout_s=60)
    return {"error": err}


def rank_two_managers(folder: str) -> dict:
    a = fastckpt.CheckpointManager(os.path.join(folder, "a"))
    b = fastckpt.CheckpointManager(os.path.join(folder, "b"))
    fut = a.async_save(1, make_state(0), io_backend=FailPwrite())
    deadline = time.monotonic() + 30
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    a_failed = fut.done()
    b.save(1, make_state(1))  # B's calls never raise A's error
    b.async_save(2, make_state(2)).result(timeout_s=60)
    b.wait()
    assert_same_tree(b.load(), make_state(2))
    fastckpt.save(make_state(3), os.path.join(folder, "plain"))  # nor does the module-level saver
    try:
        a.wait()
        a_err = None
    except Exception as e:
        a_err = describe(e)
    a.save(2, make_state(4))
    return {"a_failed_in_background": a_failed, "a_wait": a_err, "a_steps": a.steps(), "b_steps": b.steps()}


# -- the pool itself ---------------------------------------------------------------------------

def rank_identity() -> tuple:
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def rank_raise_on_1() -> str:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return "fine"


def rank_hang_on_2() -> str:
    if dist.get_rank() == 2:
        time.sleep(600)
    return "fine"


def test_pool_runs_on_every_rank_and_on_subsets(pool):
    out = pool.run(rank_identity)
    assert sorted(out) == [0, 1, 2]
    assert [out[r][:2] for r in range(3)] == [(0, 3), (1, 3), (2, 3)]
    assert len({v[2] for v in out.values()}) == 3  # three processes
    assert pool.run(rank_identity, ranks=[2]) == {2: out[2]}


def test_pool_returns_each_ranks_exception(pool):
    out = pool.call(rank_raise_on_1)
    assert out[0] == out[2] == "fine"
    assert isinstance(out[1], RankError) and out[1].type == "ValueError" and out[1].message == "boom on rank 1"
    assert out[1].isa("Exception") and "rank_raise_on_1" in out[1].traceback
    pids = {r: v[2] for r, v in pool.run(rank_identity).items()}
    with pytest.raises(AssertionError, match="rank 1: ValueError: boom on rank 1"):
        pool.run(rank_raise_on_1)
    assert {r: v[2] for r, v in pool.run(rank_identity).items()} == pids  # same processes keep serving


def test_pool_reports_a_hanging_rank_in_bounded_time(pool):
    before = pool.run(rank_identity)
    t = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank 2 did not answer within 3 s"):
        pool.call(rank_hang_on_2, timeout_s=3)
    assert time.monotonic() - t < 20
    after = pool.run(rank_identity, timeout_s=120)  # a fresh pool serves the next call
    assert [after[r][:2] for r in range(3)] == [(0, 3), (1, 3), (2, 3)]
    assert not {v[2] for v in after.values()} & {v[2] for v in before.values()}


# -- every option, 3 ranks vs one process -----------------------------------------------------

@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_option_gives_the_bytes_of_a_one_process_save(pool, solo, tmp_path, case):
    multi, one = tmp_path / "multi", tmp_path / "one"
    multi.mkdir()
    one.mkdir()
    ref = solo.run(rank_save_case, folder=str(one), case=case, multi=False)[0]
    ranks = pool.run(rank_save_case, folder=str(multi), case=case, multi=True)
    assert ref["staged"] and all(r["staged"] for r in ranks.values()), (ref, ranks)
    want = make_state(1 if case in LINKED else 0)
    names = data_files(one / "ck")
    assert names and data_files(multi / "ck") == names
    for n in names:
        assert (multi / "ck" / n).read_bytes() == (one / "ck" / n).read_bytes(), f"{case}: {n} differs"
    assert_loads(multi / "ck", want)
    from safetensors.torch import load_file
    weights = {}
    for n in names:
        if n.startswith("model") and n.endswith(".safetensors"):
            weights.update(load_file(str(multi / "ck" / n)))
    assert_same_tree(weights, want["model"])
    opts = OPTION_CASES[case]
    assert fastckpt.read_manifest(str(multi / "ck")).step == opts.get("step")
    if "extra_files" in opts:
        assert (multi / "ck" / "config.json").read_bytes() == b"{}"
    if "metadata" in opts:
        from safetensors import safe_open
        for n in (n for n in names if n.endswith(".safetensors")):
            with safe_open(str(multi / "ck" / n), "pt") as f:
                assert (f.metadata() or {}).get("a") == "b", n
    if opts.get("max_shard_bytes"):
        assert len([n for n in names if n.startswith("model-")]) > 1, names
    if "weights" in opts:
        assert "adapter_model.safetensors" in names
    if opts.get("o_direct"):
        assert ref["direct_bytes"] > 0, ref
        bad = {r: v for r, v in ranks.items() if not v["direct_bytes"]}
        assert not bad, f"o_direct=True: these ranks wrote nothing through O_DIRECT: {bad}"
    if case in LINKED:  # exactly the files whose bytes did not change are hard links of link_from's
        for root in (one, multi):
            shards = [n for n in names if n.endswith(".safetensors")]
            unchanged = {n for n in shards if (root / "prev" / n).is_file()
                         and (root / "prev" / n).read_bytes() == (root / "ck" / n).read_bytes()}
            assert any(n.startswith("model-") for n in unchanged) and set(shards) - unchanged, (root.name, unchanged)
            for n in shards:
                linked = (root / "prev" / n).is_file() and inode(root / "ck" / n) == inode(root / "prev" / n)
                assert linked == (n in unchanged), \
                    f"{root.name}: {n} {'unchanged but rewritten' if n in unchanged else 'changed but linked'}"
        assert ref["bytes_linked"] > 0
        assert any(r["bytes_linked"] > 0 for r in ranks.values()), ranks


def test_replicated_bytes_are_split_across_ranks(pool, tmp_path):
    wrote = pool.run(rank_save_split, folder=str(tmp_path))
    total = sum((tmp_path / "ck" / n).stat().st_size for n in data_files(tmp_path / "ck") if n.endswith(".safetensors"))
    assert total > 1 << 20
    for r, n in wrote.items():
        assert 0.15 * total < n < 0.6 * total, f"rank {r} wrote {n} of {total} bytes: {wrote}"
    assert 0.95 * total <= sum(wrote.values()) <= total + 3 * CHUNK, (wrote, total)
    assert_loads(tmp_path / "ck", make_state(0))


def test_local_keys_are_per_rank(pool, tmp_path):
    pool.run(rank_save_local_keys, folder=str(tmp_path))
    ck = tmp_path / "ck"
    assert fastckpt.is_committed(ck)
    assert_same_tree(fastckpt.load(ck, keys=["model"])["model"], make_state(0)["model"])
    for r in range(3):
        got = fastckpt.load_into({"optimizer": {"exp_avg": torch.zeros(20_000), "rank": -1}}, ck, local_rank=r)
        assert got["optimizer"]["rank"] == r
        assert torch.equal(got["optimizer"]["exp_avg"], torch.full((20_000,), float(r)))


def test_manager_multi_rank_links_unchanged_files(pool, tmp_path):
    pool.run(rank_manager_steps, folder=str(tmp_path))
    run = tmp_path / "run"
    assert fastckpt.CheckpointManager(run).steps() == [2, 3]  # keep_last=2
    assert (run / "latest").read_text().strip() == "3"
    assert_loads(run / "step-3", make_state(3))
    models = [n for n in data_files(run / "step-3") if n.startswith("model-")]
    assert len(models) > 1
    for n in models:  # link_unchanged=True under a process group: the weights are not rewritten
        assert inode(run / "step-3" / n) == inode(run / "step-2" / n), n


# -- who takes part ----------------------------------------------------------------------------

def test_rank0_alone_saves_alone_under_an_initialized_group(pool, tmp_path):
    took = pool.run(rank_save_alone, ranks=[0], folder=str(tmp_path), tag="alone", timeout_s=30)
    assert_saved_alone(tmp_path, "alone", [0], took)


def test_subgroup_save_then_world_save_repeatedly(pool, tmp_path):
    rounds = 3
    done = pool.run(rank_subgroup_then_world, folder=str(tmp_path), rounds=rounds, timeout_s=90)
    assert len(done[0]) == len(done[1]) == 2 * rounds and len(done[2]) == rounds
    for i in range(rounds):
        assert_loads(tmp_path / f"sub{i}", make_state(i))
        assert_loads(tmp_path / f"world{i}", make_state(10 + i))


@pytest.mark.parametrize("where", ["writes", "commit"])
def test_ranks_agree_when_a_rank_gives_up_on_a_slow_rank0(pool, tmp_path, where):
    """A rank that stops waiting for rank 0 settles the verdict: if rank 0 was already committing
    (slow commit) everyone waits for it and succeeds; if rank 0 was still writing, nobody commits
    and every rank fails. Never: some ranks fail while the checkpoint is committed."""
    out = pool.run(rank_slow_rank0, folder=str(tmp_path), where=where, timeout_s=60)
    errors = {r: o["error"] for r, o in out.items()}
    if where == "commit":
        assert all(e is None for e in errors.values()), errors
        assert_loads(tmp_path / "ck", make_state(0))
    else:
        assert all(e is not None and e.isa("DistributedSaveError") for e in errors.values()), errors
        assert_nothing_committed(tmp_path / "ck")
        assert "gave up" in errors[0].message or "timeout" in errors[0].message.lower(), errors[0].message


def test_coordination_keys_are_deleted_after_the_saves(pool, tmp_path):
    """Store keys of a save are named by group + path and deleted once every rank has left."""
    out = pool.run(rank_store_keys_around_saves, folder=str(tmp_path), timeout_s=60)
    for r, o in out.items():
        # barrier keys of new_group/barrier may add a few; a save leaves none (it would add >= 10)
        assert o["after"] - o["before"] <= 3, (r, o)
    for name in ("world", "sub", "alone0", "alone1", "alone2"):
        assert fastckpt.is_committed(tmp_path / name), name


def test_plain_calls_from_every_rank_for_one_path_fail_at_once(pool, tmp_path):
    out = pool.run(rank_plain_same_path, folder=str(tmp_path), timeout_s=30)
    for r, o in out.items():
        e = o["error"]
        assert e is not None, f"rank {r}: plain save of a path that every rank saves did not fail"
        assert e.isa("SaveConflictError") and e.isa("FastCkptError") and e.isa("RuntimeError"), (r, e)
        assert "process_group=" in e.message, (r, e.message)
        assert o["elapsed"] < 10, (r, o["elapsed"])
    assert_nothing_committed(tmp_path / "ck")


def _saves_still_work(pool, tmp_path) -> None:
    """After a failed save: a save of all ranks on a new path, then a plain save from each rank."""
    pool.run(rank_save_world, folder=str(tmp_path), name="after", version=1, timeout_s=45)
    assert_loads(tmp_path / "after", make_state(1))
    took = pool.run(rank_save_alone, folder=str(tmp_path), tag="then", timeout_s=30)
    assert_saved_alone(tmp_path, "then", range(3), took)


def test_a_rank_that_never_calls_fails_the_others_in_bounded_time(pool, tmp_path):
    out = pool.run(rank_world_save_outcome, ranks=[0, 1], folder=str(tmp_path), name="ck", save_timeout_s=5)
    for r, o in out.items():
        e = o["error"]
        assert e is not None and e.isa("DistributedSaveError"), (r, o)
        assert "rank 2" in e.message and 2 in (e.failures or {}), (r, e.message, e.failures)
        assert 2.5 <= o["elapsed"] < 20, (r, o["elapsed"])
    assert_nothing_committed(tmp_path / "ck")
    # the group is still usable: every rank retries the same path, then a new path, then plain saves
    pool.run(rank_save_world, folder=str(tmp_path), name="ck", version=1, timeout_s=45)
    assert_loads(tmp_path / "ck", make_state(1))
    _saves_still_work(pool, tmp_path)


# -- failures leave the process usable ---------------------------------------------------------

def test_bad_input_on_one_rank_fails_every_rank_then_saves_work(pool, tmp_path):
    out = pool.run(rank_world_save_outcome, folder=str(tmp_path), name="ck", save_timeout_s=SAVE_TIMEOUT_S, bad_on=1)
    for r, o in out.items():
        e = o["error"]
        assert e is not None and o["phase"] == "call", (r, o)
        assert e.isa("DistributedSaveError") or (r == 1 and e.isa("UnsupportedValueError")), (r, e)
        if e.isa("DistributedSaveError"):
            assert 1 in (e.failures or {}), (r, e.failures)
        assert "extra/bad" in e.message, (r, e.message)
        assert o["elapsed"] < 10, (r, o["elapsed"])  # at once, not after timeout_s
    assert_nothing_committed(tmp_path / "ck")
    _saves_still_work(pool, tmp_path)


def test_eio_on_one_rank_fails_every_rank_then_saves_work(pool, tmp_path):
    out = pool.run(rank_world_save_outcome, folder=str(tmp_path), name="ck", save_timeout_s=SAVE_TIMEOUT_S, eio_on=1)
    for r, o in out.items():
        e = o["error"]
        assert e is not None and o["phase"] == "result", (r, o)
        assert e.isa("DistributedSaveError") and 1 in (e.failures or {}), (r, e, e.failures)
        assert "EIO" in e.failures[1] or "Input/output" in e.failures[1], e.failures
    assert_nothing_committed(tmp_path / "ck")
    _saves_still_work(pool, tmp_path)


@pytest.mark.parametrize("kind", ["eio", "bad_input", "all_empty"])
def test_one_process_failed_save_then_two_saves_work(solo, tmp_path, kind):
    solo.restart()  # the failing save is the process's first (a fresh staging pool)
    out = solo.run(rank_fail_then_two_saves, folder=str(tmp_path), kind=kind, timeout_s=60)[0]
    e = out["error"]
    if kind == "eio":
        assert e is not None and e.isa("OSError") and e.errno == errno.EIO, e
    elif kind == "bad_input":
        assert e is not None and e.isa("UnsupportedValueError") and "extra/bad" in e.message, e
    if kind != "all_empty":
        assert_nothing_committed(tmp_path / "first")
    assert_loads(tmp_path / "second", make_state(1))
    assert_loads(tmp_path / "third", make_state(2))


@pytest.mark.parametrize("multi", [False, True], ids=["one_process", "three_ranks"])
@pytest.mark.parametrize("which", EMPTY_STATES)
def test_states_without_tensor_bytes_save_and_load(pool, solo, tmp_path, which, multi):
    if not multi:
        solo.restart()  # the first save of the process (as a DeepSpeed ZeRO-3 model-states save may be)
    (pool if multi else solo).run(rank_save_empty, folder=str(tmp_path), which=which, multi=multi, timeout_s=45)
    assert_loads(tmp_path / "run" / "step-1", empty_state(which))
    assert_loads(tmp_path / "ck", empty_state(which))


def test_two_managers_keep_their_failures_apart(solo, tmp_path):
    out = solo.run(rank_two_managers, folder=str(tmp_path), timeout_s=90)[0]
    assert out["a_failed_in_background"]
    e = out["a_wait"]
    assert e is not None and e.isa("OSError") and e.errno == errno.EIO, e
    assert out["b_steps"] == [1, 2] and out["a_steps"] == [2], out
    assert_loads(tmp_path / "b" / "step-2", make_state(2))
    assert_loads(tmp_path / "a" / "step-2", make_state(4))
    assert_nothing_committed(tmp_path / "a" / "step-1")


# -- interpreter exit with a pending save ------------------------------------------------------

def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    path = [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120, cwd=str(REPO), env=env)


def test_exit_with_a_pending_save_finishes_it_and_says_so(tmp_path):
    ck = tmp_path / "ck"
    p = _python("""
        import sys, torch, fastckpt
        g = torch.Generator().manual_seed(0)
        state = {"model": {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(8)}}  # 16 MiB
        fastckpt.async_save(state, sys.argv[1])
        """, str(ck))
    assert p.returncode == 0, p.stderr
    assert fastckpt.is_committed(ck), f"the pending save was not finished at exit; stderr: {p.stderr!r}"
    assert "fastckpt" in p.stderr, f"no line about the pending save on stderr: {p.stderr!r}"


def test_ctrl_c_while_a_pending_save_finishes_at_exit_leaves_it_cleanly(tmp_path):
    """Ctrl-C while exit waits for a pending save (a user pressing it again): exit status 130 with a
    line saying the save was left unfinished, no abort of the interpreter, and no half checkpoint:
    the folder is either committed whole or absent; the next CheckpointManager save removes the
    leftover temporary folder."""
    import signal
    ck = tmp_path / "run" / "step-1"
    path = [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    code = textwrap.dedent("""
        import sys, time, torch, fastckpt
        from fastckpt.storage.io import PosixBackend

        class Slow(PosixBackend):  # every write takes 50 ms: the save is still running at exit
            def pwrite(self, fd, data, offset):
                time.sleep(0.05)
                return super().pwrite(fd, data, offset)

        state = {"model": {f"w{i}": torch.randn(256, 1024) for i in range(16)}}  # 16 MiB, 1 MiB writes
        fastckpt.async_save(state, sys.argv[1], io_backend=Slow(), chunk_bytes=1 << 20, threads=1)
        """)
    p = subprocess.Popen([sys.executable, "-c", code, str(ck)], stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                         env=env)
    err = ""
    deadline = time.monotonic() + 60
    while "finishing the pending save" not in err and time.monotonic() < deadline:
        err += p.stderr.readline()
    assert "finishing the pending save" in err, err
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=60)[1]
    assert p.returncode == 130, (p.returncode, err + rest)
    assert "left unfinished" in rest and "terminate called" not in rest, rest
    assert fastckpt.is_committed(ck) or not ck.exists(), "a half checkpoint at the path"
    run = tmp_path / "run"
    temps = sorted(n for n in os.listdir(run) if n.startswith(".") and "tmp" in n)
    mgr = fastckpt.CheckpointManager(run)
    mgr.save(2, {"w": torch.ones(2)})
    assert sorted(n for n in os.listdir(run) if n.startswith(".") and "tmp" in n) == []
    if temps:  # what `fastckpt prune` says of such leftovers (same cleanup as the save's)
        os.mkdir(run / temps[0])
        from fastckpt.cli.main import main as cli_main
        import contextlib
        import io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["prune", str(run), "--keep", "5"]) == 0
        assert f"removed 1 leftover folder(s) of dead writers: {temps[0]}" in out.getvalue(), out.getvalue()


def test_exit_with_a_failing_pending_save_is_not_silent(tmp_path):
    ck = tmp_path / "ck"
    p = _python("""
        import errno, sys, torch, fastckpt
        from fastckpt.storage.io import PosixBackend

        class FailPwrite(PosixBackend):
            def pwrite(self, fd, data, offset):
                raise OSError(errno.EIO, "injected EIO")

        fastckpt.async_save({"model": {"w": torch.randn(512, 1024)}}, sys.argv[1], io_backend=FailPwrite())
        """, str(ck))
    assert p.returncode != 0, f"exit code 0 although the pending save failed; stderr: {p.stderr!r}"
    assert any(s in p.stderr for s in ("EIO", "Input/output error", "OSError")), p.stderr
    assert_nothing_committed(ck)
