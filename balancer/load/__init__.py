"""Replica load: :mod:`~balancer.load.tracker` (pure accounting of reservations and scraped stats),
:mod:`~balancer.load.scrape` (pure parsers of engine load reports) and :mod:`~balancer.load.scraper`
(the I/O loop that polls a replica's metrics)."""
