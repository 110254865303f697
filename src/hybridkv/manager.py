"""The public name of ``hybridkv.runtime.manager``, kept so that callers do not change their imports."""

from hybridkv.runtime.manager import Admission, CacheManager, CacheManagerError, GroupStats, GroupStep, PrefixHit, PreparedPrompt, StepBatch, TableUpdates

__all__ = ["Admission", "CacheManager", "CacheManagerError", "GroupStats", "GroupStep", "PrefixHit", "PreparedPrompt", "StepBatch", "TableUpdates"]
