"""Configuration of the fastckpt LMCache backend: option parsing and the 0.3.x key trap.

No LMCache import: works on any object with ``storage_plugins`` and ``extra_config``
attributes (an ``LMCacheEngineConfig``) or on a plain dict loaded from YAML.

LMCache 0.5.x loads a storage plugin from::

    storage_plugins: ["fastckpt"]
    extra_config:
      storage_plugin.fastckpt.module_path: fastckpt.integrations.lmcache.backend
      storage_plugin.fastckpt.class_name: FastCkptKVBackend
      storage_plugin.fastckpt.path: /mnt/array/kv
      storage_plugin.fastckpt.max_bytes: 107374182400

LMCache 0.3.x used ``external_backends`` and ``external_backend.<name>.*`` keys. 0.5.x
maps ``external_backends`` to ``storage_plugins`` but never reads the
``external_backend.<name>.*`` keys, so such a config silently runs without the
backend. :func:`check_config` finds that (and other mistakes) and says how to fix it;
``python -m fastckpt.integrations.lmcache.config [config.yaml]`` runs it on a file or
on the ``LMCACHE_*`` environment.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass

from fastckpt.kv import KVStoreOptions

logger = logging.getLogger(__name__)

DEFAULT_NAME = "fastckpt"
MODULE_PATH = "fastckpt.integrations.lmcache.backend"
CLASS_NAME = "FastCkptKVBackend"
_OLD_PREFIX = "external_backend."


@dataclass(frozen=True)
class BackendOptions:
    """Everything the backend reads from ``extra_config`` (``storage_plugin.<name>.<option>``).

    Attributes:
        store: the :class:`KVStoreOptions` (``path``, ``max_bytes``, ``o_direct``, ``durable``,
            ``piece_bytes``, ``verify``, ``min_rescan_interval_s``, ``stale_tmp_s``).
        read_threads: threads reading pieces in parallel. Default 16.
        write_threads: threads writing chunks in the background. Default 4.
        stats_log_interval_s: least seconds between two INFO logs of the counters;
            0 disables them. Default 60.
    """

    store: KVStoreOptions
    read_threads: int = 16
    write_threads: int = 4
    stats_log_interval_s: float = 60.0


def _get(cfg, attr: str):
    if isinstance(cfg, dict):
        return cfg.get(attr)
    return getattr(cfg, attr, None)


class _Bad(ValueError):
    """One bad option value; the message is a whole line (key, expected form, value)."""


def _as_bool(v, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.strip().lower() in ("1", "true", "yes", "on")
    raise _Bad(f"extra_config {name}: expected true or false, got {v!r}")


_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def _size_hint(v) -> str:
    """``; write 5000000000`` for ``"5GB"`` (and ``5368709120`` for ``"5GiB"``), else ``""``."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)b?\s*", str(v), re.IGNORECASE)
    if not m:
        return ""
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return f"; write {n} for {v!r}"


def _as_int(v, name: str, minimum: int = 0, what: str = "an integer") -> int:
    try:
        if isinstance(v, bool):
            raise TypeError
        out = int(v)
        if isinstance(v, float) and v != out:
            raise ValueError
    except (TypeError, ValueError):
        raise _Bad(f"extra_config {name}: expected {what}, got {v!r}{_size_hint(v)}") from None
    if out < minimum:
        raise _Bad(f"extra_config {name}: expected {what}, got {v!r}")
    return out


def _as_seconds(v, name: str) -> float:
    try:
        if isinstance(v, bool):
            raise TypeError
        out = float(v)
    except (TypeError, ValueError):
        out = float("nan")
    if not out >= 0 or out == float("inf"):
        raise _Bad(f"extra_config {name}: expected a number of seconds >= 0, got {v!r}")
    return out


def _as_piece(v, name: str) -> int:
    what = "a positive multiple of 4096 (bytes), e.g. 4194304 (4 MiB, the default)"
    out = _as_int(v, name, 1, what)
    if out % 4096:
        near = max(1, round(out / 4096)) * 4096
        raise _Bad(f"extra_config {name}: expected {what}, got {v!r}; the nearest is {near}")
    return out


def _as_path(v, name: str) -> str:
    if not isinstance(v, (str, os.PathLike)) or not str(v).strip():
        raise _Bad(f"extra_config {name} is required: the shared folder for KV chunk files (a path), got {v!r}")
    return str(v)


#: Every option the backend reads from ``storage_plugin.<name>.<option>``: (converter, default).
#: ``module_path`` and ``class_name`` are LMCache's own keys of the plugin.
OPTIONS = {
    "module_path": (None, None),
    "class_name": (None, None),
    "path": (_as_path, None),
    "max_bytes": (lambda v, n: _as_int(v, n, 0, "an integer number of bytes >= 0 (0 = unlimited), "
                                             "e.g. 5368709120 for 5 GiB"), 0),
    "o_direct": (_as_bool, True),
    "durable": (_as_bool, True),
    "piece_bytes": (_as_piece, 4 << 20),
    "verify": (_as_bool, True),
    "min_rescan_interval_s": (_as_seconds, 1.0),
    "stale_tmp_s": (_as_seconds, 600.0),
    "read_threads": (lambda v, n: _as_int(v, n, 1, "an integer >= 1"), 16),
    "write_threads": (lambda v, n: _as_int(v, n, 1, "an integer >= 1"), 4),
    "stats_log_interval_s": (_as_seconds, 60.0),
}
_TOP_KEYS = ("storage_plugins", "extra_config", "external_backends")


def _closest(word: str, known) -> str | None:
    got = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return got[0] if got else None


def _read_options(extra: dict, name: str) -> tuple[dict, list[str]]:
    """``({option: value}, [one line per bad value])`` for plugin ``name``; defaults fill the gaps."""
    pre = f"storage_plugin.{name}."
    vals, errs = {}, []
    for o, (conv, default) in OPTIONS.items():
        if conv is None:
            continue
        v = extra.get(pre + o)
        if v is None and o != "path":
            vals[o] = default
            continue
        try:
            vals[o] = conv(v, pre + o)
        except _Bad as e:
            errs.append(str(e))
    return vals, errs


def _unknown_keys(cfg, extra: dict, ours: list[str]) -> list[str]:
    warns = []
    for name in ours:
        pre = f"storage_plugin.{name}."
        for key in extra:
            key = str(key)
            if not key.startswith(pre) or key[len(pre):] in OPTIONS:
                continue
            near = _closest(key[len(pre):], OPTIONS)
            warns.append(f"extra_config {key}: unknown option of {CLASS_NAME}, ignored; "
                         + (f"did you mean {pre}{near}?" if near else f"known options: {', '.join(OPTIONS)}"))
    listed = set(_get(cfg, "storage_plugins") or [])
    for key in extra:  # storage_plugin.<typo>.<option> next to a real plugin name
        parts = str(key).split(".")
        if len(parts) == 3 and parts[0] == "storage_plugin" and parts[1] not in listed \
                and not any(str(k) == f"storage_plugin.{parts[1]}.class_name" for k in extra):
            near = _closest(parts[1], listed)
            if near:
                warns.append(f"extra_config {key}: no plugin {parts[1]!r} is configured, ignored; "
                             f"did you mean storage_plugin.{near}.{parts[2]}?")
    for key in extra:  # a misspelt prefix: storage_plugn.fastckpt.max_bytes (the option silently dropped)
        head, _, rest = str(key).partition(".")
        if rest and head not in ("storage_plugin", "external_backend") and difflib.get_close_matches(
                head, ["storage_plugin"], cutoff=0.8):
            warns.append(f"extra_config {key}: not an option LMCache passes to a plugin, ignored; "
                         f"did you mean storage_plugin.{rest}?")
    if isinstance(cfg, dict):
        for key in cfg:
            if str(key) not in _TOP_KEYS:
                near = difflib.get_close_matches(str(key), _TOP_KEYS, n=1, cutoff=0.8)
                if near:
                    warns.append(f"config key {key!r} is not an LMCache option, ignored; did you mean {near[0]!r}?")
    return warns


def plugin_names(cfg) -> list[str]:
    """Names in ``storage_plugins`` whose ``module_path``/``class_name`` point at our backend."""
    extra = _get(cfg, "extra_config") or {}
    out = []
    for name in _get(cfg, "storage_plugins") or []:
        mod = str(extra.get(f"storage_plugin.{name}.module_path", ""))
        cls = extra.get(f"storage_plugin.{name}.class_name")
        if cls == CLASS_NAME and mod == MODULE_PATH:  # what LMCache imports: exactly (fastkpt.integ... is a typo)
            out.append(name)
    return out


def check_config(cfg) -> list[str]:
    """Return one warning per mistake in an LMCache config (empty if none).

    Detects: 0.3.x ``external_backend.*`` keys (ignored by 0.5.x), a plugin listed in
    ``storage_plugins`` without ``module_path``/``class_name``, a plugin meant for fastckpt (a
    ``fastckpt`` module, a class name close to ours, or a ``path`` option) whose module or class
    name has a typo, our plugin configured
    but not listed, our plugin without a ``path``, a malformed option value (one line
    naming the key and the expected form: the backend refuses to start with it), and
    unknown option keys (with the closest known one).
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
    ours = plugin_names(cfg)
    for name in listed:  # meant to be ours (a fastckpt module, our class name nearly, our options) but a typo
        mod = str(extra.get(f"storage_plugin.{name}.module_path") or "")
        cls = str(extra.get(f"storage_plugin.{name}.class_name") or "")
        if name in ours or not mod or not cls:
            continue
        if difflib.get_close_matches(mod, [MODULE_PATH], cutoff=0.8) or difflib.get_close_matches(
                cls, [CLASS_NAME], cutoff=0.8) or extra.get(f"storage_plugin.{name}.path"):
            bad = []
            if mod != MODULE_PATH:
                bad.append(f"module_path {mod!r}")
            if cls != CLASS_NAME:
                bad.append(f"class_name {cls!r}")
            warns.append(f"storage plugin {name!r} looks meant for fastckpt, but LMCache cannot load its "
                         f"{' and '.join(bad)}: did you mean module_path {MODULE_PATH}, class_name {CLASS_NAME}?")
    for name in ours:
        if not extra.get(f"storage_plugin.{name}.path"):
            warns.append(f"storage_plugin.{name}.path is not set: give the shared folder for KV chunks")
        path_key = f"extra_config storage_plugin.{name}.path "  # said just above
        warns.extend(e for e in _read_options(extra, name)[1] if not e.startswith(path_key))
    warns.extend(_unknown_keys(cfg, extra, ours))
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
    vals, errs = _read_options(extra, name)
    if errs:
        raise ValueError("; ".join(errs))
    store = KVStoreOptions(path=vals["path"], max_bytes=vals["max_bytes"], o_direct=vals["o_direct"],
                         durable=vals["durable"], piece_bytes=vals["piece_bytes"], verify=vals["verify"],
                         min_rescan_interval_s=vals["min_rescan_interval_s"], stale_tmp_s=vals["stale_tmp_s"])
    return name, BackendOptions(store, read_threads=vals["read_threads"], write_threads=vals["write_threads"],
                                stats_log_interval_s=vals["stats_log_interval_s"])


def _read_yaml_or_env(config: str | None) -> dict:
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


def check_cli(argv: list[str] | None = None) -> int:
    """CLI: check a YAML config file (or the environment); exit 1 if there are warnings."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m fastckpt.integrations.lmcache.config",
        description="Check an LMCache config for the fastckpt KV backend: LMCache 0.3.x keys that 0.5.x "
                    "ignores, unlisted or incomplete plugins, a missing path, malformed option values "
                    "(one line each: the key and the expected form) and unknown option keys (with the "
                    "closest known one). Exit status 0 if fine, 1 with warnings, 2 on an unreadable config.")
    p.add_argument("config", nargs="?", default=None,
                   help="LMCache YAML config file (default: read LMCACHE_STORAGE_PLUGINS / "
                        "LMCACHE_EXTERNAL_BACKENDS and LMCACHE_EXTRA_CONFIG (JSON) from the environment)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = _read_yaml_or_env(args.config)
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
    where = args.config or "the environment"
    if not isinstance(cfg.get("extra_config") or {}, dict):
        print(f"error: {where}: extra_config must be a mapping of 'storage_plugin.<name>.<option>: value', "
              f"got {type(cfg['extra_config']).__name__}", file=sys.stderr)
        return 2
    plugins = cfg.get("storage_plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(n, str) for n in plugins):
        print(f"error: {where}: storage_plugins must be a list of plugin names, e.g. [\"fastckpt\"], "
              f"got {plugins!r}", file=sys.stderr)
        return 2
    warns = check_config(cfg)
    names = plugin_names(cfg)
    if not warns:
        try:
            folders = {n: str(parse_options(cfg, n)[1].store.path) for n in names}
            paths = [f"{n} -> {p}" for n, p in folders.items()]
        except ValueError as e:  # not expected after check_config; one line, never a traceback
            warns, folders = [str(e)], {}
        for n, p in folders.items():
            if "://" not in p and not os.path.isdir(p):
                parent = os.path.abspath(p)
                while not os.path.exists(parent) and os.path.dirname(parent) != parent:
                    parent = os.path.dirname(parent)
                warns.append(f"storage_plugin.{n}.path {p} does not exist: the backend would create it on the file "
                             f"system of {parent} (an array that is not mounted yet fills that one); mount it or "
                             "create the folder first")
    for w in warns:
        print(f"WARNING: {w}")
    if not warns and not names:
        print(f"ok, but {args.config or 'the LMCACHE_* environment'} configures no fastckpt storage plugin")
    elif not warns:
        print("ok: " + ", ".join(paths))
    return 1 if warns else 0


if __name__ == "__main__":
    raise SystemExit(check_cli())
