"""The admin API's time series (I/O): ``GET /admin/series``, the console's series per interval.

Behind ``auth.admin_token`` like every ``/admin`` path (the middleware). Requests per replica,
predicted and reported hit rate, TTFT p50/p90, from :mod:`balancer.service.series`; gathered from
every worker of ``kvlb serve --workers N`` by :mod:`balancer.api.gathered`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from aiohttp import web

from balancer import strict_json
from balancer.api.errors import ApiError
from balancer.api.middleware import STATE
from balancer.api.parsing import check_query, decimal_number

SERIES_DEFAULT_MINUTES = 10.0
SERIES_PARAMS = frozenset({"minutes", "ttft_histograms"})
SERIES_HISTOGRAMS = web.RequestKey("kvlb_series_histograms", bool)
"""Set on a ``GET /admin/series`` being gathered from every worker (:mod:`balancer.api.gathered`):
this worker's answer then has each row's ``ttft_histogram``, as the siblings' have."""


async def series(request: web.Request) -> web.Response:
    """``GET /admin/series?minutes=&ttft_histograms=``: the console's time series
    (:mod:`balancer.service.series`) over the last ``minutes`` (default 10, at most what the ring
    holds; 400 unless a decimal number > 0 in ASCII digits: :func:`~balancer.api.parsing.decimal_number`),
    each row with its ``ttft_histogram`` when ``ttft_histograms=1`` (``0``, the default: without;
    400 for anything else)."""
    state = request.app[STATE]
    check_query(request.query, SERIES_PARAMS)
    raw = request.query.get("minutes")
    minutes = SERIES_DEFAULT_MINUTES
    if raw is not None:
        given = decimal_number(raw)
        if given is None or not math.isfinite(given) or given <= 0:
            raise ApiError(400, f"'minutes' must be a decimal number > 0 (as 10 or 0.5), got {raw[:40]!r}")
        minutes = given
    histograms = series_histograms(request.query)
    sampler = state.series
    if sampler is None:
        raise ApiError(404, "the series sampler is not running on this balancer")
    minutes = min(minutes, sampler.span_s / 60.0)
    answer = sampler.series(
        minutes, state.wall_clock(), ttft_histograms=histograms or request.get(SERIES_HISTOGRAMS, False)
    )
    return web.json_response(answer, dumps=strict_json.dumps)


def series_histograms(query: Mapping[str, str]) -> bool:
    """The ``ttft_histograms`` of a ``GET /admin/series`` query: ``1`` or ``0`` (400 otherwise)."""
    raw = query.get("ttft_histograms", "0")
    if raw not in ("0", "1"):
        raise ApiError(400, f"'ttft_histograms' must be 0 or 1, got {raw[:40]!r}")
    return raw == "1"
