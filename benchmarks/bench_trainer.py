#!/usr/bin/env python
"""Trainer checkpoint overhead: the Trainer's own saving vs the fastckpt callback, back to back.

Same model, data, steps and save interval; three variants per case, run ``--repeats`` times
interleaved (medians reported; this VM's speed drifts by tens of percent): no saving (baseline),
the Trainer's own saving (torch.save/safetensors, no fsync, as users run it), and the fastckpt
callback (durable: fsync + atomic commit). Two measures of the cost of checkpointing:

  blocked_s   time the training loop stood still for saves: the Trainer's ``_save_checkpoint``
              calls; for fastckpt the staging of each save plus the wait for the last one;
  overhead_s  median wall time - median baseline wall time (also counts background work
              competing for the 2 cores; noisier).

Cases:
  full  full fine-tune of a random Llama (both save model + optimizer + scheduler + RNG)
  lora  LoRA on the same model; fastckpt saves the whole snapshot (base + adapter + ...),
        the Trainer's own saving only adapter + optimizer, so figures are also given per GB.

    python benchmarks/bench_trainer.py [--steps 20] [--save-every 5] [--hidden 512] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import common as C  # noqa: E402
try:
    from fastckpt.integrations.hf import trainer as hf_trainer
except ImportError:
    sys.path.insert(0, str(REPO))
    from fastckpt.integrations.hf import trainer as hf_trainer  # noqa: E402


def make_model(hidden: int, layers: int, vocab: int, lora: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=8,
                                         num_key_value_heads=4, max_position_embeddings=128))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return model


def run(mode: str, opts, out: Path, lora: bool) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (x := torch.randint(0, opts.vocab, (opts.seq,), generator=g)), "labels": x}
            for _ in range(opts.steps * opts.batch)]
    args = TrainingArguments(output_dir=str(out), max_steps=opts.steps, per_device_train_batch_size=opts.batch,
                             save_strategy="no" if mode == "none" else "steps", save_steps=opts.save_every,
                             report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=10**6)
    cbs, cls = [], Trainer
    blocked, per_save = [0.0], []
    if mode == "fastckpt":
        cbs = [hf_trainer.FastCkptCallback()]
        cls = type("T", (hf_trainer.FastCkptTrainerMixin, Trainer), {})
    elif mode == "trainer":
        def _save_checkpoint(self, *a, **kw):  # what the training loop waits for
            t = time.perf_counter()
            try:
                return Trainer._save_checkpoint(self, *a, **kw)
            finally:
                per_save.append(time.perf_counter() - t)
                blocked[0] += per_save[-1]
        cls = type("T", (Trainer,), {"_save_checkpoint": _save_checkpoint})
    tr = cls(model=make_model(opts.hidden, opts.layers, opts.vocab, lora), args=args, train_dataset=data,
             callbacks=cbs)
    if mode == "fastckpt":
        real_wait = cbs[0].wait

        def timed_wait(a=None):  # a wait for a pending save stops the training loop too
            t = time.perf_counter()
            try:
                return real_wait(a)
            finally:
                blocked[0] += time.perf_counter() - t
        cbs[0].wait = timed_wait
    t0 = time.perf_counter()
    tr.train()
    wall = time.perf_counter() - t0
    saves = sorted(p for p in out.glob("checkpoint-*"))
    nbytes = sum(f.stat().st_size for f in saves[-1].rglob("*") if f.is_file()) if saves else 0
    res = {"wall_s": wall, "saves": len(saves), "bytes_per_save": nbytes, "blocked_s": blocked[0],
           "max_save_blocked_s": max(per_save, default=0.0)}
    if mode == "fastckpt":
        res["blocked_s"] += sum(r["blocking_s"] for r in cbs[0].records)
        res["max_save_blocked_s"] = max((r["blocking_s"] for r in cbs[0].records), default=0.0)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--cases", default="full,lora")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant (default 3)")
    opts = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_trainer-", dir=REPO if (REPO / "runs").exists() else None))
    modes = ("none", "trainer", "fastckpt")
    try:
        for case in opts.cases.split(","):
            run("none", opts, root / f"{case}-warmup", case == "lora")  # first run pays one-time costs
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for i in range(opts.repeats):
                for m in modes:
                    out = root / f"{case}-{m}-{i}"
                    runs[m].append(run(m, opts, out, case == "lora"))
                    shutil.rmtree(out, ignore_errors=True)
            r = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0]} for m in modes}
            base = r["none"]["wall_s"]
            print(f"\n[{case}] {opts.steps} steps, save every {opts.save_every}; medians of {opts.repeats}; "
                  f"baseline (no saving) {base:.1f} s")
            print("  blocked_% / overhead_% = blocked_s / overhead_s as % of the baseline wall time; "
                  "max_save_s = the longest single save (fastckpt: call + any optimizer-step wait)")
            print(f"  {'':10} {'wall_s':>7} {'blocked_s':>9} {'blocked_%':>9} {'overhead_s':>10} {'overhead_%':>10} "
                  f"{'MB/save':>8} {'blocked s/GB':>12} {'max_save_s':>10}")
            for m in ("trainer", "fastckpt"):
                ov = r[m]["wall_s"] - base
                gb = r[m]["bytes_per_save"] * max(1, r[m]["saves"]) / 1e9
                print(f"  {m:10} {r[m]['wall_s']:7.1f} {r[m]['blocked_s']:9.2f} {100 * r[m]['blocked_s'] / base:9.1f} "
                      f"{ov:10.2f} {100 * ov / base:10.1f} {r[m]['bytes_per_save'] / 1e6:8.1f} "
                      f"{r[m]['blocked_s'] / gb if gb else 0:12.3f} {r[m]['max_save_blocked_s']:10.3f}")
            mc = C.memcpy_s(int(r["fastckpt"]["bytes_per_save"]))
            print(f"  one memcpy of a save's bytes ({r['fastckpt']['bytes_per_save'] / 1e6:.1f} MB): {mc:.3f} s; "
                  f"fastckpt's longest save blocked {r['fastckpt']['max_save_blocked_s'] / mc:.2f}x that (target <= 1.5x)")
            bt, bf = r["trainer"]["blocked_s"], r["fastckpt"]["blocked_s"]
            ov_t, ov_f = r["trainer"]["wall_s"] - base, r["fastckpt"]["wall_s"] - base
            print(f"  ratio trainer/fastckpt: blocked {bt / bf if bf > 0 else float('inf'):.2f}x, "
                  f"wall overhead {ov_t / ov_f if ov_f > 0 else float('inf'):.2f}x"
                  + ("; per GB saved (LoRA: the Trainer saves only the adapter) "
                     f"{(bt / (r['trainer']['bytes_per_save'] or 1)) / (bf / (r['fastckpt']['bytes_per_save'] or 1)):.1f}x"
                     if case == "lora" and bf > 0 else ""))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
