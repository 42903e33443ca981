"""Helper of test_hf_trainer_fsdp2_resume.py (not collected): the real HF Trainer with accelerate's FSDP2
on 2 spawned CPU gloo ranks and FastCkptCallback. accelerate enables FSDP only for GPU-like
distributed types; ``force_fsdp_on_cpu`` makes it take the FSDP plugin on MULTI_CPU too (the path a
GPU run takes by default). Usage: python trainer_fsdp2_cpu.py OUT PORT; prints one JSON line."""
import json
import os
import sys

import torch
import torch.multiprocessing as mp

VOCAB = 128


def force_fsdp_on_cpu():
    import accelerate.state as S
    orig = S.AcceleratorState.__init__

    def init(self, *a, fsdp_plugin=None, **kw):
        orig(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None and self.distributed_type == S.DistributedType.MULTI_CPU:
            self.distributed_type = S.DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            S.PartialState._shared_state["distributed_type"] = S.DistributedType.FSDP
    S.AcceleratorState.__init__ = init


class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        x = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def run(rank, out, resume, port, q):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    force_fsdp_on_cpu()
    import transformers
    from torch.distributed.tensor import DTensor
    from fastckpt.integrations.hf.trainer import FastCkptCallback
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=4, save_steps=2, save_strategy="steps", logging_steps=1, per_device_train_batch_size=2,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1, report_to="none", use_cpu=True,
        ddp_backend="gloo", disable_tqdm=True, seed=42, fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True})
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    class Count(transformers.TrainerCallback):
        steps = 0

        def on_step_end(self, *a, **k):
            Count.steps += 1

    t = transformers.Trainer(model=model, args=args, train_dataset=DS(), callbacks=[FastCkptCallback(), Count()])
    t.train(resume_from_checkpoint=resume)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in t.model.state_dict().items()}
    if rank == 0:
        q.put({"steps_run": Count.steps, "fsdp": bool(t.is_fsdp_enabled), "dtensor": any(isinstance(p, DTensor) for p in t.model.parameters()),
               "losses": [(e["step"], e["loss"]) for e in t.state.log_history if "loss" in e],
               "sum": float(sum(v.double().sum() for v in full.values()))})


if __name__ == "__main__":
    root, port = sys.argv[1], int(sys.argv[2])
    ctx = mp.get_context("spawn")
    res = {}
    for name, resume in (("whole", None), ("resumed", os.path.join(root, "whole", "checkpoint-2"))):
        q = ctx.Queue()
        mp.spawn(run, args=(os.path.join(root, name), resume, port, q), nprocs=2)
        res[name] = q.get(timeout=60)
        port += 1
    print(json.dumps(res))
