"""Prefix reuse: content keys, the cache of published pages, checkpoint and eviction order."""
