"""DeepSpeed glue: :mod:`.engine` (the checkpoint engine, ``install(engine)``) and :mod:`.tag`
(one tag committed by every rank together)."""
