"""The public name of ``hybridkv.runtime.batch``, kept so that callers do not change their imports."""

from hybridkv.runtime.batch import Admission, GroupStats, GroupStep, StepBatch, TableUpdates

__all__ = ["Admission", "GroupStats", "GroupStep", "StepBatch", "TableUpdates"]
