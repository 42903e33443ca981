"""Device copies with explicit completions: device -> host staging and host -> device loading.

Every copy between a device (CPU, CUDA, Ascend NPU, or a type registered in :data:`BACKENDS`) and
host memory that fastckpt makes goes through this package, and every copy hands back a
:class:`Completion`. Nothing reads the destination of a copy (hash, write, slot reuse, return to the
caller) before that completion was waited for:

- CPU: the copy ran in the caller's thread; its completion is :data:`DONE`.
- CUDA / NPU: the copy is issued ``non_blocking`` on a stream; its completion is an event recorded
  on that stream right after it (:class:`EventCompletion`), or the stream's own synchronize.

Torch is imported here; ``torch_npu`` only when a tensor or a load is on an ``npu`` device
(:mod:`fastckpt.device.npu`).
"""

from .copies import (BACKENDS, DONE, AllOf, Completion, CopyBackend, CopyStream, EventCompletion, backend_for,
                     cat_to_host, copy_stream, to_host)

__all__ = ["BACKENDS", "DONE", "AllOf", "Completion", "CopyBackend", "CopyStream", "EventCompletion",
           "backend_for", "cat_to_host", "copy_stream", "to_host"]
