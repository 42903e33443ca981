"""The dtype table: torch dtypes <-> safetensors dtype strings.

Source: the safetensors format specification
(https://github.com/huggingface/safetensors#format, ``Dtype`` enum of the Rust crate).
``C64`` (complex64) as the ``safetensors`` package (0.6+) writes it. Sub-byte dtypes (``F4``:
``float4_e2m1fn_x2``, whose header shape counts 4-bit elements, ``F6_*``) and complex128 are not
supported: refused at save time, and a file holding them is refused with the dtype named.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedDtypeError

_PAIRS: list[tuple[str, str]] = [
    ("BOOL", "bool"),
    ("U8", "uint8"),
    ("I8", "int8"),
    ("I16", "int16"),
    ("U16", "uint16"),
    ("I32", "int32"),
    ("U32", "uint32"),
    ("I64", "int64"),
    ("U64", "uint64"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("F32", "float32"),
    ("F64", "float64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("C64", "complex64"),
]

#: safetensors dtype string -> torch dtype (only those this torch build has).
STR_TO_DTYPE: dict[str, torch.dtype] = {
    s: getattr(torch, name) for s, name in _PAIRS if hasattr(torch, name)
}
#: torch dtype -> safetensors dtype string.
DTYPE_TO_STR: dict[torch.dtype, str] = {d: s for s, d in STR_TO_DTYPE.items()}


def dtype_to_str(dtype: torch.dtype, *, tensor: str = "?") -> str:
    """Return the safetensors dtype string of ``dtype`` (e.g. ``torch.bfloat16`` -> ``"BF16"``).

    Raises:
        UnsupportedDtypeError: ``dtype`` has no encoding here (complex128, sub-byte dtypes);
            the message names ``tensor``.
    """
    try:
        return DTYPE_TO_STR[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"tensor {tensor!r} has dtype {dtype}, which fastckpt does not store (complex128 has no safetensors "
            f"dtype; sub-byte dtypes such as float4_e2m1fn_x2 are not supported); "
            f"supported: {', '.join(str(d).replace('torch.', '') for d in DTYPE_TO_STR)}. "
            "Convert it first (e.g. complex128 -> torch.view_as_real, float4_e2m1fn_x2 -> .view(torch.uint8))."
        ) from None


def str_to_dtype(name: str, *, tensor: str = "?", path: str = "?") -> torch.dtype:
    """Return the torch dtype for a safetensors dtype string read from a file.

    Raises:
        UnsupportedDtypeError: ``name`` is unknown; the message names the dtype, tensor and file.
    """
    try:
        return STR_TO_DTYPE[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(
            f"{path}: tensor {tensor!r} has dtype {name!r}, which fastckpt does not read "
            f"(known: {', '.join(STR_TO_DTYPE)}; sub-byte dtypes such as F4 are not supported): read this file "
            "with the safetensors package"
        ) from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()
