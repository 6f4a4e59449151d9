"""The job rendezvous rules and hang detection: pure functions, asserted on their reasons."""

from __future__ import annotations

from ftd.agent.torchrun_supervisor import hang_check
from ftd.coordinator import rendezvous as rdzv

W = ("a", "b")
NOW = 1_700_000_000.0  # wall-clock seconds: the rules read no clock of their own


def formed(job: str = "job", max_restarts: int = 10) -> rdzv.JobState:
    """Round 0 of ``job`` joined by every member of W."""
    state, _ = rdzv.join(NOW, None, job, 2, W, "a", -1, 2, max_restarts)
    state, _ = rdzv.join(NOW, state, job, 2, W, "b", -1, 2, max_restarts)
    assert state.joined == W
    return state


def test_first_round_and_stable_ranks() -> None:
    state, reply = rdzv.join(NOW, None, "job", 2, W, "b", -1, 2, 10)
    assert reply.status == rdzv.READY and reply.rank == 1 and reply.world_size == 2 and state.round == 0
    state, reply = rdzv.join(NOW, state, "job", 2, W, "a", -1, 2, 10)
    assert reply.rank == 0 and state.round == 0 and state.restarts == 0


def test_a_spare_waits_without_disturbing_the_round() -> None:
    state, _ = rdzv.join(NOW, None, "job", 2, W, "a", -1, 2, 10)
    after, reply = rdzv.join(NOW, state, "job", 2, W, "s", -1, 2, 10)
    assert reply.status == rdzv.WAIT and reply.spare and "spare" in reply.message and after == state


def test_promoted_spare_takes_the_dead_rank_in_a_new_round_counted_once() -> None:
    state = formed()
    # b's workers failed when a died: it waits for the verdict instead of restarting the round.
    same, reply = rdzv.join(NOW, state, "job", 2, W, "b", 0, 2, 10, suspects={"a"})
    assert reply.status == rdzv.WAIT and "a is suspect" in reply.message and same == state
    state, reply = rdzv.join(NOW, state, "job", 3, ("s", "b"), "s", -1, 2, 10)
    assert reply.status == rdzv.READY and reply.rank == 0 and state.round == 1 and state.restarts == 1
    assert "a left the world" in state.round_reason
    state, reply = rdzv.join(NOW, state, "job", 3, ("s", "b"), "b", 0, 2, 10)
    assert reply.rank == 1 and state.round == 1 and state.restarts == 1


def test_a_local_restart_starts_a_round_and_spends_the_job_budget() -> None:
    state = formed(max_restarts=1)
    state, reply = rdzv.join(NOW, state, "job", 2, W, "a", 0, 2, 1)
    assert reply.status == rdzv.READY and state.round == 1 and state.restarts == 1
    state, reply = rdzv.join(NOW, state, "job", 2, W, "b", 0, 2, 1)  # b follows into round 1: no extra count
    assert state.round == 1 and state.restarts == 1
    # Leaving and rejoining does not reset the budget: it is the job's.
    state, reply = rdzv.join(NOW, state, "job", 2, W, "b", 1, 2, 1)
    assert reply.status == rdzv.CLOSED and "restart budget of job job exhausted" in reply.message
    _, again = rdzv.join(NOW, state, "job", 2, W, "a", -1, 2, 1)
    assert again.status == rdzv.CLOSED


def test_repeated_joins_before_the_round_formed_are_one_incident() -> None:
    """A compromised member asking again and again (last_round = the current round) used to start a
    round and charge the budget each time: six calls closed the job."""
    state = formed(max_restarts=3)
    state, reply = rdzv.join(NOW, state, "job", 2, W, "b", 0, 2, 3)  # a real restart: counted
    assert reply.status == rdzv.READY and state.round == 1 and state.restarts == 1
    for _ in range(6):  # a has not joined round 1 yet: b's calls are the same incident
        state, reply = rdzv.join(NOW, state, "job", 2, W, "b", 1, 2, 3)
        assert reply.status == rdzv.READY and reply.rank == 1
    assert state.round == 1 and state.restarts == 1 and not state.closed


def test_a_spare_creates_no_job_and_a_node_creates_few() -> None:
    state, reply = rdzv.join(NOW, None, "junk", 2, W, "s", -1, 2, 10)
    assert reply.status == rdzv.WAIT and reply.spare and state.round == 0 and not state.members
    made, _ = rdzv.join(NOW, None, "real", 2, W, "a", -1, 2, 10)
    assert made.created_by == "a" and made.created_unix_s == NOW
    assert rdzv.created_by([made, rdzv.close(formed("other"), "done")], "a") == 1


def test_too_few_nodes_waits_and_says_why() -> None:
    state, _ = rdzv.join(NOW, None, "job", 2, W, "a", -1, 2, 10)
    _, reply = rdzv.join(NOW, state, "job", 3, ("b",), "b", 0, 2, 10)
    assert reply.status == rdzv.WAIT and "needs at least 2" in reply.message
    _, reply = rdzv.join(NOW, state, "job", 3, ("b",), "b", 0, 1, 10)  # asking for a lower MIN later
    # min_nodes is the job's (set by its first join): still 2 here.
    assert reply.status == rdzv.WAIT
    shrinkable, _ = rdzv.join(NOW, None, "job2", 2, W, "a", -1, 1, 10)
    shrunk, reply = rdzv.join(NOW, shrinkable, "job2", 3, ("b",), "b", 0, 1, 10)
    assert reply.status == rdzv.READY and reply.world_size == 1 and shrunk.round == 1


def test_store_only_from_rank_0_of_the_current_round() -> None:
    state, _ = rdzv.join(NOW, None, "job", 2, W, "a", -1, 2, 10)
    _, error = rdzv.set_store(state, 0, "b", "h:1")
    assert "only rank 0 (a)" in error
    _, error = rdzv.set_store(state, 5, "a", "h:1")
    assert "round 5 is over" in error
    state, error = rdzv.set_store(state, 0, "a", "h:1")
    assert not error and state.store_address == "h:1"
    assert rdzv.decode(rdzv.encode(state)) == state


def test_hang_check() -> None:
    assert hang_check(100.0, 0.0, 95.0, 10.0, 60.0, ["S"])[0] == "ok"
    verdict, why = hang_check(100.0, 0.0, 80.0, 10.0, 60.0, ["S", "S"])
    assert verdict == "stalled" and "no step progress for 20s" in why
    verdict, why = hang_check(100.0, 0.0, 80.0, 10.0, 60.0, ["S", "T"])
    assert verdict == "culprit" and "state T" in why
    assert hang_check(100.0, 0.0, 80.0, 10.0, 60.0, [])[0] == "culprit"
    assert hang_check(50.0, 0.0, None, 10.0, 60.0, ["S"])[0] == "ok"  # startup grace for the first step
    assert hang_check(70.0, 0.0, None, 10.0, 60.0, ["D"])[0] == "culprit"
    assert hang_check(1e9, 0.0, 0.0, 0.0, 60.0, ["T"])[0] == "ok"  # off


def test_a_restarted_store_host_moves_everyone_to_a_fresh_round() -> None:
    state, _ = rdzv.join(NOW, None, "job", 2, W, "a", -1, 2, 10)
    state, _ = rdzv.set_store(state, 0, "a", "h:1")
    state, reply = rdzv.join(NOW, state, "job", 2, W, "a", -1, 2, 10)  # a's torchrun came back
    assert reply.status == rdzv.READY and state.round == 1 and state.store_address == ""
    assert state.restarts == 0 and "store host of round 0" in state.round_reason


def test_rounds_are_stamped_with_the_given_time() -> None:
    state, _ = rdzv.join(NOW, None, "job", 2, W, "a", -1, 2, 10)
    assert state.round_unix_s == NOW
    state, _ = rdzv.join(NOW + 5, state, "job", 3, ("a", "c"), "a", 0, 2, 10)
    assert state.round == 1 and state.round_unix_s == NOW + 5
    stalled = rdzv.stall_restart(NOW + 9, state, "job stalled")
    assert stalled.round == 2 and stalled.round_unix_s == NOW + 9 and stalled.restarts == state.restarts + 1


def test_a_planned_hand_over_does_not_charge_the_restart_budget() -> None:
    state, _ = rdzv.join(NOW, None, "j", 1, ["a", "b"], "a", -1, 2, 3)
    # b is handed over to c (preemption notice): a new round, no restart counted.
    after, reply = rdzv.join(NOW + 1, state, "j", 2, ["a", "c"], "a", 0, 2, 3, planned=["b"])
    assert reply.status == rdzv.READY and after.round == state.round + 1
    assert after.restarts == state.restarts and "planned hand-over of b" in after.round_reason
    # The same change without the plan is a failure.
    failed, _ = rdzv.join(NOW + 1, state, "j", 2, ["a", "c"], "a", 0, 2, 3)
    assert failed.restarts == state.restarts + 1 and "b left the world" in failed.round_reason
