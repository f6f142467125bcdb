"""``kvlb demo``: an emulated fleet, kvlb and round robin on the same traffic, and a table."""
