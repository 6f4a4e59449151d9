"""``torchrun --rdzv-backend=ftd``: torch elastic's rendezvous on the ftd coordinator.

    torchrun --rdzv-backend=ftd --rdzv-endpoint=COORD:7400[,COORD2:7400] --rdzv-id=JOB \\
             --nnodes=MIN:MAX --nproc-per-node=N [--rdzv-conf max_restarts=10,node_id=node-3] train.py

Loaded through torch's ``torchrun.handlers`` entry point. What it adds to torch's own handlers:

* **Stable ranks**: a node's rank is its rank in the coordinator's world of the current epoch, so
  survivors keep theirs and a promoted spare takes the dead node's (per-rank checkpoints map 1:1).
* **Spares wait** in ``next_rendezvous`` (hot: torchrun and torch already imported) without
  restarting the running world, and join the moment they are promoted.
* **Re-formation is pushed**: :meth:`num_nodes_waiting` answers 1 as soon as the node's agent holds a
  newer epoch or round (the coordinator pushes it within milliseconds of the commit), and the agent
  has already SIGKILLed the old workers, so no survivor waits for a collective timeout.
* **The restart budget is the job's**, kept in etcd by the coordinator (``max_restarts`` in
  ``--rdzv-conf``; give torchrun's own ``--max-restarts`` a large value).
* Each round's store is a TCPStore hosted by the round's rank 0 and published through the
  coordinator, so no fixed host is a single point of failure.

The node id comes from ``$FTD_NODE_ID`` (set by the agent that launches torchrun) or ``node_id`` in
``--rdzv-conf``; its agent's socket from ``$FTD_AGENT_SOCKET``. With ``$FTD_PKI_DIR`` (set by an agent
that runs with mTLS) the handler talks to the coordinator as ``rendezvous/<node_id>``, the node's
rendezvous certificate: it may join rounds and publish the store as that node, nothing else.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ftd.client import CoordinatorClient
from ftd.identity import IdentityFiles, PkiError
from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import coordinator_pb2

from .agent_link import AgentLink, AgentUnavailable

log = logging.getLogger("ftd.training.rendezvous")
BACKEND = "ftd"
_POLL_S = 0.2


class FtdRendezvousHandler(RendezvousHandler):
    def __init__(self, job: str, endpoints: str, node_id: str, local_addr: str, min_nodes: int, max_nodes: int,
                 max_restarts: int = 10, join_timeout_s: float = 600.0, store_timeout_s: float = 300.0,
                 agent_socket: str | None = None, pki_dir: str | None = None, on_no_spare: str = "shrink") -> None:
        self.job = job
        self.on_no_spare = on_no_spare  # the job's setting, sent with every JoinRound
        self.node_id = node_id
        self.local_addr = local_addr
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.max_restarts = max_restarts
        self.join_timeout_s = join_timeout_s
        self.store_timeout = timedelta(seconds=store_timeout_s)
        self.client = CoordinatorClient(endpoints, timeout_s=5.0, tls=rendezvous_identity(
            pki_dir if pki_dir is not None else os.environ.get("FTD_PKI_DIR"), node_id))
        self.agent = AgentLink(agent_socket) if agent_socket or os.environ.get("FTD_AGENT_SOCKET") else None
        self._round = -1
        self._epoch = -1
        self._server: TCPStore | None = None

    # ---- RendezvousHandler -----------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.job

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self.join_timeout_s
        said = ""
        while True:
            info = self._call("JoinRound", coordinator_pb2.JoinRoundRequest(
                job=self.job, node_id=self.node_id, last_round=self._round, min_nodes=self.min_nodes,
                max_nodes=self.max_nodes, max_restarts=self.max_restarts, on_no_spare=self.on_no_spare))
            if info.status == coordinator_pb2.RoundInfo.CLOSED:
                raise RendezvousClosedError(info.message)
            if info.status == coordinator_pb2.RoundInfo.READY:
                store = self._round_store(info, deadline)
                if store is not None:
                    break
                continue  # the round moved on while we waited for its store: join the next one
            if info.message != said:
                log.warning("node %s waits to join job %s: %s", self.node_id, self.job, info.message)
                said = info.message
            if info.spare:
                deadline = time.monotonic() + self.join_timeout_s  # a hot spare waits as long as it takes
            elif time.monotonic() > deadline:
                raise RendezvousTimeoutError(f"node {self.node_id} could not join job {self.job} within "
                                             f"{self.join_timeout_s:g}s: {info.message}")
            time.sleep(_POLL_S)
        self._round, self._epoch = info.round, info.epoch
        # torchrun's workers inherit this process's environment: the Checkpointer tags its commits
        # with the round (a worker restart is a new timeline in the same epoch).
        os.environ["FTD_ROUND"] = str(info.round)
        log.info("node %s joined job %s round %d (epoch %d) as rank %d of %d: %s", self.node_id, self.job,
                 info.round, info.epoch, info.rank, info.world_size, info.message)
        bootstrap = RendezvousStoreInfo.build(info.rank, store, local_addr=self.local_addr)
        return RendezvousInfo(store, info.rank, info.world_size, bootstrap)

    def _round_store(self, info: Any, deadline: float) -> Store | None:
        """Rank 0 hosts the round's TCPStore and publishes it; the others wait for it. ``None`` when
        the round moved on before its store appeared."""
        prefix = f"/ftd/{self.job}/round/{info.round}/"
        if info.rank == 0:
            self._server = TCPStore(self.local_addr, 0, is_master=True, timeout=self.store_timeout,
                                    wait_for_workers=False)
            address = f"{self.local_addr}:{self._server.port}"
            self._call("SetRoundStore", coordinator_pb2.SetRoundStoreRequest(
                job=self.job, round=info.round, node_id=self.node_id, address=address))
            return PrefixStore(prefix, self._server)
        while True:
            current = self._call("GetRound", coordinator_pb2.GetRoundRequest(job=self.job))
            if current.round != info.round:
                return None
            if current.store_address:
                host, _, port = current.store_address.rpartition(":")
                try:  # connect briefly: a store whose host just died must not hold us for minutes
                    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
                except (RuntimeError, OSError) as exc:
                    log.warning("round %d store at %s unreachable (%s); asking again", info.round,
                                current.store_address, exc)
                    return None
                store.set_timeout(self.store_timeout)
                return PrefixStore(prefix, store)
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(f"rank 0 of job {self.job} round {info.round} never published its store")
            time.sleep(_POLL_S / 4)

    def num_nodes_waiting(self) -> int:
        """1 when this node's world moved on (a newer epoch or round), so torchrun re-rendezvous."""
        try:
            if self.agent is not None:
                a = self.agent.info().assignment
                newer = a.epoch > self._epoch or (a.job == self.job and a.round > self._round)
            else:
                current = self._call("GetRound", coordinator_pb2.GetRoundRequest(job=self.job))
                newer = current.round > self._round
        except (AgentUnavailable, RendezvousConnectionError, RendezvousStateError):
            return 0  # cannot tell: keep training rather than restart on a hiccup
        return 1 if newer else 0

    def is_closed(self) -> bool:
        try:
            return bool(self._call("GetRound", coordinator_pb2.GetRoundRequest(job=self.job)).status
                        == coordinator_pb2.RoundInfo.CLOSED)
        except RendezvousStateError:
            return False  # no round yet: not closed

    def set_closed(self) -> None:
        self._call("CloseJob", coordinator_pb2.CloseJobRequest(job=self.job, reason=f"closed by node {self.node_id}"))

    def shutdown(self) -> bool:
        self._server = None
        self.client.close()
        if self.agent is not None:
            self.agent.close()
        return True

    # ---- plumbing --------------------------------------------------------------------------------

    def _call(self, method: str, request: Any) -> Any:
        try:
            return self.client.call(method, request, idempotent=method != "JoinRound")
        except ConnectionError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        except grpc.RpcError as exc:
            code = rpc_code(exc)
            raise RendezvousStateError(f"coordinator refused {method}: {code.name if code else '?'} "
                                       f"{rpc_details(exc)}") from exc


def rendezvous_identity(pki_dir: str | None, node_id: str) -> IdentityFiles | None:
    """The node's ``rendezvous/<node_id>`` certificate under ``pki_dir`` (``None``: plaintext). A
    missing or bad one fails the handler's creation with the file named."""
    if not pki_dir:
        return None
    try:
        files = IdentityFiles(Path(pki_dir), "rendezvous", node_id)
        files.load()
    except PkiError as exc:
        raise RendezvousStateError(f"the ftd rendezvous of node {node_id} cannot use mTLS: {exc}") from exc
    return files


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's creator signature: ``--rdzv-*`` options → a handler."""
    node_id = params.get("node_id") or os.environ.get("FTD_NODE_ID") or socket.gethostname()
    local_addr = params.local_addr or os.environ.get("FTD_HOST") or socket.gethostname()
    return FtdRendezvousHandler(
        job=params.run_id, endpoints=params.endpoint, node_id=str(node_id), local_addr=local_addr,
        min_nodes=params.min_nodes, max_nodes=params.max_nodes,
        max_restarts=params.get_as_int("max_restarts", 10) or 10,
        join_timeout_s=float(params.get_as_int("join_timeout", 600) or 600),
        store_timeout_s=float(params.get_as_int("store_timeout", 300) or 300),
        pki_dir=params.get("pki_dir") or None,
        on_no_spare=str(params.get("on_no_spare") or "shrink"),
    )


def handler_creator() -> Any:
    """The ``torchrun.handlers`` entry point: called without arguments, returns the creator."""
    return create_handler
