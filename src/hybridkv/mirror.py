"""The public name of ``hybridkv.tables.mirror``, kept so that callers do not change their imports."""

from hybridkv.tables.mirror import BlockTableMirror

__all__ = ["BlockTableMirror"]
