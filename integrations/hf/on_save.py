"""``on_save`` for the Trainer's other callbacks, fired once a fastckpt checkpoint is committed.

The fastckpt callback turns the Trainer's own save off (``control.should_save = False``), so the
Trainer never calls ``CallbackHandler.on_save``. Eight built-in integrations upload or log the
checkpoint folder in ``on_save`` (W&B, MLflow, Neptune, ClearML, DVCLive, Trackio, Flyte,
SwanLab; they read ``state.global_step`` to find ``checkpoint-{global_step}``), and user callbacks
may too. :class:`OnSaveRelay` keeps, per save, a copy of the ``TrainerState`` as of the save step,
and once that save is committed fires ``on_save`` through the Trainer's own ``CallbackHandler``
(every callback, in the Trainer's order, with the usual ``model``/``optimizer``/... keywords) at the
first callback event the fastckpt callback sees after the commit, on the training thread. So an
``on_save`` callback always finds a complete, committed folder; with the Trainer's own save the
folder is complete at ``on_save`` too.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any

logger = logging.getLogger("fastckpt.integrations.hf.trainer")


def state_as_of_now(state) -> Any:
    """A copy of ``state`` (a ``TrainerState``) that later training steps do not change:
    ``log_history`` and ``stateful_callbacks`` copied, the rest shallow (numbers, strings)."""
    snap = copy.copy(state)
    snap.log_history = [dict(h) for h in state.log_history]
    snap.stateful_callbacks = copy.deepcopy(state.stateful_callbacks)
    return snap


class OnSaveRelay:
    """Queue ``on_save`` for committed saves and fire it through the Trainer's callback handler.

    Call order: :meth:`attach` at train begin (the Trainer found on the stack, or ``None``), then
    :meth:`committed` for each committed save (any thread), :meth:`fire` at the start of every
    callback event (training thread).
    """

    def __init__(self) -> None:
        self._due: list[Any] = []
        self._handler = None  # weakref to the Trainer's CallbackHandler
        self._firing = False
        self._warned = False

    def attach(self, trainer) -> None:
        """Use ``trainer.callback_handler`` (``None``: no Trainer found; saves then warn once)."""
        handler = getattr(trainer, "callback_handler", None)
        self._handler = weakref.ref(handler) if handler is not None else None

    @property
    def handler(self):
        """The Trainer's ``CallbackHandler``, or ``None``."""
        return self._handler() if self._handler is not None else None

    def committed(self, state_snapshot) -> None:
        """Queue ``on_save`` for a committed save (``state_snapshot``: :func:`state_as_of_now` at the save)."""
        self._due.append(state_snapshot)

    @property
    def pending(self) -> int:
        """Number of committed saves whose ``on_save`` has not fired yet."""
        return len(self._due)

    def fire(self, args, control) -> None:
        """Fire ``on_save`` for every queued commit, oldest first, through the Trainer's handler
        (which calls every callback). Re-entrant calls (a callback's ``on_save`` that logs) return
        at once.

        ``CallbackHandler.on_save`` sets ``control.should_save = False``: right for the Trainer's own
        save, which calls it after saving, but here it may run inside the event in which the Trainer
        asks for the *next* save (``on_step_end`` of a save step, ``on_epoch_end``) before the fastckpt
        callback has read that request. So ``control.should_save`` is put back as it was."""
        if not self._due or self._firing:
            return
        handler = self.handler
        if handler is None:
            if not self._warned:
                logger.warning("fastckpt: no Trainer found on the call stack: other callbacks' on_save is not "
                               "called for fastckpt checkpoints")
                self._warned = True
            self._due.clear()
            return
        self._firing = True
        asked = control.should_save  # the Trainer's request for a save at this event, not yet read
        try:
            while self._due:
                handler.on_save(args, self._due.pop(0), control)
        finally:
            self._firing = False
            control.should_save = asked
