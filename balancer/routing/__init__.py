"""Routing of one pool (pure): :mod:`~balancer.routing.router` hashes a request, matches the index,
takes the load snapshot, asks the policy, and commits the decision as a lease."""
