"""accelerate's own checkpointing tests pass with fastckpt switched on (issue 14, first "Done when").

Runs ``scripts/run_accelerate_suite.sh`` (accelerate's sdist: ``tests/test_state_checkpointing.py``
and ``tests/test_accelerator.py -k "save_load_model or stateful_dataloader"``) once with every
``Accelerator`` using the plugin synchronously and once asynchronously, through
``tests/accelerate_suite/conftest.py``. Without fastckpt these select 40 tests here: 38 pass and 2
skip (``test_map_location`` needs a GPU). With fastckpt the same 38 must pass, minus only the
tests that conftest deselects by node id with a reason. The sdist is downloaded on first use
(``pip download``; CI installs nothing else for it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "run_accelerate_suite.sh"
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("parameterized", reason="scripts/install.sh installs parameterized (accelerate's tests need it)")
pytest.importorskip("torchdata", reason="scripts/install.sh installs torchdata (stateful dataloader tests)")

_spec = importlib.util.spec_from_file_location("fastckpt_accelerate_suite_conftest",
                                               REPO / "tests" / "accelerate_suite" / "conftest.py")
suite = importlib.util.module_from_spec(_spec)  # the deselection lists, counted below
_spec.loader.exec_module(suite)

BASELINE_PASSED = 38  # measured without fastckpt (scripts/run_accelerate_suite.sh off), accelerate 1.15.0 CPU


def _counts(out: str) -> dict[str, int]:
    tail = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    assert tail, out[-3000:]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", tail[-1])}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_accelerate_suite_passes_with_fastckpt(mode, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's options (e.g. --basetemp) are not for accelerate's suite
    proc = subprocess.run(["bash", str(SCRIPT), mode], capture_output=True, text=True, timeout=1800, env=env,
                          cwd=REPO)
    out = proc.stdout + proc.stderr
    counts = _counts(out)
    deselected = len(suite.DESELECT) + (len(suite.DESELECT_ASYNC) if mode == "async" else 0)
    assert proc.returncode == 0, out[-6000:]
    assert counts.get("failed", 0) == 0 and counts.get("error", counts.get("errors", 0)) == 0, out[-6000:]
    assert counts["passed"] == BASELINE_PASSED - deselected, counts
    assert f"fastckpt ({mode}):" in out and "checkpoints committed by fastckpt" in out, out[-3000:]
    committed = int(re.search(r"(\d+) checkpoints committed by fastckpt", out).group(1))
    assert committed >= 30, out[-3000:]  # the suite's saves went through fastckpt
