"""Hardware probe on committed fixtures (snapshots of /proc, /sys and cgroup files) and on this machine."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from omnilab.hardware import (GiB, cpu_has_native_bf16, format_cpulist, native_bf16, parse_cpulist, probe_hardware,
                              snapshot_hardware)

FIX = Path(__file__).parent / "fixtures" / "hardware"


def files(name: str) -> dict[str, str]:
    return dict(json.loads((FIX / f"{name}.json").read_text())["files"])


# name: arch, sockets, nodes, cores, threads/core, usable CPUs, cpu_limit, native bf16, memory cap GiB, cgroup
EXPECTED = {
    "vm2_avx2": ("x86_64", 1, 1, 2, 1, 2, 2.0, False, 22.0, "v1"),
    "vm2_host": ("x86_64", 1, 1, 2, 1, 2, 2.0, True, None, "v1"),
    "xeon_2s_avx512_smt": ("x86_64", 2, 2, 56, 2, 112, 112.0, False, 360.0, "v2"),
    "spr_amx_snc2": ("x86_64", 1, 2, 48, 2, 96, 96.0, True, 240.0, "v2"),
    "graviton3_64": ("aarch64", 1, 1, 64, 1, 64, 64.0, True, 120.0, "v2"),
    "container_3cpu_8g": ("x86_64", 1, 1, 8, 2, 16, 3.0, False, 8 - 600 / 1024, "v2"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe_fixture_topology(name):
    hw = probe_hardware(FIX / f"{name}.json")
    arch, sockets, nodes, cores, tpc, usable, limit, bf16, mem_gib, cg = EXPECTED[name]
    assert hw.arch == arch
    assert hw.num_sockets == sockets
    assert len(hw.nodes) == nodes
    assert len(hw.usable_cores) == cores
    assert hw.threads_per_core == tpc
    assert len(hw.usable_cpus) == usable
    assert hw.cpu_limit == pytest.approx(limit)
    assert hw.native_bf16()[0] is bf16
    assert hw.cgroup_version == cg
    if mem_gib is not None:
        assert hw.memory_available_bytes / GiB == pytest.approx(mem_gib)
    # every online CPU belongs to exactly one node and one core; SMT siblings share node and socket
    seen = [c for n in hw.nodes for c in n.cpus]
    assert sorted(seen) == list(hw.online_cpus)
    for core in hw.cores:
        assert len({hw.node_of(c) for c in core.cpus}) == 1
    assert sorted(c for core in hw.cores for c in core.cpus) == list(hw.online_cpus)


def test_probe_reads_isa_flags_and_libraries():
    clx = probe_hardware(FIX / "xeon_2s_avx512_smt.json")
    assert {"avx2", "avx512f", "avx512_vnni"} <= set(clx.isa) and "avx512_bf16" not in clx.isa
    assert clx.tcmalloc_path.endswith("libtcmalloc_minimal.so.4") and clx.iomp5_path is None
    spr = probe_hardware(FIX / "spr_amx_snc2.json")
    assert {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(spr.isa)
    assert spr.iomp5_path == "/usr/local/lib/libiomp5.so"
    arm = probe_hardware(FIX / "graviton3_64.json")
    assert arm.is_arm and {"asimd", "sve", "bf16"} <= set(arm.isa)
    assert "0xd40" in arm.model_name
    vm = probe_hardware(FIX / "vm2_avx2.json")
    assert vm.isa == ("avx2",)


def test_numa_node_cpu_lists_follow_linux_numbering():
    hw = probe_hardware(FIX / "xeon_2s_avx512_smt.json")
    assert [format_cpulist(n.cpus) for n in hw.nodes] == ["0-27,56-83", "28-55,84-111"]
    core0 = hw.cores[0]
    assert core0.cpus == (0, 56) and core0.node == 0 and core0.socket == 0
    spr = probe_hardware(FIX / "spr_amx_snc2.json")  # SNC-2: two nodes in one socket
    assert spr.num_sockets == 1 and [n.mem_total_bytes for n in spr.nodes] == [128 * GiB, 128 * GiB]


def test_cgroup_v2_quota_and_memory_limit():
    hw = probe_hardware(FIX / "container_3cpu_8g.json")
    assert hw.cpu_quota == pytest.approx(3.0)
    assert hw.cgroup_memory_limit_bytes == 8 * GiB
    assert hw.memory_available_bytes == 8 * GiB - (600 << 20)  # limit - usage, below MemAvailable (50 GiB)
    assert "3 CPUs" in str(hw)


def test_node_memory_is_what_vllm_sees_per_node():
    """Per-node (total, available) from nodeN/meminfo, clamped by the cgroup limit as vLLM's CPU worker does."""
    x = probe_hardware(FIX / "xeon_2s_avx512_smt.json")
    assert x.node_memory(0) == (192 * GiB, 180 * GiB) and x.node_memory(1) == (192 * GiB, 180 * GiB)
    assert x.node_memory(7) == (None, None)
    c = probe_hardware(FIX / "container_3cpu_8g.json")  # node: 64 GiB total, 50 available; cgroup 8 GiB, 600 MiB used
    assert c.node_memory(0) == (8 * GiB, 8 * GiB - (600 << 20))
    assert "node0: 192.0 GiB total, 180.0 GiB available" in x.summary()["memory per node"]
    bare = probe_hardware({k: v for k, v in files("vm2_avx2").items() if "/node/" not in k})
    assert bare.node_memory(0) == (None, None)


def test_cgroup_v1_nested_limits_take_the_minimum_up_the_tree():
    f = files("vm2_avx2")
    nested = "/sys/fs/cgroup/memory/process_api/4b8a6f8c9172a98d555762267220525c"
    f[f"{nested}/memory.limit_in_bytes"] = str(6 * GiB)
    f["/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes"] = str(4 * GiB)  # parent is tighter
    f[f"{nested}/memory.usage_in_bytes"] = str(GiB)
    f["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "150000"
    hw = probe_hardware(f)
    assert hw.cgroup_version == "v1"
    assert hw.cgroup_memory_limit_bytes == 4 * GiB
    assert hw.memory_available_bytes == 3 * GiB
    assert hw.cpu_quota == pytest.approx(1.5) and hw.cpu_limit == pytest.approx(1.5)


def test_cgroup_v2_nested_path_without_namespace():
    f = files("container_3cpu_8g")
    f["/proc/self/cgroup"] = "0::/system.slice/docker-abc.scope\n"
    f["/sys/fs/cgroup/system.slice/docker-abc.scope/cpu.max"] = "200000 100000\n"
    f["/sys/fs/cgroup/system.slice/docker-abc.scope/memory.max"] = "max\n"
    f["/sys/fs/cgroup/system.slice/docker-abc.scope/memory.current"] = str(GiB)
    hw = probe_hardware(f)
    assert hw.cpu_quota == pytest.approx(2.0)  # min(2 at the leaf, 3 at the root)
    assert hw.cgroup_memory_limit_bytes == 8 * GiB and hw.memory_available_bytes == 7 * GiB


def test_affinity_mask_limits_usable_cpus():
    f = files("xeon_2s_avx512_smt")
    f["/proc/self/status"] = "Cpus_allowed_list:\t0-3,56-59\n"
    hw = probe_hardware(f)
    assert hw.usable_cpus == (0, 1, 2, 3, 56, 57, 58, 59)
    assert [c.cpus for c in hw.usable_cores] == [(0, 56), (1, 57), (2, 58), (3, 59)]


def test_missing_numa_directory_means_one_node():
    f = {k: v for k, v in files("vm2_avx2").items() if "/node/" not in k}
    hw = probe_hardware(f)
    assert len(hw.nodes) == 1 and hw.nodes[0].cpus == (0, 1)
    assert any("NUMA" in n for n in hw.notes)


def test_cpulist_syntax():
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("5\n") == (5,)
    assert format_cpulist([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert parse_cpulist(format_cpulist(range(0, 64, 2))) == tuple(range(0, 64, 2))
    for bad in ("a", "3-1", "1-x"):
        with pytest.raises(ValueError, match=bad):
            parse_cpulist(bad)


def test_bf16_rules():
    assert native_bf16({"avx2", "avx512f"}, "x86_64")[0] is False
    assert native_bf16({"avx512_bf16"}, "x86_64")[0] is True
    assert native_bf16({"amx_bf16", "amx_tile"}, "x86_64")[0] is True
    assert native_bf16({"asimd", "bf16"}, "aarch64")[0] is True
    assert native_bf16({"asimd", "sve"}, "aarch64")[0] is False
    ok, reason = cpu_has_native_bf16()  # signature the model loader relies on
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    assert ok == probe_hardware().native_bf16()[0]


def test_probe_this_machine_and_snapshot_replay():
    hw = probe_hardware()
    assert set(hw.usable_cpus) == set(os.sched_getaffinity(0)) & set(hw.online_cpus)
    assert 0 < hw.memory_available_bytes <= hw.mem_total_bytes
    assert len(hw.usable_cores) >= 1 and hw.nodes
    replay = probe_hardware(snapshot_hardware())
    for attr in ("arch", "flags", "online_cpus", "affinity_cpus", "cores", "cgroup_version", "cpu_quota",
                 "iomp5_path", "tcmalloc_path"):
        assert getattr(replay, attr) == getattr(hw, attr), attr
    assert [n.cpus for n in replay.nodes] == [n.cpus for n in hw.nodes]


def test_display():
    hw = probe_hardware(FIX / "container_3cpu_8g.json")
    r = repr(hw)
    assert "16/16 CPUs usable (cgroup quota 3)" in r and len(r) < 200
    html = hw._repr_html_()
    assert html.startswith("<table>") and "NUMA nodes" in html and "AMD EPYC" in html
    assert json.loads(json.dumps(hw.to_dict()))["cpu_limit"] == 3.0
