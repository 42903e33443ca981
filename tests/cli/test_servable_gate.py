"""The servability gate of ``fastckpt load`` (:mod:`fastckpt.loading.servable`), against the real thing.

What ``save_pretrained`` writes for tiny models built from configs in the test (Llama tied and
untied, a task head, an MoE that transformers renames on save; one file and sharded) passes the
gate, and ``fastckpt load --to`` of it exits 0 with a ``vllm serve`` line. What vLLM could not
serve as its ``config.json`` says (no architecture or dtype, a parameter missing or of another
shape, tied weights that disagree) exits non-zero, names the keys and leaves nothing at ``--to``.
A checkpoint fastckpt saved of a model built from ``LlamaConfig(...)`` exports only if
transformers' own ``from_pretrained`` of the export misses nothing (before the gate it exported
a config with neither ``architectures`` nor ``dtype`` and printed ``vllm serve``, exit 0).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.cli.main import main
from fastckpt.errors import NotServableError
from fastckpt.loading.servable import check_servable

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from integrations.hf.trainer import model_snapshot  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _llama(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied)).eval()


def _bert_cls():
    torch.manual_seed(1)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=3)).eval()


def _mixtral():
    torch.manual_seed(2)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**LLAMA, num_local_experts=4,
                                                                      num_experts_per_tok=2)).eval()


MODELS = {"llama-untied": lambda: _llama(False), "llama-tied": lambda: _llama(True), "bert-cls": _bert_cls,
          "mixtral": _mixtral}


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["load", *map(str, argv), "-q"])
    cap = capsys.readouterr()
    lines = cap.out.strip().splitlines()
    return rc, lines[-1] if lines else "", cap.err


def _nothing_at(to) -> bool:
    """Neither ``to`` nor a hidden build folder of it exists."""
    return not os.path.lexists(to) and not [n for n in os.listdir(os.path.dirname(to))
                                            if n.startswith("." + os.path.basename(to))]


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("shard", ["one-file", "sharded"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_save_pretrained_folder_passes_and_exports(kind, shard, tmp_path, capsys):
    model = MODELS[kind]()
    src = tmp_path / "hf"
    model.save_pretrained(src, max_shard_size="20KB" if shard == "sharded" else "5GB")
    names = set(os.listdir(src))
    assert ("model.safetensors.index.json" in names) == (shard == "sharded"), names
    rep = check_servable(src)
    assert rep.architecture == type(model).__name__ and rep.dtype == "float32" and rep.warnings == []
    assert rep.checked > 0
    out = tmp_path / "out"
    rc, cmd, err = _run(capsys, src, "--to", out)
    assert rc == 0 and cmd == f"vllm serve {out}", err
    assert f"servable: config.json names {type(model).__name__}" in err
    check_servable(out)
    _, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info


def test_config_built_model_checkpoint_is_never_exported_unservable(tmp_path, capsys):
    """fastckpt.save of ``LlamaForCausalLM(LlamaConfig(...))`` (the issue's case): the export either
    passes transformers' own checks, or fails with nothing at --to; never exit 0 unservable."""
    model = _llama(False, seed=3)
    state, weights, extra = model_snapshot(model)
    fastckpt.save(state, tmp_path / "run" / "checkpoint-1", weights=weights, extra_files=extra)
    out = tmp_path / "out"
    rc, cmd, err = _run(capsys, tmp_path / "run", "--to", out)
    if rc != 0:
        assert cmd == "" and _nothing_at(str(out)), err
        assert "architectures" in err and "--config HF_DIR" in err, err
        return
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("architectures") == ["LlamaForCausalLM"] and cfg.get("dtype") == "float32", cfg
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert cmd == f"vllm serve {out}"


def test_config_without_architecture_and_dtype_refused_then_fixed_with_config(tmp_path, capsys):
    """The live config of a model built in code (``config.to_json_string()``: no ``architectures``,
    no ``dtype``) fails the gate, naming both and --config; ``--config HF_DIR`` with the folder
    ``save_pretrained`` wrote replaces it and the export passes."""
    model = _llama(False, seed=4)
    cfg = json.loads(model.config.to_json_string())
    assert "architectures" not in cfg or cfg["architectures"] is None
    state, weights, _ = model_snapshot(model)
    ckpt = tmp_path / "ckpt"
    fastckpt.save(state, ckpt, weights=weights, extra_files={"config.json": model.config.to_json_string().encode()})
    out = tmp_path / "out"
    rc, cmd, err = _run(capsys, ckpt, "--to", out)
    assert rc != 0 and cmd == "" and _nothing_at(str(out)), err
    assert "config.json names no architecture" in err and "config.json names no dtype" in err, err
    assert "--config HF_DIR" in err and f"nothing was written to {out}" in err, err
    rc, cmd, err = _run(capsys, ckpt, "--warm")  # the source itself: warmed, but no vllm line for it
    assert rc == 0 and cmd == "" and "WARNING: warmed, but" in err and "names no architecture" in err
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    rc, cmd, err = _run(capsys, ckpt, "--to", out, "--config", ref)
    assert rc == 0 and cmd == f"vllm serve {out}", err
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())


def test_missing_untied_lm_head_named(tmp_path, capsys):
    """Untied config, lm_head.weight not in the files (saved as if tied): refused naming it."""
    src = tmp_path / "hf"
    _llama(False).save_pretrained(src)
    sd = _weights(src)
    del sd["lm_head.weight"]
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NotServableError) as e:
        check_servable(src)
    assert e.value.missing == ["lm_head.weight"]
    out = tmp_path / "out"
    rc, cmd, err = _run(capsys, src, "--to", out)
    assert rc != 0 and cmd == "" and _nothing_at(str(out))
    assert "1 of the 21 parameters of LlamaForCausalLM are not in the folder: lm_head.weight" in err, err


def test_tied_model_lm_head_may_be_absent_but_not_different(tmp_path):
    src = tmp_path / "hf"
    _llama(True).save_pretrained(src)
    sd = _weights(src)
    assert "lm_head.weight" not in sd  # what save_pretrained writes for a tied model
    check_servable(src)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # stored twice, equal: fine
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    check_servable(src)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1  # tied in config.json, different in the files
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NotServableError, match="tie_word_embeddings") as e:
        check_servable(src)
    assert "lm_head.weight and model.embed_tokens.weight" in str(e.value)


def test_mis_shaped_parameter_named_with_both_shapes(tmp_path, capsys):
    """config.json of another size than the weights: every mis-shaped key named with both shapes."""
    src = tmp_path / "hf"
    _llama(False).save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] = 80
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotServableError) as e:
        check_servable(src)
    assert e.value.mismatched == {"model.embed_tokens.weight": ((80, 32), (64, 32)),
                                  "lm_head.weight": ((80, 32), (64, 32))}
    out = tmp_path / "out"
    rc, _, err = _run(capsys, src, "--to", out)
    assert rc != 0 and _nothing_at(str(out))
    assert "model.embed_tokens.weight [64, 32] in the folder, [80, 32] expected" in err, err


def test_failed_gate_with_overwrite_keeps_the_previous_export(tmp_path, capsys):
    src = tmp_path / "hf"
    _llama(False).save_pretrained(src)
    out = tmp_path / "out"
    assert _run(capsys, src, "--to", out)[0] == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    cfg = json.loads((src / "config.json").read_text())
    del cfg["architectures"]
    (src / "config.json").write_text(json.dumps(cfg))
    rc, cmd, err = _run(capsys, src, "--to", out, "--overwrite")
    assert rc != 0 and cmd == "" and "names no architecture" in err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_remote_code_config_is_not_built_and_warns(tmp_path, capsys):
    """``auto_map`` (trust_remote_code): no class is built (no code from the checkpoint runs); the
    config checks still apply and a WARNING says the parameters were not checked."""
    src = tmp_path / "hf"
    _llama(False).save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    cfg["architectures"] = ["EvilForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "modeling_evil.py").write_text("raise SystemExit('checkpoint code ran')\n")
    rep = check_servable(src)
    assert rep.checked == 0 and "auto_map" in rep.warnings[0] and "NOT checked" in rep.warnings[0]
    rc, cmd, err = _run(capsys, src, "--to", tmp_path / "out")
    assert rc == 0 and cmd.startswith("vllm serve") and "WARNING" in err and "NOT checked" in err


def test_quantized_config_checks_names_only(tmp_path):
    """A quantized model's tensors (qweight, scales, ...) are not the architecture's parameters: the
    gate checks architecture and dtype, and warns that the parameters were not checked."""
    src = tmp_path / "hf"
    _llama(False).save_pretrained(src)
    sd = _weights(src)
    sd["model.layers.0.mlp.down_proj.qweight"] = sd.pop("model.layers.0.mlp.down_proj.weight")[:, :8].contiguous()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    rep = check_servable(src)
    assert rep.checked == 0 and "quantization_config (awq)" in rep.warnings[0] and "NOT checked" in rep.warnings[0]
