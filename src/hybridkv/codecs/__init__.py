"""Byte codecs for DeepSeek-V4 cache rows and pages (numpy + ml_dtypes only).

* ``KVRowCodec``: main KV rows (FP8-e4m3 nope + UE8M0 scales, bf16 rope), padded SoA pages.
* ``MXFP4IndexerCodec`` / ``FP8IndexerCodec``: indexer keys, unpadded SoA pages.
* ``StateRowCodec``: fp32 compressor state rows.

Every codec has ``row_bytes``, ``page_stride_bytes(R)``, ``encode`` / ``decode`` /
``fake_quantize`` and the slot API ``new_pool`` / ``write_slots`` / ``read_slots``
/ ``write_page`` / ``read_page`` (plus byte-level ``write_slot_bytes`` /
``read_slot_bytes``). See ``docs/codecs.md``.
"""

from hybridkv.codecs._floats import AMAX_FLOOR, MXFP4_AMAX_FLOOR
from hybridkv.codecs._pool import PagedRowCodec
from hybridkv.codecs.indexer import FP8IndexerCodec, MXFP4IndexerCodec
from hybridkv.codecs.kv import KVRowCodec
from hybridkv.codecs.state import StateRowCodec

__all__ = [
    "AMAX_FLOOR",
    "MXFP4_AMAX_FLOOR",
    "FP8IndexerCodec",
    "KVRowCodec",
    "MXFP4IndexerCodec",
    "PagedRowCodec",
    "StateRowCodec",
]
