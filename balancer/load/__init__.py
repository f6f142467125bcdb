"""Replica load: :mod:`~balancer.load.tracker` (pure accounting of reservations and scraped stats),
:mod:`~balancer.load.scrape` (the generic, pure parts of load-report parsing; each engine's
own parsers are in :mod:`balancer.engines`) and :mod:`~balancer.load.scraper`
(the I/O loop that polls a replica's metrics)."""
