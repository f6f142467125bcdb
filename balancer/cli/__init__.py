"""The ``kvlb`` command line (I/O): :mod:`~balancer.cli.main` assembles the subcommands,
:mod:`~balancer.cli.command` holds the service's own (``serve`` and ``admin``)."""
