"""Moved: the soak is ``kvlb loadtest --duration 3m --fault-every 20s`` (loadtests/faults/soak.py)."""

import sys

from balancer.cli.main import main

raise SystemExit(main(["loadtest", *sys.argv[1:]]))
