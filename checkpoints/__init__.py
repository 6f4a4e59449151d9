"""Checkpoint layout, shard manifests and the catalog rules (validity, restore target, retention).

Torch-free: the coordinator, the agent and ftctl use it; the training side (``ftd.training``) adds
torch on top.
"""
