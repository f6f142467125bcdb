"""Reading a Dockerfile and a .dockerignore without Docker (pure, reads files).

* :func:`instructions` splits a Dockerfile into (stage, instruction, arguments), joining ``\\``
  continuations and dropping comments.
* :class:`DockerIgnore` decides, as Docker does, whether a context path is excluded: patterns are
  matched in order with ``*``, ``?`` and ``**``, the last match wins, ``!`` re-includes, and a pattern
  that matches a directory excludes what is below it.
* :func:`build_context` lists the files a ``docker build`` of a directory would send.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    stage: int
    name: str
    args: str


def instructions(text: str) -> list[Instruction]:
    joined: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    stage = -1
    out = []
    for line in joined:
        name, _, args = line.partition(" ")
        if name.upper() == "FROM":
            stage += 1
        out.append(Instruction(stage, name.upper(), args.strip()))
    return out


def _regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


class DockerIgnore:
    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern[str], str]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
            self.rules.append((include, _regex(pattern), pattern))

    def excluded(self, path: str) -> bool:
        """Whether the context path ``path`` (``a/b/c``) is left out of the build context."""
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        result = False
        for include, regex, _ in self.rules:
            if any(regex.fullmatch(prefix) for prefix in prefixes):
                result = not include
        return result

    def may_include_below(self, directory: str) -> bool:
        """Whether some ``!`` pattern could re-include a path under an excluded ``directory``."""
        return any(include and pattern.startswith(directory + "/") for include, _, pattern in self.rules)


def build_context(root: Path) -> list[str]:
    """Relative paths of the files ``docker build root`` would send (sorted)."""
    ignore_file = root / ".dockerignore"
    ignore = DockerIgnore(ignore_file.read_text() if ignore_file.exists() else "")
    files = []
    for directory, subdirs, names in os.walk(root):
        rel_dir = os.path.relpath(directory, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        subdirs[:] = [
            d for d in subdirs if not ignore.excluded(rel_dir + d) or ignore.may_include_below(rel_dir + d)
        ]
        files += [rel_dir + n for n in names if not ignore.excluded(rel_dir + n)]
    return sorted(files)
