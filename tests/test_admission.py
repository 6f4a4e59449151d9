"""Registration as a pure decision: :func:`decide_registration` over a hand-built view, asserted on
the record it would commit and the message or error it gives."""

from __future__ import annotations

import grpc

from ftd.coordinator import errors
from ftd.coordinator.admission import Admission, decide_registration
from ftd.coordinator.detector import Liveness, State, Verdict
from ftd.coordinator.model import Fence, NodeRecord, Role, World
from ftd.coordinator.view import ClusterView
from ftd.v1 import cluster_pb2, coordinator_pb2

NOW = 1_700_000_000.0


def node(node_id: str, host: str = "h1", inc: str = "i1", registered: float = 100.0,
         fence: Fence | None = None) -> NodeRecord:
    return NodeRecord(node_id, host, Role.ACTIVE, incarnation=inc, registered_unix_s=registered, fence=fence)


def view_of(*nodes: NodeRecord, ranks: tuple[str, ...] = ("a",)) -> ClusterView:
    view = ClusterView(nodes={n.node_id: n for n in nodes})
    view.set_world(World(epoch=3, ranks=ranks, target_size=len(ranks)), 7)
    for n in nodes:
        view.liveness[n.node_id] = Liveness(last_seen=0.0)
    return view


def reg(node_id: str, host: str = "h1", inc: str = "i1",
        role: cluster_pb2.Role.ValueType = cluster_pb2.ROLE_ACTIVE) -> coordinator_pb2.RegisterRequest:
    return coordinator_pb2.RegisterRequest(node_id=node_id, host=host, role=role, incarnation=inc,
                                           agent_address="h1:9", labels={"rack": "r1"})


def admitted(decision: Admission | errors.CoordinatorError) -> Admission:
    assert isinstance(decision, Admission), decision
    return decision


def test_a_new_node_is_recorded_with_the_role_it_asked_for_at_now() -> None:
    got = admitted(decide_registration(view_of(), reg("s", role=cluster_pb2.ROLE_SPARE), NOW))
    assert got.message == "registered as spare"
    assert got.record == NodeRecord("s", "h1", Role.SPARE, {"rack": "r1"}, "h1:9", 0, "i1", NOW)


def test_the_same_incarnation_again_changes_nothing() -> None:
    got = admitted(decide_registration(view_of(node("a")), reg("a"), NOW))
    assert got == Admission(None, "already registered")


def test_a_restarted_rank_holder_keeps_its_rank_and_registration_time() -> None:
    got = admitted(decide_registration(view_of(node("a")), reg("a", inc="i2"), NOW))
    assert got.message == "re-registered; keeps rank 0 in epoch 3"
    assert got.record is not None and got.record.incarnation == "i2" and got.record.registered_unix_s == 100.0


def test_a_fenced_node_rejoins_as_a_spare() -> None:
    fenced = node("a", fence=Fence(2, "no heartbeat for 3s", 50.0))
    got = admitted(decide_registration(view_of(fenced, ranks=()), reg("a", inc="i2"), NOW))
    assert got.record is not None and got.record.requested_role is Role.SPARE and got.record.fence is None
    assert got.record.registered_unix_s == NOW
    assert got.message == "node a was fenced at epoch 2 (no heartbeat for 3s); it rejoins as a spare in epoch 3"


def test_a_node_judged_dead_but_not_yet_fenced_is_told_to_retry() -> None:
    view = view_of(node("a"))
    view.verdicts["a"] = Verdict(State.DEAD, "no heartbeat for 3s", 3.0)
    error = decide_registration(view, reg("a", inc="i2"), NOW)
    assert isinstance(error, errors.NodeBeingFenced) and "no heartbeat for 3s" in str(error)
    assert errors.grpc_code(error) is grpc.StatusCode.UNAVAILABLE  # retryable, as before the split


def test_another_host_cannot_take_a_live_nodes_id() -> None:
    error = decide_registration(view_of(node("a")), reg("a", host="h9", inc="x"), NOW)
    assert isinstance(error, errors.NodeIdTaken)
    assert str(error) == "node id 'a' is held by a live node on host 'h1' (registration came from host 'h9')"


def test_another_host_may_take_the_id_of_a_node_that_is_not_live() -> None:
    view = view_of(node("b"), ranks=())
    del view.liveness["b"]  # registered on an earlier leader, never heard of on this one
    got = admitted(decide_registration(view, reg("b", host="h9", inc="x"), NOW))
    assert got.record is not None and got.record.host == "h9" and got.message == "registered as active"
