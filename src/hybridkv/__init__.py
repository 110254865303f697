"""hybridkv: paged KV cache management for hybrid-attention LLMs (DeepSeek-V4 first)."""

from hybridkv.spec import CacheGroupSpec, PagedCacheGroupSpec

__version__ = "0.1.0"
__all__ = ["CacheGroupSpec", "PagedCacheGroupSpec", "__version__"]
