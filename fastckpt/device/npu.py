"""Ascend NPU support of the copy layer: ``torch.npu`` for :class:`~fastckpt.device.copies.AcceleratorBackend`.

Imported only when a tensor or a load is on an ``npu`` device: ``torch_npu`` registers ``torch.npu``
on import and needs the Ascend toolkit.
"""

from __future__ import annotations

from typing import Any


def npu_module() -> Any:
    """``torch.npu`` (its ``Stream``, ``Event``, ``stream``, ``current_stream``), after importing ``torch_npu``.

    Raises:
        ImportError: ``torch_npu`` is not installed.
    """
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)
    return torch.npu
