"""`fastckpt load` never publishes bytes it has not checked, never writes over what it reads, and
names the user's paths: real bits flipped in real files of a real (tiny) PEFT checkpoint."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

import pytest
import torch
import xxhash

import fastckpt
from fastckpt.cli.main import main
from fastckpt.errors import ChecksumMismatchError
from fastckpt.format.manifest import RangeCheck
from fastckpt.loading.source import file_checks
from fastckpt.saving.export import copy_checked, read_checked, warm_files

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from integrations.hf.trainer import model_snapshot  # noqa: E402
from integrations.hf.models import tiny_llama  # noqa: E402

ADAPTER = "adapter_model.safetensors"
TOK_CFG = json.dumps({"model_max_length": 64, "tokenizer_class": "PreTrainedTokenizerFast"}).encode()


def _named(model):
    """``model`` with a config that names its architecture and dtype, as a model loaded with
    ``from_pretrained`` has (a config built in code has neither: the servability gate refuses
    such an export, tests/cli/test_servable_gate.py)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.architectures = [type(base).__name__]
    base.config.dtype = torch.float32
    return model


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["load", *map(str, argv), "-q"])
    cap = capsys.readouterr()
    lines = cap.out.strip().splitlines()  # the command is the last line (libraries may log to stdout)
    return rc, lines[-1] if lines else "", cap.err


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    """A run root holding one committed PEFT checkpoint (base shard, adapter, config, tokenizer config)."""
    root = tmp_path_factory.mktemp("honest") / "run"
    pm = peft.get_peft_model(_named(tiny_llama(3, dropout=0.0).eval()), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    state, weights, extra = model_snapshot(pm)
    extra["tokenizer_config.json"] = TOK_CFG
    fastckpt.save(state, root / "checkpoint-5", weights=weights, extra_files=extra)
    with torch.no_grad():
        run_root_logits.append(pm(input_ids=IDS).logits)
    return root


IDS = torch.tensor([[1, 5, 9, 33, 100, 7]])
run_root_logits: list[torch.Tensor] = []


def _copy(run_root, tmp_path):
    dst = tmp_path / "src" / "run"
    shutil.copytree(run_root, dst)
    return dst, dst / "checkpoint-5"


def _manifest(ckpt) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def _flip_bit(path, offset: int, bit: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _damage(ckpt, where: str) -> tuple[str, str | None]:
    """Flip one bit of ``where`` in ``ckpt``; returns (file name, manifest key of the tensor or None)."""
    man = _manifest(ckpt)
    if where in ("base", "adapter"):
        prefix = "model/" if where == "base" else "adapter/"
        key, e = [(k, e) for k, e in man["tensors"].items() if k.startswith(prefix) and "file" in e][-1]
        s, end = e["offsets"]
        _flip_bit(ckpt / e["file"], end - 1 if where == "adapter" else (s + end) // 2)  # adapter: its last byte
        return e["file"], key
    _flip_bit(ckpt / where, man["files"][where]["bytes"] // 2)
    return where, None


def _no_output(out) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("merge", [False, True], ids=["to", "to-merge-lora"])
@pytest.mark.parametrize("where", ["base", "adapter", "config.json", "adapter_config.json", "tokenizer_config.json"])
def test_one_flipped_bit_anywhere_refused_nothing_at_to(run_root, tmp_path, capsys, where, merge):
    root, ckpt = _copy(run_root, tmp_path)
    fname, key = _damage(ckpt, where)
    out = tmp_path / "out" / "serve"
    rc, cmd, err = _run(capsys, root, "--to", out, *(["--merge-lora"] if merge else []))
    assert rc != 0 and cmd == ""
    last = err.strip().splitlines()[-1]
    assert str(ckpt / fname) in last and "xxh3" in last, err
    if key is not None:
        assert repr(key) in last, err
    _no_output(out)


@pytest.mark.parametrize("merge", [False, True], ids=["to", "to-merge-lora"])
def test_corrupt_source_with_overwrite_keeps_the_previous_export(run_root, tmp_path, capsys, merge):
    root, ckpt = _copy(run_root, tmp_path)
    out = tmp_path / "out" / "serve"
    flags = ["--merge-lora"] if merge else []
    assert _run(capsys, root, "--to", out, *flags)[0] == 0
    before = _tree(out)
    _damage(ckpt, "base")
    rc, cmd, err = _run(capsys, root, "--to", out, "--overwrite", *flags)
    assert rc != 0 and cmd == "" and "xxh3" in err
    assert _tree(out) == before
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


def test_clean_exports_say_what_was_verified_and_copy_adapter_bit_exact(run_root, tmp_path, capsys):
    root, ckpt = _copy(run_root, tmp_path)
    n_tensors = sum("file" in e for k, e in _manifest(ckpt)["tensors"].items()
                    if k.split("/")[0] in ("model", "adapter"))
    rc, cmd, err = _run(capsys, root, "--to", tmp_path / "lora")
    assert rc == 0 and cmd.startswith(f"vllm serve {tmp_path / 'lora'} --enable-lora")
    assert f"verified while reading: {n_tensors} tensors" in err
    assert (tmp_path / "lora" / "adapter" / ADAPTER).read_bytes() == (ckpt / ADAPTER).read_bytes()
    assert (tmp_path / "lora" / "tokenizer_config.json").read_bytes() == TOK_CFG
    rc, cmd, err = _run(capsys, root, "--to", tmp_path / "merged", "--merge-lora")
    assert rc == 0 and cmd == f"vllm serve {tmp_path / 'merged'}"
    assert f"verified while reading: {n_tensors} tensors" in err
    assert not [p for p in (tmp_path / "merged").rglob("*") if p.name.startswith(".")]


def test_merge_reads_the_checked_bytes_same_logits_as_peft(run_root, tmp_path, capsys):
    root, ckpt = _copy(run_root, tmp_path)
    rc, _, _ = _run(capsys, root, "--to", tmp_path / "merged", "--merge-lora")
    assert rc == 0
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=IDS).logits, run_root_logits[0], rtol=1e-5, atol=1e-5)


def test_adapter_file_fully_covered_by_checksums(run_root):
    ckpt = run_root / "checkpoint-5"
    size, checks = file_checks(ckpt, ADAPTER)
    assert size == (ckpt / ADAPTER).stat().st_size
    covered = 0
    for c in sorted(checks, key=lambda c: c.start):
        assert c.start <= covered, f"bytes {covered}-{c.start} of {ADAPTER} have no checksum"
        covered = max(covered, c.end)
    assert covered == size
    assert file_checks(ckpt, "not-there.json") is None and file_checks(ckpt.parent, ADAPTER) is None


@pytest.mark.parametrize("where", ["base", "adapter", "config.json"])
def test_warm_checks_while_reading(run_root, tmp_path, capsys, where):
    root, ckpt = _copy(run_root, tmp_path)
    rc, cmd, err = _run(capsys, root, "--warm")
    assert rc == 0 and cmd.startswith(f"vllm serve {ckpt}")
    assert "warmed; verified while reading" in err
    fname, key = _damage(ckpt, where)
    rc, cmd, err = _run(capsys, root, "--warm")
    assert rc != 0 and cmd == ""
    assert str(ckpt / fname) in err and (key is None or repr(key) in err)


def test_warm_of_folder_without_checksums_says_not_verified(tmp_path, capsys):
    tiny_llama(4).save_pretrained(tmp_path / "hf")
    rc, cmd, err = _run(capsys, tmp_path / "hf")
    assert rc == 0 and cmd == f"vllm serve {tmp_path / 'hf'}"
    assert "NOT verified" in err and "no fastckpt manifest" in err


def _tree(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("given,to", [(g, t) for g in ("root", "ckpt")
                                      for t in ("root", "ckpt", "inside_root", "inside_ckpt", "above_root")
                                      if (g, t) != ("ckpt", "inside_root")])  # a sibling of a checkpoint is fine
def test_to_equal_inside_or_containing_the_source_refused_untouched(run_root, tmp_path, capsys, to, given):
    root, ckpt = _copy(run_root, tmp_path)
    target = {"root": root, "ckpt": ckpt, "inside_root": root / "served", "inside_ckpt": ckpt / "served",
              "above_root": root.parent}[to]
    before = _tree(root.parent)
    rc, cmd, err = _run(capsys, {"root": root, "ckpt": ckpt}[given], "--to", target, "--overwrite")
    assert rc == 2 and cmd == ""
    assert f"refusing --to {target}" in err.strip().splitlines()[-1], err
    assert _tree(root.parent) == before
    assert sorted(p.name for p in root.parent.iterdir()) == ["run"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-5"]


def test_to_through_a_symlink_into_the_source_refused(run_root, tmp_path, capsys):
    root, ckpt = _copy(run_root, tmp_path)
    (tmp_path / "link").symlink_to(ckpt)
    rc, _, err = _run(capsys, root, "--to", tmp_path / "link", "--overwrite")
    assert rc == 2 and "refusing --to" in err
    assert (ckpt / "manifest.json").is_file() and (tmp_path / "link").is_symlink()


def test_to_equal_to_base_model_folder_refused(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_llama(5).save_pretrained(base)
    pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base),
                             peft.LoraConfig(r=2, target_modules=["q_proj"]))
    pm.save_pretrained(tmp_path / "adapter")
    rc, _, err = _run(capsys, tmp_path / "adapter", "--base", base, "--to", base, "--overwrite")
    assert rc == 2 and f"refusing --to {base}" in err and "base model folder" in err
    assert (base / "config.json").is_file() and (base / "model.safetensors").is_file()


def test_no_config_json_fails_the_gate_and_leaves_nothing(tmp_path, capsys):
    """No config.json: not servable, so --to exits non-zero, prints no vllm line and leaves nothing
    (this exited 0 with a WARNING and left the folder behind before the servability gate)."""
    hf = tmp_path / "hf"
    tiny_llama(6).save_pretrained(hf)
    (hf / "config.json").unlink()
    out = tmp_path / "out"
    rc, cmd, err = _run(capsys, hf, "--to", out)
    assert rc != 0 and not out.exists() and not list(tmp_path.glob(".out*"))
    assert cmd == "" and "vllm serve" not in cmd
    assert f"{out}: no config.json" in err and "--config HF_DIR" in err
    rc, cmd, err = _run(capsys, hf, "--warm")  # warmed (exit 0), but no vllm line for it
    assert rc == 0 and cmd == "" and f"WARNING: warmed, but {hf}: no config.json" in err


def test_missing_config_json_taken_from_base(tmp_path, capsys):
    base = tmp_path / "base"
    m = tiny_llama(7)
    m.save_pretrained(base)
    state, weights, extra = model_snapshot(m)
    fastckpt.save(state, tmp_path / "ck", weights=weights)  # no config.json in the checkpoint
    rc, cmd, err = _run(capsys, tmp_path / "ck", "--to", tmp_path / "out", "--base", base)
    assert rc == 0 and cmd == f"vllm serve {tmp_path / 'out'}"
    assert (tmp_path / "out" / "config.json").read_bytes() == (base / "config.json").read_bytes()


def test_permission_error_names_the_users_path(tmp_path, capsys, monkeypatch, run_root):
    parent = tmp_path / "ro"
    parent.mkdir()
    out = parent / "serve"
    if os.geteuid() == 0:  # root ignores modes: the mkdir of the hidden folder fails as it would for a user
        real_mkdir = os.mkdir

        def mkdir(path, *a, **k):
            if os.path.dirname(os.fspath(path)) == str(parent):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real_mkdir(path, *a, **k)
        monkeypatch.setattr(os, "mkdir", mkdir)
    else:
        parent.chmod(0o555)
    try:
        rc, cmd, err = _run(capsys, run_root, "--to", out)
    finally:
        parent.chmod(0o755)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and cmd == ""
    assert "Permission denied" in last and f"'{out}'" in last and "fastckpt-tmp" not in last, last
    assert not out.exists()


# --- the checking copy and warm-up themselves ---------------------------------------------------

def _checks(data: bytes, ranges):
    return [RangeCheck(f"range {a}-{b}", "a", a, b, xxhash.xxh3_64(data[a:b]).hexdigest()) for a, b in ranges]


RANGES = [(0, 0), (0, 4096), (0, 10000), (100, 5000), (4096, 4096 + 3000), (9000, 10000), (10000, 10000)]


@pytest.mark.parametrize("chunk", [7, 512, 4096, 1 << 20])
def test_copy_checked_any_chunking(tmp_path, chunk):
    data = os.urandom(10000)
    (tmp_path / "a").write_bytes(data)
    assert copy_checked(str(tmp_path / "a"), str(tmp_path / "b"), 10000, _checks(data, RANGES),
                        chunk_bytes=chunk) == 10000
    assert (tmp_path / "b").read_bytes() == data
    for flip in (0, 4095, 4096, 7095, 9999):
        bad = bytearray(data)
        bad[flip] ^= 0x40
        (tmp_path / "c").write_bytes(bytes(bad))
        (tmp_path / "d").unlink(missing_ok=True)
        with pytest.raises(ChecksumMismatchError, match="range"):
            copy_checked(str(tmp_path / "c"), str(tmp_path / "d"), 10000, _checks(data, RANGES), chunk_bytes=chunk)
        with pytest.raises(ChecksumMismatchError):
            read_checked(str(tmp_path / "c"), 10000, _checks(data, RANGES))
        with pytest.raises(ChecksumMismatchError):
            warm_files([str(tmp_path / "c")], checks={str(tmp_path / "c"): _checks(data, RANGES)},
                       chunk_bytes=chunk, range_bytes=3000)
    warm = warm_files([str(tmp_path / "a")], checks={str(tmp_path / "a"): _checks(data, [(4096, 7096)])},
                      chunk_bytes=chunk, range_bytes=3000)
    assert warm == 10000  # every byte read once: the checked range plus the bytes around it
