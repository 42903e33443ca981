"""fastckpt.format.safetensors: header codec, validation of hostile headers, HF index, safe file names."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from fastckpt.errors import (CorruptCheckpointError, FastCkptError, HeaderError, UnsafePathError,
                             UnsupportedDtypeError, UnsupportedValueError)
from fastckpt.format.safetensors import MAX_HEADER_BYTES, encode_header, parse_header, write_index
from fastckpt.storage.model_files import read_header, read_index, safe_join

from fastckpt_testkit import st_file, write_bytes


def test_encode_header_matches_safetensors_package(tmp_path):
    prefix, infos = encode_header([("a", "F32", (2, 3), 24), ("b", "I64", (), 8), ("c", "BF16", (0, 4), 0)],
                                  {"k": "v"}, align=4096)
    assert len(prefix) % 4096 == 0
    assert [(i.start, i.end) for i in infos] == [(0, 24), (24, 32), (32, 32)]
    data = bytes(range(24)) + struct.pack("<q", -5)
    p = write_bytes(tmp_path / "x.safetensors", prefix + data)
    from safetensors import safe_open
    with safe_open(str(p), "pt") as f:
        assert f.metadata() == {"k": "v"}
        assert f.get_tensor("b").item() == -5
        assert f.get_tensor("c").shape == (0, 4)
        assert bytes(f.get_tensor("a").view(torch.uint8).reshape(-1).numpy()) == bytes(range(24))
    h = read_header(p)
    assert h.data_offset == len(prefix) and h.metadata == {"k": "v"}
    assert h.tensors["b"].shape == () and h.tensors["c"].shape == (0, 4)


def test_encode_header_refuses_reserved_duplicate_and_bad_sizes():
    with pytest.raises(UnsupportedValueError, match="__metadata__"):
        encode_header([("__metadata__", "F32", (1,), 4)])
    with pytest.raises(UnsupportedValueError, match="'a' appears twice"):
        encode_header([("a", "F32", (1,), 4), ("a", "F32", (1,), 4)])
    with pytest.raises(UnsupportedValueError, match="needs 8 bytes, got 4"):
        encode_header([("a", "F32", (2,), 4)])
    with pytest.raises(UnsupportedValueError, match="'n'"):
        encode_header([], {"n": 3})


def test_parse_header_reads_safetensors_package_output(tmp_path):
    data = st_save({"x": torch.arange(6, dtype=torch.int16).reshape(2, 3), "e": torch.empty(0)},
                   metadata={"format": "pt"})
    p = write_bytes(tmp_path / "s.safetensors", data)
    h = read_header(p)
    assert h.tensors["x"].dtype == "I16" and h.tensors["x"].shape == (2, 3)
    assert h.tensors["e"].nbytes == 0
    assert h.metadata == {"format": "pt"}
    assert h.file_size == len(data)


@pytest.mark.parametrize("header, data, match", [
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 4]}}, b"\0" * 8, r"\[8, 4\] with end < begin"),
    ({"t": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4]}}, b"\0" * 4, "4000000 bytes"),
    ({"t": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
      "u": {"dtype": "F32", "shape": [16], "data_offsets": [32, 96]}}, b"\0" * 96, "overlaps"),
    ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "u": {"dtype": "F32", "shape": [4], "data_offsets": [32, 48]}}, b"\0" * 48, "16 unindexed bytes"),
    ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 20, "4 trailing bytes"),
    ({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "invalid shape"),
    ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4, "invalid data_offsets"),
    ({"t": [1, 2]}, b"", "not an object"),
    ({"__metadata__": {"n": 1}}, b"", "'n' has a non-string value 1"),
    ({"__metadata__": [1]}, b"", "__metadata__ is not an object"),
])
def test_hostile_headers_are_typed_errors_naming_file_and_numbers(tmp_path, header, data, match):
    p = write_bytes(tmp_path / "bad.safetensors", st_file(header, data))
    with pytest.raises(HeaderError, match=match) as ei:
        read_header(p)
    assert str(p) in str(ei.value) and ei.value.path == str(p)


def test_unknown_dtype_names_dtype_tensor_and_file(tmp_path):
    p = write_bytes(tmp_path / "d.safetensors",
                    st_file({"zz": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0"))
    with pytest.raises(UnsupportedDtypeError) as ei:  # F4 (packed 4-bit): safetensors has it, fastckpt not
        read_header(p)
    msg = str(ei.value)
    assert "'F4'" in msg and "'zz'" in msg and str(p) in msg


def test_length_field_and_size_checks(tmp_path):
    p = write_bytes(tmp_path / "short.safetensors", b"\1\2\3")
    with pytest.raises(HeaderError, match="3 bytes, shorter than the 8-byte"):
        read_header(p)
    p = write_bytes(tmp_path / "huge.safetensors", struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(HeaderError, match=str(2**63)):
        read_header(p)
    p = write_bytes(tmp_path / "len100.safetensors", struct.pack("<Q", 100) + b"{" + b" " * 41)
    with pytest.raises(HeaderError, match="says 100 bytes but the file has only 42"):
        read_header(p)
    big = MAX_HEADER_BYTES + 1
    with open(tmp_path / "cap.safetensors", "wb") as f:
        f.write(struct.pack("<Q", big))
        f.truncate(8 + big)
    with pytest.raises(HeaderError, match="exceeds"):
        read_header(tmp_path / "cap.safetensors")


def test_not_utf8_not_object_duplicate_key(tmp_path):
    bad = [(b"\xff\xfe{}", "not valid UTF-8"), (b"[1, 2]", "JSON list, not an object"),
           (b"{nope", "not valid JSON"),
           (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
            b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', "duplicate key 'a'")]
    for i, (body, match) in enumerate(bad):
        p = write_bytes(tmp_path / f"b{i}.safetensors", struct.pack("<Q", len(body)) + body + b"\0")
        with pytest.raises(HeaderError, match=match):
            read_header(p)


def test_empty_tensors_share_an_offset_without_overlap():
    hdr = {"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
           "b": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
           "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "z": {"dtype": "I64", "shape": [0, 3], "data_offsets": [8, 8]}}
    body = json.dumps(hdr).encode()
    h = parse_header(body, 8 + len(body) + 8, path="mem")
    assert {n: t.nbytes for n, t in h.tensors.items()} == {"a": 0, "b": 0, "w": 8, "z": 0}
    # an empty tensor placed past the end of the data is still refused
    hdr["z"]["data_offsets"] = [16, 16]
    body = json.dumps(hdr).encode()
    with pytest.raises(HeaderError, match="'z' ends at data byte 16"):
        parse_header(body, 8 + len(body) + 8, path="mem")


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=False),
                         st.text(max_size=8))
_entry = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "U8", "I64", "BOOL", "F8_E4M3", "X", 3]),
    "shape": st.lists(st.integers(-2, 5), max_size=3) | _json_scalar,
    "data_offsets": st.lists(st.integers(-2, 70), min_size=0, max_size=3) | _json_scalar,
})
_header = st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]), _entry | _json_scalar, max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=200), tail=st.integers(0, 100))
def test_parser_on_any_bytes_is_typed_error_or_valid(body, tail):
    _check_parse(body, tail)


@settings(max_examples=400, deadline=None)
@given(header=_header, tail=st.integers(0, 80))
def test_parser_on_structured_json_is_typed_error_or_valid(header, tail):
    _check_parse(json.dumps(header).encode(), tail)


def _check_parse(body: bytes, tail: int) -> None:
    size = 8 + len(body) + tail
    try:
        h = parse_header(body, size, path="fuzz")
    except FastCkptError as e:
        assert isinstance(e, (HeaderError, UnsupportedDtypeError)), type(e)
        assert "fuzz" in str(e)
        return
    # valid: non-empty ranges tile [0, tail) exactly, sizes agree with shapes
    ranges = sorted((t.start, t.end) for t in h.tensors.values() if t.nbytes)
    cursor = 0
    for s, e in ranges:
        assert s == cursor
        cursor = e
    assert cursor == tail
    for t in h.tensors.values():
        assert t.end <= tail


def test_read_index_checks_shards(tmp_path):
    write_bytes(tmp_path / "m-1.safetensors", st_save({"w": torch.ones(1)}))
    ix = tmp_path / "m.safetensors.index.json"
    ix.write_bytes(write_index({"w": "m-1.safetensors"}, 4))
    assert read_index(ix) == {"w": "m-1.safetensors"}
    assert json.loads(ix.read_text())["metadata"]["total_size"] == 4
    ix.write_text(json.dumps({"weight_map": {"w": "missing.safetensors"}}))
    with pytest.raises(HeaderError, match="'missing.safetensors', which does not exist"):
        read_index(ix)
    ix.write_text(json.dumps({"weight_map": {"w": "../etc/passwd"}}))
    with pytest.raises(UnsafePathError):
        read_index(ix)
    ix.write_text("{not json")
    with pytest.raises(HeaderError, match="not a valid JSON index"):
        read_index(ix)
    ix.write_text(json.dumps({"nope": 1}))
    with pytest.raises(HeaderError, match="weight_map"):
        read_index(ix)


def test_safe_join(tmp_path):
    assert safe_join(tmp_path, "a.safetensors") == os.path.join(tmp_path, "a.safetensors")
    for bad in ["/etc/passwd", "../x", "a/../../x", "", "a\x00b"]:
        with pytest.raises(UnsafePathError):
            safe_join(tmp_path, bad)
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(UnsafePathError, match="outside the folder"):
        safe_join(tmp_path, "link/passwd")
    assert issubclass(UnsafePathError, ValueError) and issubclass(HeaderError, CorruptCheckpointError)
