"""The training-side API of ftd (imports torch): checkpoints and progress reports.

    from ftd.training import Checkpointer
"""

from .checkpoint import Checkpointer, RestoreError, SaveResult

__all__ = ["Checkpointer", "RestoreError", "SaveResult"]
