"""Framework glue for fastckpt, importable as ``fastckpt.integrations``.

Each module imports its framework lazily and uses only the public core API:
``hf_trainer`` (transformers Trainer callback), ``accelerate``, ``deepspeed``, ``peft``
helpers, ``vllm`` load-format plugin, ``lmcache`` storage backend.
"""
