"""vLLM plugin against the loader contract, with vLLM absent (a stand-in vllm package for registration)."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import fastckpt
from fastckpt.errors import ChecksumMismatchError, HeaderError, NotServableError
from integrations import vllm as plugin


class TinyModel(torch.nn.Module):
    """Like a vLLM model: ``load_weights`` consumes ``(name, tensor)`` and returns the loaded names."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(64, 32))
        self.b = torch.nn.Parameter(torch.zeros(32))
        self.seen_batches: list[int] = []

    def load_weights(self, weights) -> set[str]:
        done = set()
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
            done.add(name)
        return done


def _cfg(path, **extra):
    return SimpleNamespace(model=str(path), revision=None, quantization=None), \
        SimpleNamespace(model_loader_extra_config=extra, download_dir=None)


@pytest.fixture()
def hf_dir(tmp_path):
    torch.manual_seed(0)
    sd = {"a": torch.randn(64, 32), "b": torch.randn(32)}
    save_file({"a": sd["a"]}, tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"b": sd["b"]}, tmp_path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    # a model only vLLM knows: the gate checks the config's names and warns that it built nothing
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["TinyModel"], "model_type": "tiny",
                                                       "dtype": "float32"}))
    return tmp_path, sd


def test_module_imports_without_vllm():
    assert "vllm" not in sys.modules or isinstance(sys.modules["vllm"], types.ModuleType)
    assert plugin.LOAD_FORMAT == "fastckpt"


def test_contract_download_and_load_weights(hf_dir):
    path, sd = hf_dir
    model_config, load_config = _cfg(path, batch_bytes=1000, threads=2)
    loader = plugin.FastCkptModelLoader(load_config)
    loader.download_model(model_config)
    model = TinyModel()
    loader.load_weights(model, model_config)
    assert torch.equal(model.a.data, sd["a"]) and torch.equal(model.b.data, sd["b"])


def test_weights_iterator_yields_owned_tensors_in_batches(hf_dir):
    path, sd = hf_dir
    loader = plugin.FastCkptModelLoader(_cfg(path, batch_bytes=16)[1])
    got = list(loader.get_weights_iterator(str(path)))
    assert [n for n, _ in got] == ["a", "b"]
    a = got[0][1]
    assert torch.equal(a, sd["a"]) and a.untyped_storage().nbytes() == sd["a"].numel() * 4


def test_missing_parameter_is_an_error(tmp_path):
    save_file({"a": torch.randn(64, 32)}, tmp_path / "model.safetensors")
    model_config, load_config = _cfg(tmp_path)
    with pytest.raises(ValueError, match="'b'"):
        plugin.FastCkptModelLoader(load_config).load_weights(TinyModel(), model_config)


def test_fastckpt_run_root_and_checksums(tmp_path):
    sd = {"a": torch.randn(64, 32), "b": torch.randn(32)}
    fastckpt.save({"model": sd, "optimizer": {"x": torch.ones(3)}}, tmp_path / "step-4")
    model_config, load_config = _cfg(tmp_path)
    model = TinyModel()
    plugin.FastCkptModelLoader(load_config).load_weights(model, model_config)  # latest committed step
    assert torch.equal(model.a.data, sd["a"])
    import json
    ck = tmp_path / "step-4"
    e = json.loads((ck / "manifest.json").read_text())["tensors"]["model/a"]
    with open(ck / e["file"], "r+b") as f:
        f.seek(e["offsets"][0])
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(ChecksumMismatchError):
        plugin.FastCkptModelLoader(load_config).load_weights(TinyModel(), model_config)


def test_download_model_runs_the_servability_gate(tmp_path, caplog):
    """A folder save_pretrained wrote passes; one without the untied lm_head, or whose config names
    no architecture, is refused naming it before a weight is read; a vLLM-only architecture warns."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "hf")
    model_config, load_config = _cfg(tmp_path / "hf")
    plugin.FastCkptModelLoader(load_config).download_model(model_config)
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NotServableError, match="lm_head.weight") as e:
        plugin.FastCkptModelLoader(load_config).download_model(model_config)
    assert e.value.missing == ["lm_head.weight"]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.pop("architectures")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotServableError, match="names no architecture"):
        plugin.FastCkptModelLoader(load_config).download_model(model_config)


def test_vllm_only_architecture_warns(hf_dir, caplog):
    path, _ = hf_dir
    model_config, load_config = _cfg(path)
    with caplog.at_level("WARNING", logger=plugin.logger.name):
        plugin.FastCkptModelLoader(load_config).download_model(model_config)
    assert "NOT checked" in caplog.text


def test_bad_header_refused_before_reading(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    model_config, load_config = _cfg(tmp_path)
    with pytest.raises(HeaderError):
        plugin.FastCkptModelLoader(load_config).download_model(model_config)


def test_unknown_option_refused():
    with pytest.raises(ValueError, match="bogus"):
        plugin.FastCkptModelLoader(SimpleNamespace(model_loader_extra_config={"bogus": 1}))


def test_register_with_stand_in_vllm(monkeypatch, hf_dir):
    """The entry point registers a BaseModelLoader subclass under "fastckpt" with register_model_loader."""
    registry = {}

    class BaseModelLoader:
        def __init__(self, load_config):
            self.load_config = load_config

    def register_model_loader(name):
        def deco(cls):
            registry[name] = cls
            return cls
        return deco

    mods = {"vllm": types.ModuleType("vllm"), "vllm.model_executor": types.ModuleType("vllm.model_executor"),
            "vllm.model_executor.model_loader": types.ModuleType("vllm.model_executor.model_loader"),
            "vllm.model_executor.model_loader.base_loader": types.ModuleType("base_loader")}
    mods["vllm.model_executor.model_loader"].register_model_loader = register_model_loader
    mods["vllm.model_executor.model_loader.base_loader"].BaseModelLoader = BaseModelLoader
    for k, m in mods.items():
        monkeypatch.setitem(sys.modules, k, m)
    plugin.loader_class.cache_clear()
    try:
        plugin.register()
        cls = registry["fastckpt"]
        assert issubclass(cls, BaseModelLoader) and issubclass(cls, plugin.FastCkptLoaderMixin)
        path, sd = hf_dir
        model_config, load_config = _cfg(path)
        model = TinyModel()
        cls(load_config).load_weights(model, model_config)
        assert torch.equal(model.b.data, sd["b"])
    finally:
        plugin.loader_class.cache_clear()


def test_register_without_vllm_warns(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "vllm.model_executor", None)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader", None)
    plugin.register()
    assert "vLLM >= 0.10" in caplog.text


class Bf16Model(TinyModel):
    """Parameters in another dtype than the files; ``load_weights`` copies as vLLM's
    ``default_weight_loader`` does (size checked, then ``param.data.copy_(loaded_weight)``)."""

    def __init__(self, dtype):
        super().__init__()
        self.to(dtype)

    def load_weights(self, weights) -> set[str]:
        done = set()
        params = dict(self.named_parameters())
        for name, t in weights:
            assert params[name].size() == t.size(), (name, params[name].size(), t.size())
            params[name].data.copy_(t)
            done.add(name)
        return done


@pytest.mark.parametrize("stored,model_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_weights_come_in_their_stored_dtype_and_are_cast_not_reinterpreted(tmp_path, stored, model_dtype):
    """issue 20: the plugin yields each tensor with the stored dtype and values (never reinterpreted
    bytes); the model's weight loader casts it, so the model holds exactly ``saved.to(model_dtype)``."""
    g = torch.Generator().manual_seed(5)
    sd = {"a": (torch.randn(64, 32, generator=g, dtype=torch.float64) * 50).to(stored),
          "b": torch.randn(32, generator=g).to(stored)}
    ck = fastckpt.save({"model": sd}, tmp_path / "ck", weights={"model": "model"})
    model_config, load_config = _cfg(ck, batch_bytes=4096)
    loader = plugin.FastCkptModelLoader(load_config)
    got = dict(loader.get_weights_iterator(str(ck)))
    assert {k: v.dtype for k, v in got.items()} == {"a": stored, "b": stored}
    assert all(torch.equal(got[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
    model = Bf16Model(model_dtype)
    loader.load_weights(model, model_config)
    for k in sd:
        want = sd[k].to(model_dtype)
        assert torch.equal(getattr(model, k).data.view(torch.uint8), want.view(torch.uint8)), k
