"""``KeyDir``: an engine key file laid out as the kubelet lays out a mounted Secret, with its atomic
update (the ``..data`` symlink swapped) and an operator's (a rename over the file) (test helper)."""

from __future__ import annotations

import os
from pathlib import Path


class KeyDir:
    """``key`` → ``..data/key``, ``..data`` → ``..<version>``; :meth:`swap` is the kubelet's update,
    :meth:`rename` an operator's."""

    def __init__(self, root: Path, key: str) -> None:
        self.root = root
        self.versions = 0
        version = self._version(key)
        (root / "..data").symlink_to(version)
        (root / "key").symlink_to("..data/key")

    @property
    def path(self) -> Path:
        return self.root / "key"

    def _version(self, key: str) -> str:
        self.versions += 1
        name = f"..2026_12_01_v{self.versions}"
        (self.root / name).mkdir()
        (self.root / name / "key").write_text(key + "\n", encoding="utf-8")
        return name

    def swap(self, key: str) -> None:
        """The kubelet's update: a new version directory, a new link renamed over ``..data``."""
        version = self._version(key)
        (self.root / "..data_tmp").symlink_to(version)
        os.replace(self.root / "..data_tmp", self.root / "..data")

    def rename(self, key: str) -> None:
        """An operator's update: ``key`` replaced by a plain file written aside then renamed over it."""
        (self.root / "key.new").write_text(key + "\n", encoding="utf-8")
        os.replace(self.root / "key.new", self.path)
