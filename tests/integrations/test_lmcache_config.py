"""Config of the LMCache backend: option parsing and the 0.3.x ``external_backend.*`` trap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastckpt.integrations.lmcache_config import check_config, main, parse_options

GOOD = {
    "storage_plugins": ["fastckpt"],
    "extra_config": {
        "storage_plugin.fastckpt.module_path": "fastckpt.integrations.lmcache",
        "storage_plugin.fastckpt.class_name": "FastCkptKVBackend",
        "storage_plugin.fastckpt.path": "/mnt/array/kv",
        "storage_plugin.fastckpt.max_bytes": 1 << 30,
        "storage_plugin.fastckpt.o_direct": "false",  # env JSON often carries strings
        "storage_plugin.fastckpt.read_threads": "8",
    },
}
OLD_03X = {
    "external_backends": ["fastckpt"],
    "extra_config": {
        "external_backend.fastckpt.module_path": "fastckpt.integrations.lmcache",
        "external_backend.fastckpt.class_name": "FastCkptKVBackend",
        "external_backend.fastckpt.path": "/mnt/array/kv",
    },
}


def test_good_config_parses():
    assert check_config(GOOD) == []
    name, o = parse_options(GOOD)
    assert name == "fastckpt" and o.store.path == "/mnt/array/kv"
    assert o.store.max_bytes == 1 << 30 and o.store.o_direct is False and o.read_threads == 8
    assert o.store.durable is True and o.store.piece_bytes == 4 << 20


def test_old_external_backend_keys_are_detected():
    cfg = dict(OLD_03X, storage_plugins=OLD_03X["external_backends"])  # what 0.5.x makes of it
    warns = check_config(cfg)
    assert any("0.3.x" in w and "storage_plugin.fastckpt.module_path" in w for w in warns)
    assert any("lacks storage_plugin.fastckpt.module_path" in w for w in warns)


@pytest.mark.parametrize("bad", [
    {"storage_plugin.fastckpt.max_bytes": "5GB"},
    {"storage_plugin.fastckpt.o_direct": "maybe"},
    {"storage_plugin.fastckpt.piece_bytes": 1000},
    {"storage_plugin.fastckpt.read_threads": 0},
    {"storage_plugin.fastckpt.path": ""},
])
def test_bad_values_are_refused_with_the_key_named(bad):
    cfg = {"storage_plugins": GOOD["storage_plugins"], "extra_config": {**GOOD["extra_config"], **bad}}
    with pytest.raises(ValueError) as ei:
        parse_options(cfg)
    assert "fastckpt" in str(ei.value) or "piece_bytes" in str(ei.value)


def test_cli_checks_the_environment_form(capsys, monkeypatch):
    monkeypatch.setenv("LMCACHE_STORAGE_PLUGINS", "fastckpt")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps(GOOD["extra_config"]))
    assert main([]) == 0 and "fastckpt -> /mnt/array/kv" in capsys.readouterr().out
    monkeypatch.delenv("LMCACHE_STORAGE_PLUGINS")
    monkeypatch.setenv("LMCACHE_EXTERNAL_BACKENDS", "fastckpt")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps(OLD_03X["extra_config"]))
    assert main([]) == 1 and "0.3.x" in capsys.readouterr().out


def test_lmcache_really_ignores_the_old_keys(tmp_path):
    """The trap is real in the installed LMCache: the 0.3.x config loads no plugin."""
    pytest.importorskip("lmcache")
    code = (
        "import json, sys, torch, asyncio\n"
        "from lmcache.v1.config import LMCacheEngineConfig\n"
        "from lmcache.v1.metadata import LMCacheMetadata\n"
        "from lmcache.v1.storage_backend import CreateStorageBackends\n"
        "cfg = LMCacheEngineConfig.from_dict(json.loads(sys.argv[1]))\n"
        "meta = LMCacheMetadata('m', 1, 1, 0, 0, torch.bfloat16, (2, 2, 256, 2, 64))\n"
        "print(json.dumps(list(CreateStorageBackends(cfg, meta, asyncio.new_event_loop()))))\n"
    )
    for cfg, want in ((OLD_03X, False), (GOOD, True)):
        cfg = json.loads(json.dumps(cfg))
        key = [k for k in cfg["extra_config"] if k.endswith(".path")][0]
        cfg["extra_config"][key] = str(tmp_path / "kv")
        cfg["max_local_cpu_size"] = 0.1
        r = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONHASHSEED="0"))
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("fastckpt" in json.loads(r.stdout.strip().splitlines()[-1])) is want
