"""How many actors a Ray node gets, the CPUs each reserves, and when an actor is pinned (no Ray needed)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnilab.batch.cluster import size_node
from omnilab.batch.worker import numa_pools
from omnilab.errors import InputError

TWO_SOCKETS = [(0, tuple(range(0, 32))), (1, tuple(range(32, 64)))]


def test_a_two_socket_node_gets_one_pinned_actor_per_numa_node():
    got = size_node(64, TWO_SOCKETS)
    assert [(n, cpus) for n, cpus, _ in got] == [(32, tuple(range(0, 32))), (32, tuple(range(32, 64)))]
    assert "NUMA node 1: 32 physical core(s)" in got[1][2] and "pinned" in got[1][2]


def test_a_ray_node_with_fewer_cpus_than_its_machine_is_capped_and_not_pinned():
    # two Ray nodes of 1 CPU on a 2-core machine (the test cluster): one 1-CPU actor each, no pinning
    [(n, cpus, why)] = size_node(1, [(0, (0, 1))])
    assert (n, cpus) == (1, ()) and "not pinned" in why
    # ray start --num-cpus=40 on the two-socket machine: two actors of 20 CPUs, not pinned
    assert [(n, c) for n, c, _ in size_node(40, TWO_SOCKETS)] == [(20, ()), (20, ())]


def test_threads_and_actors_per_node_override_and_are_checked():
    assert [n for n, _, _ in size_node(64, TWO_SOCKETS, actors_per_node=4)] == [16, 16, 16, 16]
    assert [n for n, _, _ in size_node(8, [(0, tuple(range(8)))], actors_per_node=4, threads=2)] == [2, 2, 2, 2]
    assert [n for n, _, _ in size_node(3, [(0, (0, 1, 2))], actors_per_node=4, threads=2)] == [2]  # fits one
    with pytest.raises(InputError, match=r"threads=4 per actor, but Ray node h has 2 CPU\(s\).*accepted: 1-2"):
        size_node(2, [(0, (0, 1))], threads=4, where="h")


def _sys_topology(cpu: int) -> tuple[int, int, int]:
    """(NUMA node, package, core id) of logical CPU ``cpu``, read from sysfs (independently of omnilab.hardware)."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}")
    nodes = [int(d.name[4:]) for d in base.glob("node[0-9]*")]
    top = base / "topology"
    return (nodes[0] if nodes else 0, int((top / "physical_package_id").read_text()), int((top / "core_id").read_text()))


@pytest.mark.skipif(not Path("/sys/devices/system/cpu/cpu0/topology/core_id").exists(), reason="no sysfs CPU topology")
def test_this_machine_reports_its_numa_pools():
    """One pool per NUMA node of this process's CPUs, one CPU per physical core (its first logical CPU), as sysfs
    describes the machine."""
    want: dict[int, dict[tuple[int, int], int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        node, pkg, core = _sys_topology(cpu)
        want.setdefault(node, {}).setdefault((pkg, core), cpu)  # first logical CPU of each core
    assert numa_pools() == sorted((n, tuple(sorted(cores.values()))) for n, cores in want.items())
