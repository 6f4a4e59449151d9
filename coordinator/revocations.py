"""Who may act at all: the deny list (``ftctl certs revoke``, a rotation's old serial) and the operator's
admissions (``ftctl admit``), kept as the coordinator's ``access/`` records in etcd.

* ``access/revoked-id/<kind>/<name>``: every certificate of that identity is refused.
* ``access/revoked-serial/<hex>``: one certificate (the old pair of a rotation) is refused.
* ``access/admitted/<node>``: the operator let the node hold a rank (``active``) or come back after a
  drain (``spare``), at a time: :func:`~.admission.decide_registration` reads it.

The leader's guard refuses revoked callers before the table (:class:`ftd.authz_interceptors.Guard`);
agents fetch the list with ``GetDenyList`` (:mod:`ftd.deny_list`). Pure decoding here
(:func:`deny_list_of`, :func:`admissions_of`); :class:`AccessKeeper` validates and commits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Mapping

from ftd.deny_list import EMPTY, DenyList
from ftd.identity import PkiError, check_name
from ftd.node_ids import valid_node_id
from ftd.v1 import coordinator_pb2

from . import errors, validation
from .admission import Admitted
from .leader_state import LeaderState
from .view import ClusterView

log = logging.getLogger("ftd.coordinator.revocations")
REVOKED_ID = "access/revoked-id/"
REVOKED_SERIAL = "access/revoked-serial/"
ADMITTED = "access/admitted/"
MAX_REASON = 300
MAX_ENTRIES = 10_000  # deny-list entries (each an etcd key); serials of rotations past it must be pruned
_SERIAL = re.compile(r"[0-9a-f]{1,64}")


def _reason(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("reason", "revoked"))
    except (ValueError, AttributeError):
        return "revoked (record unreadable)"


def deny_list_of(access: Mapping[str, bytes]) -> DenyList:
    """The deny list the ``access/`` records say (a record that does not decode still revokes)."""
    ids = [(k.removeprefix(REVOKED_ID), _reason(v)) for k, v in access.items() if k.startswith(REVOKED_ID)]
    serials = [(k.removeprefix(REVOKED_SERIAL), _reason(v)) for k, v in access.items() if k.startswith(REVOKED_SERIAL)]
    return DenyList.of(ids, serials)


def admissions_of(access: Mapping[str, bytes]) -> dict[str, Admitted]:
    """The operator's admissions, by node (a record that does not decode admits nothing)."""
    out: dict[str, Admitted] = {}
    for key, raw in access.items():
        if key.startswith(ADMITTED):
            node = key.removeprefix(ADMITTED)
            try:
                data = json.loads(raw)
                out[node] = Admitted(node, bool(data["active"]), float(data["at"]))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def parse_identity(text: str) -> tuple[str, str]:
    """``kind/name`` (or a ``spiffe://ftd/<cluster>/kind/name`` URI) → (kind, name); raises
    :class:`~.errors.InvalidArgument` naming the field."""
    parts = text.removeprefix("spiffe://").split("/")
    if len(parts) < 2:
        raise errors.InvalidArgument("identity", f"{text[:140]!r}: expected KIND/NAME, e.g. node/node-1")
    kind, name = parts[-2], parts[-1]
    try:
        check_name(kind, name)
    except PkiError as exc:
        raise errors.InvalidArgument("identity", str(exc)) from None
    return kind, name


class AccessKeeper:
    """The ``Revoke``, ``GetDenyList`` and ``Admit`` RPCs, and the deny list the leader's guard reads."""

    def __init__(self, state: LeaderState, wall: Callable[[], float] = time.time) -> None:
        self.state = state
        self.wall = wall
        self._lock = asyncio.Lock()
        self._cached: tuple[int, int, DenyList] = (0, -1, EMPTY)  # (id of the view, generation, list)
        self._generation = 0

    def deny_list(self) -> DenyList:
        """The list in force on this replica: the leader's view's (empty on a standby, which serves no
        call but the refusal that names the leader). Recomputed only after a change."""
        view = self.state.view
        if view is None:
            return EMPTY
        view_id, generation, cached = self._cached
        if view_id == id(view) and generation == self._generation:
            return cached
        deny = deny_list_of(view.access)
        self._cached = (id(view), self._generation, deny)
        return deny

    def get_deny_list(self, req: coordinator_pb2.GetDenyListRequest) -> coordinator_pb2.DenyListResponse:
        self.state.require_leader()
        deny = self.deny_list()
        if req.known_version == deny.version:
            return coordinator_pb2.DenyListResponse(version=deny.version, unchanged=True)
        return coordinator_pb2.DenyListResponse(
            version=deny.version,
            identities=[coordinator_pb2.DenyListEntry(key=k, reason=r) for k, r in sorted(deny.identities.items())],
            serials=[coordinator_pb2.DenyListEntry(key=k, reason=r) for k, r in sorted(deny.serials.items())])

    async def revoke(self, req: coordinator_pb2.RevokeRequest) -> coordinator_pb2.RevokeResponse:
        if bool(req.identity) == bool(req.serial):
            raise errors.InvalidArgument("identity", "give exactly one of identity (KIND/NAME) and serial")
        reason = validation.clip(validation.one_line(req.reason), MAX_REASON) or "revoked by an operator"
        if req.identity:
            kind, name = parse_identity(req.identity)
            key, what = f"{REVOKED_ID}{kind}/{name}", f"identity {kind}/{name}"
        else:
            serial = req.serial.lower().removeprefix("0x")
            if not _SERIAL.fullmatch(serial):
                raise errors.InvalidArgument("serial", f"{req.serial[:80]!r}: expected a serial number in hex")
            key, what = f"{REVOKED_SERIAL}{serial}", f"certificate serial {serial}"
            if req.serial_identity:
                what += f" (of {'/'.join(parse_identity(req.serial_identity))})"
        async with self._lock:
            view = self.state.require_leader()
            if req.lift:
                if key not in view.access:
                    return coordinator_pb2.RevokeResponse(message=f"{what} was not revoked")
                await self.state.commit("revoke", events=[("revocation_lifted", "", f"{what}: no longer revoked")],
                                        kv_deletes=[key])
                view.access.pop(key, None)
                self._generation += 1
                log.warning("revocation of %s lifted", what)
                return coordinator_pb2.RevokeResponse(message=f"{what} is no longer revoked")
            if key in view.access:
                return coordinator_pb2.RevokeResponse(message=f"{what} was revoked already")
            if sum(k.startswith("access/revoked-") for k in view.access) >= MAX_ENTRIES:
                raise errors.InvalidArgument("identity", f"the deny list holds {MAX_ENTRIES} entries already")
            record = json.dumps({"reason": reason, "at": self.wall(), "what": what}).encode()
            await self.state.commit("revoke", events=[("certificate_revoked", "", f"{what} revoked: {reason}")],
                                    kv_puts={key: record})
            view.access[key] = record
            self._generation += 1
            log.warning("%s revoked: %s", what, reason)
            return coordinator_pb2.RevokeResponse(message=f"{what} revoked ({reason}): its calls are refused now "
                                                          "by the coordinator, by every agent within the deny "
                                                          "list's TTL")

    async def admit(self, req: coordinator_pb2.AdmitRequest) -> coordinator_pb2.AdmitResponse:
        if not valid_node_id(req.node_id):
            raise errors.InvalidArgument("node_id", f"{req.node_id[:140]!r} is not a node id")
        role = "spare" if req.spare else "active"
        async with self._lock:
            view = self.state.require_leader()
            record = json.dumps({"active": not req.spare, "at": self.wall()}).encode()
            await self.state.commit("admit", events=[("node_admitted", req.node_id,
                                                      f"{req.node_id} admitted as {role} by an operator")],
                                    kv_puts={ADMITTED + req.node_id: record})
            view.access[ADMITTED + req.node_id] = record
            return coordinator_pb2.AdmitResponse(message=f"{req.node_id} admitted as {role}: it registers as "
                                                         f"{role} from now on")


def admitted(view: ClusterView, node_id: str) -> Admitted | None:
    """The operator's admission of ``node_id`` in ``view``, if any."""
    raw = view.access.get(ADMITTED + node_id)
    return admissions_of({ADMITTED + node_id: raw}).get(node_id) if raw is not None else None
