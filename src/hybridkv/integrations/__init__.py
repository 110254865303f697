"""Integrations of hybridkv's cache with model implementations (optional extras)."""
