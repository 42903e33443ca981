"""Lightning's real Trainer with FastCkptModelParallelStrategy (integrations/lightning.py).

2 spawned ranks, gloo, CPU (Lightning's ModelParallelStrategy runs on CPU: its device mesh is a
CPU mesh), FSDP2 ``fully_shard`` in ``configure_model``, AdamW + a StepLR scheduler, fp32, one rank
pool per module. The pool's ranks already hold a process group; Lightning sees it through the
torchrun-style environment (LOCAL_RANK...) and uses it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import fastckpt  # noqa: E402

TIMEOUT_S = 240  # every pool call is bounded: a hung rank fails the test (RankTimeout)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "saving"))
if not hasattr(fastckpt, "load_into"):
    pytest.skip("fastckpt.load_into comes with the loadinto branch", allow_module_level=True)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from ranks import RankPool
    p = RankPool(str(tmp_path_factory.mktemp("pl-pool")), world_size=2)
    yield p
    p.close()


# ----------------------------------------------------------------------------------------------
# rank side
# ----------------------------------------------------------------------------------------------
def _module(seed: int, intermediate: int = 64, layers: int = 2):
    import lightning.pytorch as L
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.llama = LlamaForCausalLM(LlamaConfig(
                vocab_size=64, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.llama.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.llama, mesh=mesh)

        def training_step(self, batch, i):
            (ids,) = batch
            return self.llama(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(7)
            ids = torch.randint(0, 64, (16, 16), generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

    return Tiny()


def _env() -> None:
    import torch.distributed as dist
    r = dist.get_rank()
    os.environ.update(LOCAL_RANK=str(r), RANK=str(r), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")  # the group exists already


def _trainer(root: str, max_steps: int, callbacks=(), strategy=None):
    import lightning.pytorch as L
    from fastckpt.integrations.lightning import FastCkptModelParallelStrategy

    strategy = strategy or FastCkptModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    ckpt = any(isinstance(c, L.callbacks.ModelCheckpoint) for c in callbacks)
    return L.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, strategy=strategy,
                     enable_checkpointing=ckpt, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root, callbacks=list(callbacks))


def _flat(tree, prefix="") -> dict:
    """Key path -> full tensor (DTensors gathered: every rank calls it)."""
    from torch.distributed.tensor import DTensor
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, v in items:
        p = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[p] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        else:
            out.update(_flat(v, p + "/"))
    return out


def _snapshot(module, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return {"model": _flat(get_model_state_dict(module)), "optim": _flat(get_optimizer_state_dict(module, opt))}


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ (or are missing) between two flat dicts."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or _raw(a[k]) != _raw(b[k]))


class _Losses:
    """Callback factory: records each training step's loss (every rank)."""

    @staticmethod
    def make():
        import lightning.pytorch as L

        class Losses(L.Callback):
            def __init__(self):
                self.losses = []

            def on_train_batch_end(self, trainer, module, outputs, batch, i):
                self.losses.append(float(outputs["loss"]))

        return Losses()


def rank_fit_save_resume(folder: str) -> dict:
    """fit 2 steps + save; resume a fresh module from it for 2 more. References: an unbroken
    4-step run, and the same save/resume through Lightning's own ModelParallelStrategy (DCP)."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    _env()
    ck = os.path.join(folder, "epoch=0-step=2.ckpt")
    a = _module(0)
    ta = _trainer(folder, 2)
    ta.fit(a)
    ta.save_checkpoint(ck)
    saved = _snapshot(a, ta.optimizers[0])

    class Snap(L.Callback):  # the state right after Lightning restored the checkpoint
        def on_train_start(self, trainer, module):
            self.state = _snapshot(module, trainer.optimizers[0])
            self.sched = trainer.lr_scheduler_configs[0].scheduler.state_dict()
            self.step = trainer.global_step

    snap, lb = Snap(), _Losses.make()
    b = _module(1)
    tb = _trainer(folder, 4, [snap, lb])
    tb.fit(b, ckpt_path=ck)
    resumed = _snapshot(b, tb.optimizers[0])

    lc = _Losses.make()
    c = _module(0)
    _trainer(folder, 4, [lc]).fit(c)

    own = os.path.join(folder, "lightning-own.ckpt")  # the reference: Lightning's own resume
    ta2 = _trainer(folder, 2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    ta2.fit(_module(0))
    ta2.save_checkpoint(own)
    b2 = _module(1)
    tb2 = _trainer(folder, 4, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    tb2.fit(b2, ckpt_path=own)
    reference = _snapshot(b2, tb2.optimizers[0])
    return {
        "load_diff_model": _same(saved["model"], snap.state["model"]),
        "load_diff_optim": _same(saved["optim"], snap.state["optim"]),
        "n_model": len(saved["model"]), "n_optim": len(saved["optim"]),
        "global_step": snap.step, "sched_last_epoch": snap.sched["last_epoch"],
        "resumed_losses": lb.losses, "unbroken_losses": lc.losses,
        "diff_vs_lightning_model": _same(resumed["model"], reference["model"]),
        "diff_vs_lightning_optim": _same(resumed["optim"], reference["optim"]),
        "full_model": saved["model"],
    }


def test_trainer_save_then_resume_bit_exact(pool, tmp_path):
    folder = str(tmp_path)
    res = pool.run(rank_fit_save_resume, folder=folder, timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out["n_model"] > 10 and out["n_optim"] > 20, out  # params; exp_avg/exp_avg_sq/step
        assert out["load_diff_model"] == [] and out["load_diff_optim"] == [], (r, out)
        assert (out["global_step"], out["sched_last_epoch"]) == (2, 2), r
        # the first resumed step is the unbroken run's third step, bit for bit
        assert out["resumed_losses"][0] == out["unbroken_losses"][2], (r, out["resumed_losses"], out["unbroken_losses"])
        # and the resumed run ends exactly where Lightning's own save/resume (DCP) ends
        assert out["diff_vs_lightning_model"] == [] and out["diff_vs_lightning_optim"] == [], (r, out)
    ck = os.path.join(folder, "epoch=0-step=2.ckpt")
    assert fastckpt.is_committed(ck)
    names = os.listdir(ck)
    assert not {"meta.pt", ".metadata"} & set(names) and not any(n.endswith(".distcp") for n in names), names
    # HF layout: the LightningModule's own parameter names, full tensors, read by safetensors;
    # one shard is model.safetensors without an index, as save_pretrained writes it
    from safetensors import safe_open
    assert "model.safetensors.index.json" not in names, names
    full = res[0]["full_model"]
    with safe_open(os.path.join(ck, "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(full)
        for name in full:
            assert _raw(f.get_tensor(name)) == _raw(full[name]), name
    meta = fastckpt.load(ck, keys="lightning")["lightning"]
    assert meta["global_step"] == 2 and "loops" in meta and meta["lr_schedulers"][0]["last_epoch"] == 2


def rank_model_checkpoint(folder: str) -> dict:
    """ModelCheckpoint every step, save_top_k=1 + save_last: old step folders removed, last.ckpt
    overwritten (atomically), both committed; resume from last.ckpt restores step 3."""
    import lightning.pytorch as L

    _env()
    dirpath = os.path.join(folder, "ckpts")
    cb = L.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)
    _trainer(folder, 3, [cb]).fit(_module(0))
    import torch.distributed as dist
    dist.barrier()
    listing = sorted(os.listdir(dirpath))
    steps = []

    class Step(L.Callback):
        def on_train_start(self, trainer, module):
            steps.append(trainer.global_step)

    _trainer(folder, 4, [Step()]).fit(_module(1), ckpt_path=os.path.join(dirpath, "last.ckpt"))
    return {"listing": listing, "best": os.path.basename(cb.best_model_path), "resumed_at": steps}


def test_model_checkpoint_rotation_and_last(pool, tmp_path):
    res = pool.run(rank_model_checkpoint, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    dirpath = os.path.join(str(tmp_path), "ckpts")
    for r, out in res.items():
        # only the newest step folder and last.ckpt; no temporaries or half-deleted folders left
        assert out["listing"] == ["epoch=1-step=3.ckpt", "last.ckpt"], (r, out)
        assert out["resumed_at"] == [3], (r, out)
    for name in ("epoch=1-step=3.ckpt", "last.ckpt"):
        assert fastckpt.is_committed(os.path.join(dirpath, name)), name
        assert fastckpt.load(os.path.join(dirpath, name), keys="lightning")["lightning"]["global_step"] == 3


def rank_mismatch(folder: str) -> dict:
    """Resume into a module whose MLP is narrower: a typed error naming key, shapes and file."""
    _env()
    ck = os.path.join(folder, "ck")
    t = _trainer(folder, 1)
    t.fit(_module(0))
    t.save_checkpoint(ck)
    try:
        _trainer(folder, 2).fit(_module(0, intermediate=48), ckpt_path=ck)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": str(e)}
    return {"type": None}


def test_resume_into_mismatched_model_is_a_typed_error(pool, tmp_path):
    res = pool.run(rank_mismatch, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out["type"] == "StateMismatchError" and "FastCkptError" in out["mro"], (r, out)
        assert "mlp" in out["msg"] and "48" in out["msg"] and "64" in out["msg"], out["msg"]


def test_save_distributed_checkpoint_false_is_refused():
    from fastckpt.integrations.lightning import FastCkptModelParallelStrategy
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        FastCkptModelParallelStrategy(save_distributed_checkpoint=False)


# ----------------------------------------------------------------------------------------------
# issue 20: every way Lightning itself loads a checkpoint, with a checkpoint fastckpt wrote
# ----------------------------------------------------------------------------------------------
def _eval_module(seed: int, layers: int = 2):
    """The test module plus validation / test / predict steps that record the loss they see."""
    import lightning.pytorch as L

    base = type(_module(seed, layers=layers))

    class Eval(base):
        def __init__(self):
            super().__init__()
            self.seen: list[float] = []

        def _batches(self):
            g = torch.Generator().manual_seed(11)
            ids = torch.randint(0, 64, (4, 16), generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

        def validation_step(self, batch, i):
            self.seen.append(float(self.llama(input_ids=batch[0], labels=batch[0]).loss))

        test_step = validation_step

        def predict_step(self, batch, i):
            self.validation_step(batch, i)

        def val_dataloader(self):
            return self._batches()

        test_dataloader = predict_dataloader = val_dataloader

    assert issubclass(Eval, L.LightningModule)
    return Eval()


def rank_every_lightning_way(folder: str) -> dict:
    """Save with fit + save_checkpoint, then load the checkpoint every way Lightning 2.6 has: fit(ckpt_path)
    with and without weights_only, validate / test / predict(ckpt_path) (no optimizer: the checkpoint's
    optimizer keys are not the module's), a bf16-true module (cast), and load_from_checkpoint, next to
    what Lightning's own ModelParallelStrategy checkpoint does there."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from fastckpt.integrations.lightning import FastCkptModelParallelStrategy

    _env()
    ck = os.path.join(folder, "ways.ckpt")
    a = _module(0)
    ta = _trainer(folder, 2)
    ta.fit(a)
    ta.save_checkpoint(ck)
    saved = _snapshot(a, ta.optimizers[0])["model"]
    out: dict = {}

    def check(name: str, fn, dtype=torch.float32, precision="32-true", layers=2, strict=True) -> None:
        m = _eval_module(1, layers)
        m.strict_loading = strict
        strategy = FastCkptModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        import lightning.pytorch as L
        t = L.Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False, strategy=strategy,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=folder, precision=precision, limit_val_batches=1, num_sanity_val_steps=0)
        try:
            fn(t, m)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            return
        got = _flat(get_model_state_dict(m))
        want = {k: v.to(dtype) for k, v in saved.items() if layers == 2 or k in got}
        out[name] = {"diff": _same(want, got) if name not in ("fit", "fit weights_only") else None,
                     "dtypes": sorted({str(v.dtype) for v in got.values()}), "seen": len(m.seen),
                     "global_step": t.global_step}

    check("validate", lambda t, m: t.validate(m, ckpt_path=ck))
    check("test", lambda t, m: t.test(m, ckpt_path=ck))
    check("predict", lambda t, m: t.predict(m, ckpt_path=ck))
    check("validate weights_only", lambda t, m: t.validate(m, ckpt_path=ck, weights_only=True))
    check("validate bf16-true", lambda t, m: t.validate(m, ckpt_path=ck), torch.bfloat16, "bf16-true")
    check("fit", lambda t, m: t.fit(m, ckpt_path=ck))
    check("fit weights_only", lambda t, m: t.fit(m, ckpt_path=ck, weights_only=True))
    # a module with one layer: the checkpoint's second layer is refused under strict_loading, ignored without
    check("validate fewer layers", lambda t, m: t.validate(m, ckpt_path=ck), layers=1)
    check("validate fewer layers, strict_loading=False", lambda t, m: t.validate(m, ckpt_path=ck), layers=1,
          strict=False)

    # load_from_checkpoint reads one file with torch.load: Lightning's own distributed checkpoint (a
    # folder) cannot be read that way either; both are recorded so the test can compare them
    own = os.path.join(folder, "own.ckpt")
    tl = _trainer(folder, 2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    tl.fit(_module(0))
    tl.save_checkpoint(own)
    for name, path in (("load_from_checkpoint", ck), ("load_from_checkpoint lightning-own", own)):
        try:
            type(_eval_module(1)).load_from_checkpoint(path)
            out[name] = {"error": None}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": type(e).__name__}

    # a flipped byte in each rank's half of the final norm weight: every rank's load refuses it (checksums
    # are checked by default on this resume path), naming the file and the key
    import torch.distributed as dist
    if dist.get_rank() == 0:
        key = "state_dict/llama.model.norm.weight"
        e = fastckpt.read_manifest(ck).tensors[key]
        with open(os.path.join(ck, e.file), "r+b") as f:
            for pos in (e.offsets[0] + 1, e.offsets[1] - 2):  # inside element 0 and element 31
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ 0x01]))
    dist.barrier()
    check("validate flipped byte", lambda t, m: t.validate(m, ckpt_path=ck))
    return out


def test_every_lightning_way_to_load_a_fastckpt_checkpoint(pool, tmp_path):
    res = pool.run(rank_every_lightning_way, folder=str(tmp_path), timeout_s=TIMEOUT_S * 2)
    for r, out in res.items():
        for way in ("validate", "test", "predict", "validate weights_only"):
            assert out[way].get("diff") == [] and out[way]["seen"] == 1, (r, way, out[way])
            assert out[way]["dtypes"] == ["torch.float32"], (r, way, out[way])
        bf = out["validate bf16-true"]
        assert bf.get("diff") == [] and bf["dtypes"] == ["torch.bfloat16"], (r, bf)  # saved.to(bf16), bit for bit
        for way in ("fit", "fit weights_only"):
            assert out[way].get("global_step") == 3, (r, way, out[way])  # resumed at 2, one more step
        err = out["validate fewer layers"].get("error") or ""
        assert err.startswith("StateMismatchError") and "layers.1." in err and "strict_loading" in err, (r, err)
        loose = out["validate fewer layers, strict_loading=False"]
        assert loose.get("diff") == [] and loose["seen"] == 1, (r, loose)  # the module's keys, bit for bit
        err = out["validate flipped byte"].get("error") or ""
        assert err.startswith("ChecksumMismatchError") and "llama.model.norm.weight" in err and ".safetensors" in err, \
            (r, err)
        # a folder checkpoint is not a load_from_checkpoint input, fastckpt's as Lightning's own
        assert out["load_from_checkpoint"]["error"] == out["load_from_checkpoint lightning-own"]["error"], (r, out)


def rank_per_rank_extras(folder: str) -> dict:
    """A value of Lightning's checkpoint dict that differs per rank (an on_save_checkpoint extra, as a
    Timer's elapsed time or an un-synced metric is): saved as rank 0's, and the resume works."""
    import torch.distributed as dist
    _env()

    class PerRank(type(_module(0))):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["per_rank"] = {"rank": dist.get_rank(), "note": f"rank {dist.get_rank()}"}

    ck = os.path.join(folder, "per-rank.ckpt")
    m = PerRank.__new__(PerRank)
    m.__dict__ = _module(0).__dict__
    t = _trainer(folder, 2)
    t.fit(m)
    t.save_checkpoint(ck)
    t2 = _trainer(folder, 3)
    t2.fit(_module(1), ckpt_path=ck)
    return {"meta": fastckpt.load(ck, keys="lightning")["lightning"]["per_rank"], "step": t2.global_step}


def test_values_that_differ_per_rank_are_rank_0s(pool, tmp_path):
    res = pool.run(rank_per_rank_extras, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out["meta"] == {"rank": 0, "note": "rank 0"} and out["step"] == 3, (r, out)


def rank_path_hyperparameters(folder: str) -> dict:
    """save_hyperparameters() of a module taking a pathlib.Path (a data or output folder, as Lightning's
    own examples do): Lightning's checkpoint dict holds the Path in ``hyper_parameters``."""
    from pathlib import Path
    _env()

    class WithHparams(type(_module(0))):
        def __init__(self, data_dir: Path = Path("/data/set"), lr: float = 1e-2):
            super().__init__()
            self.save_hyperparameters()

    ck = os.path.join(folder, "hparams.ckpt")
    t = _trainer(folder, 2)
    t.fit(WithHparams(data_dir=Path(folder) / "data"))
    t.save_checkpoint(ck)
    t2 = _trainer(folder, 3)
    m = WithHparams()
    t2.fit(m, ckpt_path=ck)
    hp = fastckpt.load(ck, keys="lightning")["lightning"]["hyper_parameters"]
    return {"saved": [type(hp["data_dir"]).__name__, str(hp["data_dir"])], "step": t2.global_step}


def test_path_hyperparameters_are_saved_and_read_back_as_paths(pool, tmp_path):
    """The save failed with UnsupportedValueError (pathlib.Path); Lightning's own checkpoint pickles it."""
    res = pool.run(rank_path_hyperparameters, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out == {"saved": ["PosixPath", str(tmp_path / "data")], "step": 3}, (r, out)
