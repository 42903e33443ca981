"""The typed manifest (fastckpt.format.manifest): every manifest ``fastckpt.save`` writes (one process,
``process_group=`` with 2 ranks, FSDP2 DTensor with 2 ranks) parses and serialises back to the bytes on
disk; every malformed field is refused with a ManifestError naming the file, the key and the value; a
newer format version is refused with the upgrade message, by ``parse`` and by every reader."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
import xxhash

import fastckpt
from fastckpt.errors import CorruptCheckpointError, ManifestError, ManifestVersionError
from fastckpt.format.manifest import FORMAT_VERSION, Manifest, RangeCheck, parse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "saving"))
from ranks import RankPool  # noqa: E402

TIMEOUT_S = 180


def _plain_state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g)
    blob = torch.arange(12, dtype=torch.float32)
    return {"model": {"w": w, "tied": w, "e": torch.empty(0, 4)},
            "opt": {"head": blob[:6], "tail": blob[6:].view(2, 3)},  # two views of one storage
            "np": np.arange(4, dtype=np.int32), "step": 3}


def _manifest_bytes(path) -> bytes:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return f.read()


def _round_trip(path) -> Manifest:
    raw = _manifest_bytes(path)
    m = parse(raw, os.path.join(path, "manifest.json"))
    assert m.to_json() == raw
    assert parse(json.loads(raw)).to_json() == raw  # from the decoded dict too
    assert fastckpt.read_manifest(path) == m
    return m


def test_plain_save_round_trip(tmp_path):
    ck = fastckpt.save(_plain_state(), tmp_path / "ck", step=3, metadata={"run": "a"},
                       extra_files={"config.json": b"{}"})
    m = _round_trip(ck)
    assert m.version == 1 and m.step == 3 and m.world_size == 1 and m.metadata == {"run": "a"}
    assert m.distributed is None and m.weights == {"model": "model"}
    w = m.tensors["model/w"]
    assert w.stored and w.file == "model.safetensors" and w.dtype == "F32" and w.shape == (5, 3)
    assert w.offsets[1] - w.offsets[0] == 60 and w.chunks is None
    assert m.tensors["model/tied"].alias == "model/w" and m.resolve("model/tied") == ("model/w", w)
    views = {k: e for k, e in m.tensors.items() if e.view is not None}
    assert sorted(views) == ["opt/head", "opt/tail"] and views["opt/tail"].stride == (3, 1)
    assert views["opt/tail"].offset == 24 and m.tensors[views["opt/tail"].view].stored
    assert m.tensors["np"].ndarray and m.files["config.json"].xxh3 == xxhash.xxh3_64(b"{}").hexdigest()
    assert m.bytes_total == sum(f.bytes for f in m.files.values())


def test_checks_cover_every_checksum_and_hash_to_the_bytes(tmp_path):
    ck = fastckpt.save(_plain_state(), tmp_path / "ck")
    m = fastckpt.read_manifest(ck)
    checks = list(m.checks())
    assert all(isinstance(c, RangeCheck) and c.box is None for c in checks)
    assert {c.what for c in checks} >= {"file 'state.json'", "header of 'model.safetensors'", "tensor 'model/w'"}
    assert len([c for c in checks if c.key]) == len([e for e in m.tensors.values() if e.stored])
    for c in checks:
        data = (ck / c.file).read_bytes()[c.start:c.end]
        assert xxhash.xxh3_64(data).hexdigest() == c.xxh3, c.what
    assert [c.file for c in m.checks("model.safetensors")] == ["model.safetensors"] * 3  # header, w, e (tied: alias)
    w = next(c for c in checks if c.key == "model/w")
    assert w.elements == ((0,) * len(w.shape), tuple(w.shape))  # a whole tensor: its whole element box
    with pytest.raises(ValueError, match="not a tensor"):
        next(c for c in checks if c.key is None).elements


def test_load_into_checks_are_the_manifests_range_checks(tmp_path):
    """The loaders check the same :class:`RangeCheck` ranges the manifest lists (one range-check type)."""
    from fastckpt.loading.stored import open_index

    ck = fastckpt.save(_plain_state(), tmp_path / "ck")
    m = fastckpt.read_manifest(ck)
    want = {(c.key, c.file, c.start, c.end, c.xxh3) for c in m.checks()
            if c.key and not c.key.startswith("%")}  # "%storage/N": the base of views, not a state key
    idx = open_index(ck)
    got = {(c.key, c.file, c.start, c.end, c.xxh3) for d in idx.tensors.values() for c in d.checks}
    assert all(isinstance(c, RangeCheck) for d in idx.tensors.values() for c in d.checks)
    assert got == want


# -- malformed manifests ------------------------------------------------------------------------------

def _set(*args):
    path, value = args[:-1], args[-1]

    def edit(m):
        d = m
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value
    return edit


def _drop(*path):
    def edit(m):
        d = m
        for p in path[:-1]:
            d = d[p]
        del d[path[-1]]
    return edit


MALFORMED = [
    ("format", _set("format", "other"), "other"),
    ("format_version", _set("format_version", "1"), "1"),
    ("format_version", _set("format_version", 0), 0),
    ("checksum", _set("checksum", "md5"), "md5"),
    ("files", _set("files", []), []),
    ("tensors", _drop("tensors"), None),
    ("step", _set("step", "3"), "3"),
    ("world_size", _set("world_size", 0), 0),
    ("metadata", _set("metadata", {"a": 1}), {"a": 1}),
    ("created_unix_s", _set("created_unix_s", "now"), "now"),
    ("files['state.json'].bytes", _set("files", "state.json", "bytes", -1), -1),
    ("files['state.json'].xxh3", _set("files", "state.json", "xxh3", 7), 7),
    ("files['model.safetensors'].header_bytes", _set("files", "model.safetensors", "header_bytes", 1.5), 1.5),
    ("tensors['model/w']", _set("tensors", "model/w", [1]), [1]),
    ("tensors['model/w'].file", _drop("tensors", "model/w", "file"), None),
    ("tensors['model/w'].shape", _set("tensors", "model/w", "shape", [5, -3]), [5, -3]),
    ("tensors['model/w'].offsets", _set("tensors", "model/w", "offsets", [4096]), [4096]),
    ("tensors['model/w'].offsets", _set("tensors", "model/w", "offsets", [5000, 4096]), [5000, 4096]),
    ("tensors['model/w'].xxh3", _drop("tensors", "model/w", "xxh3"), None),
    ("tensors['model/w'].ndarray", _set("tensors", "model/w", "ndarray", "yes"), "yes"),
    ("tensors['model/tied'].alias", _set("tensors", "model/tied", "alias", "model/nope"), "model/nope"),
    ("tensors['model/tied'].alias", _set("tensors", "model/tied", "alias", "model/tied"), "model/tied"),
    ("tensors['opt/tail'].stride", _set("tensors", "opt/tail", "stride", [1]), [1]),
    ("tensors['opt/tail'].offset", _set("tensors", "opt/tail", "offset", None), None),
    ("tensors['model/w'].chunks", _set("tensors", "model/w", "chunks", {}), {}),
    ("tensors['model/w'].chunks[0].offsets",
     _set("tensors", "model/w", "chunks", [{"offsets": [0], "shape": [5, 3], "xxh3": "0"}]), [0]),
    ("tensors['model/w'].chunks[1]",
     _set("tensors", "model/w", "chunks", [{"offsets": [0, 0], "shape": [4, 3], "xxh3": "0"},
                                            {"offsets": [4, 0], "shape": [2, 3], "xxh3": "0"}]), None),
    ("tensors['model/w'].chunks",
     _set("tensors", "model/w", "chunks", [{"offsets": [0, 0], "shape": [4, 3], "xxh3": "0"}]), None),
    ("tensors['model/w'].chunks",
     _set("tensors", "model/w", "chunks", [{"offsets": [0, 0], "shape": [3, 3], "xxh3": "0"},
                                            {"offsets": [2, 0], "shape": [2, 3], "xxh3": "0"},
                                            {"offsets": [4, 0], "shape": [1, 3], "xxh3": "0"}]), None),
    ("distributed.mode", _set("distributed", {"mode": "copy"}), "copy"),
    ("distributed.bytes_by_rank", _set("distributed", {"mode": "rename", "bytes_by_rank": {"r0": 1}}),
     {"r0": 1}),
    # the pieces of the removed pre-release Shard values: no longer read (an empty object is ignored)
    ("distributed.shards",
     _set("distributed", {"mode": "rename", "shards": {"p": {"dtype": "F32", "global_shape": [4], "pieces": []}}}),
     {"p": {"dtype": "F32", "global_shape": [4], "pieces": []}}),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ck = fastckpt.save(_plain_state(), tmp_path_factory.mktemp("m") / "ck")
    return ck, json.loads(_manifest_bytes(ck))


@pytest.mark.parametrize("key,edit,value", MALFORMED, ids=[f"{i}-{k}" for i, (k, _, _) in enumerate(MALFORMED)])
def test_malformed_field_is_refused_naming_file_key_value(saved, key, edit, value):
    ck, doc = saved
    doc = json.loads(json.dumps(doc))
    edit(doc)
    where = os.path.join(ck, "manifest.json")
    with pytest.raises(ManifestError) as ei:
        parse(json.dumps(doc).encode(), where)
    e = ei.value
    assert isinstance(e, CorruptCheckpointError) and isinstance(e, ValueError)
    assert e.key == key and e.path == where, (e.key, str(e))
    msg = str(e)
    assert msg.startswith(where) and repr(key) in msg
    if value is not None:
        assert e.value == value and repr(value) in msg
    assert "fastckpt verify" in msg or "save it again" in msg  # says what to do


def test_malformed_manifest_on_disk_is_refused_by_readers(tmp_path):
    ck = fastckpt.save(_plain_state(), tmp_path / "ck")
    doc = json.loads(_manifest_bytes(ck))
    doc["tensors"]["model/w"]["offsets"] = ["4096", 4156]
    (ck / "manifest.json").write_text(json.dumps(doc))
    for read in (fastckpt.load, fastckpt.read_manifest, fastckpt.open_checkpoint):
        with pytest.raises(ManifestError, match=r"tensors\['model/w'\]\.offsets"):
            read(ck)
    assert not fastckpt.is_committed(ck)
    rep = fastckpt.verify(ck)
    assert not rep.ok and "tensors['model/w'].offsets" in rep.problems[0]


def test_not_json_is_refused():
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse(b"{\"format\": ", "/x/manifest.json")
    with pytest.raises(ManifestError, match="JSON list, not an object"):
        parse(b"[]", "/x/manifest.json")


def test_newer_version_is_refused_with_the_upgrade_message(tmp_path):
    ck = fastckpt.save(_plain_state(), tmp_path / "ck")
    doc = json.loads(_manifest_bytes(ck))
    doc["format_version"] = FORMAT_VERSION + 1
    doc["tensors"]["model/w"]["something_new"] = {"a": 1}  # later versions add fields
    (ck / "manifest.json").write_text(json.dumps(doc))
    for read in (lambda p: parse((p / "manifest.json").read_bytes(), str(p / "manifest.json")),
                 fastckpt.read_manifest, fastckpt.load):
        with pytest.raises(ManifestVersionError, match=f"format_version {FORMAT_VERSION + 1} is newer than this "
                                                       "fastckpt understands.*upgrade fastckpt") as ei:
            read(ck)
        assert ei.value.key == "format_version" and ei.value.value == FORMAT_VERSION + 1
    with pytest.raises(fastckpt.errors.CheckpointNotFoundError):
        fastckpt.CheckpointManager(tmp_path).load()  # not listed as committed: no step folder either


def test_older_version_1_manifest_without_optional_fields_reads(tmp_path):
    """Manifests written before ``created_unix_s`` / ``metadata`` existed still read (and load)."""
    ck = fastckpt.save(_plain_state(), tmp_path / "ck")
    doc = json.loads(_manifest_bytes(ck))
    for k in ("created_unix_s", "metadata", "checksum", "weights", "world_size"):
        del doc[k]
    (ck / "manifest.json").write_text(json.dumps(doc))
    m = fastckpt.read_manifest(ck)
    assert m.created_unix_s is None and m.metadata is None and m.world_size == 1 and m.version == 1
    assert torch.equal(fastckpt.load(ck)["model"]["w"], _plain_state()["model"]["w"])


# -- multi-rank saves (2 spawned ranks, gloo) ---------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("fmtpool")), world_size=2)
    yield p
    p.close()


def rank_process_group_save(folder: str) -> None:
    import torch.distributed as dist
    r = dist.get_rank()
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)},
             "optimizer": {"rank": torch.full((3,), float(r))}, "step": 1}
    fastckpt.save(state, os.path.join(folder, "pg"), process_group=dist.group.WORLD, local_keys=("optimizer",),
                  step=1)


def rank_fsdp2_save(folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Linear(7, 5))  # 7 rows: uneven Shard(0)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    fastckpt.save({"model": model.state_dict()}, os.path.join(folder, "fsdp"), step=2)


def test_process_group_save_round_trip(pool, tmp_path):
    pool.run(rank_process_group_save, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    m = _round_trip(tmp_path / "pg")
    d = m.distributed
    assert m.world_size == 2 and m.version == 1 and d is not None and d.mode == "rename"
    assert d.rank_local_keys == ["optimizer"] and sorted(d.rank_local_skeletons) == [0, 1]
    assert sorted(d.bytes_by_rank) == [0, 1] and all(isinstance(b, int) for b in d.bytes_by_rank.values())
    assert {"@rank0/local/optimizer/rank", "@rank1/local/optimizer/rank"} <= set(m.tensors)
    # the always-empty "shards" of the removed format-1 Shard values is no longer written ...
    doc = json.loads(_manifest_bytes(tmp_path / "pg"))
    assert "shards" not in doc["distributed"] and not hasattr(d, "shards")
    # ... and a pre-release folder's empty one still reads
    doc["distributed"]["shards"] = {}
    assert parse(json.dumps(doc).encode(), "pre-release/manifest.json").distributed.bytes_by_rank == d.bytes_by_rank


def test_fsdp2_dtensor_save_round_trip(pool, tmp_path):
    pool.run(rank_fsdp2_save, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    m = _round_trip(tmp_path / "fsdp")
    assert m.version == 2 and m.world_size == 2 and m.distributed.planner is None  # "dcp" only through FastCkptWriter (docs/FORMAT.md)
    w = m.tensors["model/0.weight"]
    assert w.xxh3 is None and [c.box for c in w.chunks] == [((0, 0), (4, 8)), ((4, 0), (3, 8))]
    assert w.placement == {"mesh_shape": [2], "placements": ["Shard(0)"]}
    chunks = [c for c in m.checks() if c.box is not None]
    assert {c.key for c in chunks} >= {"model/0.weight", "model/1.weight"}
    assert fastckpt.verify(tmp_path / "fsdp").ok
