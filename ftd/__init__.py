"""ftd: fault tolerance and elastic recovery for large PyTorch training clusters.

The design card's folders are the sub-packages of this import root: ``ftd.agent``,
``ftd.coordinator``, ``ftd.storage_backends``, ``ftd.ftctl``; the gRPC contract is ``ftd.v1``.
"""

__version__ = "0.1.0"

