"""Shared checks of the integration tests (in-process saves only; spawned ranks log elsewhere)."""

from __future__ import annotations

import pytest

from fastckpt.format import tree


@pytest.fixture(autouse=True)
def no_value_stored_as_its_plain_type(caplog, request):
    """An integration's own save must not hit the WARNING of a value stored as its plain type
    (:func:`fastckpt.format.tree._as_plain`: an IntEnum, a str-mixin Enum...): the framework's state
    then comes back with another type on resume (DeepSpeed's ZeroStageEnum came back as an int, with
    that WARNING at every save). The once-per-process memory is cleared so every test would see it."""
    tree._told.clear()
    yield
    said = [r.getMessage() for when in ("setup", "call") for r in caplog.get_records(when)
            if r.name.startswith("fastckpt") and "stored as its plain" in r.getMessage()]
    assert not said, f"an integration's save stored a value as its plain type: {said[0]}"
