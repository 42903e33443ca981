"""NumPy arrays in a non-native byte order (``">f4"``) are stored little-endian: same values back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy

import fastckpt
from fastckpt.errors import UnsupportedDtypeError


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i8", ">u2", ">i2", ">f2", "<f4", "|u1", "|b1"])
def test_big_endian_array_round_trips_by_value(tmp_path, dtype):
    a = np.arange(6).astype(dtype)
    fastckpt.save({"opt": {"m": a}, "k": [a.reshape(2, 3)[:, ::2]]}, tmp_path / "c")
    got = fastckpt.load(tmp_path / "c")
    for want, have in ((a, got["opt"]["m"]), (a.reshape(2, 3)[:, ::2], got["k"][0])):
        assert isinstance(have, np.ndarray) and have.dtype.isnative
        assert have.dtype == want.dtype.newbyteorder("=") and have.shape == want.shape
        assert np.array_equal(have, want)
    assert a.dtype.str == np.dtype(dtype).str  # the caller's array is untouched


def test_stored_bytes_are_little_endian_safetensors(tmp_path):
    a = np.arange(6).astype(">f4")
    fastckpt.save({"x": a}, tmp_path / "c")
    man = json.loads((tmp_path / "c" / "manifest.json").read_text())
    f = man["tensors"]["x"]["file"]
    stored = safetensors.numpy.load_file(str(tmp_path / "c" / f))["x"]
    assert stored.dtype == np.dtype("<f4") and np.array_equal(stored, a)
    assert fastckpt.verify(tmp_path / "c").ok


def test_zero_dim_array_keeps_its_shape(tmp_path):
    for dtype in (">f8", "<f8"):
        a = np.array(3.5, dtype=dtype)
        fastckpt.save({"s": a}, tmp_path / dtype, overwrite=True)
        got = fastckpt.load(tmp_path / dtype)["s"]
        assert got.shape == () and got == 3.5


def test_big_endian_structured_array_is_refused_naming_the_key(tmp_path):
    a = np.zeros(2, dtype=[("a", ">i4"), ("b", ">f8")])
    with pytest.raises(UnsupportedDtypeError, match="'opt/rec'"):
        fastckpt.save({"opt": {"rec": a}}, tmp_path / "c")
    assert not (tmp_path / "c").exists()
