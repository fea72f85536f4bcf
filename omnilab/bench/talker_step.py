"""Per-frame cost of the eager talker engine on a random real-geometry model (no checkpoint needed).

Decode is memory-bandwidth bound: per frame at batch 1 the talker streams its 443.6 M layer+head
params once and the code predictor its 80.75 M params 15 times (docs/model.md#bytes-and-flops-per-frame), so
``bytes / bandwidth`` is the floor. Run ``python -m omnilab.bench.talker_step --threads 2``; prints a
table of median milliseconds per phase and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from omnilab.kernels import use_gemv
from omnilab.kernels.gemv import MODES
from omnilab.stages.eager import EagerTalkerEngine
from omnilab.models import tiny
from omnilab.models.prompt import PromptRequest, build_prompt
from omnilab.models.talker import Talker, init_random_
from omnilab.sampling import SamplingParams
from omnilab.tuning.hugepages import pack


def build(size: str = "0b6", dtype: torch.dtype = torch.float32, seed: int = 0):
    geometry = tiny.REAL_0B6 if size == "0b6" else tiny.REAL_1B7
    cfg = tiny.config("custom_voice", size, geometry=geometry)
    with torch.device("meta"):
        t = Talker(cfg)
    t.to_empty(device="cpu")
    init_random_(t, torch.Generator().manual_seed(seed))
    return cfg, t.to(dtype).eval()


def weight_bytes(t: Talker) -> tuple[int, int]:
    """(talker layers + norm + codec_head, code predictor layers + norm + one lm_head [+ projection])."""
    nbytes = lambda mods: sum(p.numel() * p.element_size() for m in mods for p in m.parameters())  # noqa: E731
    cp = t.code_predictor
    talker = nbytes([t.model.layers, t.model.norm, t.codec_head])
    pred = nbytes([cp.model.layers, cp.model.norm, cp.lm_head[0], cp.small_to_mtp_projection])
    return talker, pred


def gemv_floor_ms(t: Talker, repeats: int = 3) -> tuple[float, float]:
    """Median ms of bare ``F.linear`` (1 row) over the talker-step matrices and over one predictor pass x 15:
    the bandwidth floor measured at the same moment as the engine (the machine may be shared)."""
    cp = t.code_predictor
    mats = lambda mods: [p for m in mods for p in m.parameters() if p.dim() == 2]  # noqa: E731
    groups = (mats([t.model.layers, t.codec_head]), mats([cp.model.layers, cp.lm_head[0]]) * 15)
    out = []
    for ws in groups:
        xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in ws}
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for w in ws:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            ts.append(1e3 * (time.perf_counter() - t0))
        out.append(statistics.median(ts))
    return out[0], out[1]


def run(cfg, t, batch: int, frames: int, warmup: int = 2) -> dict:
    text = list(range(1000, 1020))
    eng = EagerTalkerEngine(t, cfg)
    params = SamplingParams(max_new_tokens=frames + warmup + 2, min_new_tokens=frames + warmup + 2, seed=0)
    for i in range(batch):
        eng.add_request(i, build_prompt(t, cfg, PromptRequest(text, speaker="vivian", language="english")), params)
    rows = []
    for k in range(frames + warmup):
        t0 = time.perf_counter()
        outs = eng.step()
        wall = 1e3 * (time.perf_counter() - t0)
        if k >= warmup:
            o = outs[0]
            rows.append(dict(wall=wall, talker=o.talker_ms, predictor=o.predictor_ms, prep=o.input_prep_ms,
                             sampling=o.sampling_ms))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return dict(batch=batch, frames=frames, **{f"{k}_ms": round(v, 2) for k, v in med.items()},
                frame_ms_per_request=round(med["wall"] / batch, 2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0b6", choices=["0b6", "1b7"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--pages", default="4k", help="comma-separated: huge (streamed weights in a huge-page "
                    "arena), 4k (torch's allocations); several build one model each, alternated like --gemv")
    ap.add_argument("--gemv", default="auto", help="comma-separated OMNILAB_CPU_GEMV modes, alternated in each "
                    "repeat (side by side on one model): e.g. auto,omnilab-avx2,torch")
    a = ap.parse_args(argv)
    modes = a.gemv.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--gemv {','.join(bad)}: not a GEMV mode; accepted: {', '.join(MODES)}")
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    t0 = time.perf_counter()
    pages = a.pages.split(",")
    if set(pages) - {"huge", "4k"}:
        ap.error(f"--pages {a.pages}: accepted: huge, 4k")
    models = {}
    for pg in pages:  # same seed: identical weights, placed differently
        cfg, models[pg] = build(a.size, dtype)
        if pg == "huge":
            pack(models[pg])
    t = models[pages[0]]
    build_s = time.perf_counter() - t0
    tb, pb = weight_bytes(t)
    print(f"built {a.size} {a.dtype} in {build_s:.1f}s; talker step weights {tb / 1e9:.3f} GB, "
          f"predictor 15 x {pb / 1e9:.3f} GB = {15 * pb / 1e9:.3f} GB")
    results = []
    for _ in range(a.repeats):
        for b, mode, pg in ((int(x), m, pg) for x in a.batch.split(",") for m in modes for pg in pages):
            with torch.inference_mode():
                floor_t, floor_p = gemv_floor_ms(t)
            with use_gemv(mode) as choice:
                r = run(cfg, models[pg], b, a.frames)
            r.update(gemv=choice.label, gemv_mode=mode, pages=pg, variant=f"{mode}/{pg}",
                     gemv_floor_talker_ms=round(floor_t, 1), gemv_floor_predictor_ms=round(floor_p, 1))
            results.append(r)
            print(f"batch {b} [{choice.label}, {pg} pages]: step {r['wall_ms']:8.1f} ms | "
                  f"talker {r['talker_ms']:7.1f} | predictor "
                  f"{r['predictor_ms']:7.1f} | prep {r['prep_ms']:5.2f} | sampling {r['sampling_ms']:5.2f} | "
                  f"per request {r['frame_ms_per_request']:7.1f} ms/frame | bare-GEMV floor talker "
                  f"{floor_t:.1f} / predictor {floor_p:.1f} ms")
    ratios = {}
    variants = [f"{m}/{pg}" for m in modes for pg in pages]
    if len(variants) > 1:  # per batch: median step of each variant over the repeats, and its ratio to the first
        print("\nbatch  " + "".join(f"{v:>22}" for v in variants))
        for b in dict.fromkeys(r["batch"] for r in results):
            med = [statistics.median(r["wall_ms"] for r in results if r["batch"] == b and r["variant"] == v)
                   for v in variants]
            ratios[b] = {v: round(x / med[0], 3) for v, x in zip(variants, med)}
            print(f"{b:<7}" + "".join(f"{x:>12.1f} ms x{x / med[0]:.2f}" for x in med))
    print(json.dumps(dict(size=a.size, dtype=a.dtype, threads=a.threads, talker_gb=round(tb / 1e9, 4),
                          predictor_gb_per_frame=round(15 * pb / 1e9, 4), step_ratio_to_first_variant=ratios,
                          results=results)))


if __name__ == "__main__":
    main()
