"""``kvlb bench overhead``: what kvlb adds per request against direct and plain-proxy paths."""
