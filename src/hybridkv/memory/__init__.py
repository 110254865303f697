"""Device memory: the per-group page pools and the shared arena's slabs."""
