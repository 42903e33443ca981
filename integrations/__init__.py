"""Framework glue for fastckpt, importable as ``fastckpt.integrations``.

One package or module per framework; each imports its framework lazily and uses only the
public core API: ``hf`` (transformers Trainer callback, peft helpers), ``accelerate``,
``deepspeed``, ``lmcache`` (storage backend over :mod:`fastckpt.kv`), ``vllm`` (load-format
plugin), ``torchtitan`` and ``lightning``.
"""
