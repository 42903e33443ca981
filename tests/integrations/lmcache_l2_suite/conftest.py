"""Re-points LMCache 0.5.6's own L2 adapter tests (from its sdist) at fastckpt's L2 adapter.

``tests/integrations/test_lmcache_l2.py`` copies these files of the sdist next to this conftest
and runs them inside the LMCache venv:

* ``tests/v1/distributed/test_mock_l2_adapter.py``: the ``L2AdapterInterface`` contract ("tests
  are written based on the L2AdapterInterface contract defined in base.py"), whose fixtures
  build ``MockL2Adapter(MockL2AdapterConfig(max_size_gb=...))``;
* ``tests/v1/distributed/test_fs_l2_adapter_delete.py``: the file-system adapter's tests (delete,
  byte accounting, listener events), whose fixture builds ``FSL2Adapter(FSL2AdapterConfig(base_path))``;
* ``tests/v1/distributed/test_distributed_storage_manager.py::TestStorageManagerL2Prefetch``: the
  server's StorageManager storing to and prefetching from its L2 adapter (end to end).

Before those modules are imported, the names they import are replaced: each config becomes
LMCache's ``PluginL2AdapterConfig`` naming ``fastckpt.integrations.lmcache.l2.FastCkptL2Adapter``
(a fresh folder per adapter, ``max_bytes`` = the mock's ``max_size_gb``), and each adapter class
becomes LMCache's own ``create_l2_adapter`` (its plugin factory imports and builds ours). So every
test runs through the plugin loading path a server uses. The tests' bodies are unchanged.

The storage-manager module skips itself unless ``lmcache.torch_dev.is_available()``; LMCache's
CPU stub device says False, yet the StorageManager with an L2 adapter runs on CPU (L1 is host
memory), so the guard is answered True here.
"""

import itertools
import os
import tempfile

import lmcache
import lmcache.v1.distributed.l2_adapters.fs_l2_adapter as fs_mod
import lmcache.v1.distributed.l2_adapters.mock_l2_adapter as mock_mod
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

import fastckpt.integrations.lmcache.l2 as ours

_ROOT = tempfile.mkdtemp(prefix="fckv-l2-suite-", dir=os.environ.get("FASTCKPT_L2_SUITE_TMP"))
_seq = itertools.count()
#: every adapter the suite built (the runner checks that they were ours)
BUILT = []


def _plugin_config(path: str, max_bytes: int) -> PluginL2AdapterConfig:
    return PluginL2AdapterConfig.from_dict({"module_path": ours.MODULE_PATH, "class_name": ours.CLASS_NAME,
                                            "adapter_params": {"path": path, "max_bytes": max_bytes}})


def MockL2AdapterConfig(max_size_gb: float = 0.0, mock_bandwidth_gb: float = 0.0, **_):
    """The mock's config -> our plugin config over a fresh folder of ``max_size_gb`` GiB."""
    return _plugin_config(os.path.join(_ROOT, f"mock-{next(_seq)}"), int(max_size_gb * (1 << 30)))


def FSL2AdapterConfig(base_path: str, **_):
    """The file-system adapter's config -> our plugin config over ``base_path`` (no capacity, as fs)."""
    return _plugin_config(base_path, 0)


def _build(config, *args, **kwargs):
    adapter = create_l2_adapter(config)
    assert isinstance(adapter, ours.FastCkptL2Adapter), type(adapter)
    BUILT.append(type(adapter).__name__)
    return adapter


mock_mod.MockL2AdapterConfig = MockL2AdapterConfig
mock_mod.MockL2Adapter = _build
fs_mod.FSL2AdapterConfig = FSL2AdapterConfig
fs_mod.FSL2Adapter = _build
lmcache.torch_dev.is_available = lambda: True


def pytest_sessionfinish(session, exitstatus):
    print(f"\nfastckpt L2 adapters built through LMCache's plugin factory: {len(BUILT)}")
