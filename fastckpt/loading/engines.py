"""Device engines: how bytes move from a host slot into a device (a small strategy chosen by
device type from :data:`ENGINES`), and whether a device can be loaded into at all
(:func:`check_device`, before a byte is read). Used by :mod:`fastckpt.loading.device` and the reader.
GPU/NPU modules are imported lazily.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..device import BACKENDS, Completion, CopyStream, copy_stream
from ..device.copies import AcceleratorStream
from ..errors import DeviceUnavailableError
from ..storage.memory import host_buffer


class Engine:
    """CPU engine; base of the accelerator engines. Its copies go through the device-copy layer
    (:func:`fastckpt.device.copy_stream`: synchronous on CPU; a device type without a copy backend,
    e.g. a test's registered engine, copies synchronously too).

    Call order for one load: ``empty`` (every destination) -> ``reserve`` (only when converting)
    -> ``begin`` -> for each piece: ``wait(slot)`` -> read into ``slot(i)`` -> ``copy`` or
    ``convert`` ... -> ``record(slot)`` -> ``finish``. A slot is read into again only after the
    completion ``record`` took for it was waited for; the destinations are returned only after
    ``finish`` (every copy complete).
    All calls come from the loading thread; only the file reads run in worker threads.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.copies: CopyStream = copy_stream(device) if device.type in BACKENDS else CopyStream(device)
        self.events: dict[int, Completion] = {}

    def empty(self, nbytes: int) -> torch.Tensor:
        """A new 1-D uint8 tensor of ``nbytes`` on the device (the destination's own memory)."""
        if self.device.type == "cpu":
            return host_buffer(nbytes)[0]  # huge-page backed: faults in 2 MiB pages
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_slot(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A host bounce buffer of ``nbytes`` (pinned for accelerators)."""
        return host_buffer(nbytes)

    def begin(self) -> None:
        """Called after every destination is allocated, before the first copy."""
        self.copies.begin()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue the copy of host ``src`` into device ``dst`` (same shape, uint8); ``src`` is reused
        only after the completion :meth:`record` takes next."""
        self.copies.to_device(dst, src)

    def reserve(self, nbytes: int) -> None:
        """Called before :meth:`begin` when a load converts dtypes: no piece is larger than ``nbytes``."""

    def convert(self, dst: torch.Tensor, src: torch.Tensor, stored: torch.dtype) -> None:
        """Copy host bytes ``src`` (uint8, last dim in bytes), read as ``stored``, into ``dst`` of another dtype.

        ``dst`` has ``src``'s shape with the last dim in elements. The conversion runs on these
        bytes only: its scratch is at most ``src.numel()`` bytes (an aligned copy of a slot range
        whose address is not a multiple of the element size).
        """
        if src.data_ptr() % stored.itemsize:
            src = torch.empty_like(src, memory_format=torch.contiguous_format).copy_(src)
        self.copies.to_device(dst, src.view(stored))

    def record(self, slot: int) -> None:
        """Take the completion of every copy issued so far: ``slot`` is reused only after it."""
        self.events[slot] = self.copies.mark()

    def wait(self, slot: int) -> None:
        """Block until the copies recorded for ``slot`` are done (their completion waited for)."""
        done = self.events.pop(slot, None)
        if done is not None:
            done.wait()

    def finish(self) -> None:
        """Block until every copy is done (the copy stream synchronized)."""
        self.copies.synchronize()
        self.events.clear()


class AcceleratorEngine(Engine):
    """CUDA or NPU engine: pinned slots, copies on a side stream of the device-copy layer
    (:class:`fastckpt.device.copies.AcceleratorStream`), one event per slot.

    ``mod`` is ``torch.cuda`` or ``torch.npu`` (both expose ``Stream``, ``Event``, ``stream``).
    """

    def __init__(self, device: torch.device, mod):
        self.device = device
        self.mod = mod
        self.copies = AcceleratorStream(device, mod)
        self.events = {}
        self.scratch: torch.Tensor | None = None

    def host_slot(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # pinned directly: no pageable twin
        return t, memoryview(t.numpy())

    def reserve(self, nbytes: int) -> None:
        # one device scratch for the whole load, owned by the side stream: every H2D copy into it
        # and the conversion kernel reading it are ordered on that stream
        with self.copies.issuing():
            self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def convert(self, dst: torch.Tensor, src: torch.Tensor, stored: torch.dtype) -> None:
        n = src.numel()
        if self.scratch is None or self.scratch.numel() < n:
            raise RuntimeError(f"convert of {n} bytes without reserve() of at least that much")
        raw = self.scratch[:n]
        self.copies.to_device(raw, src.reshape(-1))
        with self.copies.issuing():
            dst.copy_(raw.view(stored).view(dst.shape))

    def finish(self) -> None:
        super().finish()
        self.scratch = None


def _cuda_engine(device: torch.device) -> Engine:
    return AcceleratorEngine(device, torch.cuda)


def _npu_engine(device: torch.device) -> Engine:
    from ..device.npu import npu_module  # torch_npu: imported only for npu loads
    return AcceleratorEngine(device, npu_module())


#: Engine registry: device type -> factory(device). Tests register fake devices here.
ENGINES: dict[str, Callable[[torch.device], Engine]] = {"cpu": Engine, "cuda": _cuda_engine, "npu": _npu_engine}


def get_engine(device: str | torch.device) -> Engine:
    """The engine for ``device`` (``"cpu"``, ``"cuda:N"``, ``"npu:N"`` or a registered type).

    Raises:
        ValueError: no engine for that device type.
    """
    dev = torch.device(device)
    if dev.type in ("cuda", "npu") and dev.index is None:
        dev = torch.device(dev.type, 0)
    try:
        factory = ENGINES[dev.type]
    except KeyError:
        raise ValueError(f"no device engine for {dev.type!r}; known: {sorted(ENGINES)}") from None
    return factory(dev)


def kvikio_usable(device: torch.device) -> bool:
    """True when kvikio imports, ``device`` is CUDA and GPUDirect Storage is not in compat mode."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import kvikio
        import kvikio.defaults as kd
    except Exception:  # ImportError, or a broken CUDA runtime raising at import
        return False
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(kd, name, None)
        if callable(fn):
            try:
                return not bool(fn())
            except Exception:
                return False
    return hasattr(kvikio, "CuFile")


# ---------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------


def check_device(device: str | torch.device) -> torch.device:
    """Check that tensors can be loaded into ``device`` in this process, before reading a byte.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"npu:N"`` or a type registered in
            :data:`fastckpt.loading.device.ENGINES`.

    Returns:
        The parsed ``torch.device``.

    Raises:
        DeviceUnavailableError: torch cannot parse ``device``; fastckpt has no engine for its
            type; CUDA (or the Ascend NPU) is not available; or its index is past the devices
            present. The message names the device and says what to pass instead.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        if isinstance(device, str) and device.split(":")[0] == "npu":
            _check_accelerator(device, None, "the Ascend NPU", None)
        raise DeviceUnavailableError(f"device={device!r} is not a device torch understands ({e}); pass "
                                     "device='cpu', 'cuda', 'cuda:N' or 'npu:N'") from None
    if dev.type == "cpu":
        return dev
    if dev.type not in ENGINES:
        raise DeviceUnavailableError(f"device={device!r}: fastckpt cannot load into {dev.type!r} devices (it "
                                     f"knows {sorted(ENGINES)}); load with device='cpu' and move the tensors")
    if dev.type == "cuda":
        _check_accelerator(device, dev, "CUDA", torch.cuda if torch.version.cuda or torch.version.hip else None)
    elif dev.type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
            mod = torch.npu
        except ImportError:
            mod = None
        _check_accelerator(device, dev, "the Ascend NPU", mod)
    return dev


def _check_accelerator(device: Any, dev: torch.device | None, what: str, mod: Any) -> None:
    """Raise :class:`DeviceUnavailableError` unless ``mod`` (``torch.cuda``/``torch.npu``) has ``dev``."""
    if mod is None or not mod.is_available():
        npu = what.endswith("NPU")
        why = ("torch_npu is not installed" if npu and mod is None
               else f"this torch build ({torch.__version__}) does not include it" if mod is None
               else "no device is visible to this process (driver, "
                    f"{'ASCEND_RT_VISIBLE_DEVICES' if npu else 'CUDA_VISIBLE_DEVICES'}?)")
        raise DeviceUnavailableError(f"device={device!r}: {what} is not available ({why}); pass device='cpu' "
                                     "to load into host memory")
    n = mod.device_count()
    if dev.index is not None and dev.index >= n:
        raise DeviceUnavailableError(f"device={device!r}: only {n} {dev.type} device(s) visible "
                                     f"({dev.type}:0 .. {dev.type}:{n - 1})")
