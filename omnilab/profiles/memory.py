"""Talker memory for ``plan()``: the KV budget, ``max_num_seqs`` and ``max_model_len`` under two memory caps.

Contract: ``kv_budget(hw, geo, dtype, ov, talker_nodes) -> ({"max_num_seqs", "max_model_len", "kv_cache_bytes"}:
Resolved, cap)``. The caps: the machine's (MemAvailable, capped by the cgroup, minus the weights, three
processes' runtime and a margin) and each talker NUMA node's (the node's available memory as vLLM's CPU
worker reads it, minus that rank's weights, its runtime and a margin): vLLM's worker allocates its weights
and KV cache on its node and refuses a KV budget above the node's free memory. An explicit budget above
either cap raises ``ConfigError`` naming the cap. ``gpu_memory_utilization=f`` (argument or preset/file)
sizes the budget as vLLM's CPU worker does: ``ceil(f x the node's MemTotal)`` minus the worker's resident
memory (estimated: weights + runtime); a ``kv_cache_bytes`` in the same or a higher layer wins. Per-token bytes and
whole-block rounding are ``cost.kv_bytes_per_token`` / ``cost.kv_cache_bytes_for``, the functions the vLLM engine
sizes its cache with (head size padded as vLLM's CPU attention pads it). Auto: one
``max_model_len`` sequence per ``max_num_seqs`` plus vLLM's spare block, rounded up to whole GiB when that
fits (so ``VLLM_CPU_KVCACHE_SPACE`` is exact), or the longest context that fits. Plain Python.
"""
from __future__ import annotations

import math

from omnilab.errors import ConfigError
from omnilab.hardware import GiB, HardwareInfo
from omnilab.profiles.cost import BLOCK_SIZE, ModelGeometry, kv_cache_bytes_for, padded_head_size
from omnilab.profiles.overrides import Overrides
from omnilab.profiles.resolved import Resolved

RUNTIME_BYTES_PER_PROCESS = 3 * GiB // 4   # torch + vLLM import RSS per process (engine core, 2 workers)
NUM_PROCESSES = 3
DEFAULT_MAX_MODEL_LEN = 4096               # vllm-omni talker default


def _set(src: str, extra: str = "") -> str:
    return f"set by {src}" + (f"; {extra}" if extra else "")


def _node_cap(hw: HardwareInfo, weights: int, talker_nodes: list[int]) -> tuple[int | None, str]:
    """The tightest per-rank KV cap over the talker's NUMA nodes (None without per-node meminfo)."""
    tp = max(1, len(talker_nodes))
    best: tuple[int | None, str] = (None, "")
    for n in sorted(set(talker_nodes)):
        _, avail = hw.node_memory(n)
        if avail is None:
            continue
        ranks = talker_nodes.count(n)
        margin = max(GiB // 2, avail // 20)
        share = weights // tp + RUNTIME_BYTES_PER_PROCESS
        cap = (avail - margin) // ranks - share
        if best[0] is None or cap < best[0]:
            per = f" / {ranks} ranks" if ranks > 1 else ""
            best = (cap, f"NUMA node {n} cap {cap / GiB:.2f} GiB = the node's available {avail / GiB:.2f} GiB "
                         f"(vLLM's worker allocates its weights and KV cache on its node) - margin {margin / GiB:.2f} "
                         f"GiB{per} - weights {weights // tp / GiB:.2f} GiB - worker runtime "
                         f"{RUNTIME_BYTES_PER_PROCESS / GiB:.2f} GiB")
    return best


def _fraction_kv(hw: HardwareInfo, frac: float, src: str, weights: int, node: int | None) -> tuple[int, str]:
    """vLLM CPU's ``gpu_memory_utilization``: requested = ceil(frac x node MemTotal); KV = requested - worker RSS."""
    total, avail = hw.node_memory(node) if node is not None else (None, None)
    where = f"NUMA node {node}"
    if total is None:  # vLLM falls back to the machine-wide numbers without per-node meminfo
        total, avail, where = hw.mem_total_bytes, hw.memory_available_bytes, "the machine (no per-node meminfo)"
    requested = math.ceil(total * frac)
    if avail is not None and requested > avail:
        raise ConfigError(f"gpu_memory_utilization={frac:g} ({src}) asks for {requested / GiB:.2f} GiB of {where}'s "
                          f"{total / GiB:.2f} GiB, above its available {avail / GiB:.2f} GiB (vLLM's CPU worker "
                          f"refuses to start so); decrease it")
    rss = weights + RUNTIME_BYTES_PER_PROCESS
    kv = requested - rss
    why = (f"gpu_memory_utilization {frac:g} ({src}), vLLM's CPU meaning: the worker takes ceil({frac:g} x {where} "
           f"MemTotal {total / GiB:.2f} GiB) = {requested / GiB:.2f} GiB and gives the KV cache what its process "
           f"does not use: - est. worker RSS {rss / GiB:.2f} GiB (weights {weights / GiB:.2f} + runtime "
           f"{RUNTIME_BYTES_PER_PROCESS / GiB:.2f}) = {kv / GiB:.2f} GiB")
    if kv <= 0:
        raise ConfigError(f"{why}: nothing is left for the KV cache; raise gpu_memory_utilization")
    return kv, why


def kv_budget(hw: HardwareInfo, geo: ModelGeometry, dtype: str, ov: Overrides, talker_nodes: list[int]):
    nbytes = 2 if dtype == "bfloat16" else 4
    per_tok = geo.kv_bytes_per_token(nbytes)
    avail = hw.memory_available_bytes
    weights = geo.resident_bytes(nbytes)
    runtime = NUM_PROCESSES * RUNTIME_BYTES_PER_PROCESS
    margin = max(GiB // 2, avail // 20)
    cap = avail - weights - runtime - margin
    cg = " capped by the cgroup limit" if hw.cgroup_memory_limit_bytes else ""
    cap_why = (f"memory cap {cap / GiB:.2f} GiB = usable {avail / GiB:.2f} GiB (MemAvailable{cg}) - weights "
               f"{weights / GiB:.2f} GiB - runtime {runtime / GiB:.2f} GiB - margin {margin / GiB:.2f} GiB")
    node_cap, node_why = _node_cap(hw, weights, talker_nodes)
    node_binds = node_cap is not None and node_cap < cap
    limit, limit_why = (node_cap, node_why) if node_binds else (cap, cap_why)
    block = BLOCK_SIZE * per_tok

    def need(seqs: int, length: int) -> int:  # vLLM keeps one block in reserve
        return kv_cache_bytes_for(per_tok, seqs, length, BLOCK_SIZE)

    so, lo = ov.get("max_num_seqs"), ov.get("max_model_len")
    ko, fo = ov.get_ranked("kv_cache_bytes"), ov.get_ranked("gpu_memory_utilization")
    seqs = so[0] if so else 1
    length = lo[0] if lo else min(DEFAULT_MAX_MODEL_LEN, geo.max_position_embeddings)
    if length > geo.max_position_embeddings:
        raise ConfigError(f"max_model_len={length} ({lo[1]}) exceeds the talker's max_position_embeddings "
                          f"{geo.max_position_embeddings}")
    if limit < 2 * block:
        raise ConfigError(f"not enough memory for {geo.name} in {dtype}: {limit_why}")
    seq_why = _set(so[1]) if so else "1 stream at a time (notebook use); pass max_concurrency= for serving"
    len_why = _set(lo[1]) if lo else (f"{length} tokens (vllm-omni talker default): about "
                                      f"{(length - 100) / 12.5 / 60:.1f} min of audio at 12.5 frames/s")
    if fo and (not ko or fo[2] < ko[2]):  # vLLM: an explicit kv_cache_memory_bytes wins over the fraction
        kv, frac_why = _fraction_kv(hw, fo[0], fo[1], weights, talker_nodes[0] if talker_nodes else None)
        ko = (kv, fo[1], fo[2])
    else:
        frac_why = ""
    if ko:
        kv = ko[0]
        for c, why in ((cap, cap_why), (node_cap, node_why)):
            if c is not None and kv > c:
                raise ConfigError(f"kv_cache_bytes {kv / GiB:.2f} GiB ({ko[1]}) is above the {why}")
        if kv < need(1, length):
            raise ConfigError(f"kv_cache_bytes {kv / GiB:.2f} GiB ({ko[1]}) cannot hold one {length}-token sequence "
                              f"(needs {need(1, length) / GiB:.2f} GiB at {per_tok} B/token)")
        holds = f"holds {kv // per_tok} tokens at {per_tok} B/token; {limit_why if frac_why else cap_why}"
        kv_why = f"{frac_why}; {holds}" if frac_why else _set(ko[1], holds)
    else:
        binding = cap_why
        if need(seqs, length) > limit:
            if lo:
                raise ConfigError(f"max_num_seqs {seqs} x max_model_len {length} ({lo[1]}) needs "
                                  f"{need(seqs, length) / GiB:.2f} GiB of KV cache, above the {limit_why}")
            length = ((limit // block - 1) // seqs) * BLOCK_SIZE
            if length < 2 * BLOCK_SIZE:
                raise ConfigError(f"max_num_seqs {seqs} ({so[1] if so else 'auto'}) leaves under 256 tokens of KV "
                                  f"per sequence: {limit_why}")
            len_why = f"{length} tokens: the most that fits the {limit_why} at {per_tok} B/token"
            binding = limit_why
        kv = need(seqs, length)
        whole = -(-kv // GiB) * GiB
        rounded = whole <= limit
        if node_binds and not rounded and whole <= cap:
            binding = node_why  # the node, not the machine, keeps the budget off whole GiB
        hd, padded = geo.talker_head_dim, padded_head_size(geo.talker_head_dim)
        head = f"{hd}" if padded == hd else f"{padded} (head_dim {hd} padded for vLLM's CPU attention)"
        kv_why = (f"{seqs} seq x {length} tokens x {per_tok} B/token ({geo.talker_layers} layers x 2 x "
                  f"{geo.talker_kv_heads} kv heads x {head} x {nbytes} B; {BLOCK_SIZE}-token blocks "
                  f"+ 1 spare) = {kv / GiB:.2f} GiB"
                  + (f", rounded up to {whole // GiB} GiB so VLLM_CPU_KVCACHE_SPACE is exact" if rounded else "")
                  + f"; {binding}")
        kv = whole if rounded else kv
    return ({"max_num_seqs": Resolved(seqs, seq_why, so[1] if so else "auto"),
             "max_model_len": Resolved(length, len_why, lo[1] if lo else "auto"),
             "kv_cache_bytes": Resolved(kv, kv_why, ko[1] if ko else "auto")}, limit)
