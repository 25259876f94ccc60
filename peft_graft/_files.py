"""Checked reads of the files the package loads (adapter configs and weights, task heads, checkpoints, states).

A file on disk may be a link to anything: a device (``/dev/zero``, ``/dev/urandom``) reads without end, a named pipe
(FIFO) blocks ``open`` until a writer comes, a folder gives errors that name no path. Every loader goes through
:func:`check_file` (or :func:`open_file`, :func:`read_file`, :func:`read_json`), which follow links and accept only a
regular file, so that nothing on disk can make a load read without bound or wait forever: anything else is a
``ValueError`` naming the path, what it is and how to fix it.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device (such as /dev/zero)"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
)


def check_file(path: str | os.PathLike, what: str = "file", missing_ok: bool = False) -> str | None:
    """``path`` (as a string) if it is a regular file once links are resolved. A link that cannot be resolved, and
    anything that is not a regular file (a folder, a device, a FIFO, a socket), is a ``ValueError`` naming ``path``
    as ``what``. Nothing there: ``FileNotFoundError``, or ``None`` with ``missing_ok``."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        if missing_ok:
            return None
        raise FileNotFoundError(2, f"No {what} at {path!r}", path)
    try:
        info = os.stat(path)
    except OSError as error:  # a loop, a missing target
        raise ValueError(
            f"{path!r} is a symbolic link that cannot be resolved (a loop, or its target is missing), so the {what} "
            f"cannot be read from there ({error.strerror}): fix or replace the link."
        ) from error
    refuse_irregular(path, info.st_mode, what)
    return path


def refuse_irregular(path: str, mode: int, what: str) -> None:
    """A ``ValueError`` naming ``path`` unless ``mode`` (of ``os.stat``) is a regular file's."""
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    target = f" (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
    raise ValueError(
        f"The {what} {path!r} is {kind}{target}, not a regular file: it cannot be read as a {what}. Replace it with "
        "the file itself (save or download it again)."
    )


@contextmanager
def open_file(path: str | os.PathLike, what: str = "file") -> Iterator[tuple[BinaryIO, int]]:
    """``(binary handle, size in bytes)`` of the regular file ``path`` (:func:`check_file`). Opened without blocking
    and checked again on the open descriptor, so that a FIFO or device put there in between is refused, not waited
    for or read."""
    path = check_file(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    descriptor = os.open(path, flags)
    try:
        info = os.fstat(descriptor)
        refuse_irregular(path, info.st_mode, what)
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        handle = os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise
    with handle:
        yield handle, info.st_size


def read_file(path: str | os.PathLike, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``: its size when opened, no more (a file that changes while read is a
    ``ValueError``)."""
    with open_file(path, what) as (handle, size):
        data = handle.read(size + 1)
    if len(data) != size:
        raise ValueError(f"The {what} {os.fspath(path)!r} changed while it was read: read it again.")
    return data


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """The JSON value of the regular file ``path`` (UTF-8). Malformed JSON raises ``json.JSONDecodeError`` and bytes
    that are not UTF-8 ``UnicodeDecodeError``, both subclasses of ``ValueError``, as ``json.load`` does."""
    return json.loads(read_file(path, what).decode("utf-8"))


def is_local_path(name: str) -> bool:
    """Whether a recorded model name (``base_model_name_or_path``...) is a local path rather than a Hub id: absolute,
    starting with ``.``, or an existing folder."""
    return bool(name) and (os.path.isabs(name) or name.startswith(".") or os.path.isdir(name))
