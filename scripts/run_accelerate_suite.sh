#!/usr/bin/env bash
# Runs accelerate's own checkpointing tests (from the sdist of the installed accelerate version)
# with fastckpt switched on for every Accelerator through tests/accelerate_suite/conftest.py.
#   scripts/run_accelerate_suite.sh MODE [pytest args...]     MODE: sync | async | off (baseline)
# The sdist is downloaded once (pip download --no-binary :all: --no-deps) into
# $FASTCKPT_ACCEL_SDIST_DIR (default ~/.cache/fastckpt/accelerate-sdist); needs parameterized
# and torchdata (scripts/install.sh installs them).
set -euo pipefail
MODE=${1:?usage: run_accelerate_suite.sh sync|async|off [pytest args]}
shift
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
VER=$($PY -c 'import accelerate; print(accelerate.__version__)')
CACHE=${FASTCKPT_ACCEL_SDIST_DIR:-$HOME/.cache/fastckpt/accelerate-sdist}
TARBALL=$CACHE/accelerate-$VER.tar.gz
mkdir -p "$CACHE"
if [ ! -f "$TARBALL" ]; then
  $PY -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps "accelerate==$VER" -d "$CACHE"
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastckpt-accel-suite.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
tar xzf "$TARBALL" -C "$WORK"
SRC=$WORK/accelerate-$VER
cp "$REPO/tests/accelerate_suite/conftest.py" "$SRC/tests/conftest.py"
cd "$SRC"
# the sdist's tests import the *installed* accelerate; fastckpt resolves as in the caller's environment
FASTCKPT_ACCELERATE_MODE=$MODE $PY -m pytest -q -p no:cacheprovider --rootdir "$SRC" \
  --basetemp "$WORK/pt" -rs tests/test_state_checkpointing.py tests/test_accelerator.py \
  -k "CheckpointTest or save_load_model or stateful_dataloader" "$@"
