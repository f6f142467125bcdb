"""The global prefix index: a protocol, an in-memory table, and (later) Redis-backed backends."""
