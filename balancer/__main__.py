"""``python -m balancer`` runs the ``kvlb`` command line."""

from balancer.cli import main

raise SystemExit(main())
