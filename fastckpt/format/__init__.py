"""Pure data and codecs, no I/O (files are read by :mod:`fastckpt.storage`): safetensors headers and HF index files,
the dtype table, the key-path tree, the shard layout.

Public parts (importable from ``fastckpt.format``; integrations may use these and nothing
else of the layer):

* The safetensors codec (:mod:`.safetensors`): :func:`encode_header` (validated header bytes
  for tensors laid out back to back, optionally padded for O_DIRECT), :func:`parse_header`,
  :func:`read_header_at` (validated against the file size, read through a callable),
  :class:`Header`, :class:`TensorInfo`, :func:`parse_index` / :func:`write_index` (HF
  ``*.safetensors.index.json``), :func:`check_name`, :data:`INDEX_SUFFIX`. Reading them from a
  file is :mod:`fastckpt.storage.model_files` (``read_header``, ``read_index``, ``safe_join``).
* The dtype table (:mod:`.dtypes`): :func:`dtype_to_str`, :func:`str_to_dtype`, :func:`itemsize`.

* The manifest (:mod:`.manifest`, imported from there): :class:`~.manifest.Manifest` and its
  entries, :data:`~.manifest.FORMAT_VERSION`, :func:`~.manifest.parse` (validating) and
  :meth:`~.manifest.Manifest.to_json`, :class:`~.manifest.RangeCheck` (one checksummed range).

The key-path tree (:mod:`.tree`) and the shard layout (:mod:`.layout`) serve the save and load
engines and are not re-exported.
"""

from .dtypes import dtype_to_str, itemsize, str_to_dtype
from .safetensors import (INDEX_SUFFIX, Header, TensorInfo, check_name, encode_header, parse_header, parse_index,
                          read_header_at, write_index)

__all__ = ["dtype_to_str", "itemsize", "str_to_dtype", "INDEX_SUFFIX", "Header", "TensorInfo", "encode_header",
           "parse_header", "read_header_at", "parse_index", "check_name", "write_index"]
