#!/usr/bin/env bash
# Runs fastckpt's save/load/integration tests on the NEWEST torch, transformers, accelerate and peft
# the package index offers (issue 20, item 7), beside the pinned set of scripts/install.sh
# (torch 2.13.0, transformers 5.24.0, accelerate 1.15.0, peft 0.21.2) that the main test run uses.
#
# It creates (or reuses, upgrading) a separate virtualenv, .venv-newest (FASTCKPT_NEWEST_VENV), with
# no system site packages, asks the index for the newest release of each package (`pip index
# versions`), installs fastckpt editable with its test extras, the newest releases pip can resolve,
# pytest-timeout and torchdata, lays the index's newest release over any that pip could not resolve
# (with --no-deps, saying so), prints the versions, and runs TESTS below with a per-test timeout and
# a total one. Exit status: pytest's (124 when the total timeout cut it short).
#
# torch: the newest release pip will install on this machine. Where /etc/xdg/pip caps torch (at
# 2.14.1 on the project's machines, which lies on disk with its CUDA libraries), that is the cap: the
# newest release on the index (2.15.0 on 2026-12-03) is refused by the cap and would be a CUDA build
# of several GB from the network; PyPI offers no CPU-only wheel of either, and the CPU index
# (download.pytorch.org) is not reachable from these machines. The script asks pip which torch it
# would take (`pip install --dry-run`, constraints applied) and installs that; it never lifts the cap.
# The torch it takes is a CUDA build (about 5.5 GB in the venv) that runs on the CPU here.
# FASTCKPT_NEWEST_TORCH=X.Y.Z chooses another torch; past the cap, give it PIP_CONSTRAINT=/dev/null (the
# cap stays for everything else) and its own venv, e.g. for the index's newest (CUDA 13.2 libraries,
# about 4 GB downloaded): FASTCKPT_NEWEST_TORCH=2.15.0 PIP_CONSTRAINT=/dev/null
# FASTCKPT_NEWEST_VENV=.venv-newest-215 bash scripts/test_newest.sh
# Do not run two of these on one venv at once: each run reinstalls transformers (below).
#
# Usage: bash scripts/test_newest.sh [extra pytest args]   (e.g. -x, or -k NAME)
# Measured on the project's 2-core machine: see docs/TESTING.md, "Tested versions".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FASTCKPT_NEWEST_VENV:-.venv-newest}
PER_TEST_TIMEOUT=${FASTCKPT_NEWEST_TEST_TIMEOUT:-300}
TOTAL_TIMEOUT=${FASTCKPT_NEWEST_TOTAL_TIMEOUT:-1140}  # 19 min, then SIGINT: pytest still prints its summary
# The save/load round trips, load_into, the DCP reader/writer (dcp.save/dcp.load with FastCkptWriter /
# FastCkptReader under FSDP2), the Trainer callback, the accelerate plugin (FSDP2 included), peft
# checkpoints and the CLI. Not here: accelerate's own sdist suite (test_accelerate_suite.py, tied to
# the pinned accelerate's sources), DeepSpeed, torchtitan, Lightning and LMCache (pinned to releases
# made for the pinned torch), fault injection. FASTCKPT_NEWEST_FULL=1 adds MORE_TESTS: the heavier
# 2-rank files (DDP/FSDP2 Trainer, accelerate multi-process, interrupted and multi-rank saves), which
# push the run past 20 minutes on the shared 2-core machine.
TESTS=(
  tests/saving/test_save_load.py
  tests/saving/test_stateful.py
  tests/saving/test_dcp_dropin.py
  tests/loading/test_exact_reads.py
  tests/reference/test_reference_equivalence.py
  tests/cli/test_servable_gate.py
  tests/integrations/test_hf_trainer_position.py
  tests/saving/test_dedupe.py
  tests/saving/test_byte_order.py
  tests/saving/test_dtensor.py
  tests/saving/test_dtensor_fsdp.py
  tests/saving/test_dtensor_chunks.py
  tests/loading/test_load_into.py
  tests/loading/test_load_into_regions.py
  tests/loading/test_dcp_reader.py
  tests/loading/test_hub_folders.py
  tests/loading/test_source_layouts.py
  tests/loading/test_format_v2_read.py
  tests/loading/test_reader_errors.py
  tests/integrations/test_hf_trainer.py
  tests/integrations/test_hf_trainer_contracts.py
  tests/integrations/test_hf_trainer_sigterm.py
  tests/integrations/test_accelerate.py
  tests/integrations/test_accelerate_contracts.py
  tests/integrations/test_accelerate_fsdp2.py
  tests/integrations/test_peft_checkpoints.py
  tests/cli/test_cli.py
  tests/cli/test_cli_errors.py
  tests/cli/test_export_honest.py
  tests/cli/test_serve_cli.py
  tests/cli/test_verify_cli.py
)
MORE_TESTS=(
  tests/saving/test_interrupted.py
  tests/saving/test_distributed.py
  tests/loading/test_load_into_multirank.py
  tests/integrations/test_hf_trainer_ddp.py
  tests/integrations/test_accelerate_multiproc.py
)
[ "${FASTCKPT_NEWEST_FULL:-0}" != 1 ] || TESTS+=("${MORE_TESTS[@]}")

[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
VPY=$VENV/bin/python
# (this machine's pip config adds local indexes that warn for every package they lack: filtered out)
pipq() { "$VPY" -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
# Newest release on the index: the first line of `pip index versions` is "NAME (X.Y.Z)".
newest() { "$VPY" -m pip index versions --disable-pip-version-check "$1" 2>/dev/null | sed -n '1s/^.*(\(.*\))$/\1/p'; }

TORCH_INDEX=$(newest torch)
if [ -n "${FASTCKPT_NEWEST_TORCH:-}" ]; then
  TORCH=$FASTCKPT_NEWEST_TORCH
else
  # What pip itself would install for a plain `torch`, under this machine's constraints.
  TORCH=$("$VPY" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed --no-deps \
            --report - torch | "$VPY" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')
fi
TF=$(newest transformers); AC=$(newest accelerate); PEFT=$(newest peft)
for v in "$TORCH_INDEX" "$TORCH" "$TF" "$AC" "$PEFT"; do
  [ -n "$v" ] || { echo "test_newest.sh: could not read a version from the package index" >&2; exit 2; }
done
echo "index offers: torch $TORCH_INDEX, transformers $TF, accelerate $AC, peft $PEFT"
[ "$TORCH" = "$TORCH_INDEX" ] || echo "torch: installing $TORCH (the newest this machine's pip takes; the index's newest, $TORCH_INDEX, is past the cap)"

pipq install --upgrade "torch==$TORCH"
# The newest transformers/accelerate/peft whose requirements the index satisfies (at least the pinned set).
pipq install --upgrade -e ".[test]" "torch==$TORCH" "transformers>=5.24.0" "accelerate>=1.15.0" \
  "peft>=0.21.2" pytest-timeout torchdata
# Where the index's newest release cannot be installed with its requirements (transformers 5.25.0 asks
# for kernels>=0.19.1, which the index lacks on 2026-12-03), that release is laid over the resolved one
# with --no-deps, with those of its requirements the index has; `pip check` below names what is missing.
NOTES=""
for pv in "transformers $TF" "accelerate $AC" "peft $PEFT"; do
  read -r name want <<<"$pv"
  have=$("$VPY" -c "from importlib.metadata import version; print(version('$name'))")
  [ "$have" = "$want" ] && continue
  pipq install --no-deps "$name==$want"
  mapfile -t reqs < <("$VPY" -c '
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
for r in map(Requirement, requires(sys.argv[1]) or []):
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        print(r)' "$name")
  ok=()
  for r in "${reqs[@]}"; do
    if "$VPY" -m pip install -q --disable-pip-version-check --dry-run --no-deps "$r" >/dev/null 2>&1; then
      ok+=("$r")
    else
      NOTES+="$name $want: its requirement '$r' is not on the index, installed without it (pip resolved $have). "
    fi
  done
  [ ${#ok[@]} -eq 0 ] || pipq install "${ok[@]}" "torch==$TORCH"
done
"$VPY" -m pip check --disable-pip-version-check || true
[ -z "$NOTES" ] || echo "NOTE: $NOTES"

echo "== versions tested =="
"$VPY" - <<'EOF'
import platform
from importlib.metadata import version
print("python", platform.python_version())
for name in ("torch", "transformers", "accelerate", "peft", "safetensors", "huggingface_hub", "tokenizers",
             "numpy", "fastckpt-io"):
    print(f"{name} {version(name)}")
EOF

# transformers 5.25.0's from_pretrained turns hub kernels on by default and then needs the `kernels`
# package; where the index cannot supply it (above), USE_HUB_KERNELS=0, transformers' own switch, turns
# them off.
if ! "$VPY" -c 'import kernels' 2>/dev/null; then
  export USE_HUB_KERNELS=0
  echo "kernels not installed: USE_HUB_KERNELS=0"
fi
export PATH="$PWD/$VENV/bin:$PATH"   # tests that call the `fastckpt` console script take this venv's
start=$(date +%s)
set +e
timeout -s INT -k 60 "$TOTAL_TIMEOUT" "$VPY" -m pytest -q -p no:cacheprovider --timeout="$PER_TEST_TIMEOUT" \
  --durations=15 "${TESTS[@]}" "$@"
rc=$?
set -e
echo "test_newest.sh: pytest exit $rc after $(( $(date +%s) - start )) s (torch $TORCH, transformers $TF, accelerate $AC, peft $PEFT)"
exit $rc
