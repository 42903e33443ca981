"""Runs the LMCache backend tests inside the LMCache venv made by scripts/install.sh.

LMCache 0.5.6 pins numpy<=2.2.6, so it cannot share the main environment (numpy 2.x newer);
``scripts/install.sh`` makes ``.venv-lmcache`` (seeing the installing environment's packages after
its own, so the same torch and fastckpt) and this test runs the real-LMCache tests there with ``FASTCKPT_REQUIRE_LMCACHE=1``
(a missing LMCache is a failure, not a skip). Without the venv it skips, except under CI.
"""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_PY = ROOT / ".venv-lmcache" / "bin" / "python"


def test_lmcache_suite_in_its_venv():
    if not VENV_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VENV_PY} missing: scripts/install.sh did not create the LMCache venv")
        pytest.skip("run scripts/install.sh to create .venv-lmcache")
    if os.environ.get("FASTCKPT_REQUIRE_LMCACHE") == "1":
        pytest.skip("already running inside the LMCache venv")
    env = dict(os.environ, FASTCKPT_REQUIRE_LMCACHE="1")
    r = subprocess.run([str(VENV_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/integrations/test_lmcache.py", "tests/kv/test_file_store.py", "tests/integrations/test_lmcache_config.py",
                        "tests/integrations/test_lmcache_l2.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
