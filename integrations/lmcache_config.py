"""Configuration of the fastckpt LMCache backend: option parsing and the 0.3.x key trap.

No LMCache import: works on any object with ``storage_plugins`` and ``extra_config``
attributes (an ``LMCacheEngineConfig``) or on a plain dict loaded from YAML.

LMCache 0.5.x loads a storage plugin from::

    storage_plugins: ["fastckpt"]
    extra_config:
      storage_plugin.fastckpt.module_path: fastckpt.integrations.lmcache
      storage_plugin.fastckpt.class_name: FastCkptKVBackend
      storage_plugin.fastckpt.path: /mnt/array/kv
      storage_plugin.fastckpt.max_bytes: 107374182400

LMCache 0.3.x used ``external_backends`` and ``external_backend.<name>.*`` keys. 0.5.x
maps ``external_backends`` to ``storage_plugins`` but never reads the
``external_backend.<name>.*`` keys, so such a config silently runs without the
backend. :func:`check_config` finds that (and other mistakes) and says how to fix it;
``python -m fastckpt.integrations.lmcache_config [config.yaml]`` runs it on a file or
on the ``LMCACHE_*`` environment.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass

from .lmcache_store import StoreOptions

logger = logging.getLogger(__name__)

DEFAULT_NAME = "fastckpt"
MODULE_PATH = "fastckpt.integrations.lmcache"
CLASS_NAME = "FastCkptKVBackend"
_OLD_PREFIX = "external_backend."


@dataclass(frozen=True)
class BackendOptions:
    """Everything the backend reads from ``extra_config`` (``storage_plugin.<name>.<option>``).

    Attributes:
        store: the :class:`StoreOptions` (``path``, ``max_bytes``, ``o_direct``, ``durable``,
            ``piece_bytes``, ``verify``, ``min_rescan_interval_s``, ``stale_tmp_s``).
        read_threads: threads reading pieces in parallel. Default 16.
        write_threads: threads writing chunks in the background. Default 4.
        stats_log_interval_s: least seconds between two INFO logs of the counters;
            0 disables them. Default 60.
    """

    store: StoreOptions
    read_threads: int = 16
    write_threads: int = 4
    stats_log_interval_s: float = 60.0


def _get(cfg, attr: str):
    if isinstance(cfg, dict):
        return cfg.get(attr)
    return getattr(cfg, attr, None)


def _as_bool(v, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError(f"extra_config {name}: expected true/false, got {v!r}")


def _as_int(v, name: str) -> int:
    try:
        out = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"extra_config {name}: expected an integer (plain bytes/count), got {v!r}") from None
    if isinstance(v, float) and v != out:
        raise ValueError(f"extra_config {name}: expected an integer, got {v!r}")
    return out


def plugin_names(cfg) -> list[str]:
    """Names in ``storage_plugins`` whose ``module_path``/``class_name`` point at our backend."""
    extra = _get(cfg, "extra_config") or {}
    out = []
    for name in _get(cfg, "storage_plugins") or []:
        mod = str(extra.get(f"storage_plugin.{name}.module_path", ""))
        cls = extra.get(f"storage_plugin.{name}.class_name")
        if cls == CLASS_NAME and mod.endswith("integrations.lmcache"):
            out.append(name)
    return out


def check_config(cfg) -> list[str]:
    """Return one warning per mistake in an LMCache config (empty if none).

    Detects: 0.3.x ``external_backend.*`` keys (ignored by 0.5.x), a plugin listed in
    ``storage_plugins`` without ``module_path``/``class_name``, our plugin configured
    but not listed, and our plugin without a ``path``.
    """
    extra = _get(cfg, "extra_config") or {}
    listed = list(_get(cfg, "storage_plugins") or [])
    warns = []
    old = sorted(k for k in extra if str(k).startswith(_OLD_PREFIX))
    if old:
        names = sorted({k[len(_OLD_PREFIX):].split(".", 1)[0] for k in old})
        warns.append(
            f"extra_config has LMCache 0.3.x keys {old}; LMCache 0.5.x ignores them and runs WITHOUT "
            f"the backend. Rename them to storage_plugin.<name>.* (e.g. "
            f"storage_plugin.{names[0]}.module_path) and list {names} in storage_plugins.")
    for name in listed:
        if not extra.get(f"storage_plugin.{name}.module_path") or not extra.get(f"storage_plugin.{name}.class_name"):
            warns.append(f"storage_plugins lists {name!r} but extra_config lacks storage_plugin.{name}.module_path "
                         f"or .class_name; LMCache skips it (use module_path {MODULE_PATH}, class_name {CLASS_NAME})")
    for key, val in extra.items():
        parts = str(key).split(".")
        if len(parts) == 3 and parts[0] == "storage_plugin" and parts[2] == "class_name" and val == CLASS_NAME \
                and parts[1] not in listed:
            warns.append(f"extra_config configures plugin {parts[1]!r} but storage_plugins {listed} does not "
                         f"list it; LMCache will not load it")
    for name in plugin_names(cfg):
        if not extra.get(f"storage_plugin.{name}.path"):
            warns.append(f"storage_plugin.{name}.path is not set: give the shared folder for KV chunks")
    return warns


def parse_options(cfg, name: str | None = None) -> tuple[str, BackendOptions]:
    """Read our options for plugin ``name`` (default: the one plugin pointing at us).

    Returns:
        ``(name, options)``.

    Raises:
        ValueError: no ``path``, a malformed value, or several plugins point at this
            class (LMCache does not tell a plugin its name; use one per engine).
    """
    extra = _get(cfg, "extra_config") or {}
    if name is None:
        names = plugin_names(cfg)
        if len(names) > 1:
            raise ValueError(f"storage_plugins {names} all use {CLASS_NAME}; configure it once per engine")
        name = names[0] if names else DEFAULT_NAME
    pre = f"storage_plugin.{name}."

    def opt(o, default, conv):
        v = extra.get(pre + o)
        return default if v is None else conv(v, pre + o)

    path = extra.get(pre + "path")
    if not path:
        raise ValueError(f"extra_config {pre}path is required: the shared folder for KV chunk files")
    store = StoreOptions(
        path=str(path),
        max_bytes=opt("max_bytes", 0, _as_int),
        o_direct=opt("o_direct", True, _as_bool),
        durable=opt("durable", True, _as_bool),
        piece_bytes=opt("piece_bytes", 4 << 20, _as_int),
        verify=opt("verify", True, _as_bool),
        min_rescan_interval_s=opt("min_rescan_interval_s", 1.0, lambda v, n: float(v)),
        stale_tmp_s=opt("stale_tmp_s", 600.0, lambda v, n: float(v)),
    )
    bo = BackendOptions(store, read_threads=opt("read_threads", 16, _as_int),
                        write_threads=opt("write_threads", 4, _as_int),
                        stats_log_interval_s=opt("stats_log_interval_s", 60.0, lambda v, n: float(v)))
    if bo.read_threads < 1 or bo.write_threads < 1:
        raise ValueError(f"{pre}read_threads and {pre}write_threads must be >= 1")
    return name, bo


def _load(config: str | None) -> dict:
    if config:
        import yaml  # PyYAML ships with LMCache's dependencies

        with open(config) as f:
            return yaml.safe_load(f) or {}
    env = os.environ
    cfg: dict = {}
    plugins = env.get("LMCACHE_STORAGE_PLUGINS") or env.get("LMCACHE_EXTERNAL_BACKENDS")
    if plugins:
        cfg["storage_plugins"] = [p.strip() for p in plugins.split(",") if p.strip()]
    if env.get("LMCACHE_EXTRA_CONFIG"):
        cfg["extra_config"] = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    return cfg


def main(argv: list[str] | None = None) -> int:
    """CLI: check a YAML config file (or the environment); exit 1 if there are warnings."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m fastckpt.integrations.lmcache_config",
        description="Check an LMCache config for the fastckpt KV backend: LMCache 0.3.x keys that 0.5.x "
                    "ignores, unlisted or incomplete plugins, a missing path. Exit status 0 if fine, "
                    "1 with warnings, 2 on an unreadable config.")
    p.add_argument("config", nargs="?", default=None,
                   help="LMCache YAML config file (default: read LMCACHE_STORAGE_PLUGINS / "
                        "LMCACHE_EXTERNAL_BACKENDS and LMCACHE_EXTRA_CONFIG (JSON) from the environment)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = _load(args.config)
    except Exception as e:  # missing file, bad JSON (ValueError), bad YAML (yaml.YAMLError)
        if not isinstance(e, (OSError, ValueError)) and not type(e).__module__.startswith("yaml"):
            raise
        print(f"error: cannot read {args.config or 'LMCACHE_EXTRA_CONFIG'}: {e}", file=sys.stderr)
        return 2
    if not isinstance(cfg, dict):
        print(f"error: {args.config or 'the environment'} is not a mapping of LMCache options", file=sys.stderr)
        return 2
    if "external_backends" in cfg and "storage_plugins" not in cfg:
        cfg["storage_plugins"] = cfg["external_backends"]
    warns = check_config(cfg)
    for w in warns:
        print(f"WARNING: {w}")
    if not warns and not plugin_names(cfg):
        print(f"ok, but {args.config or 'the LMCACHE_* environment'} configures no fastckpt storage plugin")
    elif not warns:
        print("ok: " + ", ".join(f"{n} -> {parse_options(cfg, n)[1].store.path}" for n in plugin_names(cfg)))
    return 1 if warns else 0


if __name__ == "__main__":
    raise SystemExit(main())
