"""Readers accept format_version 2 (per-chunk checksums, see the DTensor save contract): plain load,
load(verify=True), fastckpt.verify and the ``fastckpt verify`` CLI; a flipped byte inside one chunk
is caught naming the key and the chunk's offsets. The v2 checkpoints here are plain full-tensor saves
whose manifest is rewritten with ``chunks`` (what the DTensor save writes: the same files)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash

import fastckpt
from fastckpt.cli.main import main as cli_main
from fastckpt.errors import ChecksumMismatchError, CorruptCheckpointError

# key -> chunks (offsets, shape): w split Shard(0) in 2, e split Shard(1) in 2 (uneven), s one chunk
CHUNKS = {"model/w": [([0, 0], [4, 6]), ([4, 0], [4, 6])],
          "model/e": [([0, 0, 0], [5, 2, 3]), ([0, 2, 0], [5, 1, 3])],
          "model/s": [([], [])]}


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(8, 6, generator=g), "e": torch.randn(5, 3, 3, generator=g),
                      "s": torch.tensor(2.5), "plain": torch.arange(4)}, "step": 4}


def _region(t: torch.Tensor, off, shape) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(off, shape))].contiguous()


def make_v2(path) -> str:
    """Save full tensors, then rewrite the manifest as format 2 with per-chunk xxh3 (the contract)."""
    st = _state()
    path = fastckpt.save(st, path)
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    for key, chunks in CHUNKS.items():
        full = st["model"][key.split("/")[1]]
        e = m["tensors"][key]
        del e["xxh3"]
        e["chunks"] = [{"offsets": o, "shape": s,
                        "xxh3": xxhash.xxh3_64(_region(full, o, s).view(torch.uint8).numpy().tobytes()
                                               if full.dim() else full.numpy().tobytes()).hexdigest()}
                       for o, s in chunks]
        e["placement"] = {"mesh_shape": [2], "placements": ["Shard(0)"]}
    m["format_version"] = 2
    with open(mpath, "w") as f:
        json.dump(m, f)
    return str(path)


def _flip(ck: str, key: str, index: tuple) -> None:
    """Flip one bit of element ``index`` of stored tensor ``key``."""
    e = fastckpt.read_manifest(ck).tensors[key]
    shape = e.shape
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    with open(os.path.join(ck, e.file), "r+b") as f:
        f.seek(e.offsets[0] + flat * 4 + 1)
        b = f.read(1)
        f.seek(e.offsets[0] + flat * 4 + 1)
        f.write(bytes([b[0] ^ 0x04]))


def test_v2_loads_verifies_and_cli_passes(tmp_path, capsys):
    ck = make_v2(tmp_path / "ck")
    assert fastckpt.read_manifest(ck).version == 2
    want = _state()
    for verify in (False, True):
        got = fastckpt.load(ck, verify=verify)
        assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]) and got["step"] == 4
    rep = fastckpt.verify(ck)
    assert rep.ok, rep.problems
    assert rep.bytes_checked >= sum(t.numel() * t.element_size() for t in want["model"].values())
    assert cli_main(["verify", ck]) == 0
    dst = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0}
    out = fastckpt.load_into(dst, ck, verify=True)
    assert all(torch.equal(dst["model"][k], want["model"][k]) for k in want["model"]) and out["step"] == 4


def test_flipped_byte_in_one_chunk_is_named(tmp_path, capsys):
    ck = make_v2(tmp_path / "ck")
    _flip(ck, "model/e", (3, 2, 1))  # inside the second chunk: offsets [0, 2, 0], not contiguous in the file
    rep = fastckpt.verify(ck)
    assert len(rep.problems) == 1, rep.problems
    assert "'model/e'" in rep.problems[0] and "offsets [0, 2, 0]" in rep.problems[0], rep.problems
    assert cli_main(["verify", ck]) == 1
    out = capsys.readouterr().out
    assert "model/e" in out and "[0, 2, 0]" in out
    fastckpt.load(ck, verify=False)  # without verify: no check (verify is the default since issue 20)
    with pytest.raises(ChecksumMismatchError, match=r"'model/e' chunk at offsets \[0, 2, 0\]"):
        fastckpt.load(ck, verify=True)
    dst = {"model": {k: torch.zeros_like(v) for k, v in _state()["model"].items()}, "step": 0}
    with pytest.raises(ChecksumMismatchError, match=r"offsets \[0, 2, 0\]"):
        fastckpt.load_into(dst, ck, verify=True)


def test_flip_in_first_chunk_of_dim0_split(tmp_path):
    ck = make_v2(tmp_path / "ck")
    _flip(ck, "model/w", (1, 1))
    rep = fastckpt.verify(ck)
    assert len(rep.problems) == 1 and "offsets [0, 0]" in rep.problems[0], rep.problems


def test_chunks_that_do_not_tile_are_a_corrupt_manifest(tmp_path):
    ck = make_v2(tmp_path / "ck")
    mpath = os.path.join(ck, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["tensors"]["model/w"]["chunks"][1]["offsets"] = [3, 0]  # overlaps chunk 0, leaves row 7 uncovered
    with open(mpath, "w") as f:
        json.dump(m, f)
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        fastckpt.load(ck, verify=True)
    rep = fastckpt.verify(ck)
    assert not rep.ok and "model/w" in rep.problems[0]


def test_newer_format_is_refused(tmp_path):
    ck = make_v2(tmp_path / "ck")
    mpath = os.path.join(ck, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["format_version"] = 3
    with open(mpath, "w") as f:
        json.dump(m, f)
    with pytest.raises(CorruptCheckpointError, match="format_version 3 is newer"):
        fastckpt.load(ck)


def test_file_checks_list_the_contiguous_chunks(tmp_path):
    """`fastckpt load --to` checks copied bytes against file_checks: a dim-0 chunk is one byte range."""
    from fastckpt.loading.source import file_checks
    ck = make_v2(tmp_path / "ck")
    name = fastckpt.read_manifest(ck).tensors["model/w"].file
    _, checks = file_checks(ck, name)
    w = [c for c in checks if "'model/w' chunk" in c.what]
    assert [c.what.split("offsets ")[1] for c in w] == ["[0, 0]", "[4, 0]"]
    raw = open(os.path.join(ck, name), "rb").read()
    assert all(xxhash.xxh3_64(raw[c.start:c.end]).hexdigest() == c.xxh3 for c in checks if "chunk" in c.what)
    assert not any("'model/e'" in c.what for c in checks)  # a dim-1 chunk is no single range
