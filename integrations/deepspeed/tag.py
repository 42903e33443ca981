"""One DeepSpeed tag committed by every rank together (used by :mod:`fastckpt.integrations.deepspeed.engine`).

DeepSpeed's ``save_checkpoint`` has each rank write its own files of ``save_dir/tag`` and then
rank 0 writes ``save_dir/latest`` right after its *own* ``checkpoint_engine.commit`` returns
(deepspeed/runtime/engine.py, ``save_checkpoint``). With one fastckpt folder per file, each file
is atomic, but the tag is not: a rank that failed would leave ``latest`` naming a tag without
its partition. fastckpt's engine therefore makes ``commit`` a vote of every rank:

1. each rank waits for its own files (durable and committed, or failed);
2. :func:`vote`: every rank learns every rank's outcome (an ``all_gather`` of a fixed-size
   byte tensor holding the error text; no pickle);
3. all succeeded: rank 0 writes :data:`MARKER` (``fastckpt_tag.json``: the tag's file names and
   the world size; temp file, fsync, rename, fsync of the folder) and a second vote tells every
   rank that it is durable. Only then do the ranks return from ``commit`` and rank 0 writes
   ``latest``;
4. any rank failed: every rank deletes the files it wrote for the tag and raises
   :class:`~fastckpt.errors.DistributedSaveError` naming each failed rank; ``latest`` is not
   touched, so it still names the previous tag, which stays complete.

Each file is written under a hidden name first (``.NAME.fastckpt-new``) and renamed into place only
after the first vote (rank 0 removes the marker, a vote, the renames, a vote, the marker, a vote):
a failed save of a tag saved before (a rolling ``tag="last"``) leaves that tag's previous files and
marker as they were.

The marker is what the engine's ``load`` and ``fastckpt load`` (consolidation) trust: a tag folder
without it, or a file it does not list, is refused with :class:`~fastckpt.errors.IncompleteTagError`.
"""

from __future__ import annotations

import json
import os

import torch

from fastckpt.errors import DistributedSaveError, IncompleteTagError
from fastckpt.format.layout import ENGINE_TAG_MARKER
from fastckpt.storage.commit import write_small_file
from fastckpt.storage.io import fsync_dir

#: File name of the tag marker (:data:`fastckpt.format.layout.ENGINE_TAG_MARKER`).
MARKER = ENGINE_TAG_MARKER
#: Bytes of error text each rank sends in :func:`vote` (longer texts are cut).
ERROR_BYTES = 512


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device() -> torch.device:
    import torch.distributed as dist
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def vote(error: str | None) -> dict[int, str]:
    """Every rank's outcome of one step: ``{rank: error text}`` for the ranks that failed.

    Collective over the default process group (every rank must call it); a no-op without one.

    Args:
        error: this rank's error text, or ``None`` when it succeeded (cut to :data:`ERROR_BYTES`).

    Returns:
        The failed ranks and their error texts (empty when every rank succeeded).
    """
    _, size = world()
    if size == 1:
        return {} if error is None else {0: error}
    import torch.distributed as dist
    buf = torch.zeros(ERROR_BYTES + 1, dtype=torch.uint8)
    if error is not None:
        text = error.encode("utf-8", "replace")[:ERROR_BYTES]
        buf[0] = 1
        buf[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    dev = _comm_device()
    parts = [torch.empty_like(buf, device=dev) for _ in range(size)]
    dist.all_gather(parts, buf.to(dev))
    out = {}
    for r, p in enumerate(parts):
        p = p.cpu()
        if int(p[0]):
            out[r] = bytes(p[1:].numpy().tobytes()).rstrip(b"\0").decode("utf-8", "replace")
    return out


def raise_failures(failures: dict[int, str], tag_dir: str, own: BaseException | None, *, renamed: bool = False) -> None:
    """Raise :class:`DistributedSaveError` for a failed vote (chained from this rank's own error).
    ``renamed``: the failure came while the ranks renamed their new files into place (the tag's
    marker was already removed)."""
    rank, _ = world()
    lines = "; ".join(f"rank {r}: {t}" for r, t in sorted(failures.items()))
    who = "this rank" if rank in failures else f"rank(s) {sorted(failures)}"
    if renamed:
        what = (f"The tag now has no {MARKER}: every load refuses it (IncompleteTagError) rather than read a mix "
                "of two saves, and 'latest' was not written by this save")
    else:
        what = ("Every rank removed what it wrote for this save (a previous save of this tag keeps its files "
                "and marker) and 'latest' was not written, so it still names the previous tag")
    err = DistributedSaveError(
        f"DeepSpeed tag {tag_dir} not committed: {who} failed ({lines}). {what}. Fix the cause (disk space, "
        "permissions, the named value) and call save_checkpoint again", failures)
    raise err from own


def marker_path(tag_dir: str) -> str:
    """The marker file of ``tag_dir``."""
    return os.path.join(tag_dir, MARKER)


def remove_marker(tag_dir: str) -> None:
    """Forget that ``tag_dir`` was committed (before it is written again)."""
    try:
        os.unlink(marker_path(tag_dir))
    except FileNotFoundError:
        return
    fsync_dir(tag_dir)


def write_marker(tag_dir: str, world_size: int) -> None:
    """Write :data:`MARKER` listing the committed files of ``tag_dir`` (temp file, fsync, rename,
    fsync of the folder): the tag counts as committed from the rename on."""
    import fastckpt
    files = sorted(n for n in os.listdir(tag_dir)
                   if not n.startswith(".") and n != MARKER and fastckpt.is_committed(os.path.join(tag_dir, n)))
    body = {"format": "fastckpt-deepspeed-tag", "version": 1, "tag": os.path.basename(os.path.normpath(tag_dir)),
            "world_size": world_size, "files": files}
    tmp = os.path.join(tag_dir, f".{MARKER}.tmp-{os.getpid()}")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    write_small_file(tmp, json.dumps(body, indent=1, sort_keys=True).encode())
    os.replace(tmp, marker_path(tag_dir))
    fsync_dir(tag_dir)


def check_listed(path: str) -> None:
    """Refuse ``path`` unless its tag folder's marker lists it.

    Raises:
        IncompleteTagError: the tag folder has no marker, or the marker does not list ``path``.
    """
    tag_dir, name = os.path.split(os.path.abspath(path))
    try:
        with open(marker_path(tag_dir), "rb") as f:
            files = json.loads(f.read()).get("files", [])
    except FileNotFoundError:
        raise IncompleteTagError(
            f"{tag_dir}: no {MARKER}, so this DeepSpeed tag was never committed by every rank (a rank failed "
            "or the save was interrupted); load the tag that 'latest' names, or save this one again",
            path=tag_dir) from None
    except (OSError, ValueError) as e:
        raise IncompleteTagError(f"{marker_path(tag_dir)}: unreadable ({e}); save this tag again",
                                 path=tag_dir) from None
    if name not in files:
        raise IncompleteTagError(
            f"{path}: not one of the {len(files)} files committed for tag {tag_dir} ({MARKER} lists "
            f"{files}); it was written by another save (a different number of ranks?): load a tag saved "
            "with this configuration", path=tag_dir)
