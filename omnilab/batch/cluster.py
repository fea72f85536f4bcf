"""Ray: connect, size one actor per NUMA node of each node, dispatch rows, restart a dead actor and retry its rows.

Sizing (``plan_slots``): every alive Ray node with a ``CPU`` resource runs a zero-CPU probe task
(``worker.numa_pools``: its NUMA nodes and physical cores). It gets one actor per NUMA node (``actors_per_node``
overrides), each reserving ``num_cpus`` = that node's physical cores, capped by the Ray node's ``CPU`` resource
shared among its actors (``threads`` overrides). The actor's Pipeline is planned with that many threads
(``deploy_profile`` of the run, "auto" by default) and, where the actor reserves a whole NUMA node, is pinned
to it; a Ray node that advertises fewer CPUs than its machine has (several Ray nodes on one host) is not
pinned, since Ray does not say which CPUs are its own.

Dispatch (``ActorPool.run``): at most ``depth`` rows in flight per actor, results taken as they finish
(``ray.wait``). A ``RayActorError`` (the actor process died, was killed, or lost its node) puts the actor's
rows back at the head of the queue, and the actor is started again on the same node; a row whose actor died
under it ``max_retries + 1`` times is reported failed instead (a row that crashes its actor every time cannot
stop the run). Each row's record is delivered once: an actor that died returned nothing for it.
"""
from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from omnilab.batch.worker import BatchWorker, numa_pools
from omnilab.errors import InputError, WorkerError


@dataclass(frozen=True)
class Slot:
    """Where one actor runs and what it reserves: the Ray node, ``num_cpus`` (Ray resource and threads),
    the CPUs it pins to (empty: not pinned), and why."""
    node_id: str
    node_ip: str
    index: int
    num_cpus: int
    cpus: tuple[int, ...]
    reason: str

    @property
    def node(self) -> str:
        return f"{self.node_ip}/{self.node_id[:8]}"


def connect(address: str | None):
    """Connect this process to Ray; returns what to stop at the end (None when the connection was already there).

    ``None`` / ``"local"``: a new local Ray instance on this machine; ``"local:N"``: N Ray nodes on this machine
    (``local_cluster``: for study and tests); ``"auto"``: the cluster this machine belongs to (``ray start`` ran
    here); ``"ray://HOST:PORT"`` (Ray Client) or ``"HOST:PORT"``: that cluster. An already connected process (a
    notebook that called ``ray.init``) keeps its connection."""
    import ray

    if ray.is_initialized():
        return None
    kw = dict(logging_level="WARNING", log_to_driver=False)
    if isinstance(address, str) and address.startswith("local:"):
        n = address.partition(":")[2]
        if not n.isdigit() or int(n) < 1:
            raise InputError(f"address {address!r}: 'local:N' needs a node count N >= 1, e.g. 'local:2'")
        c = local_cluster(int(n))
        ray.init(address=c.address, **kw)
        return c
    if address in (None, "local"):
        _patient_start()
        ray.init(include_dashboard=False, _system_config=dict(PATIENT), **kw)
    else:
        ray.init(address=address, **kw)
    return True


# Ray's raylet gives up after 30 s when its Python agents start slowly (a loaded machine): wait longer
PATIENT = {"raylet_start_wait_time_s": 120, "agent_register_timeout_ms": 120000}


def _patient_start() -> None:
    """``PATIENT`` for the Ray processes this process starts (they read ``RAY_*``), and no usage report."""
    for k, v in PATIENT.items():
        os.environ.setdefault(f"RAY_{k}", str(v))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def local_cluster(nodes: int = 2, cpus_per_node: int | None = None, attempts: int = 4):
    """``ray.cluster_utils.Cluster`` with ``nodes`` Ray nodes on this machine, ``cpus_per_node`` CPUs each
    (default: this process's CPUs shared out, at least 1); ``.shutdown()`` stops it.

    Each node's agents get fixed ports and the raylet a 120 s start wait (Ray's default of 30 s is too short on
    a loaded machine: the raylet gives up while its Python agents are still importing); a failed start is
    retried ``attempts`` times."""
    import socket

    from ray.cluster_utils import Cluster

    cpus = cpus_per_node or max(1, len(os.sched_getaffinity(0)) // nodes)
    _patient_start()

    def ports() -> dict[str, int]:
        out = {}
        for name in ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port",
                     "runtime_env_agent_port"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                out[name] = s.getsockname()[1]
        return out

    quiet = logging.getLogger("ray")  # "Failed to get node info" while a raylet starts is Ray polling, not news
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        for attempt in range(attempts):
            c = Cluster()
            try:
                c.add_node(num_cpus=cpus, include_dashboard=False, **ports(),
                           _system_config=dict(PATIENT))
                for _ in range(nodes - 1):
                    c.add_node(num_cpus=cpus, **ports())
                return c
            except Exception:  # noqa: BLE001 - a raylet that timed out starting: stop what started, try again
                c.shutdown()
                if attempt == attempts - 1:
                    raise
    finally:
        quiet.setLevel(level)


def _node_strategy(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def size_node(ray_cpus: int, numa: list[tuple[int, tuple[int, ...]]], actors_per_node: int | None = None,
              threads: int | None = None, where: str = "") -> list[tuple[int, tuple[int, ...], str]]:
    """The actors of one Ray node: ``[(num_cpus, CPUs to pin or (), reason)]`` from its Ray ``CPU`` resource and
    its machine's ``[(NUMA node, first CPU of each physical core)]`` (``worker.numa_pools``)."""
    if threads is not None and threads > ray_cpus:
        raise InputError(f"threads={threads} per actor, but Ray node {where} has {ray_cpus} CPU(s): Ray would "
                         f"never place the actor; accepted: 1-{ray_cpus} or None")
    cores = sum(len(c) for _, c in numa)
    k = max(1, min(actors_per_node or len(numa), ray_cpus // (threads or 1)))
    share = max(1, ray_cpus // k)
    out = []
    for i in range(k):
        nid, node_cores = numa[i % len(numa)]
        want = threads or min(len(node_cores), share)
        owns = ray_cpus >= cores and k <= len(numa) and threads is None
        cpus = tuple(node_cores[:want]) if owns else ()
        why = (f"NUMA node {nid}: {len(node_cores)} physical core(s); Ray node CPU {ray_cpus} over {k} actor(s)"
               + (f"; threads={threads} asked" if threads else "")
               + ("; pinned to the node's cores" if cpus else
                  "; not pinned (the Ray node does not own the machine's cores)" if not owns else ""))
        out.append((want, cpus, why))
    return out


def plan_slots(actors_per_node: int | None = None, threads: int | None = None) -> list[Slot]:
    """One ``Slot`` per actor over the cluster's alive nodes (see the module docstring)."""
    import ray

    for name, v in (("actors_per_node", actors_per_node), ("threads", threads)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise InputError(f"{name} {v!r} must be a positive integer or None (auto)")
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1]
    if not nodes:
        raise WorkerError("the Ray cluster has no alive node with a CPU resource; start one (ray start ...)")
    probe = ray.remote(num_cpus=0)(numa_pools)
    pools = ray.get([probe.options(scheduling_strategy=_node_strategy(n["NodeID"])).remote() for n in nodes])
    slots: list[Slot] = []
    for n, numa in zip(nodes, pools):
        where = n.get("NodeManagerAddress", "?")
        for num_cpus, cpus, why in size_node(int(n["Resources"]["CPU"]), numa, actors_per_node, threads, where):
            slots.append(Slot(n["NodeID"], where, len(slots), num_cpus, cpus, why))
    return slots


def driver_env() -> dict[str, str]:
    """The driver's ``OMNILAB_*`` variables: they reach every actor (an operator's override applies cluster-wide)."""
    return {k: v for k, v in os.environ.items() if k.startswith("OMNILAB_")}


class ActorPool:
    """The run's actors, one per ``Slot``, each a ``BatchWorker`` holding one Pipeline."""

    def __init__(self, slots: list[Slot], model: Any, pipeline_kwargs: Mapping[str, Any], *, run_id: str,
                 depth: int = 2, max_retries: int = 2, max_restarts: int = 3, log: Callable[[str], None] = print):
        import ray

        self._remote = ray.remote(BatchWorker)
        self.slots, self.model, self.kwargs, self.run_id = slots, model, dict(pipeline_kwargs), run_id
        self.depth, self.max_retries, self.max_restarts, self.log = depth, max_retries, max_restarts, log
        self.gen = [0] * len(slots)
        self.restarts = 0
        self.actors: dict[int, Any] = {}
        self.infos: dict[str, dict] = {}
        for i in range(len(slots)):
            self.actors[i] = self._start(i)
        self._wait_ready(list(self.actors))

    def _name(self, i: int) -> str:
        return f"a{i}" + (f".r{self.gen[i]}" if self.gen[i] else "")

    def _start(self, i: int):
        s = self.slots[i]
        return self._remote.options(num_cpus=s.num_cpus, scheduling_strategy=_node_strategy(s.node_id),
                                    max_restarts=0, max_concurrency=1).remote(
            self.model, name=self._name(i), node=s.node, cpus=s.cpus or None, env=driver_env(),
            num_threads=s.num_cpus, **self.kwargs)

    def _wait_ready(self, idx: list[int]) -> None:
        import ray

        refs = [self.actors[i].info.remote() for i in idx]
        for i, ref in zip(idx, refs):
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise WorkerError(f"actor {self._name(i)} on {self.slots[i].node} failed to start: "
                                  f"{_cause(e)}") from e
            self.infos[info["actor"]] = info

    def _restart(self, i: int) -> bool:
        import ray

        ray.kill(self.actors[i], no_restart=True)
        if self.gen[i] >= self.max_restarts:
            self.log(f"[batch] actor {self._name(i)} died {self.gen[i] + 1} times; its slot is given up")
            del self.actors[i]
            return False
        self.gen[i] += 1
        self.restarts += 1
        self.log(f"[batch] actor died on {self.slots[i].node}; restarting it as {self._name(i)}")
        self.actors[i] = self._start(i)
        return True

    def run(self, todo: list[dict], deliver: Callable[[dict], None]) -> None:
        """Synthesize every row of ``todo`` (``Utterance.to_dict()`` form); ``deliver(record)`` once per row."""
        import ray

        queue = collections.deque(todo)
        inflight: dict[Any, tuple[dict, int, int]] = {}
        load = collections.Counter()
        deaths = collections.Counter()
        while queue or inflight:
            for i in list(self.actors):
                while queue and load[i] < self.depth:
                    utt = queue.popleft()
                    inflight[self.actors[i].synthesize.remote(utt)] = (utt, i, self.gen[i])
                    load[i] += 1
            if not inflight:
                raise WorkerError(f"every actor is gone ({self.restarts} restart(s)); {len(queue)} row(s) not run")
            [ref], _ = ray.wait(list(inflight), num_returns=1)
            utt, i, gen = inflight.pop(ref)
            load[i] -= 1 if gen == self.gen[i] else 0
            try:
                rec = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                deaths[utt["id"]] += 1
                if deaths[utt["id"]] > self.max_retries:
                    deliver(_failed(utt, f"its actor died {deaths[utt['id']]} times while running it: {_cause(e)}"))
                else:
                    queue.appendleft(utt)
                if gen == self.gen[i] and i in self.actors:
                    load[i] = 0
                    if self._restart(i):
                        self._wait_ready([i])
                continue
            except ray.exceptions.RayTaskError as e:
                rec = _failed(utt, _cause(e))
            deliver(rec)

    def close(self) -> None:
        import ray

        for a in self.actors.values():
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dying actor is killed below anyway
                pass
            ray.kill(a, no_restart=True)
        self.actors.clear()


def _cause(e: BaseException) -> str:
    c = getattr(e, "cause", None)
    return f"{type(c).__name__}: {c}" if isinstance(c, BaseException) else str(e).strip().splitlines()[0][:300]


def _failed(utt: Mapping[str, Any], message: str) -> dict[str, Any]:
    return {"id": utt["id"], "line": utt["line"], "text": utt["text"], "error": message}
