"""Reserved CPUs and the core pools the planner places the stages on (plain Python).

Contract: ``reserve(hw, ov)`` keeps one physical core free for the notebook kernel / vLLM front-end when the compute
budget is at least :data:`RESERVE_FROM_CORES` CPUs (vLLM's recommendation), honours ``reserved_cpus`` /
``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides, and returns the usable cores per NUMA node that are left.
"""
from __future__ import annotations

import math

from omnilab.errors import ConfigError
from omnilab.hardware import HardwareInfo, format_cpulist
from omnilab.profiles.overrides import NOBIND, Overrides, vllm_reserved_cores
from omnilab.profiles.profile import Resolved

RESERVE_FROM_CORES = 8                     # reserve a front-end core only when the compute budget is >= this


def reserve(hw: HardwareInfo, ov: Overrides):
    """``(reserved, pools, budget)``: the reserved CPUs (a ``Resolved`` with its reason), the usable physical cores
    left per NUMA node (first SMT thread of each), and the compute budget in CPUs (cgroup quota included)."""
    cores = hw.usable_cores
    if not cores:
        raise ConfigError(f"no usable CPU: affinity mask {format_cpulist(hw.affinity_cpus)!r} holds no online CPU")
    quota_note = f" (cgroup quota {hw.cpu_quota:g} CPUs)" if hw.cpu_quota and hw.cpu_quota < len(cores) else ""
    budget = max(1, min(math.floor(hw.cpu_limit), len(cores)))
    o, bind = ov.get("reserved_cpus"), ov.get("talker_cpus")
    if o and isinstance(o[0], int):
        tpo = ov.get("talker_tp_size")
        reserved = vllm_reserved_cores(hw, o[0], o[1], bind, tpo[0] if tpo else 1)
    elif o:
        if bind and bind[0] == NOBIND and o[0]:
            raise ConfigError(f"reserved_cpus {format_cpulist(o[0])!r} ({o[1]}) cannot be kept free: talker_cpus "
                              f"'nobind' ({bind[1]}) leaves the talker's threads unpinned on every usable CPU; "
                              f"bind CPU lists instead or drop the reservation")
        reserved = Resolved(o[0], f"set by {o[1]}; kept free for the notebook kernel / front-end", o[1])
    elif bind and bind[0] == NOBIND:
        reserved = Resolved((), f"none: talker_cpus 'nobind' ({bind[1]}) lets the talker's threads run on every "
                            f"usable CPU, so none can be kept free")
    elif budget >= RESERVE_FROM_CORES:
        first = cores[0]
        reserved = Resolved(first.cpus, f"1 physical core (CPU {format_cpulist(first.cpus)}) kept for the notebook "
                            f"kernel / vLLM front-end, as vLLM recommends; {budget} cores of compute{quota_note}")
    else:
        reserved = Resolved((), f"none: {budget} CPU(s) of compute{quota_note} < {RESERVE_FROM_CORES}; the front-end "
                            f"needs ~0.1 ms per step, a reserved core would cost {1 / budget:.0%} of the compute")
    taken = set(reserved.value)
    pools: dict[int, list[int]] = {}
    for c in cores:
        if not taken & set(c.cpus):
            pools.setdefault(c.node, []).append(c.cpus[0])
    if not pools:
        raise ConfigError(f"no CPU left for the stages after reserving {format_cpulist(taken)} "
                          f"(usable: {format_cpulist(hw.usable_cpus)})")
    budget = min(budget, sum(map(len, pools.values())))
    return reserved, pools, budget
