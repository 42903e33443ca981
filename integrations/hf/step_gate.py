"""The optimizer-step gate of the Trainer callback's pipelined snapshot (``defer_params``).

A save started with ``defer`` (see :class:`fastckpt.Consistency`) leaves the copy of the
trainable parameters and the optimizer state to its writer thread, which runs while the next
step's forward and backward compute. The only writer of those tensors in a training step is the
optimizer, so its ``step()`` must not start before that copy is done: :class:`OptimizerStepGate`
registers a step pre-hook (``torch.optim.Optimizer.register_step_pre_hook``) that waits for
:meth:`fastckpt.SaveFuture.wait_staged` and records how long it waited. This is the pipelined
snapshot of CheckFreq (Mohan et al., "CheckFreq: Frequent, Fine-Grained DNN Checkpointing",
FAST 2021).
"""

from __future__ import annotations

import time
from typing import Any, Callable


def param_or_optimizer_state(key: str, trainable: bool) -> bool:
    """``defer`` of the callback's saves: trainable parameters and optimizer state tensors (key
    paths under ``optimizer/``), which only the optimizer's step writes (gated); buffers and
    everything else are copied at the call."""
    return trainable or key.startswith("optimizer/")


class OptimizerStepGate:
    """Make a torch optimizer's ``step()`` wait until the pending save has staged its tensors.

    Args:
        pending: returns ``(future, step)`` of the save in flight, or ``None``; called from the
            training thread in the hook (must be cheap and thread-safe).

    Attributes:
        waited: save step -> seconds ``step()`` waited for that save's background copy.
    """

    def __init__(self, pending: Callable[[], tuple[Any, int] | None]):
        self._pending = pending
        self._handle = None
        self.waited: dict[int, float] = {}

    @property
    def active(self) -> bool:
        """True while a hook is registered (saves may then defer their copies)."""
        return self._handle is not None

    def install(self, optimizer) -> bool:
        """Register the hook on ``optimizer`` (unwrapping accelerate's ``AcceleratedOptimizer``,
        whose ``.optimizer`` is the torch one). Returns False, registering nothing, when there is
        no ``torch.optim.Optimizer`` to gate (then saves must copy everything at the call)."""
        import torch

        opt = optimizer
        while not isinstance(opt, torch.optim.Optimizer) or \
                isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
            opt = getattr(opt, "optimizer", None)
            if opt is None:
                return False
        self.remove()
        self._handle = opt.register_step_pre_hook(self._before_step)
        return True

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def pop_wait(self, step: int) -> float:
        """Seconds ``step()`` waited for the save of ``step`` (0.0 if none), forgetting it."""
        return self.waited.pop(step, 0.0)

    def _before_step(self, optimizer, args, kwargs) -> None:
        pending = self._pending()
        if pending is None or pending[0].wait_staged(0):
            return
        t = time.perf_counter()
        pending[0].wait_staged()
        self.waited[pending[1]] = self.waited.get(pending[1], 0.0) + time.perf_counter() - t
