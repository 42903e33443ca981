"""``accelerate`` glue: :mod:`.plugin` (``enable(accelerator)``: ``save_state`` / ``load_state``
through fastckpt), :mod:`.state` (its pure helpers) and :mod:`.fsdp2` (the FSDP2 DTensor route)."""
