"""Copy backends (one per device type), their completions, and the host -> device copy stream.

A backend moves bytes between a tensor on its device and host memory:

- :meth:`CopyBackend.to_host` / :meth:`CopyBackend.cat_to_host` (saving: device -> host staging)
  return a :class:`Completion` that must be waited for before any byte of the destination is
  hashed or written;
- :meth:`CopyBackend.copy_stream` (loading: host -> device) returns a :class:`CopyStream` whose
  :meth:`CopyStream.mark` completions say when the host sources of the copies issued so far may be
  reused, and whose :meth:`CopyStream.synchronize` says when every destination holds its bytes.

:data:`BACKENDS` maps a device type to its backend; tests register a fake asynchronous device there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch


class Completion:
    """The end of one copy (or of several): :meth:`wait` returns once its destination holds every byte."""

    def wait(self) -> None:
        """Block until the copy is complete."""
        raise NotImplementedError

    def done(self) -> bool:
        """True when :meth:`wait` would return at once."""
        raise NotImplementedError


class _Done(Completion):
    def wait(self) -> None:
        """Nothing to wait for: the copy ran in the caller's thread."""

    def done(self) -> bool:
        """Always true."""
        return True


#: The completion of a synchronous (CPU) copy: complete when the copy call returned.
DONE: Completion = _Done()


class EventCompletion(Completion):
    """A CUDA / NPU event recorded on the copy's stream right after the copy was issued.

    :meth:`wait` blocks the calling host thread until the device has run every operation queued on
    that stream before the event (the copy included); it does not make other streams wait.
    """

    def __init__(self, event: Any):
        self.event = event

    def wait(self) -> None:
        """``event.synchronize()``: the host waits for the copy (and what the stream ran before it)."""
        self.event.synchronize()

    def done(self) -> bool:
        """``event.query()``: the device has passed the event."""
        return bool(self.event.query())


class AllOf(Completion):
    """Complete when every one of ``parts`` is (waited for in order)."""

    def __init__(self, parts: Sequence[Completion]):
        self.parts = [p for p in parts if p is not DONE]

    def wait(self) -> None:
        """Wait for each part."""
        for p in self.parts:
            p.wait()

    def done(self) -> bool:
        """True when every part is done."""
        return all(p.done() for p in self.parts)


def _host_view(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst`` (contiguous uint8 on the host, exactly ``src``'s bytes) viewed with ``src``'s dtype and shape."""
    return dst.view(src.dtype).view(src.shape)


class CopyStream:
    """Host -> device copies of one load onto ``device``; this base is the synchronous CPU one.

    Call order: :meth:`begin` (after the destinations were allocated) -> :meth:`to_device` ... ->
    :meth:`mark` (a completion per batch of copies whose host sources are to be reused) ... ->
    :meth:`synchronize` (every destination complete). All calls come from one thread.

    Args:
        device: the destinations' device.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def begin(self) -> None:
        """Order the copies after the work already queued for ``device`` (the destinations' allocation)."""

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        """Context in which device work (allocations, conversion kernels) runs in the copies' order."""
        yield

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue ``dst.copy_(src)``: host ``src`` into ``dst`` on ``device`` (same shape; a dtype
        difference is converted, as ``copy_`` does). Neither ``src`` may be reused nor ``dst`` read
        before a later :meth:`mark` completion or :meth:`synchronize`; on CPU it is complete at once."""
        dst.copy_(src)

    def mark(self) -> Completion:
        """A completion of every copy issued so far (:data:`DONE` on CPU)."""
        return DONE

    def synchronize(self) -> None:
        """Block until every copy issued so far is complete."""


class AcceleratorStream(CopyStream):
    """CUDA / NPU host -> device copies on one side stream; :meth:`mark` records an event on it.

    Args:
        device: a ``cuda:N`` / ``npu:N`` device.
        mod: ``torch.cuda`` or ``torch.npu`` (``Stream``, ``Event``, ``stream``, ``current_stream``).
    """

    def __init__(self, device: torch.device, mod: Any):
        super().__init__(device)
        self.mod = mod
        self.stream = mod.Stream(device=device)

    def begin(self) -> None:
        """The side stream waits for ``device``'s current stream (where the destinations were allocated)."""
        self.stream.wait_stream(self.mod.current_stream(self.device))

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        """Work inside runs on the side stream, ordered with the copies."""
        with self.mod.stream(self.stream):
            yield

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue the copy ``non_blocking`` on the side stream (asynchronous from pinned ``src``)."""
        with self.mod.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def mark(self) -> Completion:
        """An event recorded on the side stream after every copy issued so far."""
        ev = self.mod.Event()
        ev.record(self.stream)
        return EventCompletion(ev)

    def synchronize(self) -> None:
        """``stream.synchronize()``: every copy issued on the side stream is complete."""
        self.stream.synchronize()


class CopyBackend:
    """Copies of CPU tensors: synchronous, complete when the call returns (:data:`DONE`)."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, one_thread: bool = False) -> Completion:
        """Start copying ``src`` (this backend's device, any dtype, shape, strides) into ``dst``.

        Args:
            dst: contiguous ``uint8`` host tensor of exactly ``src.numel() * src.element_size()`` bytes.
            src: the tensor to copy; not empty.
            one_thread: copy on the calling thread only (NumPy; for background copies that share the
                cores with training); torch's copy uses every intra-op thread.

        Returns:
            The copy's completion (:data:`DONE` here): wait for it before reading ``dst``.
        """
        if one_thread and src.is_contiguous():
            np.copyto(dst.numpy(), src.reshape(-1).view(torch.uint8).numpy())
        else:
            _host_view(dst, src).copy_(src)
        return DONE

    def cat_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> Completion:
        """Copy ``srcs`` (one dtype, contiguous, this device) back to back into ``dst`` (``uint8``,
        exactly their bytes together) with one ``torch.cat``; returns its completion."""
        torch.cat([s.reshape(-1) for s in srcs], out=dst.view(srcs[0].dtype))
        return DONE

    def copy_stream(self, device: torch.device) -> CopyStream:
        """The host -> device copy stream of one load onto ``device``."""
        return CopyStream(device)


class AcceleratorBackend(CopyBackend):
    """CUDA / NPU copies: issued ``non_blocking``, each completed by an event recorded right after it
    on the stream it ran on (the source device's current stream).

    Args:
        module: returns ``torch.cuda`` or ``torch.npu`` (called at the first copy: NPU support is
            imported only then).
    """

    def __init__(self, module: Callable[[], Any]):
        self._module = module

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, one_thread: bool = False) -> Completion:
        """Issue the device -> host copy on ``src.device``'s current stream (asynchronous into pinned
        ``dst``) and return an event recorded on that stream after it. ``one_thread`` is ignored."""
        mod = self._module()
        _host_view(dst, src).copy_(src, non_blocking=True)
        ev = mod.Event()
        ev.record(mod.current_stream(src.device))
        return EventCompletion(ev)

    def cat_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> Completion:
        """One copy per source into consecutive ranges of ``dst``; one event after the last (one stream)."""
        off = 0
        mod = self._module()
        for s in srcs:
            n = s.numel() * s.element_size()
            _host_view(dst[off:off + n], s).copy_(s, non_blocking=True)
            off += n
        ev = mod.Event()
        ev.record(mod.current_stream(srcs[0].device))
        return EventCompletion(ev)

    def copy_stream(self, device: torch.device) -> CopyStream:
        """A side stream on ``device`` (:class:`AcceleratorStream`)."""
        return AcceleratorStream(device, self._module())


def _import_npu() -> Any:
    from .npu import npu_module  # only for npu tensors: torch_npu needs the Ascend toolkit
    return npu_module()


#: Device type -> copy backend. Tests register fake devices here (``monkeypatch.setitem``).
BACKENDS: dict[str, CopyBackend] = {"cpu": CopyBackend(), "cuda": AcceleratorBackend(lambda: torch.cuda),
                                    "npu": AcceleratorBackend(_import_npu)}


def backend_for(device: torch.device | str) -> CopyBackend:
    """The copy backend of ``device``'s type.

    Raises:
        ValueError: no backend for that device type (names the known ones).
    """
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    try:
        return BACKENDS[kind]
    except KeyError:
        raise ValueError(f"fastckpt cannot copy tensors on {kind!r} devices (it knows {sorted(BACKENDS)}); "
                         "move them to 'cpu' or 'cuda' first") from None


def to_host(dst: torch.Tensor, src: torch.Tensor, *, one_thread: bool = False) -> Completion:
    """Start copying ``src`` (any device, dtype, strides) into the contiguous ``uint8`` host range ``dst``.

    ``dst`` holds exactly ``src.numel() * src.element_size()`` bytes. Returns the copy's completion:
    wait for it before hashing or writing any byte of ``dst`` (:data:`DONE` for CPU and empty sources).
    ``one_thread``: see :meth:`CopyBackend.to_host`.
    """
    if src.numel() == 0:
        return DONE
    return backend_for(src.device).to_host(dst, src, one_thread=one_thread)


def cat_to_host(dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> Completion:
    """Start copying ``srcs`` (one device and dtype, contiguous, not empty) back to back into ``dst``
    (contiguous ``uint8`` host range of exactly their bytes); returns the completion of all of them."""
    return backend_for(srcs[0].device).cat_to_host(dst, srcs)


def copy_stream(device: torch.device | str) -> CopyStream:
    """The host -> device copy stream for one load onto ``device`` (see :class:`CopyStream`).

    Raises:
        ValueError: no backend for ``device``'s type.
    """
    dev = torch.device(device)
    return backend_for(dev).copy_stream(dev)
