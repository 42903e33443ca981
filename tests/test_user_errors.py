"""Errors a user can reach are typed (``fastckpt.errors``, each also the matching built-in) and name
what the user asked for: the key, the folder, the path, the rank and store, never a hidden temporary
folder or a raw ``TypeError``/``OSError``/``DistNetworkError`` from inside (issue 21, part 7).

Each test reproduces one case a user meets as a user would (a public call, a subprocess for the
multi-process and read-only-mount cases) and checks the type, what the message names, and that
nothing was left behind.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import (CheckpointNotFoundError, FastCkptError, FolderNotWritableError, HeaderError,
                             InvalidArgumentError, NotAFolderError, NotSafetensorsError)


def state() -> dict:
    return {"model": {"w": torch.arange(6, dtype=torch.float32)}, "step": 3}


def leftovers(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


# --- extra_files given a str -------------------------------------------------------------------

@pytest.mark.parametrize("extra, named", [({"notes.txt": "hello"}, "'notes.txt'"), (["notes.txt"], "list"),
                                          ({"a.json": {"x": 1}}, "'a.json'")])
def test_extra_files_of_the_wrong_type_is_refused_at_the_call_naming_the_key(tmp_path, extra, named):
    """Today ``{"notes.txt": "hello"}`` fails in the writer thread with ``TypeError: memoryview: a
    bytes-like object is required``; a list fails with ``dictionary update sequence element``."""
    path = tmp_path / "ck"
    with pytest.raises(InvalidArgumentError) as ei:
        fastckpt.async_save(state(), path, extra_files=extra)  # raised at the call, not by the future
    msg = str(ei.value)
    assert "extra_files" in msg and named in msg and "bytes" in msg, msg
    assert "memoryview" not in msg and "sequence element" not in msg
    assert isinstance(ei.value, TypeError)
    assert leftovers(tmp_path) == []  # no folder, no temporary
    fastckpt.save(state(), path, extra_files={"notes.txt": b"hello", "b.txt": bytearray(b"x")})
    assert (path / "notes.txt").read_bytes() == b"hello" and (path / "b.txt").read_bytes() == b"x"


@pytest.mark.parametrize("name, weights", [
    ("state-00001-of-00001.safetensors", None), ("model.safetensors", None), ("model.safetensors.index.json", None),
    ("model-00001-of-00002.safetensors", None), ("state-rank00000.json", None),
    ("adapter_model.safetensors", {"model": "adapter_model.safetensors"}),
    ("base-00002-of-00003.safetensors", {"model": "base"})])
def test_extra_files_named_as_a_file_the_save_writes_are_refused_at_the_call(tmp_path, name, weights):
    """A README-only trial: ``extra_files={"state-00001-of-00001.safetensors": b"x"}`` committed a
    checkpoint that fastckpt.load refused (HeaderError) and verify failed; ``"model.safetensors"``
    raised a raw FileExistsError naming the hidden temporary folder. Both sync and async, at the call."""
    path = tmp_path / "ck"
    for save in (fastckpt.save, fastckpt.async_save):
        with pytest.raises(InvalidArgumentError, match=f"extra file name {name!r} is a file this save writes"):
            save(state(), path, extra_files={name: b"x"}, weights=weights)
        assert leftovers(tmp_path) == []
    fastckpt.save(state(), path, extra_files={"model-notes.json": b"{}"}, weights=weights)
    assert fastckpt.verify(path).ok


def test_save_and_load_with_a_path_of_the_wrong_type_name_the_argument(tmp_path):
    for bad in (None, 123):
        with pytest.raises(InvalidArgumentError, match=rf"path must be a str or os.PathLike.*{type(bad).__name__}"):
            fastckpt.save(state(), bad)
        with pytest.raises(InvalidArgumentError, match=r"path must be a str or os.PathLike"):
            fastckpt.load(bad)
        with pytest.raises(InvalidArgumentError, match=r"path must be a str or os.PathLike"):
            fastckpt.load_into(state(), bad)
    p = fastckpt.save(state(), os.fsencode(tmp_path / "b"))  # bytes: decoded, as os.fspath accepts them
    assert p == tmp_path / "b" and fastckpt.load(os.fsencode(p))["step"] == 3


def test_bad_step_is_refused_at_the_call(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"step must be an int.*'x'"):
        fastckpt.save(state(), tmp_path / "ck", step="x")
    assert leftovers(tmp_path) == []


# --- saving under a read-only folder ------------------------------------------------------------

@pytest.fixture(params=["ro-mount", "immutable"])
def read_only_folder(request, tmp_path):
    """A folder no save can write into, even as root: a read-only tmpfs (``EROFS``) or a folder
    with the immutable attribute (``EPERM``). Skipped where neither can be made."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if request.param == "ro-mount":
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.decode().strip()}")
        undo = ["umount", str(folder)]
    else:
        r = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot set the immutable attribute here: {r.stderr.decode().strip()}")
        undo = ["chattr", "-i", str(folder)]
    try:
        probe = folder / "probe"
        try:
            probe.mkdir()
        except OSError:
            pass
        else:
            pytest.skip("the folder is still writable (permissions not enforced here)")
        yield folder
    finally:
        subprocess.run(undo, check=True)


def test_save_under_a_read_only_folder_names_the_folder_asked_for(read_only_folder):
    """Today: a plain ``OSError``/``PermissionError`` naming ``.ck.fastckpt-tmp-<pid>@...``."""
    for path in (read_only_folder / "ck", read_only_folder / "sub" / "ck"):
        with pytest.raises(FolderNotWritableError) as ei:
            fastckpt.save(state(), path)
        e, msg = ei.value, str(ei.value)
        assert isinstance(e, PermissionError) and e.errno is not None
        assert str(path) in msg and str(read_only_folder) in msg and "fastckpt-tmp" not in msg, msg
        assert e.path == str(path)
    with pytest.raises(FolderNotWritableError, match=str(read_only_folder)):
        fastckpt.CheckpointManager(read_only_folder).save(1, state())
    assert leftovers(read_only_folder) == []


def test_prune_of_a_read_only_run_root_is_a_typed_error_naming_it(tmp_path):
    """fastckpt prune of a run root it cannot write failed with a raw '[Errno 30] ... .fastckpt.storage.lock'
    (a README-only trial); it names the root, says nothing was pruned, and deletes nothing."""
    root = tmp_path / "run"
    mgr = fastckpt.CheckpointManager(root)
    for step in (1, 2):
        mgr.save(step, state())
    lock = root / ".fastckpt.storage.lock"
    if lock.exists():
        lock.unlink()  # a fresh tier copy: prune must create the lock file, which the read-only root refuses
    r = subprocess.run(["chattr", "+i", str(root)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot set the immutable attribute here: {r.stderr.decode().strip()}")
    try:
        p = subprocess.run([sys.executable, "-m", "fastckpt", "prune", str(root), "--keep", "1"], capture_output=True,
                           text=True, timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert f"{root}: not writable" in p.stderr and "nothing was pruned" in p.stderr, p.stderr
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-1", "step-2"]


def test_save_where_a_parent_is_a_file_names_the_file(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotAFolderError) as ei:
        fastckpt.save(state(), tmp_path / "file.txt" / "ck")
    assert isinstance(ei.value, NotADirectoryError)
    assert str(tmp_path / "file.txt" / "ck") in str(ei.value) and "is a file" in str(ei.value)
    assert ei.value.file == str(tmp_path / "file.txt")


# --- fastckpt.dcp.load of a missing path ----------------------------------------------------------

def test_dcp_load_of_a_missing_path_is_not_found_naming_the_path(tmp_path):
    """Today: ``DCPLoadError("... AssertionError: metadata is None; global metadata read failed: ...")``."""
    pytest.importorskip("torch.distributed.checkpoint")
    import fastckpt.dcp
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError) as ei:
        fastckpt.dcp.load({"model": {"w": torch.zeros(6)}}, missing)
    msg = str(ei.value)
    assert str(missing) in msg and "AssertionError" not in msg and "metadata is None" not in msg, msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=str(empty)):
        fastckpt.dcp.load({"model": {"w": torch.zeros(6)}}, empty)


def test_model_safetensors_of_sharded_weights_names_the_index_and_the_folder(tmp_path):
    """``model.safetensors`` asked for where the weights are sharded (a multi-rank save cuts them):
    the error says so and names what to load instead."""
    p = fastckpt.save({"model": {f"w{i}": torch.zeros(4) for i in range(2)}}, tmp_path / "ck", max_shard_bytes=16)
    assert (p / "model.safetensors.index.json").exists()
    with pytest.raises(CheckpointNotFoundError) as ei:
        fastckpt.load(p / "model.safetensors")
    msg = str(ei.value)
    assert "model.safetensors.index.json" in msg and "sharded" in msg and f"load the folder {p}" in msg, msg
    assert set(fastckpt.load(p)["model"]) == {"w0", "w1"}


# --- a torch.save file where a safetensors file is expected --------------------------------------

class _Tripwire:
    """Unpickling this creates a file: proof that a reader unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("kind", ["zip", "legacy", "pickle"])
def test_torch_save_file_is_named_as_such_and_never_unpickled(tmp_path, kind, capsys):
    """Today: ``header length field says 578712552184433488 bytes`` (zip) or 5088219219985302144 (legacy)."""
    marker = tmp_path / "unpickled"
    obj = {"w": torch.ones(3), "trap": _Tripwire(str(marker))}
    f = tmp_path / "model.pt"
    if kind == "zip":
        torch.save(obj, f)
    elif kind == "legacy":
        torch.save(obj, f, _use_new_zipfile_serialization=False)
    else:
        f.write_bytes(pickle.dumps(obj, protocol=4))
    for call in (lambda: fastckpt.load(f), lambda: fastckpt.load_into({"w": torch.zeros(3)}, f),
                 lambda: fastckpt.verify(f)):  # verify too: the file asked for is not one it checks
        with pytest.raises(NotSafetensorsError) as ei:
            call()
        msg = str(ei.value)
        assert str(f) in msg and "torch.save" in msg and "not a safetensors file" in msg, msg
        assert "weights_only=True" in msg and "fastckpt.save" in msg  # how to convert
        assert "header length field" not in msg
    from fastckpt.cli.main import main as cli_main
    assert cli_main(["verify", str(f)]) == 2  # an input error (exit 2), not a checksum MISMATCH (exit 1)
    assert cli_main(["ls", str(f)]) == 2
    io = capsys.readouterr()
    assert "MISMATCH" not in io.out + io.err and "fastckpt verify: error:" in io.err and "torch.save" in io.err
    assert "verify" not in io.err.split("fastckpt ls: error:")[1]  # ls does not send a .pt file to verify
    assert not marker.exists()
    e = pytest.raises(NotSafetensorsError, fastckpt.load, f).value
    assert isinstance(e, HeaderError) and isinstance(e, ValueError) and e.path == str(f)


def test_hf_folder_of_pytorch_model_bin_says_why_not(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError) as ei:
        fastckpt.load(folder)
    msg = str(ei.value)
    assert str(folder) in msg and "pytorch_model.bin" in msg and "torch.save" in msg and "weights_only=True" in msg
    r = subprocess.run([sys.executable, "-m", "fastckpt", "verify", str(folder)], capture_output=True, text=True,
                       timeout=120)  # verify named no pickle (a README-only trial)
    assert r.returncode == 2 and "pytorch_model.bin" in r.stderr and "never unpickles" in r.stderr, r.stderr


def test_folder_of_checkpoints_named_as_lightning_names_them_says_pass_one(tmp_path):
    """Lightning's ModelCheckpoint names its checkpoints ``epoch=E-step=S.ckpt`` / ``last.ckpt``; with
    fastckpt's checkpoint IO each is a fastckpt folder. Given their parent, load/ls/verify name them
    (load called them torch.save pickle files; ls said only 'no step-N folders')."""
    parent = tmp_path / "checkpoints"
    for n in ("epoch=0-step=4.ckpt", "last.ckpt"):
        fastckpt.save(state(), parent / n)
    with pytest.raises(CheckpointNotFoundError) as ei:
        fastckpt.load(parent)
    msg = str(ei.value)
    assert "fastckpt checkpoints epoch=0-step=4.ckpt, last.ckpt" in msg and str(parent / "last.ckpt") in msg, msg
    assert "pickle" not in msg, msg
    for cmd in ("ls", "verify"):
        r = subprocess.run([sys.executable, "-m", "fastckpt", cmd, str(parent)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "fastckpt checkpoints named otherwise (epoch=0-step=4.ckpt, last.ckpt)" in r.stderr, (cmd, r.stderr)


def test_json_file_given_as_a_checkpoint_says_pass_the_folder(tmp_path):
    p = fastckpt.save(state(), tmp_path / "ck")
    with pytest.raises(NotSafetensorsError) as ei:
        fastckpt.load(p / "manifest.json")
    assert "JSON" in str(ei.value) and str(p) in str(ei.value) and "header length field" not in str(ei.value)


# --- a dead torchrun agent (the TCPStore is gone) -------------------------------------------------

DEAD_STORE = textwrap.dedent(r"""
    import json, socket, subprocess, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    # the torchrun agent: hosts the TCPStore, then dies
    agent = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                              f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False); "
                              "print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    agent.stdout.readline()
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    agent.kill(); agent.wait()
    import fastckpt
    out = {}
    for mode in ("group", "plain"):
        t0 = time.monotonic()
        try:
            kw = {"process_group": dist.group.WORLD} if mode == "group" else {}
            fastckpt.save({"w": torch.ones(4)}, sys.argv[1] + "/" + mode, **kw)
            out[mode] = {"type": None}
        except BaseException as e:
            out[mode] = {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": str(e),
                         "rank": getattr(e, "rank", None), "address": getattr(e, "address", None),
                         "s": time.monotonic() - t0}
    out["port"] = port
    print("RESULT " + json.dumps(out))
""")


def test_dead_store_names_rank_address_operation_and_what_to_check(tmp_path):
    """Today: a raw ``DistNetworkError: Broken pipe`` / ``Failed to recv, got 0 bytes`` from coordination.py."""
    pytest.importorskip("torch.distributed")
    r = subprocess.run([sys.executable, "-c", DEAD_STORE, str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, (r.stdout, r.stderr[-3000:])
    out = json.loads(line[0][7:])
    for mode in ("group", "plain"):
        got = out[mode]
        assert got["type"] == "StoreUnreachableError", got
        assert "RuntimeError" in got["mro"] and "FastCkptError" in got["mro"]
        msg = got["msg"]
        assert "rank 0" in msg and f"127.0.0.1:{out['port']}" in msg, msg
        assert got["rank"] == 0 and got["address"] == f"127.0.0.1:{out['port']}"
        assert "torchrun" in msg and "MASTER_ADDR" in msg, msg  # what to check
        assert got["s"] < 60, got  # at once, not after the wait's deadline
    assert "multi-rank save" in out["group"]["msg"], out["group"]["msg"]
    assert "plain save" in out["plain"]["msg"] and str(tmp_path / "plain") in out["plain"]["msg"], out["plain"]["msg"]
    assert [n for n in os.listdir(tmp_path)] == []  # nothing committed, no temporaries


# --- python -m fastckpt --------------------------------------------------------------------------

def test_python_dash_m_fastckpt_is_the_cli(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fastckpt", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"fastckpt {fastckpt.__version__}", (p.stdout, p.stderr)
    p = subprocess.run([sys.executable, "-m", "fastckpt", "verify", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and str(tmp_path / "missing") in p.stderr
    assert issubclass(NotSafetensorsError, FastCkptError)


# --- fastckpt verify shows progress like fastckpt load --to ----------------------------------------

def test_verify_reports_progress_and_the_cli_draws_it_on_stderr(tmp_path):
    p = fastckpt.save({"model": {"w": torch.randn(1_000_000)}, "opt": {"m": torch.randn(500_000)}}, tmp_path / "ck")
    calls = []
    rep = fastckpt.verify(p, progress=lambda done, total: calls.append((done, total)))
    assert rep.ok and calls[0][0] == 0 and calls[-1] == (rep.bytes_checked, rep.bytes_checked)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len({t for _, t in calls}) == 1
    assert rep.bytes_checked >= 6_000_000
    cmd = [sys.executable, "-m", "fastckpt", "verify", str(p)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines() == [f"{p}: OK, {rep.bytes_checked / 1e6:.1f} MB checked"], r
    total = f"{rep.bytes_checked / 1e6:.2f}M/{rep.bytes_checked / 1e6:.2f}M"  # tqdm, decimal units (1000)
    assert "verify" in r.stderr and "100%" in r.stderr and total in r.stderr and "B/s" in r.stderr, r.stderr
    r = subprocess.run(cmd + ["-q"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "" and "OK" in r.stdout
    r = subprocess.run(cmd + ["--threads", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--threads" in r.stderr and "Traceback" not in r.stderr


# --- more arguments a user can get wrong: typed, named, at the call --------------------------------

def test_bad_arguments_of_load_save_and_the_manager_are_named(tmp_path):
    """Today: ``TypeError: 'int' object is not iterable`` (keys=3), ``ValueError: max_workers must be greater
    than 0`` (threads=-1), local_keys='model' saved as the keys 'm', 'o', 'd', 'e', 'l', on_commit=3 a
    ``TypeError`` after the commit, manager.load('1') "step 1 is not committed (have [1])"."""
    p = fastckpt.save(state(), tmp_path / "ck")
    cases = [
        (lambda: fastckpt.load(p, keys=3), r"keys must be a key path"),
        (lambda: fastckpt.load(p, threads=-1), r"threads must be a positive int.*-1"),
        (lambda: fastckpt.verify(p, threads=-1), r"threads must be a positive int.*-1"),
        (lambda: fastckpt.load_into(state(), p, threads=-1), r"threads must be a positive int.*-1"),
        (lambda: fastckpt.load_into(state(), p, strict="yes"), r"strict must be None, True or False"),
        (lambda: fastckpt.save(state(), tmp_path / "a", local_keys="model"), r"local_keys=\['model'\]"),
        (lambda: fastckpt.save(state(), tmp_path / "b", on_commit=3), r"on_commit must be a callable"),
        (lambda: fastckpt.load(p, verify="no"), r"verify must be True or False, got str 'no'"),
        (lambda: fastckpt.load_into(state(), p, verify="no"), r"verify must be True or False, got str 'no'"),
        (lambda: fastckpt.load(p, io_backend="bogus"), r"unknown I/O backend 'bogus'; known: \['posix'"),
        (lambda: fastckpt.load_into(state(), p, io_backend="bogus"), r"unknown I/O backend 'bogus'"),
        (lambda: fastckpt.save(state(), tmp_path / "c", io_backend="bogus"), r"unknown I/O backend 'bogus'"),
    ]
    for call, pattern in cases:
        with pytest.raises(InvalidArgumentError, match=pattern):
            call()
    assert fastckpt.load(p, keys={"model": 1}.keys())["model"]["w"].shape == (6,)  # any iterable of str
    mgr = fastckpt.CheckpointManager(tmp_path / "run")
    mgr.save(1, state())
    with pytest.raises(InvalidArgumentError, match=r"step must be an int .*got str '1'"):
        mgr.load("1")
    with pytest.raises(InvalidArgumentError, match="root must be a str or os.PathLike"):
        fastckpt.CheckpointManager(None)
    assert sorted(os.listdir(tmp_path)) == ["ck", "run"]  # nothing of the refused saves


DEAD_STORE_MID_SAVE = textwrap.dedent(r"""
import json, socket, subprocess, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
out_dir = sys.argv[1]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
agent = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                          f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False); "
                          "print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
agent.stdout.readline()
peer = subprocess.Popen([sys.executable, "-c", "import time, datetime, torch.distributed as d; "
                         f"s = d.TCPStore('127.0.0.1', {port}, 2, False, timeout=datetime.timedelta(seconds=20)); "
                         "d.init_process_group('gloo', store=s, rank=1, world_size=2); time.sleep(600)"])
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=20))
dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=60))
import fastckpt
watch = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=20))
base = watch.num_keys()

def kill_when_waiting():  # the agent dies once rank 0 has published its plan and waits for rank 1's
    while watch.num_keys() < base + 2:
        time.sleep(0.05)
    time.sleep(1.0)
    agent.kill()

threading.Thread(target=kill_when_waiting, daemon=True).start()
t0 = time.monotonic()
try:
    fastckpt.save({"w": torch.ones(4)}, out_dir + "/ck", process_group=dist.group.WORLD, timeout_s=40)
    out = {"type": None}
except BaseException as e:
    out = {"type": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}
peer.kill()
print("RESULT " + json.dumps(out), flush=True)
import os; os._exit(0)
""")


def test_store_dying_while_a_rank_waits_fails_at_once_not_at_the_timeout(tmp_path):
    """Two ranks; rank 1 never saves, rank 0 publishes its plan and waits; then the agent hosting the
    store dies. Today: the wait swallows the connection errors until ``timeout_s`` (40 s here), then a
    raw ``DistNetworkError: Broken pipe`` (47 s measured); now a StoreUnreachableError at once."""
    pytest.importorskip("torch.distributed")
    r = subprocess.run([sys.executable, "-c", DEAD_STORE_MID_SAVE, str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, (r.stdout, r.stderr[-3000:])
    out = json.loads(line[0][7:])
    assert out["type"] == "StoreUnreachableError", out
    assert "rank 0" in out["msg"] and "multi-rank save" in out["msg"] and "127.0.0.1:" in out["msg"], out
    assert out["s"] < 30, out  # timeout_s=40: it did not wait the deadline out
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_only_a_checkpoint_or_an_empty_folder(tmp_path):
    """``overwrite=True`` never deletes other files: a plain file or a folder of someone else's files
    is refused, typed, naming the path and what to do (a fresh-user trial lost ``notes.txt``)."""
    import torch

    import fastckpt
    from fastckpt.errors import CheckpointExistsError
    st = {"w": torch.arange(4.0)}
    (tmp_path / "plain.bin").write_bytes(b"keep me")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for name in ("plain.bin", "mine"):
        for save in (fastckpt.save, lambda s, p, **kw: fastckpt.async_save(s, p, **kw).result()):
            for overwrite in (True, False):  # without it too: no advice to pass overwrite=True, which would fail
                with pytest.raises(CheckpointExistsError, match="not a fastckpt checkpoint.*another path") as ei:
                    save(st, tmp_path / name, overwrite=overwrite)
                assert "pass overwrite=True" not in str(ei.value)
    assert (tmp_path / "plain.bin").read_bytes() == b"keep me"
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "plain.bin"]  # no hidden leftovers
    (tmp_path / "empty").mkdir()
    fastckpt.save(st, tmp_path / "empty", overwrite=True)
    fastckpt.save({"w": torch.arange(5.0)}, tmp_path / "empty", overwrite=True)  # a checkpoint: replaced
    assert torch.equal(fastckpt.load(tmp_path / "empty")["w"], torch.arange(5.0))
    crashed = tmp_path / "crashed"  # an uncommitted commit="marker" save: state.json, files, no manifest
    crashed.mkdir()
    (crashed / "state.json").write_text("{}")
    (crashed / "model.safetensors").write_bytes(b"\0" * 64)
    fastckpt.save(st, crashed, overwrite=True, commit="marker")  # replaced, as MarkerCommit documents
    assert torch.equal(fastckpt.load(crashed)["w"], st["w"])


def test_reserve_checks_its_size_at_the_call():
    import fastckpt
    from fastckpt.errors import InvalidArgumentError
    for bad in (-5, "16MiB", 1.5, True):
        with pytest.raises(InvalidArgumentError, match="nbytes must be an int >= 0"):
            fastckpt.reserve(bad)


def test_native_dcp_folder_is_named_as_such_by_every_reader(tmp_path, capsys):
    """A folder ``torch.distributed.checkpoint.save`` wrote (``.metadata`` + ``*.distcp``, pickles)
    is refused the same way by the API and the CLI: ``NativeCheckpointError`` naming ``.metadata``
    and how to convert (the API used to say "nothing to load"); nothing is unpickled."""
    import torch.distributed.checkpoint as dcp

    import fastckpt.dcp
    from fastckpt.cli.main import main as cli_main
    from fastckpt.dcp import FastCkptReader
    from fastckpt.errors import NativeCheckpointError
    folder = tmp_path / "native"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(folder))
    assert (folder / ".metadata").is_file()
    for call in (lambda: fastckpt.load(folder), lambda: fastckpt.load_into({"w": torch.zeros(3)}, folder),
                 lambda: fastckpt.dcp.load({"w": torch.zeros(3)}, folder)):
        with pytest.raises(NativeCheckpointError) as ei:
            call()
        text = str(ei.value)
        assert ei.value.pickle_file == str(folder / ".metadata") and "nothing to load" not in text, text
    with pytest.raises(BaseException, match="a native torch.distributed.checkpoint folder"):  # DCP's own wrapper
        dcp.load({"w": torch.zeros(3)}, storage_reader=FastCkptReader(folder))
    assert cli_main(["load", str(folder), "--to", str(tmp_path / "out")]) == 2
    assert "a native torch.distributed.checkpoint folder" in capsys.readouterr().err


def test_saving_under_proc_says_pseudo_file_system_not_full_disk():
    """/proc has 0 bytes free: the save said 'InsufficientSpaceError: 0 bytes free' (a README-only trial)."""
    import fastckpt
    import torch
    with pytest.raises(fastckpt.errors.FolderNotWritableError, match="without storage"):
        fastckpt.save({"a": torch.ones(3)}, "/proc/fastckpt-test-ckpt")


def test_load_into_given_a_path_as_the_state_says_what_a_state_is(tmp_path):
    """``fastckpt.load_into("m1", "m1")`` (a README-only trial) said "missing from the checkpoint: ''"
    and suggested strict=False; it names the argument and points at fastckpt.load."""
    path = fastckpt.save(state(), tmp_path / "ck")
    for bad in (str(path), path, torch.zeros(6), None):
        with pytest.raises(InvalidArgumentError, match=r"state must be what to fill in place.*fastckpt.load\(path\)"):
            fastckpt.load_into(bad, path)
    filled = fastckpt.load_into({"model": {"w": torch.zeros(6)}}, path)
    assert torch.equal(filled["model"]["w"], torch.arange(6, dtype=torch.float32))


def test_an_extra_safetensors_file_must_be_one(tmp_path):
    """``extra_files={"adapter_model.safetensors": b""}`` (a name the save does not write itself)
    committed a checkpoint every load and verify then refused (HeaderError; a second README-only
    trial): refused at the call; real safetensors bytes are kept as they are."""
    from safetensors.torch import save as st_save
    for bad in (b"", b"junk", (100).to_bytes(8, "little") + b"{}"):
        with pytest.raises(InvalidArgumentError, match="'adapter_model.safetensors'.*not a safetensors file"):
            fastckpt.save(state(), tmp_path / "ck", extra_files={"adapter_model.safetensors": bad})
        assert leftovers(tmp_path) == []
    good = st_save({"lora_A.weight": torch.ones(2, 2)})
    fastckpt.save(state(), tmp_path / "ck", extra_files={"adapter_model.safetensors": good})
    assert (tmp_path / "ck" / "adapter_model.safetensors").read_bytes() == good and fastckpt.verify(tmp_path / "ck").ok


def test_ls_hint_names_the_newest_checkpoint_not_the_last_in_sort_order(tmp_path):
    """`fastckpt ls` of a folder of checkpoints named otherwise said "e.g. ... epoch=9-step=90.ckpt" after
    epoch=10-step=100.ckpt was saved (the last name in sort order; a README-only trial)."""
    parent = tmp_path / "checkpoints"
    for n in ("epoch=9-step=90.ckpt", "epoch=10-step=100.ckpt"):
        fastckpt.save(state(), parent / n)
    r = subprocess.run([sys.executable, "-m", "fastckpt", "ls", str(parent)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and f"e.g. the newest, `fastckpt verify {parent / 'epoch=10-step=100.ckpt'}`" in r.stderr, \
        r.stderr


def test_ls_with_a_prefix_that_matches_nothing_names_the_runs_there(tmp_path, capsys):
    """`ls ROOT --prefix wrong-` on a root of step-N folders suggested `fastckpt verify ROOT/step-2`
    (a README-only trial); it names the run there and the prefix to pass."""
    from fastckpt.cli.main import main as cli_main
    mgr = fastckpt.CheckpointManager(tmp_path)
    mgr.save(1, state())
    mgr.save(2, state())
    assert cli_main(["ls", str(tmp_path), "--prefix", "wrong-"]) == 2
    err = capsys.readouterr().err
    assert f"it holds {tmp_path}/step-N: drop --prefix wrong- or pass --prefix step-" in err, err
