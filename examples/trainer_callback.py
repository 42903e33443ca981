"""transformers' Trainer checkpointed by fastckpt: FastCkptCallback, stop, resume, same losses.

A tiny Llama built from a config (no download) trains on CPU for ``--steps`` steps; the callback
takes over the Trainer's saving (every ``--save-every`` steps, asynchronous, committed atomically,
each ``checkpoint-N`` folder also an HF model folder). ``--stop-at N`` ends the run at step N as a
crash would; a second run with ``--resume`` continues from the newest committed checkpoint.

    python examples/trainer_callback.py --out /tmp/trainer-run --stop-at 6
    python examples/trainer_callback.py --out /tmp/trainer-run --resume     # steps 7.. as if never stopped

Each run prints ``step N loss L`` lines (from the Trainer's log history).
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from fastckpt.integrations.hf.trainer import FastCkptCallback

VOCAB, SEQ = 128, 16


class Tokens(torch.utils.data.Dataset):
    """64 short token sequences (labels = inputs), deterministic."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.tensor([(i * 7 + j * 13) % VOCAB for j in range(SEQ)])
        return {"input_ids": ids, "labels": ids.clone()}


class StopAt(TrainerCallback):
    """Ends training after ``step`` (as if the job had been killed there)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def main() -> None:
    """Train (or resume) and print the losses."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="Trainer output_dir: checkpoint-N folders")
    ap.add_argument("--steps", type=int, default=12, help="total training steps (default 12)")
    ap.add_argument("--save-every", type=int, default=3, help="checkpoint every N steps (default 3)")
    ap.add_argument("--stop-at", type=int, default=None, help="end the run at this step")
    ap.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.1)                # dropout: the RNG state must resume too
    model = LlamaForCausalLM(cfg)
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                              learning_rate=1e-2, logging_steps=1, save_strategy="steps",
                              save_steps=args.save_every, seed=1234, report_to="none", use_cpu=True,
                              disable_tqdm=True, dataloader_num_workers=0)
    callbacks = [FastCkptCallback()] + ([StopAt(args.stop_at)] if args.stop_at else [])
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    for h in trainer.state.log_history:
        if "loss" in h:
            print(f"step {h['step']} loss {h['loss']}")


if __name__ == "__main__":
    main()
