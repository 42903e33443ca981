"""The package's imports point one way (DESIGN.md "Layers"): import-linter's contracts in
pyproject.toml, and the shared layering check (cycles, private names across modules) where the
shared tools are present."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_linter_contracts_hold():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout and "0 broken" in out.stdout, out.stdout[-2000:]


def test_no_cycles_or_private_names_across_modules():
    tool = os.path.join(ROOT, "..", "shared", "tools", "layering.py")
    if not os.path.exists(tool):
        pytest.skip("../shared/tools/layering.py is not beside this checkout")
    out = subprocess.run([sys.executable, tool, "fastckpt", "integrations"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout


def test_public_names_are_documented_and_dir_lists_no_import_helpers():
    """``dir(fastckpt)`` is what a user tabs through: the public API (every name in ``__all__``
    resolves and has a docstring, classes and functions), not ``os`` / ``Path`` / ``Any``; the
    signatures still resolve for ``typing.get_type_hints`` (checked in a fresh interpreter, so no
    other test's imports add layers)."""
    code = ("import sys, typing, fastckpt\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules\n"  # fastckpt.dcp: on first use only
            "assert fastckpt.dcp.FastCkptWriter and fastckpt.dcp.load\n"  # README's fastckpt.dcp.FastCkptWriter(path)
            "names = dir(fastckpt)\n"
            "bad = sorted(set(names) & {'os', 'Path', 'Any', 'Callable', 'fields', 'annotations'})\n"
            "assert not bad, bad\n"
            "assert set(fastckpt.__all__) <= set(names)\n"
            "for n in names:\n"
            "    obj = getattr(fastckpt, n)\n"
            "    if callable(obj) and not isinstance(obj, type(fastckpt)):\n"
            "        assert (obj.__doc__ or '').strip(), n\n"
            "for f in (fastckpt.save, fastckpt.async_save, fastckpt.load, fastckpt.load_into):\n"
            "    typing.get_type_hints(f)\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_snapshot_of_a_model_without_peft_does_not_import_peft():
    """``model_snapshot`` (what the Trainer callback calls at each save) imported peft to ask whether the
    model was a PeftModel: about 0.1-1.8 s inside a full fine-tune's first save, for a model peft never
    touched. A peft model exists only once peft is imported, so nothing needs importing (fresh interpreter)."""
    pytest.importorskip("transformers")
    code = ("import sys, torch, transformers as T\n"
            "from fastckpt.integrations.hf.snapshot import model_snapshot\n"
            "m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,\n"
            "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
            "assert 'peft' not in sys.modules, 'imported before the snapshot: the test proves nothing'\n"
            "state, weights, extra = model_snapshot(m)\n"
            "assert 'peft' not in sys.modules\n"
            "assert 'model.embed_tokens.weight' in state['model']\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
