"""peft checkpoints that every reader opens correctly (issue 14, peft bullet).

Three adapters on a tiny Llama (fp32, CPU), each trained 2 steps by the real ``transformers.Trainer``
and saved by :class:`FastCkptCallback` (``checkpoint-2``):

* ``modules_to_save``: LoRA with ``modules_to_save=["embed_tokens", "lm_head"]`` after
  ``resize_token_embeddings`` (the base model folder has the old vocabulary);
* ``dora``: ``use_dora=True`` (``lora_magnitude_vector``);
* ``all_linear``: ``target_modules="all-linear"``.

For each: ``adapter_model.safetensors`` holds exactly peft's own key set and bytes
(``PeftModel.save_pretrained`` of the same model, read with the ``safetensors`` package),
``adapter_config.json`` is peft's, the base weights are the plain base model's under transformers'
names, and the logits of ``PeftModel.from_pretrained``, ``AutoModelForCausalLM.from_pretrained``
(which attaches the adapter through transformers' peft integration) and ``fastckpt load --merge-lora``
equal peft's (atol 1e-5, fp32).
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import fastckpt  # noqa: E402
from fastckpt.cli.main import main  # noqa: E402
from fastckpt.integrations.hf.snapshot import model_snapshot, peft_base_weights  # noqa: E402
from fastckpt.integrations.hf.trainer import FastCkptCallback  # noqa: E402
from fastckpt.integrations.hf.models import tiny_llama  # noqa: E402
from fastckpt_testkit import assert_same  # noqa: E402

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

OLD_VOCAB, NEW_VOCAB, SEQ = 128, 136, 8
CASES = {
    "modules_to_save": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    "dora": dict(target_modules=["q_proj", "v_proj"], use_dora=True),
    "all_linear": dict(target_modules="all-linear"),
}
ATOL = 1e-5


class Tokens(torch.utils.data.Dataset):
    """16 short sequences over ``vocab`` ids (the resized case uses the new ids too)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.tensor([(i * 11 + j * 17) % self.vocab for j in range(SEQ)])
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    tiny_llama(seed=0, dropout=0.0).save_pretrained(d)
    return d


def _base(base_dir, case):
    m = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if case == "modules_to_save":
        torch.manual_seed(5)
        m.resize_token_embeddings(NEW_VOCAB)
    return m


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _load(*argv):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["load", *map(str, argv), "-q"]) == 0


@pytest.fixture(scope="module", params=list(CASES))
def run(request, base_dir, tmp_path_factory):
    """Train 2 steps with the Trainer + FastCkptCallback; keep peft's own save and the reference logits."""
    case = request.param
    out = tmp_path_factory.mktemp(case)
    model = peft.get_peft_model(_base(base_dir, case), peft.LoraConfig(r=4, lora_alpha=8, **CASES[case]))
    vocab = NEW_VOCAB if case == "modules_to_save" else OLD_VOCAB
    before = {k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    args = transformers.TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=4, max_steps=2, learning_rate=5e-2,
        save_strategy="steps", save_steps=2, report_to="none", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=7, logging_steps=1)
    cb = FastCkptCallback()
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(vocab), callbacks=[cb]).train()
    assert not cb.failed_saves and [r["step"] for r in cb.records] == [2]
    ckpt = out / "run" / "checkpoint-2"
    assert fastckpt.is_committed(ckpt)
    after = peft.get_peft_model_state_dict(model)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert any("lora_B" in k for k in changed), "training left the adapter at its initial value"
    if case == "dora":
        assert any("lora_magnitude_vector" in k for k in changed)
    if case == "modules_to_save":
        assert any("embed_tokens.modules_to_save" in k for k in changed)
        assert any("lm_head.modules_to_save" in k for k in changed)
    own = out / "peft-own"
    model.save_pretrained(own)  # peft's own save of the same (trained) model: the reference
    ids = torch.tensor([[(7 * j + 3) % vocab for j in range(SEQ)], [(5 * j + vocab - 1) % vocab for j in range(SEQ)]])
    ref = _logits(model, ids)
    merged = _logits(copy.deepcopy(model).merge_and_unload(), ids)
    _close(merged, ref, f"{case}: peft's merge_and_unload vs the unmerged model")
    with model.disable_adapter():
        plain = _logits(model, ids)
    assert (plain - ref).abs().max() > 1e-3, "the adapter does not change the logits: the test could not fail"
    return dict(case=case, ckpt=ckpt, own=own, ids=ids, ref=ref, merged=merged, model=model, out=out)


def test_adapter_file_is_peft_own_key_set_and_bytes(run):
    ours, theirs = run["ckpt"] / "adapter_model.safetensors", run["own"] / "adapter_model.safetensors"
    with safe_open(str(theirs), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(ours), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(got) == sorted(want)
    for k in want:
        assert_same(got[k], want[k], k)
    if run["case"] == "modules_to_save":  # the copies and the resized embeddings are in the file itself
        assert {"base_model.model.model.embed_tokens.modules_to_save.weight",
                "base_model.model.lm_head.modules_to_save.weight"} <= set(got)
        assert got["base_model.model.model.embed_tokens.modules_to_save.weight"].shape[0] == NEW_VOCAB
    if run["case"] == "dora":
        assert any(k.endswith("lora_magnitude_vector") for k in got)
    manifest = json.loads((run["ckpt"] / "manifest.json").read_text())
    adapter_keys = [k for k in manifest["tensors"] if k.startswith("adapter/")]
    assert adapter_keys and all(manifest["tensors"][k].get("file") == "adapter_model.safetensors"
                                for k in adapter_keys), "an adapter tensor lives only in the manifest"


def test_adapter_config_is_peft_own(run):
    ours = json.loads((run["ckpt"] / "adapter_config.json").read_text())
    theirs = json.loads((run["own"] / "adapter_config.json").read_text())
    for cfg in (ours, theirs):  # peft writes these sets as lists in set iteration order (not stable)
        for k in ("target_modules", "modules_to_save"):
            if isinstance(cfg.get(k), list):
                cfg[k] = sorted(cfg[k])
    assert ours == theirs
    assert ours["inference_mode"] is True


def test_base_weights_under_transformers_names(run, base_dir):
    """The model-*.safetensors files hold the base model (resized when it was), nothing of the adapter."""
    ckpt = run["ckpt"]
    got = {}
    for p in sorted(ckpt.glob("model-*.safetensors")):
        got.update(load_file(str(p)))
    want = _base(base_dir, run["case"]).state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert_same(got[k], want[k], k)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want)
    # a peft checkpoint keeps model-00001-of-00001.safetensors + index even as one shard: the Trainer's
    # resume would take a model.safetensors for a full-model checkpoint and not load the adapter
    assert not (ckpt / "model.safetensors").exists()


def test_peft_from_pretrained_same_logits_as_peft_own_save(run, base_dir):
    ours = peft.PeftModel.from_pretrained(_base(base_dir, run["case"]), run["ckpt"])
    theirs = peft.PeftModel.from_pretrained(_base(base_dir, run["case"]), run["own"])
    want = _logits(theirs, run["ids"])
    _close(want, run["ref"], "peft's own save")
    _close(_logits(ours, run["ids"]), want, "PeftModel.from_pretrained(base, checkpoint)")


def test_peft_from_pretrained_on_checkpoint_base(run):
    """The checkpoint alone: its base weights (loaded without the adapter) + its adapter."""
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(run["ckpt"]))
    state = {}
    for p in sorted(run["ckpt"].glob("model-*.safetensors")):
        state.update(load_file(str(p)))
    base.load_state_dict(state, strict=True)
    _close(_logits(peft.PeftModel.from_pretrained(base, run["ckpt"]), run["ids"]), run["ref"],
           "PeftModel.from_pretrained(checkpoint base, checkpoint)")


def test_auto_model_from_pretrained(run, tmp_path):
    """transformers finds adapter_config.json next to config.json and attaches the adapter itself."""
    got = _logits(transformers.AutoModelForCausalLM.from_pretrained(run["ckpt"], dtype=torch.float32), run["ids"])
    # what transformers makes of peft's own adapter next to the same base weights
    same_base = tmp_path / "peft-own-with-base"
    shutil.copytree(run["own"], same_base)
    for p in run["ckpt"].iterdir():
        if p.name.startswith("model") or p.name in ("config.json", "generation_config.json"):
            shutil.copy(p, same_base / p.name)
    theirs = _logits(transformers.AutoModelForCausalLM.from_pretrained(same_base, dtype=torch.float32), run["ids"])
    _close(got, theirs, "AutoModelForCausalLM: fastckpt checkpoint vs peft's own adapter")
    if run["case"] == "dora":
        # transformers 5.24 + peft 0.21.2 leave DoRA's lora_magnitude_vector unloaded (peft's own
        # save too): README does not present a DoRA checkpoint as loadable this way
        return
    _close(got, run["ref"], "AutoModelForCausalLM.from_pretrained(checkpoint)")


def test_fastckpt_load_merge_lora(run, tmp_path):
    to = tmp_path / "merged"
    _load(run["ckpt"], "--to", to, "--merge-lora")
    assert not (to / "adapter_config.json").exists() and not (to / "adapter").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(to, dtype=torch.float32)
    assert not getattr(merged, "_hf_peft_config_loaded", False)
    _close(_logits(merged, run["ids"]), run["merged"], "fastckpt load --merge-lora")
    if run["case"] == "modules_to_save":  # merge_and_unload puts the trained copies in place
        assert merged.config.vocab_size == NEW_VOCAB
        sd = run["model"].state_dict()
        assert_same(merged.get_input_embeddings().weight.detach(),
                    sd["base_model.model.model.embed_tokens.modules_to_save.default.weight"], "embed_tokens")


def test_fastckpt_load_adapter_layout(run, tmp_path):
    """Without --merge-lora: base in DIR, adapter in DIR/adapter (vllm serve --enable-lora)."""
    to = tmp_path / "serve"
    _load(run["ckpt"], "--to", to)
    base = transformers.AutoModelForCausalLM.from_pretrained(to, dtype=torch.float32)
    assert not getattr(base, "_hf_peft_config_loaded", False)
    with safe_open(str(to / "adapter" / "adapter_model.safetensors"), "pt") as f, \
            safe_open(str(run["own"] / "adapter_model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
    _close(_logits(peft.PeftModel.from_pretrained(base, to / "adapter"), run["ids"]), run["ref"],
           "PeftModel.from_pretrained(DIR, DIR/adapter)")


# ---------------------------------------------------------------- the rule, without peft


def test_weights_groups_hold_every_tensor_their_readers_expect(tmp_path):
    """One storage under names in two weights groups, twice in a single-file group, as views in a
    sharded group, and in the state: each weights file holds each of its tensors; only the sharded
    model group keeps a tied duplicate as an alias (transformers re-ties it); state keys alias."""
    emb = torch.randn(10, 4)
    fused = torch.randn(12, 4)
    state = {"model": {"embed.weight": emb, "lm_head.weight": emb, "q.weight": fused[:4], "k.weight": fused[4:8],
                       "t.weight": fused.t()[:, :3]},  # a strided view of the same storage
             "adapter": {"a.original_module.weight": emb, "a.weight": emb, "a.modules_to_save.weight": emb},
             "opt": {"copy": emb, "v": fused[8:]}}
    path = fastckpt.save(state, tmp_path / "ck", weights={"model": "model", "adapter": "adapter_model.safetensors"})
    adapter = load_file(str(path / "adapter_model.safetensors"))
    assert sorted(adapter) == sorted(state["adapter"])
    for k, v in state["adapter"].items():
        assert_same(adapter[k], v, k)
    model = load_file(str(path / "model-00001-of-00001.safetensors"))
    assert sorted(model) == ["embed.weight", "k.weight", "q.weight", "t.weight"]  # lm_head tied to embed: alias
    assert_same(model["q.weight"], fused[:4], "q")
    assert_same(model["k.weight"], fused[4:8], "k")
    assert_same(model["t.weight"], fused.t()[:, :3].contiguous(), "t")
    m = json.loads((path / "manifest.json").read_text())["tensors"]
    assert m["model/lm_head.weight"] == {"alias": "model/embed.weight"}
    assert m["opt/copy"] == {"alias": "model/embed.weight"}
    assert all("file" in m[f"adapter/{k}"] for k in state["adapter"])
    out = fastckpt.load(path)
    for group in state:
        for k, v in state[group].items():
            assert_same(out[group][k], v, f"{group}/{k}")
    assert out["model"]["lm_head.weight"].data_ptr() == out["model"]["embed.weight"].data_ptr()


def test_trainable_tokens_base_names(base_dir):
    """trainable_token_indices wraps embed_tokens as token_adapter.base_layer: the base keeps its plain name."""
    base = _base(base_dir, "dora")
    want = {k: v.clone() for k, v in base.state_dict().items()}
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                      trainable_token_indices={"embed_tokens": [1, 2]}))
    got = peft_base_weights(model)
    assert sorted(got) == sorted(want)
    for k in want:
        assert_same(got[k], want[k], k)
    state, _, _ = model_snapshot(model)
    assert any("trainable_tokens_delta" in k for k in state["adapter"])


# ---------------------------------------------------------------- fastckpt.save of model_snapshot, refusals


@pytest.fixture(scope="module")
def snap_ckpt(base_dir, tmp_path_factory):
    """modules_to_save + resized embeddings saved by ``fastckpt.save(*model_snapshot(model))`` (README)."""
    model = peft.get_peft_model(_base(base_dir, "modules_to_save"),
                                peft.LoraConfig(r=4, **CASES["modules_to_save"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    d = tmp_path_factory.mktemp("snap")
    state, weights, extra = model_snapshot(model)
    fastckpt.save(state, d / "ck", weights=weights, extra_files=extra)
    ids = torch.tensor([[(9 * j + 1) % NEW_VOCAB for j in range(SEQ)]])
    return dict(ckpt=d / "ck", ids=ids, ref=_logits(model, ids),
                merged=_logits(copy.deepcopy(model).merge_and_unload(), ids), state=state, weights=weights,
                extra=extra)


def test_fastckpt_save_of_model_snapshot_opens_everywhere(snap_ckpt, base_dir, tmp_path):
    ck = snap_ckpt["ckpt"]
    _close(_logits(peft.PeftModel.from_pretrained(_base(base_dir, "modules_to_save"), ck), snap_ckpt["ids"]),
           snap_ckpt["ref"], "PeftModel.from_pretrained")
    _close(_logits(transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32), snap_ckpt["ids"]),
           snap_ckpt["ref"], "AutoModelForCausalLM.from_pretrained")
    _load(ck, "--to", tmp_path / "m", "--merge-lora")
    _close(_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32),
                   snap_ckpt["ids"]), snap_ckpt["merged"], "fastckpt load --merge-lora")


def test_merge_refuses_base_under_peft_wrapper_names(snap_ckpt, tmp_path, capsys):
    """What an older fastckpt wrote (``model.embed_tokens.original_module.weight``): transformers would
    initialise ``model.embed_tokens.weight`` at random; the merge refuses, nothing appears at --to."""
    model = dict(snap_ckpt["state"]["model"])
    model["model.embed_tokens.original_module.weight"] = model.pop("model.embed_tokens.weight")
    ck = fastckpt.save({**snap_ckpt["state"], "model": model}, tmp_path / "old", weights=snap_ckpt["weights"],
                       extra_files=snap_ckpt["extra"])
    to = tmp_path / "out"
    assert main(["load", str(ck), "--to", str(to), "--merge-lora", "-q"]) != 0
    err = capsys.readouterr().err
    assert "model.embed_tokens.weight" in err and "original_module" in err, err
    assert not to.exists()
    from fastckpt.cli.lora import load_base
    from fastckpt.errors import LoraMergeError
    cfg = transformers.AutoConfig.from_pretrained(ck)
    with pytest.raises(LoraMergeError) as ei:
        load_base(transformers.LlamaForCausalLM, cfg, model, str(ck))
    assert ei.value.missing == ["model.embed_tokens.weight"]
    assert ei.value.unexpected == ["model.embed_tokens.original_module.weight"]


def test_merge_refuses_adapter_tensor_only_in_manifest(snap_ckpt, tmp_path, capsys):
    """An adapter tensor the manifest lists as an alias (older fastckpt) is refused by name."""
    ck = tmp_path / "ck"
    shutil.copytree(snap_ckpt["ckpt"], ck)
    man = json.loads((ck / "manifest.json").read_text())
    key = "adapter/base_model.model.lm_head.modules_to_save.weight"
    assert man["tensors"][key]["file"] == "adapter_model.safetensors"
    man["tensors"][key] = {"alias": "model/lm_head.weight"}
    (ck / "manifest.json").write_text(json.dumps(man))
    from fastckpt.cli.lora import missing_adapter_tensors
    assert missing_adapter_tensors(str(ck)) == [key]
    assert missing_adapter_tensors(str(snap_ckpt["ckpt"])) == []
    for merge in (["--merge-lora"], []):  # merged, or laid out as DIR/adapter for vllm serve --enable-lora
        to = tmp_path / f"out{len(merge)}"
        assert main(["load", str(ck), "--to", str(to), *merge, "-q"]) != 0
        err = capsys.readouterr().err
        assert key in err and "older fastckpt" in err, err
        assert not to.exists()
