"""``omnilab bench --address``: the sweep's configurations run across a Ray cluster's nodes, gathered into one table.

Contract: ``run_on_cluster(cfg, meta) -> (rows, points, requests, rounds)`` (the shape every mode of
:mod:`omnilab.bench.modes` returns):

- Each configuration is one Ray task reserving ``cfg.threads`` CPUs, so Ray runs at most
  ``floor(node CPUs / threads)`` configurations at once on a node and spreads the rest over the other nodes. No
  node with that many CPUs is an ``InputError`` before anything runs (Ray would wait forever).
- The task runs the configuration as ``--fresh`` does: ``python -m omnilab.bench.run --child`` in its own process
  on that node (vLLM's worker processes spawn from a plain interpreter, never from inside a Ray worker), so a row
  is what that node measures alone, with its own floor probe.
- A random checkpoint (no ``--model``) is written on each node from the same size, variant and seed (the weights
  are the same: ``make_random_checkpoint`` is deterministic) by the first task there (``run.checkpoint_for`` holds
  a file lock); a ``--model`` directory must exist at the same path on every node.
- Every row names its ``node`` (IP and Ray node id) and that machine's CPU (``node_cpu``); ``meta["nodes"]`` lists
  the nodes that ran something. A task that fails (its node died, its process failed) is a note; the others go on.
- The driver connects with :func:`omnilab.batch.cluster.connect` (``local``, ``local:N``, ``auto``, ``HOST:PORT``,
  ``ray://HOST:PORT``) and disconnects at the end.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from omnilab.batch import cluster
from omnilab.errors import InputError
from omnilab.hardware import probe_hardware

if TYPE_CHECKING:
    from omnilab.bench.run import BenchConfig


def run_config(child_cfg: dict) -> dict:
    """One configuration on this node (the body of the Ray task): a fresh bench process, which writes the random
    checkpoint first if this node has none (``run.checkpoint_for``, under a file lock)."""
    import json
    import os
    import platform
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import ray

    node = f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"
    with tempfile.TemporaryDirectory(prefix="omnilab-bench-") as d:
        cfg_path, out_path = Path(d) / "config.json", Path(d) / "result.json"
        cfg_path.write_text(json.dumps(child_cfg))
        rc = subprocess.call([sys.executable, "-m", "omnilab.bench.run", "--child", str(cfg_path), str(out_path)],
                             env={**os.environ})
        part = json.loads(out_path.read_text()) if rc == 0 and out_path.is_file() else None
    return {"node": node, "node_cpu": probe_hardware().model_name or platform.processor(), "rc": rc, "part": part}


def run_on_cluster(cfg: BenchConfig, meta: dict, address: str | None) -> tuple[list, list, list, list]:
    import ray

    from omnilab.bench.modes import log  # lazy: numpy

    owned = cluster.connect(address)
    try:
        cpus = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
        if not any(c >= cfg.threads for c in cpus):
            raise InputError(f"--threads {cfg.threads}: no Ray node has that many CPUs (nodes: {cpus}); each "
                             f"configuration reserves --threads CPUs on one node")
        task = ray.remote(run_config).options(num_cpus=cfg.threads, max_retries=0)
        pending = {}
        for name in cfg.configs:
            child = dataclasses.replace(cfg, configs=(name,), mode="same-process", rounds=1, reference="off",
                                        address=None)  # checkpoint stays as given: None = each node's random one
            pending[task.remote(dataclasses.asdict(child))] = name
        log(f"[bench] {len(pending)} configuration(s) on a Ray cluster of {len(cpus)} node(s) "
            f"(CPUs per node: {cpus}), {cfg.threads} CPU(s) each")
        rows, points, reqs, nodes = [], [], [], {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            name = pending.pop(done[0])
            try:
                got = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - a lost node or a failed task: a note, the others go on
                meta["notes"].append(f"{name}: its Ray task failed: {type(e).__name__}: {str(e)[:300]}")
                log(f"[bench] {name}: failed on the cluster ({type(e).__name__})")
                continue
            if got["part"] is None:
                meta["notes"].append(f"{name}: its process on {got['node']} failed (exit {got['rc']})")
                continue
            part = got["part"]
            rows += [{**r, "node": got["node"], "node_cpu": got["node_cpu"]} for r in part["rows"]]
            points += [{**p, "node": got["node"]} for p in part["summary"]]
            reqs += part["requests"]
            meta["notes"] += part["meta"].get("notes", [])
            nodes.setdefault(got["node"], {"cpu": got["node_cpu"], "configs": []})["configs"].append(name)
            log(f"[bench] {name}: done on {got['node']}")
        meta["nodes"] = nodes
        order = [n for n in cfg.configs if any(r["config"] == n for r in rows)]
        rows.sort(key=lambda r: order.index(r["config"]) if r["config"] in order else len(order))
        return rows, points, reqs, [{"round": 1, "order": list(cfg.configs), "cluster": address or "local"}]
    finally:
        if owned is not None:
            ray.shutdown()
            if owned is not True:
                owned.shutdown()
