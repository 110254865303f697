"""hybridkv: paged KV cache management for hybrid-attention LLMs (DeepSeek-V4 first)."""

__version__ = "0.1.0"
__all__ = ["CacheGroupSpec", "PagedCacheGroupSpec", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `hybridkv --help` does not import the library (PEP 562).
    if name in ("CacheGroupSpec", "PagedCacheGroupSpec"):
        from hybridkv import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")
