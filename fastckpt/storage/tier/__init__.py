"""The tier arbiter: processes on one storage tier share its bandwidth and one capacity budget.

Public parts (see :mod:`.arbiter` for the rules, :mod:`.state` for the shared state):

* :func:`tier_for` (this process's membership of the tier a path lies on: :class:`Tier`, or
  :class:`NullTier` where there is no arbitration), with :meth:`Tier.reading` (a
  latency-critical read; ``kv=True``: a KV get), :meth:`Tier.writer` (a checkpoint's
  :class:`WritePacer`), :meth:`Tier.loader` (a weight load's :class:`LoadPacer`),
  :meth:`Tier.background` (a :class:`BackgroundPacer`), :meth:`Tier.claim` /
  :meth:`Tier.reserve_kv` (capacity, a :class:`Claim`), :meth:`Tier.publish` /
  :meth:`Tier.add_stored` (stored bytes per folder) and :meth:`Tier.add_evictor`;
* :func:`snapshot` (what ``fastckpt tier`` shows), :func:`overcounted` (bytes counted but no
  longer on disk, what :meth:`Tier.recount` removes) and :data:`CLASSES`.

It sits below ``storage`` in the layers: saving, loading and the KV store call it; it imports
only :mod:`fastckpt.errors`.
"""

from .arbiter import NO_WRITES, BackgroundPacer, CheckpointWrites, Claim, LoadPacer, NullTier, Tier, WritePacer, tier_for, overcounted
from .report import snapshot
from .shared import CLASSES

__all__ = ["NO_WRITES", "CheckpointWrites", "BackgroundPacer", "Claim", "LoadPacer", "NullTier", "Tier", "WritePacer", "tier_for", "overcounted", "snapshot", "CLASSES"]
