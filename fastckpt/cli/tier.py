"""``fastckpt tier [PATH]``: what the tier arbiter sees on the tier PATH lies on.

Per class (checkpoints, models, KV) the bytes stored, claimed by writes in flight and allowed
under the shared budget; the recent read and write bandwidth of the tier's processes; readers
waiting (and the KV gets among them); whether checkpoint writes are being paced. ``--json`` prints the same as one JSON
object, ``--prometheus`` as Prometheus text exposition (needs ``prometheus-client``: the
``metrics`` extra). ``--budget SIZE`` (bytes or e.g. ``2TB``) sets the tier's shared capacity budget (0: none).
Reading joins nothing: the command itself never counts as a participant.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..storage.store import LOCAL
from ..storage.tier import CLASSES, overcounted, snapshot
from ..storage.tier.shared import arbitration_off
from ..errors import InvalidArgumentError
from .common import human_bytes, parse_bytes


def _text(s: dict, recounted: bool = False) -> str:
    """The snapshot ``s`` as text; unless ``recounted`` (the counts were just lowered to what is on
    disk), the counted folders are walked once to say how much of their count is no longer there."""
    found = "" if s["found"] else ": none yet, no process joined"
    budget = (human_bytes(s["budget_bytes"]) if s["budget_bytes"]
              else f"none (the file system: {human_bytes(s['fs_free_bytes'])} free)")
    lines = [f"tier {s['tier']} (state {s['state']}{found})", f"budget: {budget}",
             f"{'class':<12} {'stored':>10} {'claimed':>10} {'allowed':>10}"]
    for c in CLASSES:
        v = s["classes"][c]
        allowed = "-" if v["allowed_bytes"] is None else human_bytes(v["allowed_bytes"])
        lines.append(f"{c:<12} {human_bytes(v['stored_bytes']):>10} {human_bytes(v['claimed_bytes']):>10} "
                     f"{allowed:>10}")
    roots = sorted((r for r in s["roots"] if r["stored_bytes"]), key=lambda r: -r["stored_bytes"])
    if roots:
        lines.append(f"counted folders: {len(roots)}, the largest "
                     + ", ".join(f"{r['path']} ({r['class']} {human_bytes(r['stored_bytes'])})" for r in roots[:3])
                     + ("; --json lists every one" if len(roots) > 3 else ""))
    over = {} if recounted else overcounted([(CLASSES.index(r["class"]), r["path"], r["stored_bytes"])
                                             for r in s["roots"] if r["class"] in CLASSES])
    if over:
        lines.append(f"note: {human_bytes(sum(over.values()))} counted in {len(over)} folder(s) are no longer on disk "
                     "(deleted by hand?): `fastckpt tier PATH --recount` lowers the counts to what is on disk")
    lines.append(f"bandwidth (last second): read {human_bytes(s['read_bps'])}/s, write {human_bytes(s['write_bps'])}/s")
    lines.append(f"waiting readers: {s['waiting_readers']} (KV gets: {s['kv_gets']}); checkpoint writers: {s['writers']}; "
                 f"background jobs: {s['background']}")
    lines.append(f"pacing: {'in effect' if s['pacing'] else 'not now'} ({s['paced_s']:.2f} s held back in "
                 f"{s['pace_waits']} waits by the live processes)")
    lines.append(f"participants: {len(s['participants'])} live process(es)"
                 + (": pids " + ", ".join(str(p["pid"]) for p in s["participants"]) if s["participants"] else ""))
    return "\n".join(lines)


def prometheus_text(s: dict) -> str:
    """The snapshot ``s`` (:func:`fastckpt.storage.tier.snapshot`) as Prometheus text exposition."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()
    lab = {"tier": s["tier"]}
    g = Gauge("fastckpt_tier_budget_bytes", "Shared capacity budget of the tier (0: none)", ["tier"], registry=reg)
    g.labels(**lab).set(s["budget_bytes"])
    stored = Gauge("fastckpt_tier_stored_bytes", "Bytes stored per class", ["tier", "class"], registry=reg)
    claimed = Gauge("fastckpt_tier_claimed_bytes", "Bytes claimed by writes in flight per class", ["tier", "class"],
                    registry=reg)
    allowed = Gauge("fastckpt_tier_allowed_bytes", "Bytes the class may hold now under the budget",
                    ["tier", "class"], registry=reg)
    for c in CLASSES:
        v = s["classes"][c]
        stored.labels(s["tier"], c).set(v["stored_bytes"])
        claimed.labels(s["tier"], c).set(v["claimed_bytes"])
        if v["allowed_bytes"] is not None:
            allowed.labels(s["tier"], c).set(v["allowed_bytes"])
    for name, key, doc in (("fs_free_bytes", "fs_free_bytes", "Free bytes of the file system the tier lies on"),
                           ("read_bytes_per_second", "read_bps", "Recent read bandwidth of the tier's processes"),
                           ("write_bytes_per_second", "write_bps", "Recent write bandwidth of the tier's processes"),
                           ("waiting_readers", "waiting_readers", "Latency-critical reads running now"),
                           ("kv_gets", "kv_gets", "KV gets running now (weight loads yield to them)"),
                           ("writers", "writers", "Checkpoint saves writing now"),
                           ("background_jobs", "background", "Background jobs (verify, copies) running now"),
                           ("pacing", "pacing", "1 while checkpoint writes are held back for readers"),
                           ("paced_seconds", "paced_s", "Time checkpoint writes of live processes were held back"),
                           ("participants", None, "Live processes on the tier")):
        gg = Gauge(f"fastckpt_tier_{name}", doc, ["tier"], registry=reg)
        gg.labels(**lab).set(len(s["participants"]) if key is None else float(s[key]))
    return generate_latest(reg).decode()


def cmd_tier(args: argparse.Namespace) -> int:
    """Show (or with ``--budget`` set, or ``--recount`` corrected) the tier that ``args.path`` lies on.

    Raises:
        InvalidArgumentError: ``args.path`` does not exist (a mistyped path would show another tier).
    """
    if not LOCAL.exists(args.path):
        raise InvalidArgumentError(f"{args.path}: no such file or folder; `fastckpt tier PATH` shows the tier an "
                                   "existing path lies on (e.g. the folder your checkpoints, models or KV chunks "
                                   "are written to)")
    if arbitration_off():
        print("note: FASTCKPT_TIER=off in this environment: processes started with it are neither arbitrated nor "
              "counted; shown is the tier's shared state as the other processes see it", file=sys.stderr)
    if args.budget is not None or args.recount:
        from ..storage.tier import tier_for
        t = tier_for(args.path)
        if not t.enabled:
            raise OSError(f"{args.path}: the tier's shared state cannot be created; nothing set or recounted")
        if args.budget is not None:
            t.set_budget(args.budget)
        if args.recount:
            freed = t.recount()
            print(f"recounted from disk: {freed} bytes of checkpoints and models removed by hand no longer counted",
                  file=sys.stderr)
        t.leave()
    s = snapshot(args.path)
    if args.json:
        print(json.dumps(s, indent=1))
    elif args.prometheus:
        try:
            text = prometheus_text(s)
        except ImportError as e:
            raise InvalidArgumentError(f"fastckpt tier --prometheus needs prometheus-client ({e}): "
                                       "pip install 'fastckpt-io[metrics]' (or prometheus-client)") from None
        print(text, end="")
    else:
        print(_text(s, recounted=args.recount))
    return 0


def add_tier_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``fastckpt tier`` to the ``fastckpt`` subcommands (called by :mod:`fastckpt.cli.main`)."""
    p = subparsers.add_parser("tier", help="per class bytes, bandwidth, waiting readers and pacing on a storage tier",
                              description=re.sub(r":[a-z]+:`", "`", __doc__.replace("``", "`")),
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="Environment: FASTCKPT_TIER names one tier spanning several mounts ('off': no "
                                     "arbitration); FASTCKPT_TIER_DIR holds the shared state (default /dev/shm); "
                                     "FASTCKPT_TIER_FACTOR bounds a paced checkpoint (default 1.3x); "
                                     "FASTCKPT_TIER_BUDGET_BYTES sets the budget; FASTCKPT_TIER_EVICT_WAIT_S bounds a save's wait "
                                     "for KV evictions (default 10 s); FASTCKPT_TIER_PROBE_S is a first save's unpaced "
                                     "probe (default 0.3 s). The budget is the tier's, shared by every user of the host's "
                                     "state. See docs/TIER.md.")
    p.add_argument("path", nargs="?", default=".", help="a path on the tier (default: the current folder)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--prometheus", action="store_true", help="print Prometheus text exposition")
    p.add_argument("--budget", type=parse_bytes, default=None,
                   help="set the tier's shared capacity budget for checkpoints, models and KV (e.g. 2TB; 0: none)")
    p.add_argument("--recount", action="store_true",
                   help="lower the stored bytes of checkpoint and model folders to what is on disk (folders "
                        "removed by hand; a save that would not fit the budget does this first by itself)")
    p.set_defaults(func=cmd_tier)
    return p
