#!/usr/bin/env bash
# Real-vLLM check of the fastckpt load-format plugin (outside CI: downloads vLLM and its CUDA
# torch build, several GB). vLLM cannot share the CI venv (it pins its own torch/torchvision).
#   1. makes its own venv ($VENV, default /tmp/fastckpt-vllm-venv) and installs vllm + fastckpt;
#   2. checks the vllm.general_plugins entry point "fastckpt" is installed (pyproject) and that
#      vLLM's plugin loading registers --load-format fastckpt;
#   3. get_model_loader(LoadConfig(load_format="fastckpt")) round trip on a tiny random Llama saved
#      with save_pretrained: download_model + the weights iterator give the saved tensors bit-exactly;
#   4. on vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu, no GPU needed): `--load-format fastckpt
#      --model-loader-extra-config` parsed by vLLM's EngineArgs reach the loader; loader.load_model
#      builds vLLM's own LlamaForCausalLM and fills it through its load_weights (fused qkv/gate_up)
#      bit-identically to load_format="safetensors", from an HF folder (small batches), a fastckpt
#      checkpoint folder (manifest checksums verified) and a run root (with --hf-config-path);
#      a flipped data byte fails the load with ChecksumMismatchError;
#   5. with a GPU: vllm.LLM(..., load_format="fastckpt") generates the same greedy tokens as
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

cfgbytes = open(os.path.join(work, "config.json"), "rb").read()
import fastckpt
fastckpt.save({"model": model.state_dict()}, os.path.join(work, "run", "step-5"),
              extra_files={"config.json": cfgbytes}, max_shard_bytes=100_000)
PY

# 4. vLLM's CPU platform: real model construction and load_weights, no GPU (own process: the
#    platform is chosen once per process).
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - "$WORK" <<'PY'
import os, shutil, sys, tempfile
import torch
work = sys.argv[1]
from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model_loader
from vllm.utils.argparse_utils import FlexibleArgumentParser
from fastckpt.errors import ChecksumMismatchError
from fastckpt.integrations.vllm import FastCkptLoaderMixin

def engine_args(*argv):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", *argv]))

ea = engine_args(work, "--load-format", "fastckpt",
                 "--model-loader-extra-config", '{"threads": 2, "batch_bytes": 65536}')
loader = get_model_loader(ea.create_load_config())
assert isinstance(loader, FastCkptLoaderMixin) and (loader.threads, loader.batch_bytes) == (2, 65536)
print("CLI --load-format fastckpt --model-loader-extra-config -> loader options OK")

def params(model, fmt, extra="{}", *more):
    ea = engine_args(model, "--load-format", fmt, "--model-loader-extra-config", extra,
                     "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "128", *more)
    mc = ea.create_model_config()
    vc = VllmConfig(model_config=mc, load_config=ea.create_load_config(), device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vc):
        if not torch.distributed.is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp()}")
            initialize_model_parallel(1, 1)
        loader = get_model_loader(vc.load_config)
        loader.download_model(mc)
        m = loader.load_model(vllm_config=vc, model_config=mc)
    return type(m).__name__, {k: v.detach().clone() for k, v in m.named_parameters()}

arch, ref = params(work, "safetensors")
ckpt, root = os.path.join(work, "run", "step-5"), os.path.join(work, "run")
for what, args in [("HF folder, 64 KiB batches", (work, "fastckpt", '{"batch_bytes": 65536, "threads": 2}')),
                   ("fastckpt checkpoint folder", (ckpt, "fastckpt")),
                   ("run root + --hf-config-path", (root, "fastckpt", "{}", "--hf-config-path", ckpt))]:
    a, got = params(*args)
    assert a == arch and got.keys() == ref.keys(), (a, sorted(got.keys() ^ ref.keys()))
    bad = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not bad, bad
    print(f"vLLM {arch} via load_format=fastckpt == safetensors, bit-exact ({len(ref)} params): {what}")

bad = os.path.join(work, "bad")
shutil.copytree(ckpt, bad)
shard = os.path.join(bad, sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[0])
with open(shard, "r+b") as f:
    f.seek(-1, os.SEEK_END); b = f.read(1); f.seek(-1, os.SEEK_END); f.write(bytes([b[0] ^ 1]))
try:
    params(bad, "fastckpt")
except ChecksumMismatchError as e:
    print("flipped byte -> ChecksumMismatchError:", str(e)[:120])
else:
    raise AssertionError("a flipped data byte loaded without error")
PY

"$VENV/bin/python" - "$WORK" <<'PY'
import sys, torch
work = sys.argv[1]
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
