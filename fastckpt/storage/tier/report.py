"""What a tier's shared state says now, read without joining it (``fastckpt tier``)."""

from __future__ import annotations

import os
import time

from .shared import CLASSES, RATE_WINDOW_S, TTL_S, SharedState, state_path, tier_name


def snapshot(path: str | os.PathLike = ".") -> dict:
    """The tier that ``path`` lies on, as a plain dict (read-only: this call joins nothing).

    Returns:
        ``{"tier", "state", "found", "budget_bytes", "classes": {cls: {"stored_bytes",
        "claimed_bytes", "allowed_bytes"}}, "roots": [{"class", "path", "stored_bytes"}],
        "read_bps", "write_bps",
        "waiting_readers", "kv_gets", "writers", "background", "pacing", "paced_s", "pace_waits",
        "participants": [...], "fs_free_bytes", "fs_total_bytes"}``. ``allowed_bytes`` is what
        the class may hold at most now (the budget less what the classes it cannot evict hold;
        None without a budget). Rates are bytes per second over the last second.
        ``waiting_readers`` counts latency-critical reads running now, ``kv_gets`` the KV gets
        among them (weight loads hold their next reads while one runs).
    """
    name = tier_name(path)
    sp = state_path(name)
    st = os.statvfs(os.fspath(path) if os.path.exists(path) else os.path.dirname(os.path.abspath(path)))
    out: dict = {"tier": name, "state": sp, "found": False, "budget_bytes": 0,
                 "fs_free_bytes": st.f_bavail * st.f_frsize, "fs_total_bytes": st.f_blocks * st.f_frsize,
                 "classes": {c: {"stored_bytes": 0, "claimed_bytes": 0, "allowed_bytes": None} for c in CLASSES},
                 "roots": [], "read_bps": 0.0, "write_bps": 0.0, "waiting_readers": 0, "kv_gets": 0, "writers": 0,
                 "background": 0, "pacing": False, "paced_s": 0.0, "pace_waits": 0, "participants": []}
    try:
        state = SharedState(sp, writable=False)
    except OSError:
        return out
    try:
        now = time.time_ns()
        budget = state.budget()
        used = state.used_by_class()
        claims = [0, 0, 0]
        out.update(found=True, budget_bytes=budget)
        for _, s in state.live(now):
            fresh = (now - s.win_t0_ns) / 1e9 < 2 * RATE_WINDOW_S + TTL_S
            for c in range(3):
                claims[c] += s.claims[c]
            out["read_bps"] += s.read_bps if fresh else 0.0
            out["write_bps"] += s.write_bps if fresh else 0.0
            out["waiting_readers"] += s.readers
            out["kv_gets"] += s.kv_readers
            out["writers"] += s.writers
            out["background"] += s.background
            out["pacing"] = out["pacing"] or bool(s.pacing)
            out["paced_s"] += s.paced_ns / 1e9
            out["pace_waits"] += s.pace_waits
            out["participants"].append({
                "pid": s.pid, "readers": s.readers, "kv_gets": s.kv_readers, "writers": s.writers, "background": s.background,
                "kv_evictor": bool(s.evictor), "claimed_bytes": dict(zip(CLASSES, s.claims)),
                "read_bytes": s.read_bytes, "write_bytes": s.write_bytes, "paced_s": s.paced_ns / 1e9,
                "pace_waits": s.pace_waits, "background_waited_s": s.bg_waited_ns / 1e9})
        for i, c in enumerate(CLASSES):
            held = sum(used[j] + claims[j] for j in range(3) if j != i and CLASSES[j] != "kv") if c != "kv" \
                else sum(used[j] + claims[j] for j in range(3) if j != i)
            out["classes"][c] = {"stored_bytes": used[i], "claimed_bytes": claims[i],
                                 "allowed_bytes": max(0, budget - held) if budget else None}
        out["roots"] = [{"class": CLASSES[c] if 0 <= c < 3 else str(c), "path": p, "stored_bytes": u}
                        for _, c, p, u, _ in state.roots()]
        return out
    finally:
        state.close()
