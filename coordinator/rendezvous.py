"""The training job's rendezvous as pure functions over a :class:`JobState` (kept in etcd, one record
per job): which round a node joins, with which rank, and when the job is over.

* A **round** is one formation of the job. It moves on when the world's epoch changed (a node died
  and a spare took its rank, or a node joined) and when a node that already ran in the current round
  asks again (its workers failed or it was restarted).
* **Ranks are the world's node ranks** of the current epoch: survivors keep theirs, a promoted spare
  takes the dead node's, so per-rank checkpoints map one to one.
* **The restart budget is the job's**, not a node's: every round started because of a failure (a
  node's restart, a member lost from the world) counts, so a node leaving and rejoining cannot reset
  it (pytorch issue 147064). Past ``max_restarts`` the job is closed with the reason. It counts
  incidents, not calls: a node asking again before every member joined the current round joins that
  round (the same incident), so one node's repeated joins cannot spend the budget.
* **Only a node of the world creates a job**: a spare's join of a job that does not exist waits
  without a record (spares filled the job table), and :func:`created_by` bounds how many open jobs
  one node created (:data:`MAX_JOBS_PER_NODE`).
* A node not in the world (a spare) **waits** and disturbs nobody; so does everybody while the world
  is smaller than ``min_nodes``, with the reason given.
* **No spare for a lost node** (the world is below its target size): the job's ``on_no_spare`` says
  what happens. ``shrink`` (the default): the smaller world forms a round (not below ``min_nodes``)
  and restores the newest step resharded, and so does a grown one when nodes return. ``wait``:
  everybody waits until the world is back to its target size, and the job's state says why (one
  event when the wait begins; ``ftctl status`` shows it).

Every rule takes ``now_unix`` (wall-clock seconds, stamped on the round) instead of reading a clock.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

READY, WAIT, CLOSED = "ready", "wait", "closed"
SHRINK = "shrink"
ON_NO_SPARE = (SHRINK, WAIT)  # JobState.on_no_spare


@dataclass(frozen=True)
class JobState:
    job: str
    round: int = 0
    epoch: int = -1  # the world epoch the round was formed in
    members: tuple[str, ...] = ()  # node ids by rank in this round
    restarts: int = 0
    max_restarts: int = 10
    min_nodes: int = 1
    store_address: str = ""  # the round's store, hosted by its rank 0
    closed: bool = False
    closed_reason: str = ""
    round_reason: str = "first round"
    round_unix_s: float = 0.0
    on_no_spare: str = SHRINK  # "shrink" or "wait": see the module docstring
    waiting: str = ""  # why the job waits for its world to be whole again ("" when it does not)
    rollbacks: int = 0  # rollbacks past a step anomaly (coordinator/rollback_rules.py), not restarts
    last_rollback: str = ""  # the key of the anomaly the last rollback answered (Seen.key)
    skip_until: int = -1  # with skip_batches: the restored job skips the data of the steps up to this one
    # The last rollback past a step anomaly: the first suspect step and when (leader's wall clock). A memory
    # snapshot of a step from it on saved before then is suspect too: it has no etcd record to mark, and a
    # new leader learns it again from the agents' reports (coordinator/memory_ledger.py).
    suspect_from: int = -1
    suspect_unix_s: float = 0.0
    joined: tuple[str, ...] = ()  # the members answered READY in this round (it formed once every one is)
    created_by: str = ""  # the node whose join created the job (a node creates at most MAX_JOBS_PER_NODE)
    created_unix_s: float = 0.0


@dataclass(frozen=True)
class Reply:
    status: str
    message: str
    rank: int = -1
    world_size: int = 0
    spare: bool = False


def _advance(now_unix: float, state: JobState, epoch: int, world: Sequence[str], why: str,
             failure: bool) -> JobState:
    restarts = state.restarts + (1 if failure else 0)
    new = replace(state, round=state.round + 1, epoch=epoch, members=tuple(world), store_address="",
                  restarts=restarts, round_reason=why, round_unix_s=now_unix, joined=())
    if restarts > state.max_restarts:
        new = replace(new, closed=True, closed_reason=f"restart budget of job {state.job} exhausted: {restarts} "
                                                      f"restarts > max_restarts {state.max_restarts} (last: {why})")
    return new


MAX_JOBS_PER_NODE = 4  # open jobs one node may have created (a cluster runs one job; a few for a hand-over)


def created_by(jobs: Collection[JobState], node_id: str) -> int:
    """How many open jobs ``node_id`` created."""
    return sum(1 for j in jobs if j.created_by == node_id and not j.closed)


def check_on_no_spare(value: str) -> str:
    """``value`` as the job's setting ("" is the default, ``shrink``); ``ValueError`` names the choices."""
    value = value or SHRINK
    if value not in ON_NO_SPARE:
        raise ValueError(f"on_no_spare must be one of {', '.join(ON_NO_SPARE)}, got {value[:40]!r}")
    return value


def wait_reason(state: JobState, world_size: int, target_size: int) -> str:
    """Why a job with ``on_no_spare = "wait"`` does not run on the world now ("" when it may)."""
    if state.on_no_spare != WAIT or world_size >= target_size:
        return ""
    return (f"the world has {world_size} of its {target_size} node(s): no spare took the lost rank(s) and job "
            f"{state.job} has on_no_spare=wait, so it waits for a spare or a returning node instead of shrinking")


def join(now_unix: float, state: JobState | None, job: str, epoch: int, world: Sequence[str], node_id: str,
         last_round: int, min_nodes: int, max_restarts: int,
         suspects: Collection[str] = (), planned: Collection[str] = (), on_no_spare: str = SHRINK,
         target_size: int = 0) -> tuple[JobState, Reply]:
    """One node asks to (re)join the job. Returns the job's new state and the answer.

    ``suspects``: nodes the detector currently suspects. A node whose workers failed because a peer
    died asks again before that death is committed; it waits for the verdict instead of starting a
    round that would count the same incident twice (once as a restart, once as a lost member).

    ``planned``: nodes that left the world by a planned hand-over (a preemption notice, a drain):
    the round their departure starts is not a failure and does not charge the restart budget.

    ``on_no_spare`` (the job's setting, taken from its first join) and ``target_size`` (the size the
    world should have, the membership's): a ``wait`` job does not run on a world below it."""
    if node_id not in world:  # before a job is created: a spare (or a stranger) creates no job
        if state is not None and state.closed:
            return state, Reply(CLOSED, state.closed_reason or f"job {job} is closed")
        return state or JobState(job), Reply(WAIT, f"node {node_id} holds no rank in epoch {epoch}: a spare waits "
                                                   "until it is promoted", spare=True)
    if state is None:
        state = JobState(job, round=0, epoch=epoch, members=tuple(world), max_restarts=max_restarts,
                         min_nodes=max(1, min_nodes), round_unix_s=now_unix, on_no_spare=check_on_no_spare(on_no_spare),
                         created_by=node_id, created_unix_s=now_unix)
    if state.closed:
        return state, Reply(CLOSED, state.closed_reason or f"job {job} is closed")
    if len(world) < state.min_nodes:
        return state, Reply(WAIT, f"the world has {len(world)} node(s) and job {job} needs at least "
                                  f"{state.min_nodes}: waiting for a spare or a returning node")
    waiting = wait_reason(state, len(world), target_size)
    if waiting:  # recorded once (one event), then every join hears the same
        return replace(state, waiting=waiting), Reply(WAIT, waiting)
    if state.waiting:
        state = replace(state, waiting="")
    if epoch != state.epoch or tuple(world) != state.members:
        lost = [n for n in state.members if n not in world]
        failed = [n for n in lost if n not in planned]
        why = (f"epoch {epoch}: {', '.join(lost)} left the world" if failed
               else f"epoch {epoch}: planned hand-over of {', '.join(lost)}" if lost
               else f"epoch {epoch}: the world changed to {len(world)} node(s)")
        state = _advance(now_unix, state, epoch, world, why, failure=bool(failed))
    elif world.index(node_id) == 0 and state.store_address and last_round < state.round:
        # The round's store host is joining again: the torchrun that hosted the store is gone, so is
        # the store. Everybody moves to a new round with a fresh store (not a new failure).
        state = _advance(now_unix, state, epoch, world,
                         f"{node_id}, the store host of round {state.round}, restarted", failure=False)
    elif last_round >= state.round and not set(state.members) <= set(state.joined):
        # The round has not formed yet (not every member was answered): asking again is the same
        # incident, not a new one. The node joins the round being formed; the budget is not charged.
        pass
    elif last_round >= state.round:
        suspected = sorted(set(state.members) & set(suspects))
        if suspected:
            return state, Reply(WAIT, f"round {state.round} failed while {', '.join(suspected)} is suspect: waiting "
                                      "for the coordinator's verdict before the job restarts")
        state = _advance(now_unix, state, epoch, world, f"{node_id} restarted after round {last_round}",
                         failure=True)
    if state.closed:
        return state, Reply(CLOSED, state.closed_reason)
    if node_id not in state.joined:
        state = replace(state, joined=(*state.joined, node_id))
    return state, Reply(READY, f"round {state.round} ({state.round_reason})", world.index(node_id), len(world))


def stall_restart(now_unix: float, state: JobState, reason: str) -> JobState:
    """Every node of the round waits and nobody can be blamed: start a new round (counted)."""
    return _advance(now_unix, state, state.epoch, state.members, reason, failure=True)


def rolled_back(now_unix: float, state: JobState, key: str, reason: str, skip_until: int = -1,
                suspect_from: int = -1) -> JobState:
    """A rollback past a bad step: a new round of the same members (every rank restarts from the
    newest checkpoint not marked suspect), counted against the rollback budget, not the restart
    budget. ``suspect_from``: the first suspect step (its checkpoints and later ones saved until now)."""
    new = _advance(now_unix, state, state.epoch, state.members, reason, failure=False)
    return replace(new, rollbacks=state.rollbacks + 1, last_rollback=key, skip_until=skip_until,
                   suspect_from=suspect_from, suspect_unix_s=now_unix if suspect_from >= 0 else 0.0)


def set_store(state: JobState, round_: int, node_id: str, address: str) -> tuple[JobState, str]:
    """The round's rank 0 publishes its store; returns an error text when it may not."""
    if round_ != state.round:
        return state, f"round {round_} is over; the job is in round {state.round}"
    if not state.members or state.members[0] != node_id:
        owner = state.members[0] if state.members else "nobody"
        return state, f"only rank 0 ({owner}) hosts the store of round {round_}"
    return replace(state, store_address=address), ""


def close(state: JobState, reason: str) -> JobState:
    return state if state.closed else replace(state, closed=True, closed_reason=reason)


def encode(state: JobState) -> bytes:
    return json.dumps(asdict(state), sort_keys=True).encode()


def decode(raw: bytes) -> JobState:
    data: dict[str, Any] = json.loads(raw)
    data["members"] = tuple(data.get("members", ()))
    data["joined"] = tuple(data.get("joined", ()))
    known = {f.name for f in fields(JobState)}
    return JobState(**{k: v for k, v in data.items() if k in known})  # a newer leader's fields are dropped


def key(job: str) -> str:
    return f"jobs/{job}"
