"""Hugging Face ``transformers`` / ``peft`` glue: :mod:`.trainer` (the Trainer callback and mixin)
and its helpers (:mod:`.checkpoints`, :mod:`.snapshot`, :mod:`.resume`, :mod:`.rank_state`,
:mod:`.on_save`, :mod:`.step_gate`); :mod:`.models` builds tiny and real test models."""
