"""Serving simulation: workloads (``hybridkv.sim.workloads``) and, later, the driver."""
