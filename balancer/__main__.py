"""``python -m balancer`` runs the ``kvlb`` command line."""

from balancer.cli.main import main

raise SystemExit(main())
