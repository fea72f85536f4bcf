"""``plan(hardware, model_config)`` -> ``DeployProfile``: every knob sized for one machine, with reasons.

Contract: pure function of (``HardwareInfo``, model geometry, optional measured ``StageTimes``, override
layers, see ``overrides.py``). Order: dtype -> quantization -> cost model -> reserved CPUs -> stage placement (mode, TP,
threads, CPU lists) -> KV budget (``memory.py``) -> chunking -> preload. Placement enumerates candidates
(shared cores; split within a node; split across nodes), scores them with the cost model and keeps the
fastest steady state, preferring an earlier first audio and then fewer CPUs among those within 3 %. Every
CPU list stays inside one NUMA node and holds one CPU per physical core (the first SMT thread), except an
unpinned talker (``VLLM_CPU_OMP_THREADS_BIND=nobind``/``all``: every usable CPU, shared with code2wav).
``VLLM_CPU_NUM_OF_RESERVED_CPU`` reserves cores the way vLLM's auto binding does. Fixed values the machine
cannot honour raise ``ConfigError`` naming the value.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omnilab.config import Qwen3TTSConfig, SpeechTokenizerConfig
from omnilab.errors import ConfigError
from omnilab.hardware import GiB, HardwareInfo, format_cpulist, probe_hardware
from omnilab.profiles.cost import (CODE2WAV_MAX_THREADS, FRAME_MS, SHARED_PENALTY, CostModel, ModelGeometry, StageTimes,
                                   bandwidth_from_times, code2wav_dtype_for, doubling_ramp, estimate)
from omnilab.profiles.memory import kv_budget
from omnilab.profiles.overrides import NOBIND, Overrides
from omnilab.profiles.quantization import quantization_field
from omnilab.profiles.profile import DeployProfile, Resolved
import omnilab.profiles.tensor_parallel as tp_estimate
from omnilab.profiles.pools import reserve
from omnilab.profiles.timing import dtype_from_times

EASY_SHARE = 0.5  # a shared layout this far under real time is kept (one process) even where a split is faster
# a split with no CPU free for vLLM's engine core and the client; measured x1.37-1.47 (docs/profiles.md, placement)
FRONT_END_PENALTY = 1.35
NEAR_BEST = 1.03
FIRST_CHOICES, STEADY_CHOICES = (1, 2, 3, 4, 6, 8, 12), (8, 12, 16, 25, 32, 50)


@dataclass(frozen=True)
class _Cand:
    mode: str
    ranks: tuple[tuple[int, ...], ...]
    code2wav: tuple[int, ...]
    talker_ms: float
    code2wav_ms: float
    frame_ms: float
    ttfa_ms: float
    where: str           # talker node(s)
    c2w_where: str       # code2wav node
    threads: int = 0     # talker threads per rank (0: one per listed CPU)
    front_end: float = 1.0  # FRONT_END_PENALTY where a split leaves no CPU for vLLM's engine core and the client

    @property
    def front_end_note(self) -> str:
        fe = self.front_end
        return f" (x {fe:g}: no CPU left for vLLM's engine core and the client)" if fe != 1 else ""

    @property
    def num_cpus(self) -> int:
        return len({c for r in self.ranks for c in r} | set(self.code2wav))

    def describe(self) -> str:
        t = " | ".join(format_cpulist(r) for r in self.ranks)
        return (f"{self.mode} talker {len(self.ranks[0])} thr [{t}] + code2wav {len(self.code2wav)} thr "
                f"[{format_cpulist(self.code2wav)}]: {self.frame_ms:.0f} ms/frame{self.front_end_note}")


def as_geometry(model_config: Any, speech_config: Any = None, where: Any = None) -> ModelGeometry:
    """``Qwen3TTSConfig`` (already parsed; with its ``SpeechTokenizerConfig`` for the decoder geometry and
    ``where`` it was read from, for the name) | ``ModelGeometry`` | checkpoint dir or config.json path (parsed
    here) | None (released 0.6B)."""
    if model_config is None:
        return ModelGeometry.released("0b6")
    if isinstance(model_config, ModelGeometry):
        return model_config
    if isinstance(model_config, Qwen3TTSConfig):
        cfg = model_config
        decoder = speech_config.decoder if speech_config is not None else None
        name = f"{cfg.tts_model_type} {cfg.tts_model_size} ({where})" if where is not None else ""
        return ModelGeometry.from_config(cfg, decoder, name=name)
    path = Path(model_config)
    cfg_path = path / "config.json" if path.is_dir() else path
    st = cfg_path.parent / "speech_tokenizer" / "config.json"
    return as_geometry(Qwen3TTSConfig.load(cfg_path), SpeechTokenizerConfig.load(st) if st.exists() else None,
                       cfg_path.parent)


def plan(hardware: HardwareInfo | None = None, model_config: Any = None, *, max_concurrency: int | None = None,
         max_model_len: int | None = None, stage_times: StageTimes | None = None,
         overrides: Mapping[str, Any] | None = None, defaults: Mapping[str, Any] | None = None,
         defaults_source: str = "preset", env: Mapping[str, str] | None = None, name: str = "auto",
         path_times: Any = None) -> DeployProfile:
    """Size both stages for ``hardware`` (probed if None) and ``model_config`` (see ``as_geometry``).

    Args:
        max_concurrency: concurrent requests (``max_num_seqs``); default 1.
        max_model_len: talker context in tokens; default 4096 (about 5 min of audio at 12.5 tokens/s).
        stage_times: measured per-frame times; otherwise they are estimated from bytes and FLOPs per frame.
        overrides: field -> value (see ``omnilab.profiles.overrides.FIELDS``), source "argument".
        defaults: preset or file values, below arguments; ``defaults_source`` labels them.
        env: environment (default ``os.environ``); ``OMNILAB_*`` variables win over everything, vLLM's CPU
            variables (``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``,
            ``VLLM_CPU_NUM_OF_RESERVED_CPU``) over arguments (see ``omnilab.profiles.overrides``).
        path_times: a :class:`~omnilab.profiles.timing.PathTimes` measured on this machine
            (``omnilab.tuning.timing.path_times``): an automatic dtype follows it; None: the ISA rule.
    """
    hw = hardware or probe_hardware()
    geo = as_geometry(model_config)
    args = dict(overrides or {})
    args.setdefault("max_num_seqs", max_concurrency)
    args.setdefault("max_model_len", max_model_len)
    ov = Overrides(os.environ if env is None else env, args, defaults, defaults_source)
    dtype, quant = _dtype(hw, ov, path_times), quantization_field(geo, ov)
    cost = CostModel.build(geo, hw, dtype.value, stage_times, quant.value, bandwidth_from_times(path_times),
                           code2wav_dtype_for(hw, dtype.value if dtype.source != "auto" else "", env,
                                              (getattr(path_times, "extra", None) or {}).get("code2wav")))
    reserved, pools, budget = reserve(hw, ov)
    placed = _place(hw, cost, ov, reserved.value, pools, budget)
    tp, nt = placed["talker_tp_size"].value, placed["talker_threads"].value
    nodes = [hw.node_of(r[0]) for r in placed["talker_cpus"].value]
    scale = tp_estimate.talker_ms(cost, nt, tp, len(set(nodes)) == tp) / cost.talker_ms(nt)
    cost_tp = dataclasses.replace(cost, talker_ms_1=cost.talker_ms_1 * scale) if tp > 1 else cost
    fe = front_end_penalty(placed["mode"].value, sum(map(len, placed["talker_cpus"].value)) +
                           len(placed["code2wav_cpus"].value), budget, reserved.value)
    if fe != 1:  # the stream estimate of a split without a free CPU carries the same factor as its score
        cost_tp = dataclasses.replace(cost_tp, talker_ms_1=cost_tp.talker_ms_1 * fe, fixed_ms=cost_tp.fixed_ms * fe,
                                      ms_per_gflop_1=cost_tp.ms_per_gflop_1 * fe)
    mem, cap = kv_budget(hw, geo, dtype.value, ov, nodes)
    chunks, est = _chunking(cost_tp, geo, ov, placed)
    pinned = (ov.get("talker_cpus") or (None,))[0] != NOBIND
    profile = DeployProfile(name=name, reserved_cpus=reserved, dtype=dtype, quantization=quant,
                            preload=_preload(hw, ov), **placed,
                            **mem, **chunks, estimate=est, memory_cap_bytes=cap, hardware=_hw_line(hw),
                            talker_pinned=pinned)
    return dataclasses.replace(profile, warnings=tuple(profile.check(hw)))


def _hw_line(hw: HardwareInfo) -> str:
    return (f"{hw.model_name or hw.arch} ({hw.source}): {len(hw.usable_cpus)} usable CPUs on "
            f"{len(hw.usable_cores)} cores, {len(hw.nodes)} NUMA node(s), {'/'.join(hw.isa[-1:]) or 'no SIMD'}, "
            f"{hw.memory_available_bytes / GiB:.1f} GiB usable")


def _set(src: str, extra: str = "") -> str:
    return f"set by {src}" + (f"; {extra}" if extra else "")


# ---------------------------------------------------------------- dtype
def _dtype(hw: HardwareInfo, ov: Overrides, times: Any = None) -> Resolved[str]:
    native, why = hw.native_bf16()
    o = ov.get("dtype")
    if o:
        note = "" if o[0] == "float32" or native else f"warning: {why}"
        return Resolved(o[0], _set(o[1], note), o[1])
    value, reason = dtype_from_times(native, why, times)
    return Resolved(value, reason, "auto")


# ---------------------------------------------------------------- placement
def front_end_penalty(mode: str, stage_cpus: int, budget: int, reserved) -> float:
    """:data:`FRONT_END_PENALTY` for a split whose stages take all ``budget`` compute CPUs with none reserved (vLLM's
    engine core and the client then run on the stages' cores), else 1."""
    return FRONT_END_PENALTY if mode == "split" and not reserved and stage_cpus >= budget else 1.0


def _score(cost: CostModel, mode: str, ranks, c2w, where: str, c2w_where: str = "", threads: int = 0,
           own_nodes: bool = True, front_end: float = 1.0) -> _Cand:
    tp, nt, nc = len(ranks), threads or len(ranks[0]), len(c2w)
    t = tp_estimate.talker_ms(cost, nt, tp, own_nodes)  # profiles/tensor_parallel.py: what the ranks split
    # shared: a shared plan runs in one process by default (deploy=None), where the stages take turns (lock-step)
    # and code2wav uses the talker's nt threads (deployment.fit_in_process); its worker-process layout (nc threads
    # on the talker's last CPUs) is stated in the reason
    c = cost.code2wav_ms_per_frame(nc if mode == "split" else nt)
    frame = max(t, c) * front_end if mode == "split" else (t + c) * SHARED_PENALTY
    return _Cand(mode, tuple(map(tuple, ranks)), tuple(c2w), t, c, frame, t + cost.chunk_ms(1, nc), where,
                 c2w_where or where, nt, front_end)


def _candidates(cost, pools, budget, fixed, reserved) -> list[_Cand]:
    mode_f, tp, nt_f, nc_f, ranks_f, c2w_f = (fixed.get(k) for k in ("mode", "talker_tp_size", "talker_threads",
                                                                      "code2wav_threads", "talker_cpus",
                                                                      "code2wav_cpus"))
    tp = len(ranks_f) if ranks_f else tp or 1
    nodes = sorted(pools, key=lambda n: (-len(pools[n]), n))
    node_of = {c: n for n, cs in pools.items() for c in cs}
    talkers = []  # (ranks, node ids)
    if ranks_f:
        talkers.append((ranks_f, None))
    elif tp > len(nodes):  # an explicit request for more ranks than nodes: ranks share a node (testing, study)
        talkers += [(r, sorted({node_of[c] for x in r for c in x})) for r in
                    tp_estimate.single_node_ranks(pools, tp, nt_f) if sum(map(len, r)) <= budget]
    else:
        for i in range(len(nodes) - tp + 1):  # tp > 1: one rank per node, on the largest nodes
            group = nodes[i:i + tp]
            most = min(len(pools[n]) for n in group)
            for nt in ([nt_f] if nt_f else range(1, min(most, budget) + 1)):
                if nt <= most and nt * tp <= budget:
                    talkers.append((tuple(tuple(pools[n][:nt]) for n in group), group))
    out = []
    for ranks, group in talkers:
        used = {c for r in ranks for c in r}
        where = f"NUMA node {', '.join(map(str, group))}" if group else "the given talker CPUs"
        own = len({node_of.get(r[0], -1 - i) for i, r in enumerate(ranks)}) == tp
        if mode_f in (None, "shared"):
            for nc in ([nc_f] if nc_f else [1]):
                c2w = c2w_f or ranks[-1][-nc:]  # a tensor-parallel talker's code2wav shares its last rank's CPUs
                if len(ranks[-1]) >= nc and set(c2w) <= used:
                    out.append(_score(cost, "shared", ranks, c2w, where, own_nodes=own))
        if mode_f in (None, "split"):
            if c2w_f:  # explicit lists are the caller's choice; check() warns about the quota
                if not used & set(c2w_f):
                    fe = front_end_penalty("split", len(used | set(c2w_f)), budget, reserved)
                    out.append(_score(cost, "split", ranks, c2w_f, where, own_nodes=own, front_end=fe))
                continue
            for n in nodes:
                free = [c for c in pools[n] if c not in used]
                same = bool(group) and n in group
                for nc in ([nc_f] if nc_f else range(1, min(len(free), CODE2WAV_MAX_THREADS // 2) + 1)):
                    if 1 <= nc <= len(free) and len(used) + nc <= budget:
                        c2w = free[-nc:] if same else free[:nc]
                        fe = front_end_penalty("split", len(used) + nc, budget, reserved)
                        out.append(_score(cost, "split", ranks, c2w, where, f"NUMA node {n}", own_nodes=own,
                                          front_end=fe))
    return out


def _place(hw: HardwareInfo, cost: CostModel, ov: Overrides, reserved, pools, budget) -> dict[str, Resolved]:
    got = {k: ov.get(k) for k in ("mode", "talker_tp_size", "talker_threads", "talker_cpus", "code2wav_threads",
                                  "code2wav_cpus")}
    bind = got["talker_cpus"] if got["talker_cpus"] and isinstance(got["talker_cpus"][0], str) else None
    if bind and bind[0] == NOBIND:
        return _unpinned(hw, cost, got, reserved, budget)
    if bind:  # auto: nothing fixed, the planner places the talker (its source is shown)
        got["talker_cpus"] = None
    ranks_f = got["talker_cpus"][0] if got["talker_cpus"] else None
    if ranks_f and got["talker_tp_size"] and got["talker_tp_size"][0] != len(ranks_f):
        raise ConfigError(f"talker_tp_size={got['talker_tp_size'][0]} ({got['talker_tp_size'][1]}) but talker_cpus "
                          f"{'|'.join(map(format_cpulist, ranks_f))!r} ({got['talker_cpus'][1]}) has {len(ranks_f)} rank(s)")
    for k, lst in (("talker_threads", ranks_f and ranks_f[0]), ("code2wav_threads", got["code2wav_cpus"] and
                                                                got["code2wav_cpus"][0])):
        if got[k] and lst and got[k][0] != len(lst):
            raise ConfigError(f"{k}={got[k][0]} ({got[k][1]}) but the matching CPU list {format_cpulist(lst)!r} "
                              f"has {len(lst)} CPUs (one thread per listed CPU)")
    fixed = {k: got[k] and got[k][0] for k in got}  # field -> the value an override fixes, or None
    cands = _candidates(cost, pools, budget, fixed, reserved)
    tp_note = ""
    if cands and not fixed["talker_tp_size"] and not fixed["talker_cpus"] and len(pools) > 1:
        multi = _candidates(cost, pools, budget, {**fixed, "talker_tp_size": len(pools)}, reserved)  # rank per node
        cands, tp_note = tp_estimate.propose(cands, multi, len(pools))
    if not cands:
        given = ", ".join(f"{k}={v!r} ({got[k][1]})" for k, v in fixed.items() if v)
        raise ConfigError(f"no CPU placement satisfies {given or 'the defaults'}: usable physical cores per NUMA node "
                          f"{ {n: format_cpulist(p) for n, p in pools.items()} } after reserving "
                          f"{format_cpulist(reserved) or 'none'}, compute budget {budget} CPUs")
    best = min(c.frame_ms for c in cands)
    near = [c for c in cands if c.frame_ms <= best * NEAR_BEST]
    ttfa0 = min(c.ttfa_ms for c in near)
    # among layouts within 3 % of the fastest: split first (no time-slicing), then earlier audio, then fewer CPUs
    pick = min(near, key=lambda c: (c.mode != "split", round(c.ttfa_ms / max(ttfa0 * 0.05, 1e-9)), c.num_cpus))
    shared = [c for c in cands if c.mode == "shared"]
    easy = min(shared, key=lambda c: c.frame_ms) if shared and not fixed["mode"] else None
    note = ""
    if easy is not None and easy.frame_ms <= EASY_SHARE * FRAME_MS:  # far under real time: the fastest shared one
        if pick.mode == "split":
            note = (f"; both layouts run far under real time (shared est. {easy.frame_ms:.0f} ms per {FRAME_MS:.0f} "
                    f"ms frame, under {EASY_SHARE:.0%}), so one process: no second process to start or feed")
        pick = easy
    others = [c for c in cands if c.mode != pick.mode]
    alt = min(others, key=lambda c: c.frame_ms) if others else None
    out = _explain(pick, alt, got, cost, pools, hw)
    if note:
        out["mode"] = dataclasses.replace(out["mode"], reason=out["mode"].reason + note)
    if tp_note and len(pick.ranks) == 1:
        r = out["talker_tp_size"]
        out["talker_tp_size"] = dataclasses.replace(r, reason=r.reason + tp_note)
    if len(pick.ranks) > 1:  # the expected gain (or, ranks sharing a node, the warning that there is none)
        own = len({hw.node_of(r[0]) for r in pick.ranks}) == len(pick.ranks)
        r = out["talker_tp_size"]
        out["talker_tp_size"] = dataclasses.replace(r, reason=f"{r.reason}; " + tp_estimate.gain_note(
            cost, len(pick.ranks[0]), len(pick.ranks), own))
    if bind:
        r = out["talker_cpus"]
        out["talker_cpus"] = Resolved(r.value, f"auto ({bind[1]}): placed by the planner with vLLM's auto-binding "
                                      f"rules (rank i on its own NUMA node, one CPU per physical core); {r.reason}",
                                      bind[1])
    return out


def _unpinned(hw: HardwareInfo, cost: CostModel, got, reserved, budget) -> dict[str, Resolved]:
    """``VLLM_CPU_OMP_THREADS_BIND=nobind`` (or ``all``): vLLM leaves the talker's OpenMP threads unpinned, so
    its CPU list is every usable CPU, the threads one per usable physical core unless fixed, and code2wav
    (always pinned) shares them."""
    src = got["talker_cpus"][1]
    for key, bad in (("talker_tp_size", lambda v: v > 1), ("mode", lambda v: v == "split")):
        if got[key] and bad(got[key][0]):
            raise ConfigError(f"{key}={got[key][0]!r} ({got[key][1]}) needs pinned talker CPU lists, but talker_cpus "
                              f"is 'nobind' ({src}): one unpinned CPU set for one rank, shared with code2wav")
    cpus = tuple(c for c in hw.usable_cpus if c not in reserved)
    cores = [c.cpus[0] for c in hw.usable_cores if not set(c.cpus) & set(reserved)]
    nt = got["talker_threads"][0] if got["talker_threads"] else min(len(cores), budget)
    nc = got["code2wav_threads"][0] if got["code2wav_threads"] else 1
    c2w = got["code2wav_cpus"][0] if got["code2wav_cpus"] else tuple(cores[-nc:])
    if nt > len(cpus) or not set(c2w) <= set(cpus) or len(c2w) != nc:
        raise ConfigError(f"no placement with an unpinned talker ('nobind', {src}) on CPUs {format_cpulist(cpus)}: "
                          f"talker_threads {nt}, code2wav CPUs {format_cpulist(c2w)!r} ({nc} thread(s))")
    pick = _score(cost, "shared", (cpus,), c2w, "every usable CPU (unpinned)", threads=nt)
    nodes = sorted({hw.node_of(c) for c in cpus})

    def res(key: str, value, auto_reason: str) -> Resolved:
        return Resolved(value, _set(got[key][1]), got[key][1]) if got[key] else Resolved(value, auto_reason)

    return {
        "mode": res("mode", "shared", f"shared: the talker's threads are unpinned ('nobind', {src}), so code2wav's "
                    f"CPUs are talker CPUs too; est. {pick.frame_ms:.0f} ms/frame at 25-frame chunks"),
        "talker_tp_size": res("talker_tp_size", 1, "1: an unpinned talker is one rank"),
        "talker_threads": res("talker_threads", nt, f"{nt}: one per usable physical core, est. {pick.talker_ms:.0f} "
                              f"ms/frame ({cost.source}); vLLM sets no OMP_NUM_THREADS under nobind, so the worker "
                              f"is started with this one"),
        "talker_cpus": Resolved((cpus,), f"nobind ({src}): vLLM does not pin the talker's OpenMP threads; they may "
                                f"run on any of these {len(cpus)} usable CPUs (NUMA node(s) "
                                f"{', '.join(map(str, nodes))}), SMT siblings included", src),
        "code2wav_threads": res("code2wav_threads", nc, f"{nc} thread(s), est. {pick.code2wav_ms:.0f} ms/frame at "
                                f"25-frame chunks"),
        "code2wav_cpus": res("code2wav_cpus", c2w, "the last usable physical core(s), pinned (code2wav's worker "
                             "always pins its threads)"),
    }


def _explain(pick: _Cand, alt: _Cand | None, got, cost: CostModel, pools, hw: HardwareInfo) -> dict[str, Resolved]:
    def res(key: str, value, auto_reason: str) -> Resolved:
        return Resolved(value, _set(got[key][1]), got[key][1]) if got[key] else Resolved(value, auto_reason)

    nt, nc, tp = len(pick.ranks[0]), len(pick.code2wav), len(pick.ranks)
    vs = f"; best {alt.mode} layout: {alt.describe()}" if alt else ""
    smt = ", SMT siblings left idle" if hw.threads_per_core > 1 else ""
    if pick.mode == "shared":
        workers = (pick.talker_ms + cost.code2wav_ms_per_frame(nc)) * SHARED_PENALTY
        why = (f"est. {pick.frame_ms:.0f} ms/frame at 25-frame chunks in one process (the default placement of a "
               f"shared plan), where the stages take turns on the talker's {nt} thread(s); as worker processes the "
               f"talker keeps every core and code2wav runs {nc} thread on talker CPU {pick.code2wav[-1]} (one thread "
               f"has no OpenMP barrier, so time-slicing cannot gang-stall it): est. {workers:.0f} ms/frame")
    else:
        why = (f"est. {pick.frame_ms:.0f} ms/frame at 25-frame chunks = max(talker {pick.talker_ms:.0f}, code2wav "
               f"{pick.code2wav_ms:.0f}){pick.front_end_note}: the stages run concurrently on disjoint cores")
    node_sizes = ", ".join(f"node {n}: {len(p)}" for n, p in sorted(pools.items()))
    return {
        "mode": res("mode", pick.mode, f"{pick.mode}: {why}{vs}"),
        "talker_tp_size": res("talker_tp_size", tp, f"{tp}: " + ("one rank" if tp == 1 else "one rank per NUMA node")
                              + " (OMNILAB_TALKER_TP=N runs N ranks, one per node where there are N)"),
        "talker_threads": res("talker_threads", nt, f"{nt} thread(s), est. {pick.talker_ms:.0f} ms/frame "
                              f"({cost.source}); usable physical cores per node: {node_sizes}; more threads gain "
                              f"< {NEAR_BEST - 1:.0%} or take cores code2wav needs"),
        "talker_cpus": res("talker_cpus", pick.ranks, f"{pick.where}" + (", one rank per node" if tp > 1 else "")
                           + f": one CPU per physical core (first SMT thread{smt}), never across a NUMA node"),
        "code2wav_threads": res("code2wav_threads", nc, f"{nc} thread(s), est. {pick.code2wav_ms:.0f} ms/frame at "
                                f"25-frame chunks vs talker {pick.talker_ms:.0f} ms/frame; first-chunk decode "
                                f"{cost.chunk_ms(1, nc):.0f} ms"),
        "code2wav_cpus": res("code2wav_cpus", pick.code2wav, "the talker's last core (shared mode)" if pick.mode ==
                             "shared" else f"{pick.c2w_where}, disjoint from the talker; one CPU per physical core"),
    }


# ---------------------------------------------------------------- chunking
def _chunking(cost: CostModel, geo: ModelGeometry, ov: Overrides, placed: dict[str, Resolved]):
    mode, nt, nc = placed["mode"].value, placed["talker_threads"].value, placed["code2wav_threads"].value
    if mode == "shared":
        nc = nt  # in one process (a shared plan's default placement) code2wav takes turns on the talker's threads
    fo, ro, so = (ov.get(k) for k in ("first_chunk_frames", "chunk_ramp_frames", "steady_chunk_frames"))
    trials = []
    for s in ([so[0]] if so else STEADY_CHOICES):
        for f in ([fo[0]] if fo else [x for x in FIRST_CHOICES if x <= s]):
            for ramp in ([ro[0]] if ro else {doubling_ramp(f, s), ()}):
                trials.append((estimate(cost, mode, nt, nc, f, ramp, s), f, ramp, s))
    ok = [t for t in trials if t[0].stall_ms <= 1.0]
    if ok:
        e, f, ramp, s = min(ok, key=lambda t: (round(t[0].ttfa_ms / 10), round(t[0].rtf, 2), abs(t[3] - 25),
                                               len(t[2])))
        why = (f"no playback stall over {e.horizon_frames * 0.08:.0f} s with the earliest first audio: TTFA "
               f"{e.ttfa_ms:.0f} ms after prefill, RTF {e.rtf:.2f} (wall/audio)")
    else:
        e, f, ramp, s = min(trials, key=lambda t: (round(t[0].rtf, 2), round(t[0].ttfa_ms / 10), abs(t[3] - 25),
                                                   len(t[2])))
        if e.rtf > 1:
            why = (f"RTF {e.rtf:.2f} > 1 (wall/audio): audio comes slower than real time, so playback stalls "
                   f"whatever the chunking; buffer ~{1 - 1 / e.rtf:.0%} of an utterance before playing to avoid it. "
                   f"These sizes give the least wall time, then the earliest first audio (TTFA {e.ttfa_ms:.0f} ms)")
        else:
            why = f"no schedule avoids a stall; least stall {e.stall_ms:.0f} ms, TTFA {e.ttfa_ms:.0f} ms"
    return ({"first_chunk_frames": Resolved(f, _set(fo[1]) if fo else f"{f}: {why}", fo[1] if fo else "auto"),
             "chunk_ramp_frames": Resolved(tuple(ramp), _set(ro[1]) if ro else (
                 "doubling from the first chunk up to the steady size, so each chunk decodes while the previous one "
                 "plays" if ramp else "none: straight from the first chunk to steady chunks") + f" ({why})",
                                           ro[1] if ro else "auto"),
             "steady_chunk_frames": Resolved(s, _set(so[1]) if so else f"{s}: a code2wav chunk costs its frames' work "
                                             f"+ {geo.chunk_fixed_frames:g} frame(s) (the decoder's weights read once), "
                                             f"x{(s + geo.chunk_fixed_frames) / s:.2f} at {s} frames; {why}",
                                             so[1] if so else "auto")}, e)


# ---------------------------------------------------------------- preload
def _preload(hw: HardwareInfo, ov: Overrides) -> Resolved[tuple[str, ...]]:
    o = ov.get("preload")
    if o:
        return Resolved(o[0], _set(o[1], "" if o[0] else "nothing preloaded"), o[1])
    libs = [p for p in (hw.tcmalloc_path, None if hw.is_arm else hw.iomp5_path) if p]
    missing = [n for n, p in (("libtcmalloc", hw.tcmalloc_path), ("libiomp5", hw.iomp5_path)) if not p
               and not (n == "libiomp5" and hw.is_arm)]
    why = ("tcmalloc cuts allocator overhead; Intel OpenMP (libiomp5) is what vLLM's CPU docs ask for on x86"
           if libs else "nothing found to preload; vLLM then preloads torch's libgomp itself")
    if missing:
        why += f"; not found: {', '.join(missing)} (apt libgoogle-perftools4 / pip intel-openmp)"
    return Resolved(tuple(libs), why, "auto")
