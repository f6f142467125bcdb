"""``settings_from``: kvlb ``Settings`` from a config tree plus dotted overrides (test helper)."""

from __future__ import annotations

from typing import Any

from balancer.config import Settings, from_mapping


def settings_from(tree: dict[str, Any], overrides: dict[str, Any]) -> Settings:
    """``tree`` (a config file's mapping) with ``overrides`` set in it, validated. An override's name
    is the dotted path with ``__`` for the dots (``limits__max_inflight``); ``tree`` is changed."""
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    settings: Settings = from_mapping(Settings, tree)
    return settings.validate()
