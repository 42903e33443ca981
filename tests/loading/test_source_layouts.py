"""`fastckpt load RUN_ROOT` finds the newest committed step of every layout this project writes."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.cli import main as cli_main
from fastckpt.loading.source import find_checkpoint


@pytest.mark.parametrize("layout", ["step-{}", "checkpoint-{}", "checkpoints/checkpoint_{}"])
def test_run_root_of_each_layout_resolves_to_its_newest_committed_step(tmp_path, layout):
    # a config.json naming an architecture (one transformers lacks: only its names are checked) and a
    # dtype, so the export passes the servability gate of `fastckpt load`
    cfg = json.dumps({"architectures": ["WModel"], "model_type": "w", "dtype": "float32"}).encode()
    for step in (1, 2):
        fastckpt.save({"model": {"w": torch.full((3,), float(step))}}, tmp_path / layout.format(step),
                      extra_files={"config.json": cfg})
    os.makedirs(tmp_path / layout.format(3))  # a newer folder that never committed
    assert find_checkpoint(tmp_path) == str(tmp_path / layout.format(2))
    out = tmp_path.parent / (tmp_path.name + "-out")
    assert cli_main(["load", str(tmp_path), "--to", str(out), "-q"]) == 0
    assert torch.equal(fastckpt.load(out)["w"], torch.full((3,), 2.0))


def test_a_folder_without_steps_is_its_own_source(tmp_path):
    assert find_checkpoint(tmp_path) == str(tmp_path)
