"""All file-system access of the library goes through the storage seam (issue 21 "one storage seam").

Scans every module of ``fastckpt/`` outside ``fastckpt/storage/`` with :mod:`ast` for direct
file-system calls (``open()``, ``os.*`` file calls, ``os.path`` queries, ``shutil``, ``glob``,
``fcntl``, ``mmap``, ``pathlib.Path`` I/O) and fails naming each ``file:line``. Such calls belong
in :mod:`fastckpt.storage` (the :class:`~fastckpt.storage.store.Store` interface and its helpers).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "fastckpt")

#: ``os.<name>(...)`` calls that touch the file system.
OS_CALLS = {
    "open", "read", "write", "pread", "pwrite", "preadv", "pwritev", "close", "fsync", "fdatasync", "listdir",
    "scandir", "stat", "lstat", "fstat", "rename", "replace", "unlink", "remove", "rmdir", "makedirs", "mkdir",
    "link", "symlink", "readlink", "walk", "statvfs", "truncate", "ftruncate", "posix_fallocate", "chmod",
    "utime", "access", "chdir", "sendfile", "copy_file_range", "lseek", "posix_fadvise",
}
#: ``os.path.<name>(...)`` calls that touch the file system (pure string functions are not listed).
OS_PATH_CALLS = {"exists", "lexists", "isfile", "isdir", "islink", "ismount", "getsize", "getmtime", "getatime",
                 "getctime", "realpath", "samefile"}
#: ``pathlib.Path`` methods that touch the file system, on a ``Path(...)`` built in place.
PATH_METHODS = {"read_bytes", "read_text", "write_bytes", "write_text", "mkdir", "unlink", "rmdir", "exists",
                "is_dir", "is_file", "is_symlink", "glob", "rglob", "iterdir", "stat", "lstat", "touch",
                "rename", "replace", "resolve", "readlink", "symlink_to", "hardlink_to", "open", "samefile"}
#: ``pathlib.Path`` methods that the Store also has, but always with a path argument: without
#: arguments (``folder.exists()``) the receiver is a ``Path``.
NO_ARG_PATH_METHODS = {"exists", "stat", "lstat", "read_bytes", "resolve", "readlink", "open"}
#: Methods only ``pathlib.Path`` / ``os.DirEntry`` have (the Store spells its own differently):
#: flagged on any receiver, since a variable's type is not known to the scan.
PATH_ONLY_METHODS = {"read_text", "write_bytes", "write_text", "mkdir", "unlink", "rmdir", "is_dir", "is_file",
                     "is_symlink", "rglob", "iterdir", "touch", "symlink_to", "hardlink_to"}
#: Whole modules whose calls are file-system access.
MODULES = {"shutil", "glob", "fcntl", "mmap", "tempfile"}

#: Calls of :data:`MODULES` that only compute on strings.
PURE = {"glob.escape", "glob.has_magic", "tempfile.gettempprefix"}

#: ``relative/path.py:line-content-substring`` -> reason. Keep it small; every entry says why.
ALLOWED: dict[str, str] = {
    "fastckpt/cli/main.py:os.open(os.devnull": "the CLI's stdout after its reader closed the pipe: /dev/null, no checkpoint",
    "fastckpt/cli/main.py:os.dup2(devnull": "the same: the interpreter's final flush goes to /dev/null",
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _violations(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    aliases: dict[str, str] = {}  # local name -> module or module.attr it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name:
            head, _, rest = name.partition(".")
            full = aliases.get(head, head) + ("." + rest if rest else "")
        else:
            full = ""
        mod, _, attr = full.rpartition(".")
        bad = None
        if full == "open" or full == "io.open" or full == "builtins.open":
            bad = full
        elif mod == "os" and attr in OS_CALLS:
            bad = full
        elif mod == "os.path" and attr in OS_PATH_CALLS:
            bad = full
        elif full.split(".")[0] in MODULES and "." in full and full not in PURE:
            bad = full
        elif isinstance(node.func, ast.Attribute) and (
                node.func.attr in PATH_ONLY_METHODS
                or node.func.attr in PATH_METHODS and _is_path_expr(node.func.value, aliases)
                or node.func.attr in NO_ARG_PATH_METHODS and not node.args and not node.keywords):
            bad = f"Path.{node.func.attr}"
        if bad:
            out.append((node.lineno, bad))
    return out


def _is_path_expr(node: ast.AST, aliases: dict[str, str]) -> bool:
    """True for ``Path(...)...``/``pathlib.Path(...)`` chains (a ``pathlib`` object built in place)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.BinOp)):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, rest = name.partition(".")
            full = aliases.get(head, head) + ("." + rest if rest else "")
            if full.startswith("pathlib."):
                return True
            node = node.func
        elif isinstance(node, ast.BinOp):
            node = node.left
        else:
            node = node.value
    return False


def find_fs_calls() -> list[str]:
    """``file:line: call`` of every direct file-system call in fastckpt/ outside fastckpt/storage/."""
    found = []
    for folder, dirs, files in os.walk(PKG):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel_folder = os.path.relpath(folder, ROOT)
        if rel_folder.split(os.sep)[:2] == ["fastckpt", "storage"]:
            dirs[:] = []
            continue
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
            for line, call in _violations(path):
                text = lines[line - 1]
                if any(rel == k.split(":", 1)[0] and k.split(":", 1)[1] in text for k in ALLOWED):
                    continue
                found.append(f"{rel}:{line}: {call}  | {text.strip()}")
    return found


def test_no_file_system_call_outside_the_store():
    found = find_fs_calls()
    assert not found, ("direct file-system calls outside fastckpt/storage/ (route them through the Store, "
                       "fastckpt/storage/store.py):\n" + "\n".join(found))


def test_the_scan_sees_each_kind_of_call(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os, shutil\nfrom pathlib import Path\nfrom os.path import exists as ex\n"
                   "open('x')\nos.listdir('.')\nos.path.isdir('.')\nshutil.rmtree('x')\nPath('x').read_bytes()\n"
                   "ex('x')\nos.path.join('a', 'b')\nPath('a') / 'b'\nfolder.is_dir()\nfolder.exists()\n"
                   "store.exists(folder)\n")
    calls = [c for _, c in _violations(str(src))]
    assert sorted(calls) == sorted(["open", "os.listdir", "os.path.isdir", "shutil.rmtree", "Path.read_bytes",
                                    "os.path.exists", "Path.is_dir", "Path.exists"])
