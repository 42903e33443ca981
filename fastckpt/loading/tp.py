"""Tensor-parallel slicing by rank: which bytes of a stored tensor one rank needs (pure, no I/O).

A :class:`Shard` says how a tensor is split: along ``dim`` into ``world_size`` equal parts,
rank ``rank`` keeping part ``rank`` (the layout vLLM's column/row parallel layers use:
``narrow(dim, rank * size // world_size, size // world_size)``). :func:`slice_spec` turns that
into a byte description of the C-order stored tensor: ``outer`` rows of ``row_bytes`` bytes,
of which the rank needs ``[col_off, col_off + col_bytes)`` in each row. When ``outer == 1``
(a split along dim 0, or leading dims of size 1) the slice is one contiguous byte range of
the file and nothing else is read.

Memory: a sharded load allocates only the rank's slices, so ``R`` in the bound of
:func:`fastckpt.loading.device.load_tensors` is the slices' bytes (host ``<= R + ring_bytes +
slot_bytes`` on CPU; device ``<= R + slot_bytes`` on CUDA/NPU, ``R`` without dtype conversion).
Narrow slices read blocks of whole rows into the ring's slots, never a whole stored tensor.

Example::

    shard = Shard(rank=1, world_size=2, dims={"*.q_proj.weight": 0, "*.o_proj.weight": 1})
    spec = slice_spec(info, shard.dim_for("model.layers.0.o_proj.weight"), 1, 2)
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

from ..format.dtypes import itemsize, str_to_dtype
from ..format.safetensors import TensorInfo


@dataclass(frozen=True)
class Shard:
    """Tensor-parallel split of the tensors of one load.

    Attributes:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks (``>= 1``).
        dims: ``fnmatch`` pattern of a tensor name -> dim to split it along (negative dims
            count from the end). The first matching pattern wins; a tensor that matches none
            is replicated (read whole).
    """

    rank: int
    world_size: int
    dims: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {self.rank!r}")

    def dim_for(self, name: str) -> int | None:
        """The dim ``name`` is split along, or ``None`` (replicated)."""
        for pat, dim in self.dims.items():
            if fnmatch.fnmatchcase(name, pat):
                return dim
        return None


@dataclass(frozen=True)
class SliceSpec:
    """The bytes one rank needs of a stored C-order tensor.

    Attributes:
        shape: shape of the rank's slice.
        outer: number of rows (product of the dims before the split dim).
        row_bytes: bytes of one stored row (product of the split dim and after, times itemsize).
        col_off: first needed byte within each row.
        col_bytes: needed bytes per row; the slice holds ``outer * col_bytes`` bytes.
    """

    shape: tuple[int, ...]
    outer: int
    row_bytes: int
    col_off: int
    col_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes of the slice."""
        return self.outer * self.col_bytes

    @property
    def contiguous(self) -> bool:
        """True when the slice is one contiguous byte range of the stored tensor."""
        return self.outer <= 1 or self.col_bytes == self.row_bytes


def slice_spec(info: TensorInfo, dim: int, rank: int, world_size: int) -> SliceSpec:
    """Describe rank ``rank``'s part of ``info`` split along ``dim`` into ``world_size`` parts.

    Raises:
        ValueError: ``dim`` is out of range for the tensor, or its size is not divisible by
            ``world_size`` (names the tensor and the numbers).
    """
    shape = tuple(info.shape)
    if not shape:
        raise ValueError(f"tensor {info.name!r} is a 0-dim scalar; it cannot be split (replicate it)")
    d = dim + len(shape) if dim < 0 else dim
    if not 0 <= d < len(shape):
        raise ValueError(f"tensor {info.name!r} of shape {list(shape)} has no dim {dim}")
    if shape[d] % world_size:
        raise ValueError(f"tensor {info.name!r}: dim {d} of size {shape[d]} is not divisible by "
                         f"world_size {world_size}; replicate it or pick another dim")
    part = shape[d] // world_size
    isz = itemsize(str_to_dtype(info.dtype, tensor=info.name))
    inner = math.prod(shape[d + 1:]) * isz
    out_shape = shape[:d] + (part,) + shape[d + 1:]
    return SliceSpec(out_shape, math.prod(shape[:d]), shape[d] * inner, rank * part * inner, part * inner)
