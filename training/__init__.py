"""The training-side API of ftd (imports torch): checkpoints and progress reports.

    from ftd.training import Checkpointer
"""

from .checkpoint import Checkpointer, HandoverTimeout, RestoreError, SaveResult
from .fingerprint import replica_fingerprint
from .snapshot import Snapshotter

__all__ = ["Checkpointer", "HandoverTimeout", "RestoreError", "SaveResult", "Snapshotter", "replica_fingerprint"]
