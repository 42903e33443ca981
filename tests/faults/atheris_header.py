"""atheris target: any byte string as a whole safetensors file -> typed error or valid header.

Run: ``python tests/faults/atheris_header.py -runs=100000 -max_len=4096``. Any exception other
than a :class:`fastckpt.errors.FastCkptError` is a crash (non-zero exit, input saved by libFuzzer).
"""

import os
import sys

import atheris

import fastckpt.format.safetensors as fmt
from fastckpt.errors import FastCkptError
from fastckpt.storage.model_files import read_header_fd

for _name in ("parse_header", "read_header_at", "_parse_entry", "_check_layout", "_dup_check", "check_metadata"):
    atheris.instrument_func(getattr(fmt, _name))

_FD = os.memfd_create("fuzz")


def one_input(data: bytes) -> None:
    os.ftruncate(_FD, 0)
    os.pwrite(_FD, data, 0)
    try:
        read_header_fd(_FD, "fuzz")
    except FastCkptError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
