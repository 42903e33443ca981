"""The saver decides the route of a save (fastckpt.save_route) without importing torch.distributed.tensor:
a plain state's first save in a fresh process leaves that module unimported (0.55 s off the blocking path)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plain_first_save_never_imports_torch_distributed_tensor(tmp_path):
    got = _run(f"""
        import json, sys
        import torch
        import fastckpt
        before = "torch.distributed.tensor" in sys.modules
        state = {{"model": {{"w": torch.randn(64, 64)}}, "step": 1}}
        fastckpt.save(state, {str(tmp_path / "a")!r})
        after_save = "torch.distributed.tensor" in sys.modules
        fastckpt.async_save(state, {str(tmp_path / "b")!r}).result()
        route = fastckpt.save_route(state)
        print(json.dumps({{"before": before, "after_save": after_save,
                          "after_async": "torch.distributed.tensor" in sys.modules,
                          "dtensor": route.dtensor, "refused": list(route.refused)}}))
    """)
    assert got == {"before": False, "after_save": False, "after_async": False, "dtensor": False, "refused": []}


def test_dtensor_route_names_the_options_it_refuses_and_drops_them(tmp_path):
    got = _run(f"""
        import json
        import torch
        import torch.distributed as dist
        import fastckpt
        from fastckpt.saving.saver import DTENSOR_REFUSED
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (1,))
        state = {{"model": {{"w": distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])}}}}
        route = fastckpt.save_route(state)
        opts = {{"link_from": "x", "staging_bytes": 1 << 20, "overwrite": True, "defer_frozen": True}}
        try:
            fastckpt.save(state, {str(tmp_path / "c")!r}, **opts)
            err = None
        except ValueError as e:
            err = str(e)
        fastckpt.save(state, {str(tmp_path / "c")!r}, **route.drop(opts))
        print(json.dumps({{"dtensor": route.dtensor, "refused": list(route.refused), "all": list(DTENSOR_REFUSED),
                          "dropped": sorted(route.drop(opts)), "err": err, "leads": route.leads(state),
                          "plain": fastckpt.save_route({{"w": torch.ones(1)}}).dtensor,
                          "ok": fastckpt.is_committed({str(tmp_path / "c")!r})}}))
        dist.destroy_process_group()
    """)
    assert got["dtensor"] and got["refused"] == got["all"] and got["leads"] and got["ok"] and not got["plain"]
    assert got["dropped"] == ["overwrite"]
    assert got["err"] is not None and "link_from" in got["err"] and "staging_bytes" in got["err"], got["err"]
