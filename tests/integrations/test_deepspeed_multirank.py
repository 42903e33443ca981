"""DeepSpeed ZeRO-1/2/3 with 2 ranks through fastckpt's engine, and consolidation to an HF folder.

Real DeepSpeed 0.19 on CPU: 2 spawned ranks of one gloo group (one :class:`RankPool` for the
module; every call has a bounded wait, ``CALL_TIMEOUT_S``), a tiny transformers Llama (hidden 32,
2 layers, fp32) trained with torch AdamW (``zero_allow_untested_optimizer``). Per stage:

* save and load: train 2 steps, save, load into a fresh engine (other init) -> every rank's
  optimizer state and the gathered parameters bit-identical, and the next loss identical;
* failing rank: an ``OSError`` injected in one rank's writes -> both ranks raise
  ``DistributedSaveError``, ``latest`` still names the previous tag, that tag still loads
  (bit-identical to what was saved), nothing of the failed tag is left, the next save works;
* consolidation: ``fastckpt load SAVE_DIR --to DIR`` -> an HF folder whose weights are the
  trained model's parameters gathered by DeepSpeed itself (``GatheredParameters``) bit for bit,
  and ``AutoModelForCausalLM.from_pretrained`` gives the same logits.

Native DeepSpeed and DCP folders are refused naming the pickle file; an FSDP2-style
one-process ``fastckpt.save({"model": full_state_dict, ...})`` exports the same way.
Functions named ``rank_*`` run in the pool's processes.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "saving"))
from ranks import RankError, RankPool  # noqa: E402

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

CALL_TIMEOUT_S = 240  # a rank that hangs (a lost collective) fails the test in bounded time
VOCAB = 64
IDS = torch.tensor([[1, 5, 9, 2, 33, 7, 60, 11]])


def _config():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    tie_word_embeddings=False)


# -- in the ranks ---------------------------------------------------------------------------

def _deepspeed():
    """DeepSpeed on the pool's gloo group (CPU accelerator; its shared-memory op is not built)."""
    import torch.distributed as dist
    os.environ["DS_ACCELERATOR"] = "cpu"
    for k, v in dict(RANK=dist.get_rank(), LOCAL_RANK=dist.get_rank(), WORLD_SIZE=dist.get_world_size(),
                     LOCAL_WORLD_SIZE=dist.get_world_size(), MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        os.environ[k] = str(v)
    import deepspeed.comm.torch
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # a JIT build of minutes on 2 cores
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _engine(stage: int, seed: int):
    ds = _deepspeed()
    from fastckpt.integrations.deepspeed.engine import install
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    eng, *_ = ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                            config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                    "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                                    "steps_per_print": 10 ** 9})
    install(eng)
    return eng


def _batch(step: int) -> torch.Tensor:
    import torch.distributed as dist
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (1, 8), generator=g)


def _step(eng, step: int) -> float:
    ids = _batch(step)
    loss = eng(input_ids=ids, labels=ids).loss
    eng.backward(loss)
    eng.step()
    return loss.item()


def _gathered(eng) -> dict[str, torch.Tensor]:
    """Full parameters as DeepSpeed itself gathers them (ZeRO-3: ``GatheredParameters``)."""
    import deepspeed
    params = list(eng.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=eng.zero_optimization_stage() == 3):
        return {n: p.detach().clone() for n, p in params}


def _snapshot(v):
    """``v`` with every tensor cloned (detached), containers copied, other values kept."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return type(v)((k, _snapshot(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
        return type(v)(_snapshot(x) for x in v)
    return v


def _same(a, b) -> bool:
    """Deep equality; tensors bit-exact (dtype, shape, bytes)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or repr(a) == repr(b)


def rank_roundtrip(stage: int, folder: str, native: str | None = None) -> dict:
    """Train 2 steps, save after each; load the newest into a fresh engine; compare everything.
    Rank 0 writes the gathered parameters (``ref.safetensors``) for the consolidation check."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    a = _engine(stage, seed=0)
    _step(a, 1)
    a.save_checkpoint(folder, tag="s1")
    _step(a, 2)
    a.save_checkpoint(folder, tag="s2")
    ref = _gathered(a)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(folder, "..", f"ref{stage}.safetensors"))
    b = _engine(stage, seed=1)
    differed = not _same(_gathered(b), ref)
    b.load_checkpoint(folder)
    out = {"differed_before": differed, "params": _same(_gathered(b), ref),
           "optim": _same(b.optimizer.state_dict(), a.optimizer.state_dict()),
           "steps": (a.global_steps, b.global_steps)}
    ids = _batch(3)
    out["loss"] = (a(input_ids=ids, labels=ids).loss.item(), b(input_ids=ids, labels=ids).loss.item())
    if native:  # the same engine saved with DeepSpeed's own torch engine: a native folder
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        a.checkpoint_engine = a.optimizer.checkpoint_engine = TorchCheckpointEngine()
        a.save_checkpoint(native, tag="s2")
    return out


#: Parameters rank_frozen trains with ``requires_grad=False`` (3 of the model's 21).
FROZEN = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")


def rank_frozen(stage: int, folder: str, native: str, excluded: str) -> int:
    """Train 1 step with :data:`FROZEN` frozen; save through fastckpt's engine (``folder``, tag s1),
    with ``exclude_frozen_parameters=True`` (``excluded``) and through DeepSpeed's own torch
    engine (``native``, for ``zero_to_fp32``). Rank 0 writes the parameters DeepSpeed gathers."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    ds = _deepspeed()
    from fastckpt.integrations.deepspeed.engine import install
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in FROZEN)
    eng, *_ = ds.initialize(model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                                     lr=1e-2),
                            config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                    "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                                    "steps_per_print": 10 ** 9})
    install(eng)
    _step(eng, 1)
    eng.save_checkpoint(folder, tag="s1")
    eng.save_checkpoint(excluded, tag="s1", exclude_frozen_parameters=True)
    ref = _gathered(eng)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(folder, "..", "ref.safetensors"))
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    eng.checkpoint_engine = eng.optimizer.checkpoint_engine = TorchCheckpointEngine()
    eng.checkpoint_engine.zipfile_serialization = True  # zero_to_fp32 mmaps the files
    eng.save_checkpoint(native, tag="s1")
    return len(ref)


class _FailingWrites:
    """An I/O backend whose writes fail with EIO (the posix backend otherwise)."""

    def __new__(cls):
        from fastckpt.storage.io import PosixBackend

        class Failing(PosixBackend):
            def pwrite(self, fd, data, offset):
                raise OSError(errno.EIO, "injected EIO in pwrite")
        return Failing()


def rank_failing(stage: int, folder: str, bad_rank: int) -> dict:
    """Save s1, then s2 and s1 again with failing writes on ``bad_rank``; then load (latest) into a
    fresh engine; then save s3 normally."""
    import torch.distributed as dist
    import fastckpt
    a = _engine(stage, seed=0)
    _step(a, 1)
    a.save_checkpoint(folder, tag="s1")
    at_s1 = _gathered(a)
    optim_s1 = _snapshot(a.optimizer.state_dict())  # it holds the live partitions: step 2 changes them
    _step(a, 2)
    if dist.get_rank() == bad_rank:
        a.checkpoint_engine.save_options["io_backend"] = _FailingWrites()
    out: dict = {}
    try:
        a.save_checkpoint(folder, tag="s2")
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        out["raised"] = type(e).__name__
        out["failures"] = sorted(getattr(e, "failures", {}))
        out["cause"] = type(e.__cause__).__name__ if e.__cause__ is not None else None
        out["message"] = str(e)
    try:  # a rolling tag saved again (tag="last"): the failed re-save must leave s1 as it was
        a.save_checkpoint(folder, tag="s1")
        out["resave_raised"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        out["resave_raised"] = type(e).__name__
    dist.barrier()
    out["s1_marker"] = os.path.isfile(os.path.join(folder, "s1", "fastckpt_tag.json"))
    out["hidden_left"] = sorted(n for d in ("s1", "s2") if os.path.isdir(os.path.join(folder, d))
                                for n in os.listdir(os.path.join(folder, d)) if n.startswith("."))
    with open(os.path.join(folder, "latest")) as f:
        out["latest"] = f.read().strip()
    s2 = os.path.join(folder, "s2")
    out["s2_left"] = sorted(n for n in os.listdir(s2) if fastckpt.is_committed(os.path.join(s2, n)) or
                            n == "fastckpt_tag.json") if os.path.isdir(s2) else []
    b = _engine(stage, seed=1)
    b.load_checkpoint(folder)
    out["loaded_s1"] = _same(_gathered(b), at_s1) and _same(b.optimizer.state_dict(), optim_s1)
    a.checkpoint_engine.save_options.pop("io_backend", None)
    a.save_checkpoint(folder, tag="s3")
    dist.barrier()
    with open(os.path.join(folder, "latest")) as f:
        out["latest_after"] = f.read().strip()
    return out


# -- the tests --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("dspool")), world_size=2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def hf_config_dir(tmp_path_factory) -> Path:
    """config.json + a small real tokenizer (WordLevel), as an HF model folder holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = tmp_path_factory.mktemp("hfcfg")
    transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32).save_pretrained(d)
    (d / "model.safetensors").unlink()  # config.json as save_pretrained writes it (architectures, dtype)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(d)
    return d


def _fastckpt_load(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastckpt.cli.main", "load", *args, "-q"], capture_output=True,
                          text=True, timeout=180)


def _logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=IDS).logits


#: One rank loads a 2-rank ZeRO-3 save with ``load_module_only=True``; prints the message and the
#: error type (last line), or ``loaded``.
_ONE_RANK_MODULE_ONLY = """
import sys, torch.distributed as dist
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
import test_deepspeed_multirank as t
eng = t._engine(3, seed=1)
try:
    eng.load_checkpoint(sys.argv[1], load_module_only=True)
    print("loaded")
except Exception as e:
    print(e)
    print(type(e).__name__)
"""


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_save_load_and_consolidate(pool, tmp_path, hf_config_dir, stage):
    from safetensors.torch import load_file
    folder = tmp_path / "run"
    native = tmp_path / "native" if stage == 1 else None
    out = pool.run(rank_roundtrip, stage=stage, folder=str(folder), native=native and str(native),
                   timeout_s=CALL_TIMEOUT_S)
    for r, o in out.items():
        assert o["differed_before"], f"rank {r}: the fresh engine must start from other weights"
        assert o["params"] and o["optim"], (r, o)
        assert o["steps"] == (2, 2), (r, o)
        assert o["loss"][0] == o["loss"][1], (r, o)
    assert (folder / "latest").read_text().strip() == "s2"
    marker = json.loads((folder / "s2" / "fastckpt_tag.json").read_text())
    assert marker["world_size"] == 2 and len(marker["files"]) == (4 if stage == 3 else 3), marker

    # consolidation: config + tokenizer from --config (stage 2: from the save_dir, as HF Trainer puts them)
    extra = ["--config", str(hf_config_dir)]
    if stage == 2:
        for n in os.listdir(hf_config_dir):
            (folder / n).write_bytes((hf_config_dir / n).read_bytes())
        extra = []
    hf = tmp_path / "hf"
    res = _fastckpt_load(str(folder), "--to", str(hf), *extra)
    assert res.returncode == 0, res.stderr
    assert f"ZeRO-{stage} tag" in res.stderr and res.stdout.strip() == f"vllm serve {hf}"
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(os.listdir(hf))
    ref = load_file(str(tmp_path / f"ref{stage}.safetensors"))
    got = load_file(str(hf / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].dtype == torch.float32 and torch.equal(got[k].view(torch.int32), ref[k].view(torch.int32)), k
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    model.load_state_dict(ref)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    assert torch.equal(_logits(hf), want)
    transformers.AutoTokenizer.from_pretrained(hf)  # servable: the tokenizer came along

    if stage == 2:  # without --to: the tag is warmed (checked while read), no command, exit 0 (README: load warms)
        res = _fastckpt_load(str(folder))
        assert res.returncode == 0 and res.stdout == "", res.stderr
        assert "warmed 3 file(s) of DeepSpeed tag" in res.stderr and "3 checked" in res.stderr, res.stderr
        assert "pass --to DIR to consolidate" in res.stderr, res.stderr
        shard = sorted((folder / "s2").glob("*_states.pt/*.safetensors"))[-1]
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF
        shard.write_bytes(bytes(raw))
        res = _fastckpt_load(str(folder))
        assert res.returncode != 0 and res.stdout == "" and shard.name in res.stderr, res.stderr

    if stage == 3:  # 2 -> 1 rank, load_module_only: DeepSpeed would take old rank 0's partition, silently
        res = subprocess.run([sys.executable, "-c", _ONE_RANK_MODULE_ONLY, str(folder), str(tmp_path / "store")],
                             capture_output=True, text=True, timeout=300, cwd=os.path.dirname(__file__))
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip().splitlines()[-1] == "StateMismatchError", res.stdout[-3000:]
        assert "saved by 2 data-parallel ranks, loaded by 1" in res.stdout, res.stdout[-3000:]

    if native is not None:  # DeepSpeed's own torch engine: pickles, refused naming the .pt file
        res = _fastckpt_load(str(native), "--to", str(tmp_path / "hf-native"))
        assert res.returncode != 0 and res.stdout == ""
        assert str(native / "s2" / "mp_rank_00_model_states.pt") in res.stderr, res.stderr
        assert "never unpickles" in res.stderr and not (tmp_path / "hf-native").exists()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_failing_rank_keeps_latest(pool, tmp_path, stage):
    folder = tmp_path / "run"
    bad = 1 if stage != 2 else 0
    out = pool.run(rank_failing, stage=stage, folder=str(folder), bad_rank=bad, timeout_s=CALL_TIMEOUT_S)
    for r, o in out.items():
        assert o["raised"] == "DistributedSaveError", (r, o)
        assert o["failures"] == [bad], (r, o)
        assert o["cause"] == ("OSError" if r == bad else None), (r, o)
        assert "injected EIO" in o["message"] and "'latest' was not written" in o["message"], (r, o)
        assert o["latest"] == "s1" and o["s2_left"] == [], (r, o)
        # a failed re-save of s1 (a rolling tag): s1 keeps its files and marker and still loads
        # (the engine removed the marker before writing and every file after the vote: s1 was empty)
        assert o["resave_raised"] == "DistributedSaveError" and o["s1_marker"] and o["hidden_left"] == [], (r, o)
        assert o["loaded_s1"], (r, o)
        assert o["latest_after"] == "s3", (r, o)
    assert (folder / "s3" / "fastckpt_tag.json").is_file()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_frozen_parameters_exported(pool, tmp_path, hf_config_dir, stage):
    """``requires_grad=False`` parameters: the export holds all 21 weights, each equal to DeepSpeed's
    own ``zero_to_fp32`` of the same run where that gives it, and the frozen ones to what the
    engine holds (ZeRO-1 stores frozen parameters only in the module state, and zero_to_fp32 drops
    them: before, so did the export, 18 of 21, exit 0). Saved with exclude_frozen_parameters=True
    the values are gone: the export is refused naming them, nothing at --to."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    folder, native, excluded = tmp_path / "run", tmp_path / "native", tmp_path / "excluded"
    out = pool.run(rank_frozen, stage=stage, folder=str(folder), native=str(native), excluded=str(excluded),
                   timeout_s=CALL_TIMEOUT_S)
    assert out == {0: 21, 1: 21}
    hf = tmp_path / "hf"
    res = _fastckpt_load(str(folder), "--to", str(hf), "--config", str(hf_config_dir))
    assert res.returncode == 0 and res.stdout.strip() == f"vllm serve {hf}", res.stderr
    got = load_file(str(hf / "model.safetensors"))
    ref = load_file(str(tmp_path / "ref.safetensors"))
    ds = get_fp32_state_dict_from_zero_checkpoint(str(native), tag="s1")
    assert sorted(got) == sorted(ref) and len(got) == 21
    assert (set(FROZEN) & set(ds)) == (set() if stage == 1 else set(FROZEN))  # DeepSpeed's own converter
    for k, v in ds.items():
        assert torch.equal(got[k], v), k
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    _, info = transformers.AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info

    res = _fastckpt_load(str(excluded), "--to", str(tmp_path / "hf-ex"), "--config", str(hf_config_dir))
    assert res.returncode != 0 and res.stdout == "" and not (tmp_path / "hf-ex").exists(), res.stderr
    assert "3 of the 21 parameters of LlamaForCausalLM are not in the folder" in res.stderr, res.stderr
    assert all(k in res.stderr for k in FROZEN), res.stderr


def test_native_dcp_folder_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    res = _fastckpt_load(str(tmp_path / "dcp"), "--to", str(tmp_path / "out"))
    assert res.returncode != 0 and str(tmp_path / "dcp" / ".metadata") in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_incomplete_tag_refused(tmp_path):
    """A tag folder of fastckpt-written DeepSpeed files without the marker is not consolidated."""
    import fastckpt
    tag = tmp_path / "run" / "s1"
    fastckpt.save({"ds": {"module": {"w": torch.ones(2)}}}, tag / "mp_rank_00_model_states.pt", weights={})
    (tmp_path / "run" / "latest").write_text("s1")
    res = _fastckpt_load(str(tmp_path / "run"), "--to", str(tmp_path / "out"))
    assert res.returncode != 0 and "fastckpt_tag.json" in res.stderr and str(tag) in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_fsdp2_style_save_exports(tmp_path, hf_config_dir):
    """A one-process ``fastckpt.save({"model": full_state_dict, ...})`` (the layout fastckpt's FSDP2
    saves write) exports its model subtree; config and tokenizer from --config."""
    import fastckpt
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fastckpt.save({"model": sd, "optimizer": {"state": {}}, "step": 7}, tmp_path / "ckpt")
    res = _fastckpt_load(str(tmp_path / "ckpt"), "--to", str(tmp_path / "hf"), "--config", str(hf_config_dir))
    assert res.returncode == 0, res.stderr
    assert "config.json" in os.listdir(tmp_path / "hf") and "tokenizer.json" in os.listdir(tmp_path / "hf")
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    assert torch.equal(_logits(tmp_path / "hf"), want)


def test_marker_name_is_shared():
    from fastckpt.integrations.deepspeed import tag as deepspeed_tag
    from fastckpt.loading import zero
    assert deepspeed_tag.MARKER == zero.MARKER
