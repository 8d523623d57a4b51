"""Atomic file writes: write to a temporary name in the same dir, flush, fsync, rename.

A reader (or a resumed run) therefore sees either the old file or the whole new one, never a
torn one, after a crash, a kill -9 or a full disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

TMP_SUFFIX = ".tmp"
T = TypeVar("T")


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Path], T]) -> T:
    """Have `write(tmp)` create a temporary file beside `path`, then fsync it and rename it to
    `path`; returns what `write` returned. On any error (ENOSPC included) the temporary file is
    removed and the error re-raised with the path in its message."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    try:
        result = write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"could not write {path}: {exc.strerror or exc}") from exc
        raise OSError(f"could not write {path}: {exc}") from exc
    fsync_dir(path.parent)
    return result


def write_bytes_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` atomically (see `write_atomic`)."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
    write_atomic(path, write)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)
