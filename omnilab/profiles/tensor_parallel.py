"""What a tensor-parallel talker is expected to gain, and where its ranks go (plain Python; docs/profiles.md).

Contract:
- ``split_fraction(geo)``: the share of a frame's streamed weights that tensor parallelism splits across ranks:
  the talker decoder's layers (omnilab.stages.vllm.tensor_parallel cuts attention and MLP matrices). The codec
  head and the code predictor's 15 passes run whole on every rank (replicated), so they do not shrink.
- ``talker_ms(cost, threads, tp, own_nodes)``: estimated talker step per frame with ``tp`` ranks of ``threads``
  threads. One rank per NUMA node (``own_nodes``): each node streams its slice from its own memory, so the split
  part divides by ``tp`` and the replicated part stays, plus :data:`ALLREDUCE_MS` per all-reduce (2 per talker
  layer). Ranks on one node share its bandwidth: the node streams the split part once and the replicated part
  once per rank, at ``threads * tp`` threads; no gain is expected there.
- ``single_node_ranks(pools, tp, threads)``: rank CPU lists cut from the usable physical cores when there are fewer
  NUMA nodes than ranks (for testing and study); more ranks than usable cores raises ``ConfigError``.
- ``shared_node_warning(ranks, nodes)``: the profile's warning for ranks sharing a node (:data:`SHARED_NODE` marks
  it; ``deployment.prepare`` repeats it as a UserWarning).
- ``propose(one_rank, per_node, nodes)``: the planner proposes one rank per NUMA node only where its estimate gains
  :data:`TP_MIN_GAIN`; it says both estimates either way.
- ``gain_note(cost, threads, tp, own_nodes)``: the reason text stating the estimate beside one rank's.
"""
from __future__ import annotations

from typing import Any

from omnilab.errors import ConfigError

# One all-reduce of a [1, H] fp32 row through vLLM's shared-memory CPU communicator: ~50 us (a per-call cost at
# batch 1, dominated by the ranks' synchronisation, not by the 4 KiB moved); the planner's prior, not measured here
ALLREDUCE_MS = 0.05
# the planner proposes one rank per NUMA node only where the estimate gains this much over one rank: the estimate
# rests on priors (ALLREDUCE_MS, per-node bandwidth), and a smaller gain does not pay for a second set of processes
TP_MIN_GAIN = 0.10
WHY_MIN_GAIN = "the estimate's priors are not measured on this host"


SHARED_NODE = "talker ranks share NUMA node(s)"  # the profile's warning; from_pretrained repeats it as a UserWarning


def shared_node_warning(ranks: int, nodes: list[int]) -> str:
    return (f"{ranks} {SHARED_NODE} {nodes}: tensor parallelism brings no memory-bandwidth gain there (the ranks read "
            f"from the same memory); for testing and study")


def split_fraction(geo: Any) -> float:
    """Share of a frame's streamed weights in the talker decoder layers (the part tensor parallelism splits)."""
    talker = geo.talker_layers * geo._talker_layer
    return talker / geo.streamed_params_per_frame()


def talker_ms(cost: Any, threads: int, tp: int, own_nodes: bool) -> float:
    if tp == 1:
        return cost.talker_ms(threads)
    f = split_fraction(cost.geometry)
    allreduce = ALLREDUCE_MS * 2 * cost.geometry.talker_layers
    if own_nodes:
        return cost.talker_ms(threads) * (1 - f + f / tp) + allreduce
    return cost.talker_ms(threads * tp) * (f + (1 - f) * tp) + allreduce


def single_node_ranks(pools: dict[int, list[int]], tp: int, threads: int | None = None
                      ) -> list[tuple[tuple[int, ...], ...]]:
    """Rank lists (each ``threads`` CPUs, or every size that fits) cut from the usable cores, node after node."""
    cores = [c for n in sorted(pools) for c in pools[n]]
    if tp > len(cores):
        raise ConfigError(f"talker_tp_size={tp}: each tensor-parallel rank needs a physical core of its own; "
                          f"{len(cores)} usable core(s) here ({', '.join(map(str, cores))})")
    sizes = [threads] if threads else range(1, len(cores) // tp + 1)
    return [tuple(tuple(cores[i * n:(i + 1) * n]) for i in range(tp)) for n in sizes if n * tp <= len(cores)]


def propose(one_rank: list, per_node: list, nodes: int) -> tuple[list, str]:
    """The planner's candidates: ``per_node`` (one rank per NUMA node) where its best estimate gains at least
    :data:`TP_MIN_GAIN` over ``one_rank``'s, else ``one_rank``; and the reason text saying both estimates."""
    one = min(c.frame_ms for c in one_rank)
    many = min((c.frame_ms for c in per_node), default=float("inf"))
    gains = many <= one * (1 - TP_MIN_GAIN)
    note = (f"; {nodes} ranks, one per NUMA node: est. {many:.0f} ms/frame vs {one:.0f} at one rank, "
            f"{'at least' if gains else 'under'} the {TP_MIN_GAIN:.0%} a second rank must gain ({WHY_MIN_GAIN})")
    return (per_node if gains else one_rank), note


def gain_note(cost: Any, threads: int, tp: int, own_nodes: bool) -> str:
    one = cost.talker_ms(threads if own_nodes else threads * tp)
    est = talker_ms(cost, threads, tp, own_nodes)
    f = split_fraction(cost.geometry)
    if own_nodes:
        return (f"one rank per NUMA node: est. talker {est:.0f} ms/frame vs {one:.0f} at one rank ({f:.0%} of the "
                f"frame's weights are the decoder layers the ranks split; the code predictor runs whole on every "
                f"rank)")
    return (f"warning: the ranks share a NUMA node, so its memory bandwidth: no gain expected (est. talker "
            f"{est:.0f} ms/frame vs {one:.0f} at one rank on the same cores); for testing and study")
