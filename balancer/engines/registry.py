"""Every engine kvlb speaks, by name (pure): the one place that lists the engine modules.

Adding an engine is one module under :mod:`balancer.engines` that defines its ``SPEC``, one line in
``_SPECS`` here, and its name in :data:`balancer.config.EngineKind` (the type of the config field).
This module is separate from :mod:`balancer.engines` because the engine modules import that package's
decoder seam.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from balancer.engines import sglang, trtllm, vllm
from balancer.engines.spec import EngineSpec
from balancer.errors import ConfigError

_SPECS = (
    sglang.SPEC,
    vllm.SPEC,
    trtllm.SPEC,
)

ENGINE_SPECS: Mapping[str, EngineSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})
"""Each engine's spec by its name (read-only)."""


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine ``name``; raises :class:`ConfigError` naming the known engines if unknown."""
    spec = ENGINE_SPECS.get(name)
    if spec is None:
        raise ConfigError(f"unknown engine {name!r}; known engines: {', '.join(ENGINE_SPECS)}")
    return spec
