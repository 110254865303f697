"""Model recipes: which layers feed which cache group, and page bytes per group."""
