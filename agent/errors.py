"""The agent's error hierarchy at its RPC boundary, and its one table to gRPC status codes.

Handlers and the parts they call (peer copy, replication) raise these; the service translates them
once (:func:`grpc_code`), so the classes say what happened and only :data:`GRPC_CODES` says how a
caller sees it. A peer agent answers by the same table, so :data:`PEER_ERRORS` reads its status back
as the class it stands for (:func:`peer_error`): the restore path depends on telling a peer that did
not answer (skip the copy, it may be intact) from a copy that arrived corrupt. Every message names
the thing: the node, the tier, the job, step and rank, the file.
"""

from __future__ import annotations

import grpc

from ftd.rpc import describe, rpc_code


class AgentError(Exception):
    """Base of every error the agent answers with on purpose; anything else is a bug (UNKNOWN)."""

    @property
    def code(self) -> grpc.StatusCode:
        """The status this error answers with (:func:`grpc_code`)."""
        return grpc_code(self)


class BadRequest(AgentError):
    """A request field or stream message is malformed; the message names the field."""


class NodeCannot(AgentError):
    """This node is not set up for what was asked: no memory tier, no training worker, drills off."""


class DrillDenied(AgentError):
    """A drill (Kill) came without this node's drill token, the second factor on top of mTLS."""


class PeerDenied(AgentError):
    """A peer may not read or write this shard (agent/peer_rules.py): the message names the rule."""


class PeerBusy(AgentError):
    """A peer has reached its limit of concurrent streams or bytes in flight (agent/peer_limits.py)."""


class NoRoom(AgentError):
    """Taking the copy would exceed a tier's byte budget; nothing was written."""


class NoFastCopy(AgentError):
    """The fast copy path (``OpenShard``) is off on this node, or the tier is not a directory: use ReadShard."""


class TierUnavailable(AgentError):
    """A tier's storage failed while serving or taking a copy (an I/O error, the backend down)."""


class CoordinatorUnreachable(AgentError):
    """The coordinator's leader could not be reached, so nothing was recorded in its catalog."""


class Forwarded(AgentError):
    """The coordinator's own answer to a call this agent forwarded, passed on with its status."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


class PeerCopyError(AgentError):
    """A copy could not be fetched from (or pushed to) a peer agent; the subclasses say why."""


class PeerUnreachable(PeerCopyError):
    """The node holding the copy did not answer: skip the copy, it may well be intact."""


class CallCancelled(PeerUnreachable):
    """This side cancelled the call (its channel closed, or what it was sending vanished)."""


class PeerRefusedIdentity(PeerUnreachable):
    """The peer did not authenticate this node (its TLS material): the copy may well be intact."""


class CopyMissing(PeerCopyError):
    """The node does not hold the copy (retention removed it, it never did, or it has no such tier)."""


class CopyCorrupt(PeerCopyError):
    """The copy arrived, and its bytes do not match their checksum (or the stream breaks its framing)."""


GRPC_CODES: dict[type[AgentError], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NodeCannot: grpc.StatusCode.FAILED_PRECONDITION,
    DrillDenied: grpc.StatusCode.PERMISSION_DENIED,
    PeerDenied: grpc.StatusCode.PERMISSION_DENIED,
    PeerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoRoom: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoFastCopy: grpc.StatusCode.UNIMPLEMENTED,  # the caller falls back to the ReadShard stream
    TierUnavailable: grpc.StatusCode.UNAVAILABLE,
    CoordinatorUnreachable: grpc.StatusCode.UNAVAILABLE,
    PeerCopyError: grpc.StatusCode.UNAVAILABLE,
    PeerUnreachable: grpc.StatusCode.UNAVAILABLE,
    CopyMissing: grpc.StatusCode.NOT_FOUND,
    CopyCorrupt: grpc.StatusCode.DATA_LOSS,
}

# A peer agent's (or the transport's) status as the error it stands for on this side.
PEER_ERRORS: dict[grpc.StatusCode, type[AgentError]] = {
    grpc.StatusCode.UNAVAILABLE: PeerUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerUnreachable,
    grpc.StatusCode.CANCELLED: CallCancelled,
    grpc.StatusCode.UNAUTHENTICATED: PeerRefusedIdentity,
    grpc.StatusCode.NOT_FOUND: CopyMissing,
    grpc.StatusCode.DATA_LOSS: CopyCorrupt,
    grpc.StatusCode.RESOURCE_EXHAUSTED: NoRoom,
}


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status a caller sees: a forwarded answer's own, else the nearest class in
    :data:`GRPC_CODES`, else UNKNOWN (what gRPC answers for an exception nobody translated)."""
    if isinstance(exc, Forwarded):
        return exc.status
    for cls in type(exc).__mro__:
        if issubclass(cls, AgentError) and cls in GRPC_CODES:
            return GRPC_CODES[cls]
    return grpc.StatusCode.UNKNOWN


def peer_error(exc: BaseException) -> AgentError | None:
    """A failed call to a peer agent as the error its status stands for (:data:`PEER_ERRORS`), with
    the call's description as the message; None when the status is not in the table (the caller
    raises its own, more general error)."""
    code = rpc_code(exc)
    cls = PEER_ERRORS.get(code) if code is not None else None
    return cls(describe(exc)) if cls is not None else None


__all__ = [
    "GRPC_CODES", "PEER_ERRORS", "AgentError", "BadRequest", "CallCancelled", "CoordinatorUnreachable", "CopyCorrupt",
    "CopyMissing", "DrillDenied", "Forwarded", "NoFastCopy", "NoRoom", "NodeCannot", "PeerBusy", "PeerCopyError",
    "PeerDenied", "PeerRefusedIdentity", "PeerUnreachable", "TierUnavailable", "grpc_code", "peer_error",
]
