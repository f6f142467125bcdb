"""Report files written whole or not at all (I/O), for every file the loadtest tools write as a
report (``kvlb loadtest``, ``kvlb capacity``, ``kvlb simulate --output``, the soak, the what-if
check, ``kvlb tune``'s plot).

Each file is written to a temporary file in its own directory (``.<name>.<random>.tmp``), flushed
and ``fsync``-ed, then renamed over the path (``os.replace``, atomic on one file system), and the
directory is ``fsync``-ed. A path that is a symbolic link, a device or a pipe (``--output
/dev/stdout``) is written in place, as before: a rename would replace the link itself.
A SIGINT or SIGTERM, an exception or a full disk while it is written
leaves the path as it was (the old file, or none) and removes the temporary file (a signal whose
default action kills the process, SIGTERM outside the tools that handle it, leaves the temporary
file, never a cut report). Until 2026-12-01 a signal while ``capacity.json`` (or any report) was
written left it as far as it got.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Literal


@contextlib.contextmanager
def atomic_file(path: Path, mode: Literal["w", "wb"] = "w") -> Iterator[IO[Any]]:
    """A file object (text, UTF-8, for ``"w"``; bytes for ``"wb"``) whose content becomes ``path``
    only when the block ends without an exception; until then ``path`` is untouched."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # a link (``/dev/stdout``: to the process's own stdout, whatever it is), a device or a pipe:
        # written in place, as before; a rename would replace the link itself
        with open(path, mode, encoding=None if "b" in mode else "utf-8") as stream:
            yield stream
        return
    directory = path.parent
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    replaced = False
    try:
        os.fchmod(descriptor, 0o666 & ~_umask())  # as open() would have made it (mkstemp: 0600)
        encoding = None if "b" in mode else "utf-8"
        with open(descriptor, mode, encoding=encoding) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        replaced = True
        _sync_directory(directory)
    finally:
        if not replaced:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def write_text_atomic(path: Path, text: str) -> None:
    """``path.write_text(text, "utf-8")``, whole or not at all."""
    with atomic_file(path) as file:
        file.write(text)


def write_lines_atomic(path: Path, lines: Iterable[str]) -> None:
    """Each of ``lines`` (each ending in its own newline) in ``path``, as they come, the file whole or
    not at all."""
    with atomic_file(path) as file:
        for line in lines:
            file.write(line)


def save_figure_atomic(figure: Any, path: Path, **options: Any) -> None:
    """``figure.savefig(path, **options)`` (a matplotlib figure), whole or not at all; the format is
    ``options["format"]``, else the path's suffix (``png`` without one, as matplotlib's default)."""
    options.setdefault("format", Path(path).suffix.lstrip(".") or "png")
    with atomic_file(path, "wb") as file:
        figure.savefig(file, **options)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _sync_directory(directory: Path) -> None:
    """The rename made durable (best effort: some file systems refuse ``fsync`` on a directory)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
