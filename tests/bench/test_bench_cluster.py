"""``omnilab bench --address``: the configurations spread over a two-node Ray cluster on this machine (1 CPU per
node), one table gathered, each row naming the node it ran on (omnilab/bench/cluster.py)."""
from __future__ import annotations

import json

import pytest

from _deps import need  # noqa: E402

from omnilab.bench.run import BenchConfig, bench_main, run_bench

ray = need("ray")


def test_address_refuses_interleave():
    with pytest.raises(ValueError, match="--address runs each configuration in its own process"):
        BenchConfig(configs=("eager",), mode="interleave", rounds=2, address="local")


@pytest.mark.slow
def test_sweep_points_run_on_both_nodes_and_gather_one_table(tmp_path, capsys):
    rc = bench_main(["--size", "tiny", "--configs", "eager,vllm", "--frames", "6", "--concurrency", "1",
                     "--threads", "1", "--no-floor", "--reference", "off", "--address", "local:2",
                     "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert [c.strip() for c in lines[0].split(" | ")[:2]] == ["config", "node"]  # the table names each row's node
    path = lines[-1].removeprefix("results: ")
    data = json.loads(open(path).read())
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "vllm"}
    for r in rows.values():
        assert r["step_ms"] > 0 and r["rtf"] > 0 and r["node"] and r["node_cpu"]
    # two tasks of 1 CPU on two nodes of 1 CPU: Ray runs them side by side, one per node
    assert rows["eager"]["node"] != rows["vllm"]["node"]
    assert set(data["meta"]["nodes"]) == {rows["eager"]["node"], rows["vllm"]["node"]}


@pytest.mark.slow
def test_more_threads_than_any_node_has_is_refused_before_running():
    from omnilab.errors import InputError

    with pytest.raises(InputError, match="no Ray node has that many CPUs"):
        run_bench(BenchConfig(configs=("eager",), frames=2, concurrency=(1,), threads=2, floor=False,
                              reference="off", address="local:2"))
