"""Runs accelerate's own test suite with fastckpt switched on for every ``Accelerator``.

``scripts/run_accelerate_suite.sh`` copies this file into the extracted accelerate sdist as
``tests/conftest.py`` and runs ``tests/test_state_checkpointing.py`` and the save/load tests of
``tests/test_accelerator.py`` with ``FASTCKPT_ACCELERATE_MODE`` set:

- ``sync``: every ``Accelerator.__init__`` ends with ``fastckpt.integrations.accelerate.plugin.enable(self)``;
- ``async``: ``enable(self, async_save=True)``;
- ``off`` (or unset): nothing is patched (the baseline run; in our own test tree this file then
  does nothing either).

Baseline here (accelerate 1.15.0, torch 2.13.0 CPU, torchdata 0.11.0): 38 passed, 2 skipped
(``test_map_location`` needs a GPU). Tests that cannot hold with fastckpt by design are
deselected by exact node id below, each with its reason; a listed id that is not collected
fails the run (the list cannot go stale silently).
"""

from __future__ import annotations

import os

import pytest

MODE = os.environ.get("FASTCKPT_ACCELERATE_MODE", "off")

#: node id -> reason; deselected in both fastckpt modes. accelerate 1.15.0's selected tests assert no
#: pickle file name (optimizer.bin, scheduler.bin, random_states_0.pkl ...), so nothing is listed.
DESELECT: dict[str, str] = {}

#: node id -> reason; deselected in the async mode only.
DESELECT_ASYNC: dict[str, str] = {
    f"tests/test_state_checkpointing.py::CheckpointTest_{kind}::test_checkpoint_deletion": (
        "asserts that checkpoint_10 exists on disk the moment save_state() returns; with "
        "async_save=True the folder appears at the background commit (one atomic rename), by "
        "design. The sync run passes it; tests/integrations/test_accelerate_contracts.py checks "
        "total_limit after wait() in async mode")
    for kind in ("use_safetensors", "use_pytorch")
}


def pytest_configure(config):
    if MODE == "off":
        return
    if MODE not in ("sync", "async"):
        raise pytest.UsageError(f"FASTCKPT_ACCELERATE_MODE must be sync, async or off, got {MODE!r}")
    from accelerate import Accelerator

    from fastckpt.integrations.accelerate import plugin as fca

    original = Accelerator.__init__
    if getattr(original, "_fastckpt_switch", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _PLUGINS.append(fca.enable(self, async_save=MODE == "async"))

    __init__._fastckpt_switch = True
    Accelerator.__init__ = __init__
    if MODE == "async":
        _wait_before_temp_cleanup()
    config.addinivalue_line("markers", "fastckpt: run with the fastckpt accelerate plugin")


#: every plugin enabled in this session (to prove at the end that fastckpt did the saving)
_PLUGINS: list = []


def pytest_sessionfinish(session, exitstatus):
    if MODE == "off":
        return
    for p in _PLUGINS:
        try:
            p.wait()
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            _FAILED.append(f"{type(e).__name__}: {e}")
    for f in _FAILED:
        print(f"\nfastckpt: a save failed outside its test's calls: {f}")
        session.exitstatus = 1
    saves = sum(len(p.records) for p in _PLUGINS)
    print(f"\nfastckpt ({MODE}): {len(_PLUGINS)} accelerators enabled, {saves} checkpoints committed by fastckpt")
    if session.testscollected and not saves:
        print("fastckpt: no checkpoint went through fastckpt: the switch did not take effect")
        session.exitstatus = 1


_FAILED: list[str] = []


def _wait_before_temp_cleanup() -> None:
    """async mode: ``tempfile.TemporaryDirectory`` cleanup first waits for the pending saves.

    Several tests end inside ``with TemporaryDirectory() as d:`` right after ``save_state()``;
    removing ``d`` while the background save still writes into it fails the save (and the
    removal). A user of ``async_save=True`` calls ``accelerator.fastckpt.wait()`` before removing
    a folder that is being saved; this does that for them. No assertion of the tests changes; a
    save that fails here fails the run at the end.
    """
    import tempfile

    cleanup = tempfile.TemporaryDirectory.cleanup

    def waiting_cleanup(self):
        for p in _PLUGINS:
            try:
                p.wait()
            except Exception as e:  # noqa: BLE001 - reported at the end, and the run fails
                _FAILED.append(f"{type(e).__name__}: {e}")
        cleanup(self)

    tempfile.TemporaryDirectory.cleanup = waiting_cleanup


def pytest_report_header(config):
    return f"fastckpt accelerate plugin: {MODE}"


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection: every listed id must still be collected
def pytest_collection_modifyitems(config, items):
    if MODE == "off":
        return
    listed = dict(DESELECT)
    if MODE == "async":
        listed.update(DESELECT_ASYNC)
    ids = {item.nodeid for item in items}
    stale = [n for n in listed if n not in ids]
    if stale:
        raise pytest.UsageError(f"deselection list names tests that were not collected: {stale}")
    keep = [item for item in items if item.nodeid not in listed]
    dropped = [item for item in items if item.nodeid in listed]
    for item in dropped:
        print(f"\nfastckpt: deselected {item.nodeid}: {listed[item.nodeid]}")
    config.hook.pytest_deselected(items=dropped)
    items[:] = keep
