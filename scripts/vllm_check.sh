#!/usr/bin/env bash
# Real-vLLM check of the fastckpt load-format plugin (outside CI: downloads vLLM and its CUDA
# torch build, several GB). vLLM cannot share the CI venv (it pins its own torch/torchvision).
#   1. makes its own venv ($VENV, default /tmp/fastckpt-vllm-venv) and installs vllm + fastckpt;
#   2. checks the vllm.general_plugins entry point "fastckpt" is installed (pyproject) and that
#      vLLM's plugin loading registers --load-format fastckpt;
#   3. get_model_loader(LoadConfig(load_format="fastckpt")) round trip on a tiny random Llama saved
#      with save_pretrained: download_model + the weights iterator give the saved tensors bit-exactly;
#   4. with a GPU: vllm.LLM(..., load_format="fastckpt") generates the same greedy tokens as
#      load_format="safetensors".
# Usage: bash scripts/vllm_check.sh [VLLM_SPEC]   (default "vllm>=0.10")
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-/tmp/fastckpt-vllm-venv}"
SPEC="${1:-vllm>=0.10}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "$SPEC"                  # brings vLLM's own torch build
"$VENV/bin/pip" install -q -e . --no-deps           # fastckpt from this tree (entry points)
"$VENV/bin/pip" install -q xxhash tqdm safetensors
WORK="$(mktemp -d /tmp/fastckpt-vllm.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

"$VENV/bin/python" - "$WORK" <<'PY'
import importlib.metadata as md, os, sys
import torch, transformers
work = sys.argv[1]
import vllm
print("vllm", vllm.__version__, "torch", torch.__version__)

eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "fastckpt"]
print("entry point:", eps[0].value if eps else "MISSING (add it to pyproject.toml and reinstall)")
from vllm.plugins import load_general_plugins
load_general_plugins()
if not eps:
    from fastckpt.integrations.vllm import register
    register()

from vllm.config import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
from fastckpt.integrations.vllm import FastCkptLoaderMixin
loader = get_model_loader(LoadConfig(load_format="fastckpt"))
assert isinstance(loader, FastCkptLoaderMixin), type(loader)
print("get_model_loader ->", type(loader).__mro__[:3])

torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(cfg)
model.save_pretrained(work, max_shard_size="100KB")
class MC:  # the fields the loader reads from vLLM's ModelConfig
    model, revision, quantization = work, None, None
loader.download_model(MC)
got = dict(loader.get_weights_iterator(work))
ref = {k: v for k, v in model.state_dict().items() if k in got}
assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), "weights differ"
print(f"round trip OK: {len(got)} tensors")

if torch.cuda.is_available():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(511)} | {"[UNK]": 511}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(work)
    from vllm import LLM, SamplingParams
    sp = SamplingParams(max_tokens=8, temperature=0)
    outs = {}
    for fmt in ("fastckpt", "safetensors"):
        llm = LLM(model=work, load_format=fmt, enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=128)
        outs[fmt] = llm.generate(["t1 t2 t3"], sp)[0].outputs[0].token_ids
        del llm
    assert outs["fastckpt"] == outs["safetensors"], outs
    print("LLM generate OK, same tokens:", outs["fastckpt"])
else:
    print("no GPU: skipped LLM(load_format='fastckpt') generation")
PY
