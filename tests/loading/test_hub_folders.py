"""Model folders as they exist in the wild: a huggingface_hub cache snapshot (every file a relative
symlink into ``../../blobs/``), other layouts beside the index, indexes naming missing shards.

The cache is built exactly as huggingface_hub lays it out (``blobs/<sha>``: sha256 for LFS files,
the git blob sha1 for small ones; ``snapshots/<rev>/`` of relative symlinks; ``refs/main``), and
``huggingface_hub.scan_cache_dir`` is asked to confirm it; no network. Every load path is compared
with safetensors' own ``load_file``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save as st_save

import fastckpt
from fastckpt.cli import main as cli_main
from fastckpt.errors import ChecksumMismatchError, HeaderError, UnsafePathError
from fastckpt.loading.device import load_weights
from integrations import vllm as plugin

REV = "0123456789abcdef0123456789abcdef01234567"
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_file(repo: Path, name: str, data: bytes, *, lfs: bool) -> Path:
    """Store ``data`` as huggingface_hub does: ``blobs/<sha>`` plus the relative symlink
    ``snapshots/<REV>/<name> -> ../../blobs/<sha>`` (one ``../`` more per sub-folder)."""
    blob = repo / "blobs" / (hashlib.sha256(data).hexdigest() if lfs else _git_sha1(data))
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = repo / "snapshots" / REV / name
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(blob, link.parent), link)
    return blob


def hub_repo(cache: Path, files: dict[str, bytes]) -> Path:
    """A ``models--org--tiny`` repo in ``cache`` holding ``files``; returns its snapshot folder."""
    repo = cache / "models--org--tiny"
    for name, data in files.items():
        add_file(repo, name, data, lfs=name.endswith(".safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)  # huggingface_hub writes the bare hash, no newline
    return repo / "snapshots" / REV


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g),
            "c": torch.randn(16, 8, generator=g).bfloat16()}


@pytest.fixture()
def hub(tmp_path):
    """A hub snapshot with an index over two shards, plus what real repos carry beside it:
    ``consolidated.safetensors`` (another layout, other names), ``original/`` and a leftover."""
    sd = _weights()
    parts = [{"a": sd["a"]}, {"b": sd["b"], "c": sd["c"]}]
    wm = {k: SHARDS[i] for i, p in enumerate(parts) for k in p}
    snap = hub_repo(tmp_path / "cache", {
        SHARDS[0]: st_save(parts[0], {"format": "pt"}),
        SHARDS[1]: st_save(parts[1], {"format": "pt"}),
        INDEX: json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}).encode(),
        "config.json": json.dumps({"architectures": ["TinyForCausalLM"], "model_type": "llama",
                                    "dtype": "float32"}).encode(),  # a dtype: the servability gate asks for one
        "tokenizer.json": b'{"version": "1.0"}',
        "consolidated.safetensors": st_save({"tok_embeddings.weight": torch.ones(4)}),
        "original/model.safetensors": st_save({"layers.0.attention.wq.weight": torch.ones(4)}),
        "model-00003-of-00003.safetensors": st_save({"a": torch.zeros(64, 32)}),  # leftover, same name as a weight
    })
    return snap, sd


def reference(snap: Path) -> dict[str, torch.Tensor]:
    """What safetensors' own ``load_file`` reads from the files the index names."""
    wm = json.loads((snap / INDEX).read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(wm.values())):
        out.update(load_file(snap / shard))
    return out


def _same(got: dict, ref: dict) -> None:
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k].cpu(), ref[k]), k


def _vllm(path, **extra) -> tuple[SimpleNamespace, SimpleNamespace]:
    return (SimpleNamespace(model=str(path), revision=None, quantization=None),
            SimpleNamespace(model_loader_extra_config=extra, download_dir=None))


def _vllm_weights(snap: Path) -> dict[str, torch.Tensor]:
    loader = plugin.FastCkptModelLoader(_vllm(snap, batch_bytes=4096, threads=2)[1])
    got = list(loader.get_weights_iterator(str(snap)))
    assert len(got) == len({n for n, _ in got})
    return dict(got)


def test_fixture_is_a_valid_hub_cache(hub):
    snap, _ = hub
    huggingface_hub = pytest.importorskip("huggingface_hub")
    info = huggingface_hub.scan_cache_dir(snap.parents[2])
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == "org/tiny" and {r.commit_hash for r in repo.revisions} == {REV}
    assert all(os.path.islink(snap / n) and not os.path.isabs(os.readlink(snap / n)) for n in SHARDS)


def test_hub_snapshot_loads_through_every_path(hub, tmp_path):
    snap, sd = hub
    ref = reference(snap)
    _same(ref, sd)
    _same(fastckpt.load(snap), ref)
    _same(fastckpt.load(snap, keys=["a", "c"]), {k: ref[k] for k in "ac"})
    _same(fastckpt.load(snap / SHARDS[1]), load_file(snap / SHARDS[1]))  # one symlinked file
    _same(load_weights(snap, "cpu"), ref)
    _same(load_weights(snap, "cpu", ring_bytes=8192, slot_bytes=4096), ref)
    _same(_vllm_weights(snap), ref)
    rep = fastckpt.verify(snap)
    assert rep.ok and rep.problems == [], rep.problems
    assert cli_main(["verify", str(snap)]) == 0


def test_vllm_resolves_a_hub_id_to_the_snapshot_offline(hub, monkeypatch):
    """`vllm serve org/tiny --load-format fastckpt`: the model id is resolved through the hub cache."""
    snap, _ = hub
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never the network
    model_config, load_config = _vllm("org/tiny")
    load_config.download_dir = str(snap.parents[2])
    loader = plugin.FastCkptModelLoader(load_config)
    loader.download_model(model_config)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen: dict[str, torch.Tensor] = {}

        def load_weights(self, weights):
            self.seen = dict(weights)
            return set(self.seen)

    m = Model()
    loader.load_weights(m, model_config)
    _same(m.seen, reference(snap))


def test_export_of_a_hub_snapshot_is_a_plain_folder(hub, tmp_path, capsys):
    snap, _ = hub
    blobs = {p.name: p.read_bytes() for p in (snap.parents[1] / "blobs").iterdir()}
    out = tmp_path / "served"
    assert cli_main(["load", str(snap), "--to", str(out), "-q"]) == 0
    assert f"vllm serve {out}" in capsys.readouterr().out
    files = sorted(os.listdir(out))
    assert "consolidated.safetensors" not in files and "original" not in files
    assert {"config.json", "tokenizer.json"} <= set(files)
    assert not any(os.path.islink(out / n) for n in files)  # copies, never links into the cache
    got: dict[str, torch.Tensor] = {}
    for n in files:
        if n.endswith(".safetensors"):
            got.update(load_file(out / n))
    _same(got, reference(snap))
    assert (out / "config.json").read_bytes() == (snap / "config.json").read_bytes()
    assert {p.name: p.read_bytes() for p in (snap.parents[1] / "blobs").iterdir()} == blobs  # cache untouched


def test_index_names_exactly_what_is_loaded(hub):
    """consolidated.safetensors, original/ and a leftover shard beside the index are never mixed in."""
    snap, _ = hub
    wm = json.loads((snap / INDEX).read_text())["weight_map"]
    assert set(fastckpt.open_checkpoint(snap).headers) == set(SHARDS)
    for got in (fastckpt.load(snap), load_weights(snap, "cpu"), _vllm_weights(snap)):
        assert set(got) == set(wm)
        assert torch.equal(got["a"], reference(snap)["a"])  # not the leftover's zeros


def test_no_index_model_safetensors_alone(tmp_path):
    """Without an index a folder's model.safetensors is the model (transformers' rule): another
    layout beside it is not mixed in; a folder of other files still loads them all."""
    sd = _weights()
    snap = hub_repo(tmp_path / "cache", {"model.safetensors": st_save(sd),
                                         "consolidated.safetensors": st_save({"tok.weight": torch.ones(4)})})
    _same(fastckpt.load(snap), load_file(snap / "model.safetensors"))
    _same(_vllm_weights(snap), load_file(snap / "model.safetensors"))
    os.unlink(snap / "model.safetensors")
    assert set(fastckpt.load(snap)) == {"tok.weight"}


@pytest.mark.parametrize("how", ["dangling", "absent"])
def test_missing_shard_is_refused_by_every_path(hub, tmp_path, how, capsys):
    """An index naming a shard that is not there (an interrupted download leaves a dangling
    symlink or no link): a typed error naming the index and the shard, nothing loaded or written."""
    snap, _ = hub
    if how == "dangling":
        os.unlink(snap.parents[1] / "blobs" / os.path.basename(os.readlink(snap / SHARDS[1])))
    else:
        os.unlink(snap / SHARDS[1])
    for fn in (lambda: fastckpt.load(snap), lambda: fastckpt.load(snap, keys=["a"]),
               lambda: load_weights(snap, "cpu"), lambda: _vllm_weights(snap), lambda: fastckpt.open_checkpoint(snap)):
        with pytest.raises(HeaderError) as ei:
            fn()
        msg = str(ei.value)
        assert INDEX in msg and SHARDS[1] in msg and "does not exist" in msg, msg
        assert ("symlink" in msg) == (how == "dangling"), msg
    rep = fastckpt.verify(snap)
    assert not rep.ok and any(SHARDS[1] in p for p in rep.problems), rep.problems
    assert cli_main(["verify", str(snap)]) == 1
    out = tmp_path / "served"
    capsys.readouterr()
    assert cli_main(["load", str(snap), "--to", str(out), "-q"]) != 0
    assert SHARDS[1] in capsys.readouterr().err
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".served")]


def test_names_that_escape_the_folder_are_still_refused(hub, tmp_path):
    """Symlinked files are followed; a NAME that leaves the folder is not, even when it points at
    a real blob of the same repo."""
    snap, _ = hub
    blob = os.readlink(snap / SHARDS[1])  # "../../blobs/<sha>"
    ix = snap / INDEX
    doc = json.loads(ix.read_text())
    for bad in (blob, str((snap / blob).resolve()), "sub/../../x.safetensors"):
        doc["weight_map"]["b"] = doc["weight_map"]["c"] = bad
        os.unlink(ix)
        ix.write_text(json.dumps(doc))
        for fn in (lambda: fastckpt.load(snap), lambda: load_weights(snap, "cpu"), lambda: _vllm_weights(snap)):
            with pytest.raises(UnsafePathError):
                fn()
        rep = fastckpt.verify(snap)
        assert not rep.ok and rep.problems[0].startswith("UnsafePathError:"), rep.problems
    # a sub-folder that is a symlink out of the folder: the name passes through it, refused
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", snap / "sub")
    (tmp_path / "elsewhere" / "x.safetensors").write_bytes(st_save({"b": torch.ones(1)}))
    doc["weight_map"] = {"b": "sub/x.safetensors"}
    os.unlink(ix)
    ix.write_text(json.dumps(doc))
    with pytest.raises(UnsafePathError, match="sub"):
        fastckpt.load(snap)


def test_fifo_under_a_weight_name_is_refused_not_waited_on(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    os.mkfifo(folder / "model.safetensors")
    with pytest.raises(HeaderError, match="not a regular file"):
        fastckpt.load(folder)


def _as_hub(ck: Path, cache: Path) -> Path:
    """Upload-and-download of a fastckpt checkpoint: the same files, as a hub snapshot."""
    files = {}
    for root, _, names in os.walk(ck):
        for n in names:
            p = Path(root) / n
            files[str(p.relative_to(ck))] = p.read_bytes()
    return hub_repo(cache, files)


def test_fastckpt_checkpoint_from_the_hub_keeps_its_checksums(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}, "step": 3}
    ck = fastckpt.save(state, tmp_path / "ck")
    snap = _as_hub(Path(ck), tmp_path / "cache")
    assert os.path.islink(snap / "manifest.json") and os.path.islink(snap / "state.json")
    out = fastckpt.load(snap, verify=True)
    assert out["step"] == 3 and torch.equal(out["model"]["w"], state["model"]["w"])
    rep = fastckpt.verify(snap)
    assert rep.ok and rep.bytes_checked > 0, rep.problems
    _same(_vllm_weights(snap), state["model"])
    # a flipped byte in a blob is still caught through the symlink
    e = json.loads((snap / "manifest.json").read_text())["tensors"]["model/w"]
    blob = (snap / e["file"]).resolve()
    data = bytearray(blob.read_bytes())
    data[e["offsets"][0] + 5] ^= 0x01
    blob.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="model/w"):
        fastckpt.load(snap, verify=True)
    assert not fastckpt.verify(snap).ok


@pytest.mark.parametrize("order", ["file_then_shards", "shards_then_file"])
def test_save_pretrained_leftovers_load_what_from_pretrained_loads(tmp_path, order):
    """``save_pretrained`` into a folder that held the other layout leaves it there: a stale
    ``model.safetensors`` beside a new index, or a stale index (naming shards that are gone) beside a
    new ``model.safetensors``. transformers' own ``from_pretrained`` is the reference: it loads
    ``model.safetensors`` in both cases; fastckpt's loaders load the same tensors (they loaded the
    shards of the first case, different weights with exit 0, and refused the second)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(1)
    b = transformers.LlamaForCausalLM(cfg)
    folder = tmp_path / "model"
    if order == "file_then_shards":
        a.save_pretrained(folder)
        b.save_pretrained(folder, max_shard_size=20_000)
    else:
        a.save_pretrained(folder, max_shard_size=20_000)
        b.save_pretrained(folder)
    names = sorted(os.listdir(folder))
    assert "model.safetensors" in names and "model.safetensors.index.json" in names, names
    shards = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1  # the layout transformers left, as the docstring says
    if order == "shards_then_file":
        assert not shards & set(names), "save_pretrained removed the shards, kept their index"
    ref = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    want = load_file(folder / "model.safetensors")
    for k, v in want.items():  # the reference loaded the file
        assert torch.equal(ref[k], v), k
    _same(fastckpt.load(folder), want)
    _same(load_weights(folder, "cpu"), want)
    _same(_vllm_weights(folder), want)
    fresh = {k: torch.zeros_like(v) for k, v in want.items()}
    fastckpt.load_into(fresh, folder)
    _same(fresh, want)


def test_variants_beside_the_default_weights_are_not_mixed_in(tmp_path):
    """``save_pretrained(variant="fp16")`` beside the default save (the hub's usual diffusers layout,
    and transformers'): the default file is loaded, as ``from_pretrained`` without a variant does;
    fastckpt refused ('stored in both'). A folder of variants only is refused naming them."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    folder = tmp_path / "tf"
    m.save_pretrained(folder)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    m.half().save_pretrained(folder, variant="fp16")
    assert (folder / "model.fp16.safetensors").is_file()
    ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    got = fastckpt.load(folder)
    for k, v in got.items():  # the default file's bytes, as from_pretrained without a variant reads
        assert v.dtype == torch.float32 and torch.equal(v, want[k]) and torch.equal(v, ref[k]), k
    # a diffusers component folder as ModelMixin.save_pretrained lays it out (default + fp16 variant)
    unet = tmp_path / "unet"
    unet.mkdir()
    sd = _weights()
    (unet / "diffusion_pytorch_model.safetensors").write_bytes(st_save(sd, {"format": "pt"}))
    (unet / "diffusion_pytorch_model.fp16.safetensors").write_bytes(
        st_save({k: v.half() for k, v in sd.items()}, {"format": "pt"}))
    (unet / "config.json").write_text('{"_class_name": "UNet2DModel"}')
    _same(fastckpt.load(unet), sd)
    os.unlink(folder / "model.safetensors")
    m.bfloat16().save_pretrained(folder, variant="bf16")
    with pytest.raises(HeaderError, match=r"variants \(bf16, fp16\).*pass the file"):
        fastckpt.load(folder)
    assert fastckpt.load(folder / "model.bf16.safetensors").keys() == got.keys()


def test_diffusers_pipeline_root_names_its_model_folders(tmp_path):
    """A diffusers pipeline root (model_index.json, a model per sub-folder) is not one model: the
    error says so and names the sub-folders to load (it said only 'nothing to load')."""
    root = tmp_path / "pipe"
    (root / "unet").mkdir(parents=True)
    (root / "scheduler").mkdir()
    (root / "model_index.json").write_text('{"_class_name": "DDPMPipeline", "unet": ["diffusers", "UNet2DModel"]}')
    (root / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(st_save(_weights(), {"format": "pt"}))
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    with pytest.raises(fastckpt.errors.CheckpointNotFoundError, match=r"diffusers pipeline.*\(unet\).*pipe/unet"):
        fastckpt.load(root)
    _same(fastckpt.load(root / "unet"), _weights())


def test_two_sharded_variant_sets_are_refused_naming_them(tmp_path):
    """transformers 5 names a sharded variant model.fp16-00001-of-0000n.safetensors; with two such sets
    (and no default) the refusal said only 'refusing to pick one' instead of naming the variants."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    m = transformers.LlamaForCausalLM(cfg)
    for variant in ("fp16", "v2"):
        m.save_pretrained(tmp_path, variant=variant, max_shard_size="40KB")
    assert any(p.name.startswith("model.fp16-00001-of-") for p in tmp_path.iterdir()), sorted(os.listdir(tmp_path))
    with pytest.raises(HeaderError, match=r"variants \(fp16, v2\)"):
        fastckpt.load(tmp_path)
