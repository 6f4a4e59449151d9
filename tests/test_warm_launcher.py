"""The warm launcher (agent/launcher.py, agent/warm_pool.py, training/warm_worker.py): torchrun's job
done by the agent with standby workers that imported torch before they were needed.

* Pure decisions (what to do with a RoundInfo, with the workers' exit codes, with a pushed assignment;
  the workers' environment) without processes.
* The state machine against the coordinator's real rendezvous rules (coordinator/rendezvous.py) with
  cheap stand-in workers (``sleep``/``true``), driven step by step on a fake clock.

Real standby processes and a node killed in a local cluster: test_warm_launcher_standbys.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from doubles import ManualClock

from ftd.agent.launcher import (
    Act,
    Launcher,
    RoundView,
    State,
    after_join,
    join_address,
    push_action,
    split_address,
    store_wait,
    worker_env,
    worker_outcome,
)
from ftd.agent.warm_pool import (
    ENV_BACKGROUND,
    PROTOCOL,
    WORKER_MODULE,
    WarmPool,
    WorkerAssignment,
    entry_from_cmd,
    kill_processes,
    reap,
    standby_argv,
)
from ftd.coordinator import rendezvous as rules
from ftd.coordinator.jobs import round_info
from ftd.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent

# ---- pure decisions -----------------------------------------------------------------------------------


def ready(rank: int, world: int = 2, store: str = "", round_: int = 3) -> RoundView:
    return RoundView("ready", round=round_, epoch=5, rank=rank, world_size=world, store_address=store)


def test_after_join_decides_from_the_round_info() -> None:
    assert after_join(RoundView("closed", message="budget spent"))[0] is Act.CLOSE
    act, why = after_join(RoundView("wait", message="node c holds no rank", spare=True))
    assert act is Act.WAIT and "no rank" in why
    assert after_join(ready(0))[0] is Act.HOST_STORE
    assert after_join(ready(1, store="10.0.0.1:29500"))[0] is Act.START
    act, why = after_join(ready(1))
    assert act is Act.AWAIT_STORE and "rank 0" in why
    assert after_join(ready(2, world=2))[0] is Act.WAIT  # not a usable rank: ask again, never start
    assert after_join(RoundView("unknown"))[0] is Act.WAIT


def test_store_wait_follows_the_round() -> None:
    assert store_wait(3, RoundView("closed", round=3), 0, 10)[0] is Act.CLOSE
    act, why = store_wait(3, ready(-1, round_=4), 0, 10)
    assert act is Act.REJOIN and "moved on" in why
    assert store_wait(3, ready(-1, store="h:1", round_=3), 0, 10)[0] is Act.START
    assert store_wait(3, ready(-1, round_=3), 5, 10)[0] is Act.WAIT
    act, why = store_wait(3, ready(-1, round_=3), 10, 10)
    assert act is Act.ABANDON and "no store" in why


def test_worker_outcome() -> None:
    assert worker_outcome([])[0] is Act.FAIL
    assert worker_outcome([None, None])[0] is Act.RUN
    assert worker_outcome([0, None])[0] is Act.RUN  # one finished: wait for the others
    assert worker_outcome([0, 0]) == (Act.DONE, "all 2 workers exited 0")
    assert worker_outcome([None, 3]) == (Act.FAIL, "local rank 1 exited with code 3")
    assert worker_outcome([-9, None]) == (Act.FAIL, "local rank 0 was killed by signal 9")
    assert worker_outcome([0, 1])[0] is Act.FAIL


def test_push_action() -> None:
    def act(state: State, epoch: int = 4, job: str = "j", round_: int = 2, fenced: bool = False) -> str:
        return push_action(state, "j", 2, 4, epoch, job, round_, fenced)[0]

    assert act(State.RUNNING, epoch=5) == "abort"  # a newer world: the running one is gone
    assert act(State.RUNNING, round_=3) == "abort"  # the job moved on (a stall restart, a peer's restart)
    assert act(State.RUNNING) == "none"
    assert act(State.RUNNING, epoch=3) == "none"  # older news
    assert act(State.RUNNING, job="other", round_=9) == "none"
    assert act(State.RUNNING, fenced=True) == "abort"
    assert act(State.WAIT) == "kick" and act(State.JOIN, fenced=True) == "kick" and act(State.STORE) == "kick"
    assert act(State.DONE, epoch=9) == "none" and act(State.CLOSED, epoch=9) == "none"


def test_worker_env_is_torchruns() -> None:
    r = RoundView("ready", round=7, epoch=3, rank=1, world_size=3, restarts=2)
    env = worker_env("job", "node-b", "10.0.0.2", r, nproc=4, local_rank=2, master_addr="10.0.0.1",
                     master_port=29500, max_restarts=10)
    assert env["RANK"] == "6" and env["WORLD_SIZE"] == "12" and env["LOCAL_RANK"] == "2"
    assert env["LOCAL_WORLD_SIZE"] == "4" and env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "3"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_RUN_ID"] == "job"
    assert env["FTD_ROUND"] == "7" and env["FTD_EPOCH"] == "3" and env["FTD_NODE_ID"] == "node-b"
    assert all(isinstance(v, str) for v in env.values())


def test_addresses() -> None:
    assert split_address("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert split_address("[::1]:80") == ("::1", 80) and join_address("::1", 80) == "[::1]:80"
    assert join_address("h", 1) == "h:1"
    for bad in ("h", "h:", ":1", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            split_address(bad)


def test_entry_from_torchrun_cmd() -> None:
    assert entry_from_cmd(["-m", "ftd.training.demo_job", "--steps", "3"]) == ("ftd.training.demo_job",
                                                                                ["--steps", "3"])
    assert entry_from_cmd(["train.py", "--lr", "1"]) == ("train.py", ["--lr", "1"])
    for bad in ([], ["-m"], ["--foo"]):
        with pytest.raises(ValueError):
            entry_from_cmd(bad)
    argv = standby_argv("m:f", ["--x"], python="py", wait_s=5)
    assert argv == ["py", "-m", WORKER_MODULE, "--entry", "m:f", "--wait-s", "5", "--", "--x"]


def test_worker_protocol_parts() -> None:
    from ftd.training import warm_worker as ww  # imports torch (the training package does)

    assert (ww.PROTOCOL, ww.ENV_BACKGROUND, ww.__name__) == (PROTOCOL, ENV_BACKGROUND, WORKER_MODULE)
    assert ww.parse_entry("a.b") == ("module", "a.b", None)
    assert ww.parse_entry("a.b:run") == ("module", "a.b", "run")
    assert ww.parse_entry("dir/train.py") == ("path", "dir/train.py", None)
    for bad in ("", "a:", ":f"):
        with pytest.raises(ValueError):
            ww.parse_entry(bad)
    env, argv = ww.parse_assignment(WorkerAssignment({"RANK": "1"}, ["--x"]).line())
    assert env == {"RANK": "1"} and argv == ["--x"]
    assert ww.parse_assignment(b'{"env": {}}') == ({}, None)
    for bad_line in (b"nope", b"[]", b'{"env": {"A": 1}}', b'{"env": {"A=B": "1"}}', b'{"argv": "x"}'):
        with pytest.raises(ww.ProtocolError):
            ww.parse_assignment(bad_line)
    assert [ww.exit_code(v) for v in (None, 0, 3, 256 + 4, True, "x", 1.5)] == [0, 0, 3, 4, 1, 0, 0]
    assert ww.takes_argument(lambda argv: 0) and ww.takes_argument(lambda argv=None: 0)
    assert not ww.takes_argument(lambda: 0)
    assert ww.process_age_s() is not None


def test_agent_modules_do_not_import_torch() -> None:
    code = "import sys, ftd.agent.warm_pool, ftd.agent.launcher; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- the state machine against the coordinator's rules, with stand-in workers ------------------------


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class RulesCoordinator:
    """JoinRound / GetRound / SetRoundStore as the coordinator answers them (its pure rules)."""

    def __init__(self, world: Sequence[str], epoch: int = 1) -> None:
        self.world = list(world)
        self.epoch = epoch
        self.state: rules.JobState | None = None
        self.suspects: set[str] = set()
        self.calls: list[tuple[str, Any]] = []
        self.down = False

    def call(self, method: str, request: Any, *, idempotent: bool, timeout_s: float | None = None,
             deadline_s: float | None = None) -> Any:
        self.calls.append((method, request))
        if self.down:
            raise ConnectionError("no coordinator leader reachable")
        if method == "JoinRound":
            self.state, reply = rules.join(time.time(), self.state, request.job, self.epoch, self.world,
                                           request.node_id, request.last_round, request.min_nodes,
                                           request.max_restarts or 10, self.suspects)
            return round_info(self.state, reply)
        assert self.state is not None
        if method == "GetRound":
            return round_info(self.state)
        if method == "SetRoundStore":
            self.state, error = rules.set_store(self.state, request.round, request.node_id, request.address)
            if error:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, error)
            return round_info(self.state)
        raise AssertionError(f"unexpected {method}")

    def joins(self, node: str) -> list[Any]:
        return [r for m, r in self.calls if m == "JoinRound" and r.node_id == node]


class FakePool:
    """A WarmPool's interface over stand-in processes (``sleep``: a worker that runs; ``true``: one
    that finishes)."""

    def __init__(self, nproc: int = 1, cmd: Sequence[str] = ("sleep", "60")) -> None:
        self.nproc = nproc
        self.cmd = list(cmd)
        self.assignments: list[list[WorkerAssignment]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.refills: list[str] = []  # why the launcher asked for the deferred refill
        self.closed = False

    def activate(self, assignments: Sequence[WorkerAssignment]) -> list[subprocess.Popen[bytes]]:
        self.assignments.append(list(assignments))
        procs = [subprocess.Popen(self.cmd, start_new_session=True) for _ in assignments]
        self.procs += procs
        return procs

    def tend(self) -> None:
        pass

    def refill_now(self, why: str) -> bool:
        self.refills.append(why)
        return True

    def close(self, timeout_s: float = 5.0) -> list[int]:
        self.closed = True
        killed = kill_processes(self.procs)
        reap(self.procs, timeout_s)
        return killed

    def env(self, activation: int = -1, local_rank: int = 0) -> dict[str, str]:
        return dict(self.assignments[activation][local_rank].env)


Clock = ManualClock


@pytest.fixture
def pools() -> Iterator[list[FakePool]]:
    made: list[FakePool] = []
    yield made
    for pool in made:
        pool.close()


def launcher(coord: RulesCoordinator, node: str, pools: list[FakePool], clock: Clock, nproc: int = 1,
             min_nodes: int = 2, cmd: Sequence[str] = ("sleep", "60"), **kw: Any) -> Launcher:
    pools.append(FakePool(nproc, cmd))
    return Launcher(coord, "job", node, "127.0.0.1", nproc, min_nodes, 3, 5, cast(WarmPool, pools[-1]), clock=clock,
                    **kw)


def dead(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is not None


def test_launchers_form_a_round_with_torchruns_environment(pools: list[FakePool]) -> None:
    coord, clock = RulesCoordinator(["a", "b"]), Clock()
    la, lb, lc = (launcher(coord, n, pools, clock, nproc=2) for n in ("a", "b", "c"))
    la.step()
    assert la.state is State.RUNNING and la.rank == 0 and la.round == 0
    assert coord.state is not None and coord.state.store_address.startswith("127.0.0.1:")
    port = coord.state.store_address.rpartition(":")[2]
    lb.step()
    assert lb.state is State.RUNNING and lb.rank == 1
    envs = [pools[0].env(0, 0), pools[0].env(0, 1), pools[1].env(0, 0), pools[1].env(0, 1)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["MASTER_PORT"] for e in envs} == {port}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len(la.worker_pids()) == 2 and [e.kind for e in la.events] == ["joined", "activated"]

    assert lc.step() == pytest.approx(0.2) and lc.state is State.WAIT and lc.reason.endswith("promoted")
    clock.now += 0.1
    assert lc.step() == pytest.approx(0.1) and len(coord.joins("c")) == 1  # polls at most every 0.2 s ...
    lc.kick()
    lc.step()
    assert len(coord.joins("c")) == 2  # ... and at once when kicked
    assert not pools[2].assignments


def test_a_failed_worker_rejoins_with_its_round_and_the_restart_is_counted(pools: list[FakePool]) -> None:
    coord, clock = RulesCoordinator(["a", "b"]), Clock()
    la, lb = launcher(coord, "a", pools, clock), launcher(coord, "b", pools, clock)
    la.step()
    lb.step()
    b_worker = lb.workers[0]
    os.kill(b_worker.pid, signal.SIGKILL)
    wait_for(lambda: dead(b_worker), 10, "the killed stand-in worker")
    assert lb.step() == pytest.approx(0.5)  # settles before joining again (a peer's death may be pending)
    assert lb.state is State.JOIN and "killed by signal 9" in lb.reason and lb.events[-1].kind == "failed"
    clock.now += 0.2
    lb.step()
    assert len(coord.joins("b")) == 1
    clock.now += 0.3
    lb.step()
    assert coord.joins("b")[-1].last_round == 0
    assert coord.state is not None and coord.state.round == 1 and coord.state.restarts == 1
    assert lb.state is State.STORE  # rank 1 waits for rank 0's store of round 1

    assert la.on_push(1, "job", 1, False) == "abort"  # the agent's push: the job moved on
    old = la.workers[0]
    wait_for(lambda: dead(old), 10, "the aborted worker")
    la.step()
    assert la.state is State.RUNNING and la.round == 1 and coord.joins("a")[-1].last_round == 0
    lb.step()
    assert lb.state is State.RUNNING and lb.round == 1
    assert pools[1].env()["MASTER_PORT"] == coord.state.store_address.rpartition(":")[2]
    assert pools[1].env()["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert old.returncode == -signal.SIGKILL and coord.state.restarts == 1


def test_push_abort_on_a_new_epoch_and_the_spare_takes_the_rank(pools: list[FakePool]) -> None:
    coord, clock = RulesCoordinator(["a", "b"]), Clock()
    la, lb, lc = (launcher(coord, n, pools, clock) for n in ("a", "b", "c"))
    for node in (la, lb, lc):
        node.step()
    assert lc.state is State.WAIT
    lb.stop()  # node b dies
    coord.world, coord.epoch = ["a", "c"], 2  # the coordinator promoted c
    worker = la.workers[0]
    assert la.on_push(2, "job", 0, False) == "abort"
    wait_for(lambda: dead(worker), 10, "the push-aborted worker")  # killed at once, before any step
    assert lc.on_push(2, "job", 0, False) == "kick"
    clock.now += 0.05
    la.step()
    lc.step()
    assert len(pools[0].refills) == 1 and "aborted" in pools[0].refills[0]  # standbys are needed again now
    assert (la.state, la.rank, la.round, la.epoch) == (State.RUNNING, 0, 1, 2)
    assert (lc.state, lc.rank, lc.round) == (State.RUNNING, 1, 1)
    assert pools[2].env()["RANK"] == "1" and pools[2].env()["FTD_EPOCH"] == "2"
    assert pools[2].env()["MASTER_PORT"] == pools[0].env()["MASTER_PORT"]
    assert coord.state is not None and coord.state.restarts == 1  # b was lost: one failure
    assert [e.kind for e in la.events][-2:] == ["joined", "activated"] and "aborted" in [e.kind for e in la.events]


def test_all_workers_exit_zero_is_done(pools: list[FakePool]) -> None:
    coord, clock = RulesCoordinator(["a"]), Clock()
    la = launcher(coord, "a", pools, clock, nproc=2, min_nodes=1, cmd=("true",))
    la.step()
    wait_for(lambda: all(dead(p) for p in pools[0].procs), 10, "the stand-in workers to finish")
    assert la.step() == float("inf")
    assert la.state is State.DONE and la.events[-1].kind == "done"
    la.stop()
    assert la.state is State.DONE and pools[0].closed
    assert [m for m, _ in coord.calls].count("JoinRound") == 1  # no rejoin; no CloseJob (an operator's call)


def test_a_closed_job_stops_the_launcher(pools: list[FakePool]) -> None:
    coord, clock = RulesCoordinator(["a", "b"]), Clock()
    la = launcher(coord, "a", pools, clock)
    la.step()
    assert coord.state is not None
    coord.state = rules.close(coord.state, "restart budget exhausted")
    la.abort("test")
    assert la.step() == float("inf") and la.state is State.CLOSED and "budget" in la.reason
    assert not la.worker_pids()


def test_rpc_failures_back_off_and_recover(pools: list[FakePool]) -> None:
    coord, clock = RulesCoordinator(["a"]), Clock()
    la = launcher(coord, "a", pools, clock, min_nodes=1, max_backoff_s=1.0)
    coord.down = True
    delays = []
    for _ in range(5):
        delays.append(la.step())
        clock.now += delays[-1]
    assert delays == sorted(delays) and delays[0] == pytest.approx(0.4) and max(delays) == 1.0
    assert la.state is State.JOIN
    coord.down = False
    la.step()
    assert la.state is State.RUNNING


def test_a_store_that_never_appears_is_abandoned_and_counted(pools: list[FakePool]) -> None:
    coord, clock = RulesCoordinator(["a", "b"]), Clock()
    lb = launcher(coord, "b", pools, clock, store_wait_s=30.0)
    assert lb.step() == 0.0 and lb.state is State.STORE
    assert lb.step() == pytest.approx(0.05) and lb.state is State.STORE
    clock.now += 31
    lb.step()
    assert lb.state is State.JOIN and lb.last_round == 0 and "no store" in lb.reason
    lb.step()
    # a never joined: the round never formed, so asking again is the same incident (no charge)
    assert coord.joins("b")[-1].last_round == 0 and coord.state is not None
    assert coord.state.round == 0 and coord.state.restarts == 0
    # a joins but its store never appears: the formed round failed, b's next abandonment is counted
    coord.state, _ = rules.join(time.time(), coord.state, "job", 1, ["a", "b"], "a", -1, 2, 5)
    assert lb.state is State.STORE
    clock.now += 31
    lb.step()
    assert lb.state is State.JOIN and lb.last_round == 0 and "no store" in lb.reason
    lb.step()
    assert coord.state.round == 1 and coord.state.restarts == 1


def test_the_run_loop_stops_and_kills_its_workers(pools: list[FakePool]) -> None:
    coord = RulesCoordinator(["a"])
    pools.append(FakePool())
    la = Launcher(coord, "job", "a", "127.0.0.1", 1, 1, 1, 5, cast(WarmPool, pools[-1]))
    thread = la.start()
    wait_for(lambda: la.state is State.RUNNING, 10, "the launcher to start its worker")
    worker = la.workers[0]
    la.stop()
    assert not thread.is_alive() and la.state is State.STOPPED
    assert worker.returncode == -signal.SIGKILL and pools[-1].closed
