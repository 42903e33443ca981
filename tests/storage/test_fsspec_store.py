"""The storage seam proven by a second store: fastckpt on an S3-compatible server (moto's, started
here on localhost) through :class:`fastckpt.storage.fsspec_store.FsspecStore`.

Save / async_save / load / verify / prune on ``s3://`` give the same files (byte for byte, the
manifest's commit time aside) and the same results as the local store; a failed upload and a
SIGKILLed writer leave no committed partial checkpoint, and the next save succeeds. The module
skips when moto's server or s3fs is not installed or the server does not start.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch

import fastckpt
from fastckpt.cli.main import main as cli_main
from fastckpt.errors import CheckpointExistsError, CheckpointNotFoundError, ChecksumMismatchError
from fastckpt.storage.retention import prune_checkpoints, scan_checkpoints
from fastckpt.storage.locate import store_for
from fastckpt.storage.store import LOCAL, STRATEGIES

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from fastckpt.storage.fsspec_store import FsspecStore  # noqa: E402  (after the skips: needs fsspec)

_BUCKETS = itertools.count()
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server in a subprocess on a free localhost port; the process environment points
    boto at it (``AWS_ENDPOINT_URL``), as a user's would point at their object store."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.skip("moto's S3 server did not start")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in [*CREDS, "AWS_ENDPOINT_URL"]}
    os.environ.update(CREDS, AWS_ENDPOINT_URL=url)
    FsspecStore._CACHE.clear()
    try:
        yield url
    finally:
        FsspecStore._CACHE.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.kill()
        proc.wait()


@pytest.fixture
def bucket(s3_server, request, tmp_path, monkeypatch):
    """A fresh bucket per test; spool files go under tmp_path (checked empty after each save)."""
    fs = s3fs.S3FileSystem(endpoint_url=s3_server, key="testing", secret="testing", skip_instance_cache=True)
    name = f"b{next(_BUCKETS)}-" + "".join(c for c in request.node.name.lower() if c.isalnum())[:40]
    fs.mkdir(name)
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setenv("FASTCKPT_SPOOL_DIR", str(spool))
    return name, fs, spool


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
                      "ids": torch.arange(100, dtype=torch.int64)},
            "optim": {"m": torch.randn(64, 33, generator=g)}, "step": seed, "name": "run"}


def local_files(folder) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, folder)] = open(p, "rb").read()
    return out


def remote_files(fs, prefix: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {p[len(prefix) + 1:]: fs.cat_file(p) for p in fs.find(prefix)}


def same_checkpoint_files(a: dict[str, bytes], b: dict[str, bytes]) -> None:
    """Same names and bytes; the manifests equal but for the commit time."""
    assert sorted(a) == sorted(b)
    for n in a:
        if n == "manifest.json":
            ma, mb = json.loads(a[n]), json.loads(b[n])
            ma.pop("created_unix_s"), mb.pop("created_unix_s")
            assert ma == mb
        else:
            assert a[n] == b[n], n


def assert_state_equal(got, want) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if isinstance(want[k], dict):
            assert_state_equal(got[k], want[k])
        elif isinstance(want[k], torch.Tensor):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        else:
            assert got[k] == want[k]


def test_store_interface_same_answers_local_and_s3(bucket, tmp_path):
    """The folder-level operations answer alike on both stores (the seam's contract)."""
    name, fs, _ = bucket
    for store, root in ((LOCAL, str(tmp_path / "root")), (FsspecStore(fs, "s3"), f"s3://{name}/root")):
        store.makedirs(store.join(root, "a"))
        f = store.join(root, "a", "x.json")
        store.write_file(f, b"one")
        with pytest.raises(FileExistsError):
            store.write_file(f, b"two")
        store.write_file(f, b"two", replace=True)
        assert store.read_bytes(f) == b"two" and store.size(f) == 3
        assert store.exists(f) and store.isfile(f) and store.isdir(store.join(root, "a"))
        assert sorted(store.listdir(root)) == ["a"]
        w = store.open_write(store.join(root, "big.bin"), 10000)
        w.write(memoryview(b"B" * 5000), 5000)  # pieces at offsets, any order
        w.write(memoryview(b"A" * 5000), 0)
        w.sync()
        w.close()
        assert store.read_bytes(store.join(root, "big.bin")) == b"A" * 5000 + b"B" * 5000
        with pytest.raises(FileNotFoundError):
            store.listdir(store.join(root, "missing"))
        with pytest.raises(FileNotFoundError):
            store.read_bytes(store.join(root, "missing.json"))
        assert store.remove(store.join(root, "a")) and not store.exists(f)
        assert store.remove(store.join(root, "a")) is False
        assert store.free_bytes(root) > 0


def test_save_load_verify_same_as_local(bucket, tmp_path):
    """fastckpt.save to s3:// writes the same bytes as a local save; load and verify agree."""
    name, fs, spool = bucket
    state = make_state(1)
    local = fastckpt.save(state, tmp_path / "step-1")
    url = f"s3://{name}/run/step-1"
    assert fastckpt.save(state, url) == url
    same_checkpoint_files(local_files(local), remote_files(fs, f"{name}/run/step-1"))
    assert os.listdir(spool) == []  # the spool is gone once the manifest is uploaded
    assert fastckpt.is_committed(url) and not fastckpt.is_committed(f"s3://{name}/run/step-9")
    assert_state_equal(fastckpt.load(url), fastckpt.load(local))
    assert_state_equal(fastckpt.load(url, keys="model"), {"model": state["model"]})
    rep = fastckpt.verify(url)
    assert rep.ok and rep.path == url and rep.bytes_checked == fastckpt.verify(local).bytes_checked
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    fastckpt.load_into(target, url)
    assert_state_equal(target["model"], state["model"])
    with pytest.raises(CheckpointExistsError):
        fastckpt.save(state, url)
    state2 = make_state(2)
    fastckpt.save(state2, url, overwrite=True)
    assert_state_equal(fastckpt.load(url), state2)
    with pytest.raises(CheckpointNotFoundError):
        fastckpt.load(f"s3://{name}/run/nothing")


def test_async_save_with_an_explicit_store_object(bucket, tmp_path):
    """An explicit store object (configured in code, not from the environment) via store.path()."""
    name, fs, spool = bucket
    store = FsspecStore(fs, "s3")
    state = make_state(3)
    target = store.path(f"{name}/ckpt")
    assert store_for(target) is store and store.commits == ("marker",)
    fut = fastckpt.async_save(state, target)
    assert fut.result() == f"s3://{name}/ckpt" and fut.bytes_written > 0
    local = fastckpt.async_save(state, tmp_path / "ckpt").result()
    same_checkpoint_files(local_files(local), remote_files(fs, f"{name}/ckpt"))
    assert fastckpt.is_committed(target)
    assert_state_equal(fastckpt.load(target), state)
    assert os.listdir(spool) == []
    with pytest.raises(ValueError, match="rename"):
        fastckpt.save(state, store.path(f"{name}/other"), commit="rename")  # no atomic rename on S3


def test_prune_and_scan_same_as_local(bucket, tmp_path):
    """Retention on s3:// keeps and deletes the same steps as on a local root."""
    name, fs, _ = bucket
    roots = (str(tmp_path / "run"), f"s3://{name}/run")
    for step in (1, 2, 3, 4):
        for root in roots:
            fastckpt.save({"x": torch.full((10,), float(step))}, f"{root}/step-{step}")
        time.sleep(0.01)  # distinct commit times
    fs.pipe_file(f"{name}/run/step-7/state.json", b"{}")  # an uncommitted step folder, as a crash leaves
    os.makedirs(f"{roots[0]}/step-7")
    open(f"{roots[0]}/step-7/state.json", "wb").write(b"{}")
    scans = [scan_checkpoints(r, "step-") for r in roots]
    assert scans[0].steps == scans[1].steps == [1, 2, 3, 4]
    assert [s for s, _ in scans[0].uncommitted] == [s for s, _ in scans[1].uncommitted] == [7]
    assert scans[0].by_commit() == scans[1].by_commit() == [1, 2, 3, 4]
    deleted = [prune_checkpoints(r, "step-", 2, protect=(1,), by_manifest_time=True) for r in roots]
    assert deleted[0] == deleted[1] == [2]
    assert [scan_checkpoints(r, "step-").steps for r in roots] == [[1, 3, 4], [1, 3, 4]]
    assert fs.exists(f"{name}/run/step-7/state.json")  # uncommitted folders are never deleted
    assert not fs.exists(f"{name}/run/step-2")
    assert_state_equal(fastckpt.load(f"{roots[1]}/step-4"), {"x": torch.full((10,), 4.0)})


def test_verify_and_load_catch_a_damaged_object(bucket):
    name, fs, _ = bucket
    url = f"s3://{name}/bad"
    fastckpt.save({"w": torch.arange(4096, dtype=torch.float32)}, url)
    assert cli_main(["verify", url]) == 0  # `fastckpt verify s3://...`
    key = next(p for p in fs.find(f"{name}/bad") if p.endswith(".safetensors"))
    data = bytearray(fs.cat_file(key))
    data[-7] ^= 0x10
    fs.pipe_file(key, bytes(data))
    rep = fastckpt.verify(url)
    assert not rep.ok and rep.problems
    assert cli_main(["verify", url]) == 1
    assert all(url in p for p in rep.problems if ".safetensors" in p)  # names the object, not the local copy
    with pytest.raises(ChecksumMismatchError):
        fastckpt.load(url)


@pytest.mark.parametrize("fail_on", ["a shard", "the manifest"])
def test_failed_put_leaves_no_committed_checkpoint(bucket, monkeypatch, fail_on):
    """An upload failing (EIO from the store) fails the save with that error: nothing committed, nothing
    left under the prefix, no spool left; the next save succeeds."""
    name, fs, spool = bucket
    url = f"s3://{name}/run/step-5"
    real = FsspecStore.put_file

    def faulty(self, local, path):
        hit = path.endswith(".safetensors") if fail_on == "a shard" else path.endswith("manifest.json")
        if hit:
            raise OSError(errno.EIO, "injected: put failed", path)
        return real(self, local, path)

    monkeypatch.setattr(FsspecStore, "put_file", faulty)
    fut = fastckpt.async_save(make_state(5), url)
    with pytest.raises(OSError) as ei:
        fut.result()
    assert ei.value.errno == errno.EIO
    assert not fastckpt.is_committed(url)
    fs.invalidate_cache()
    assert fs.find(f"{name}/run") == []
    assert scan_checkpoints(f"s3://{name}/run", "step-").committed == []
    assert os.listdir(spool) == []
    monkeypatch.setattr(FsspecStore, "put_file", real)
    fastckpt.save(make_state(5), url)
    assert_state_equal(fastckpt.load(url), make_state(5))


WRITER = textwrap.dedent("""
    import os, sys, time, torch, fastckpt
    from fastckpt.storage.fsspec_store import FsspecStore
    real = FsspecStore.put_file
    def slow(self, local, path):
        real(self, local, path)
        open(sys.argv[2], "a").write(path + "\\n")  # one object uploaded: the parent kills us now
        time.sleep(60)
    FsspecStore.put_file = slow
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(1 << 20, generator=g)}
    fastckpt.save(state, sys.argv[1], io=fastckpt.IOTuning(max_shard_bytes=1 << 22))
    print("NOT KILLED")
""")


def test_killed_writer_leaves_no_committed_checkpoint(bucket, tmp_path):
    """SIGKILL a process in the middle of its upload: the prefix holds files but no manifest, so no
    checkpoint (load, is_committed, scan, prune all skip it); the next saves succeed."""
    name, fs, spool = bucket
    url = f"s3://{name}/run/step-1"
    script, log = tmp_path / "writer.py", tmp_path / "uploaded.txt"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), url, str(log)], env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (log.exists() and log.read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the writer never uploaded"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(os.listdir(spool)) == 1  # the killed writer's local spool: removed by the next spool made
    fs.invalidate_cache()
    left = fs.find(f"{name}/run/step-1")
    assert left and not any(p.endswith("manifest.json") for p in left)  # killed mid-upload, really
    assert not fastckpt.is_committed(url)
    with pytest.raises(CheckpointNotFoundError):
        fastckpt.load(url)
    scan = scan_checkpoints(f"s3://{name}/run", "step-")
    assert scan.committed == [] and [s for s, _ in scan.uncommitted] == [1]
    state = make_state(7)
    fastckpt.save(state, f"s3://{name}/run/step-2")
    assert os.listdir(spool) == []
    fastckpt.save(state, url, overwrite=True)  # the leftover is replaced
    assert prune_checkpoints(f"s3://{name}/run", "step-", 1) == [1]
    assert scan_checkpoints(f"s3://{name}/run", "step-").steps == [2]
    assert_state_equal(fastckpt.load(f"s3://{name}/run/step-2"), state)


def test_commit_strategies_are_the_only_commit_modes():
    """The commit= names come from the strategies (no mode strings elsewhere)."""
    from fastckpt.saving.options import COMMIT_MODES
    assert COMMIT_MODES == tuple(STRATEGIES) == ("rename", "marker")
    assert STRATEGIES["marker"].per_node and not STRATEGIES["rename"].per_node


def test_checkpoint_manager_on_s3_same_as_local(bucket, tmp_path):
    """CheckpointManager on an s3:// root: same steps kept, same latest, same loads as a local root."""
    name, fs, spool = bucket
    mgrs = [fastckpt.CheckpointManager(tmp_path / "run", keep_last=2),
            fastckpt.CheckpointManager(f"s3://{name}/run", keep_last=2)]
    for step in (10, 20, 30):
        for m in mgrs:
            m.async_save(step, {"x": torch.full((5,), float(step)), "step": step}).result()
        time.sleep(0.01)
    assert mgrs[0].steps() == mgrs[1].steps() == [20, 30]
    assert mgrs[0].latest() == mgrs[1].latest() == 30
    assert fs.cat_file(f"{name}/run/latest") == (tmp_path / "run" / "latest").read_bytes() == b"30\n"
    for m in mgrs:
        assert_state_equal(m.load(), {"x": torch.full((5,), 30.0), "step": 30})
        assert_state_equal(m.load(20), {"x": torch.full((5,), 20.0), "step": 20})
    assert mgrs[1].path(30) == f"s3://{name}/run/step-30"
    with pytest.raises(CheckpointExistsError):
        mgrs[1].save(30, {"x": torch.zeros(1)})
    assert mgrs[0].prune(1) == mgrs[1].prune(1) == [20]
    assert os.listdir(spool) == []


def test_local_strategies_after_a_failure(tmp_path):
    """The two strategies on the local store: an aborted rename save leaves the previous checkpoint;
    a marker abort never removes a folder its manifest committed."""
    from fastckpt.storage.store import strategy
    path = str(tmp_path / "ckpt")
    fastckpt.save({"x": torch.ones(3)}, path)
    rename = strategy("rename")
    tmp = rename.begin(LOCAL, path, overwrite=True, subfolders=["sub/a.json"])
    assert os.path.isdir(os.path.join(tmp, "sub")) and os.path.basename(tmp).startswith(".ckpt.fastckpt-tmp-")
    rename.abort(LOCAL, tmp)
    assert not os.path.exists(tmp) and fastckpt.is_committed(path)
    marker = strategy("marker")
    marker.abort(LOCAL, path)  # has a manifest: committed, never removed
    assert fastckpt.is_committed(path)
    with pytest.raises(CheckpointExistsError):
        marker.begin(LOCAL, path, overwrite=False)
    folder = marker.begin(LOCAL, str(tmp_path / "m"), overwrite=False)
    assert os.listdir(folder) == ["state.json"] and not fastckpt.is_committed(folder)
    marker.abort(LOCAL, folder)
    assert not os.path.exists(folder)


def test_cli_ls_verify_prune_on_s3(bucket, tmp_path, capsys):
    """`fastckpt ls / verify / prune s3://bucket/run` answer as for a local run root."""
    name, fs, _ = bucket
    roots = (str(tmp_path / "run"), f"s3://{name}/run")
    for step in (1, 2, 3):
        for root in roots:
            fastckpt.save({"x": torch.full((10,), float(step))}, f"{root}/step-{step}")
        time.sleep(0.01)
    out = []
    for root in roots:
        capsys.readouterr()
        assert cli_main(["ls", root]) == 0
        out.append(capsys.readouterr().out.replace(root, "ROOT"))
    assert out[0] == out[1] and "latest committed: 3" in out[1]
    assert cli_main(["verify", roots[1]]) == 0  # a run root: its newest checkpoint
    assert f"{roots[1]}/step-3" in capsys.readouterr().out
    for root in roots:
        assert cli_main(["prune", root, "--keep", "1"]) == 0
    assert [scan_checkpoints(r, "step-").steps for r in roots] == [[3], [3]]
    assert cli_main(["ls", f"s3://{name}/nothing"]) == 2


def test_overwrite_never_deletes_objects_that_are_not_a_checkpoint(bucket):
    """A local save with overwrite=True refuses a folder of other files; on s3 it deleted every object
    under the prefix (an object-store differential probe). Refused on both, nothing deleted."""
    name, fs, _ = bucket
    fastckpt.save(make_state(1), f"s3://{name}/run/step-1")
    fs.pipe_file(f"{name}/run/notes.txt", b"mine")
    fs.pipe_file(f"{name}/afile", b"an object")
    for url in (f"s3://{name}/run", f"s3://{name}/afile"):
        for save in (fastckpt.save, fastckpt.async_save):
            with pytest.raises(CheckpointExistsError, match="not a fastckpt checkpoint"):
                save(make_state(2), url, overwrite=True)
    fs.invalidate_cache()
    assert fs.cat_file(f"{name}/run/notes.txt") == b"mine" and fs.cat_file(f"{name}/afile") == b"an object"
    assert fastckpt.is_committed(f"s3://{name}/run/step-1")
    fastckpt.save(make_state(3), f"s3://{name}/run/step-1", overwrite=True)  # a checkpoint: replaced
    assert_state_equal(fastckpt.load(f"s3://{name}/run/step-1"), make_state(3))


def test_glob_characters_in_a_prefix_touch_only_that_prefix(bucket):
    """fsspec's rm and get expand * ? [ ] as globs: overwriting s3://b/run*/step-1 deleted runZ/step-1,
    pruning s3://b/run* deleted runZ's steps, and loads of such prefixes failed (an object-store
    differential probe). Keys are listed and removed one by one now, as a local folder's names."""
    name, fs, _ = bucket
    for run in ("runZ", "run*", "r[1]"):
        for s in (1, 2, 3):
            fastckpt.save(make_state(s), f"s3://{name}/{run}/step-{s}")
    fastckpt.save(make_state(9), f"s3://{name}/run*/step-1", overwrite=True)
    assert prune_checkpoints(f"s3://{name}/run*", "step-", 1) == [1, 2]
    fs.invalidate_cache()
    assert sorted({p.split("/")[2] for p in fs.find(f"{name}/runZ")}) == ["step-1", "step-2", "step-3"]
    assert sorted({p.split("/")[2] for p in fs.find(f"{name}/run*/")}) == ["step-3"]
    assert_state_equal(fastckpt.load(f"s3://{name}/runZ/step-1"), make_state(1))
    assert_state_equal(fastckpt.load(f"s3://{name}/run*/step-3"), make_state(3))
    assert_state_equal(fastckpt.load(f"s3://{name}/r[1]/step-2"), make_state(2))
    assert fastckpt.verify(f"s3://{name}/r[1]/step-2").ok


def test_a_delete_the_store_ignores_is_an_error_not_a_removal(bucket, monkeypatch):
    """s3fs's bulk delete ignores per-key errors (read-only credentials, an object lock): prune said
    'removed steps: [1]', exit 0, and step 1 stayed committed (an object-store differential probe).
    A delete that leaves the objects there raises PermissionError naming the URL."""
    name, fs, _ = bucket
    for s in (1, 2):
        fastckpt.save(make_state(s), f"s3://{name}/run/step-{s}")
    store = store_for(f"s3://{name}/run")
    monkeypatch.setattr(store.fs, "rm_file", lambda path, **kw: None)  # the store drops the delete
    with pytest.raises(PermissionError, match=f"s3://{name}/run/step-1"):
        prune_checkpoints(f"s3://{name}/run", "step-", 1)
    assert fastckpt.is_committed(f"s3://{name}/run/step-1")


def test_one_file_of_an_s3_checkpoint_loads_and_errors_name_the_url(bucket, tmp_path):
    """README's one-file load worked locally and said 'nothing there' on s3; `fastckpt load s3://...
    --to DIR` took the URL for a local path; errors named the deleted spool copy; a run root was
    downloaded whole before it was refused (an object-store differential probe)."""
    name, fs, _ = bucket
    url = f"s3://{name}/run/step-1"
    state = make_state(1)
    fastckpt.save(state, url)
    got = fastckpt.load(f"{url}/model.safetensors")
    assert all(torch.equal(got[k], state["model"][k]) for k in state["model"])
    assert fastckpt.verify(f"{url}/model.safetensors").ok
    with pytest.raises(KeyError, match=f"s3://{name}/run/step-1"):
        fastckpt.load(url, keys="nope")
    with pytest.raises(CheckpointNotFoundError, match=rf"s3://{name}/run: a run root .*step-1.*nothing was downloaded"):
        fastckpt.load(f"s3://{name}/run")
    fs.pipe_file(f"{name}/run/step-1/model.safetensors", fs.cat_file(f"{name}/run/step-1/model.safetensors")[:-1] + b"\x01")
    with pytest.raises(fastckpt.CorruptCheckpointError):  # the file is checked against its manifest
        fastckpt.load(f"{url}/model.safetensors")


def test_a_client_error_mid_upload_is_an_oserror_naming_the_url(bucket, monkeypatch, capsys):
    """The endpoint lost mid-upload raised botocore's EndpointConnectionError (no OSError, no fastckpt
    error) from the cleanup, hiding the upload's own error and naming an encoded endpoint URL (an
    object-store differential probe). Also: `fastckpt load s3://... ` without --to says to pass one."""
    name, fs, _ = bucket
    url = f"s3://{name}/run/step-5"

    class EndpointGone(Exception):  # botocore's errors are no OSError
        pass

    def gone(*a, **kw):
        raise EndpointGone("Could not connect to the endpoint URL")

    monkeypatch.setattr(FsspecStore, "put_file", gone)
    monkeypatch.setattr(FsspecStore, "remove", gone)  # the cleanup cannot reach the store either
    with pytest.raises(OSError, match=rf"uploading failed \(EndpointGone: Could not connect.*") as ei:
        fastckpt.save(make_state(5), url)
    assert ei.value.filename == url
    monkeypatch.undo()
    assert not fastckpt.is_committed(url)
    fastckpt.save(make_state(5), url, overwrite=True)
    assert cli_main(["load", url]) == 2
    assert "pass --to DIR" in capsys.readouterr().err


def test_an_oserror_starting_the_upload_is_raised_as_itself(bucket, monkeypatch):
    """An OSError from the commit strategy's start (a denied write) is raised as it is: it was passed
    through the client-error wrapper and raised `from` itself, a cause cycle in every traceback."""
    import fastckpt.storage.fsspec_store as fss
    name, _, _ = bucket
    url = f"s3://{name}/run/step-6"

    class Denied:
        def begin(self, *a, **kw):
            raise PermissionError(13, "Access Denied", url)

    monkeypatch.setattr(fss, "strategy", lambda commit: Denied())
    with pytest.raises(PermissionError, match="Access Denied") as ei:
        fastckpt.save(make_state(6), url)
    assert ei.value.__cause__ is not ei.value
    monkeypatch.undo()
    assert not fastckpt.is_committed(url)
