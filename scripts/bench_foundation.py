"""Per-frame cost of the eager backend vs the official qwen-tts, measured side by side in one run.

    .venv/bin/python scripts/bench_foundation.py [--ckpt DIR] [--threads 2] [--frames 24] [--ref-python PY]

Builds (once, cached) a real-geometry 0.6B CustomVoice random checkpoint, then measures at
``--threads`` threads in fp32 with denormals flushed:
- omnilab eager talker step and code predictor (15 steps) per frame, medians over the decode steps;
- the floor: weight bytes read per frame / measured fp32 GEMV bandwidth;
- omnilab code2wav: offline 1/25/100-frame chunks, streaming steady state (25-frame chunks after 75
  frames of context) and the first 1-frame chunk of a fresh stream;
- the official implementation on the same checkpoint (``scripts/reference/bench_reference.py`` in the
  reference env) when ``--ref-python`` (default ``.venv-ref/bin/python``) exists.
Prints a table and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def weight_bytes_per_frame(talker) -> tuple[int, int]:
    """(talker bytes, 15 predictor passes bytes) read per generated frame at batch 1."""
    def nbytes(mod):
        return sum(p.numel() * p.element_size() for p in mod.parameters())
    tb = nbytes(talker.model.layers) + nbytes(talker.model.norm) + nbytes(talker.codec_head)
    cp = talker.code_predictor
    one_head = next(iter(cp.lm_head.parameters()))
    per_pass = nbytes(cp.model.layers) + nbytes(cp.model.norm) + one_head.numel() * one_head.element_size()
    if getattr(cp, "small_to_mtp_projection", None) is not None:
        per_pass += nbytes(cp.small_to_mtp_projection)
    return tb, 15 * per_pass


def bench_talker(pipe, frames: int) -> dict:
    rid = pipe.talker.start("Hello from omnilab, running on the CPU.", speaker="vivian", language="english",
                            max_new_tokens=frames + 1, do_sample=False, subtalker_do_sample=False)
    talker, pred, total = [], [], []
    while pipe.talker.has_unfinished():
        t0 = time.perf_counter()
        o = pipe.talker.step()[rid]
        dt = 1e3 * (time.perf_counter() - t0)
        if o.prefill_ms == 0 and not o.finished:
            talker.append(o.talker_ms)
            pred.append(o.predictor_ms)
            total.append(dt)
    return {"talker_step_ms": statistics.median(talker), "code_predictor_ms": statistics.median(pred),
            "talker_plus_predictor_ms": statistics.median(total), "decode_steps": len(total)}


def bench_code2wav(decoder, repeats: int = 3) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for n in (1, 25, 100):
            codes = torch.randint(0, 2048, (1, 16, n), generator=g)
            decoder(codes)
            ts = []
            for _ in range(repeats if n < 100 else 2):
                t0 = time.perf_counter()
                decoder(codes)
                ts.append(time.perf_counter() - t0)
            out[f"code2wav_{n}f_ms_per_frame"] = 1e3 * statistics.median(ts) / n
        ctx = torch.randint(0, 2048, (1, 16, 75), generator=g)
        chunk = torch.randint(0, 2048, (1, 16, 25), generator=g)
        steady, first = [], []
        for _ in range(repeats):
            st = decoder.start_stream(1)
            t0 = time.perf_counter()
            decoder.decode_chunk(st, ctx[..., :1])
            first.append(time.perf_counter() - t0)
            decoder.decode_chunk(st, ctx[..., 1:])
            t0 = time.perf_counter()
            decoder.decode_chunk(st, chunk)
            steady.append(time.perf_counter() - t0)
            st.free()
        out["code2wav_stream_steady_ms_per_frame"] = 1e3 * statistics.median(steady) / 25
        out["code2wav_stream_first_chunk_ms"] = 1e3 * statistics.median(first)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (default: cached 0.6b custom_voice seed 0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--ref-python", default=str(ROOT / ".venv-ref" / "bin" / "python"))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch

    from omnilab.checkpoint.random import make_random_checkpoint
    from omnilab.paths import cache_dir
    from omnilab.pipeline import Pipeline

    ckpt = Path(args.ckpt) if args.ckpt else cache_dir() / "checkpoints" / "bench-0.6b-custom_voice-seed0"
    if not (ckpt / "config.json").exists():
        print(f"[bench] writing 0.6b checkpoint to {ckpt} ...", flush=True)
        make_random_checkpoint(ckpt, size="0.6b", variant="custom_voice", seed=0)

    pipe = Pipeline.from_pretrained(ckpt, backend="eager", dtype="float32", num_threads=args.threads)
    res: dict = {"threads": args.threads, "dtype": "float32", "checkpoint": str(ckpt)}
    bench_talker(pipe, 3)  # warm-up
    res.update(bench_talker(pipe, args.frames))
    res.update(bench_code2wav(pipe.model.code2wav))
    tb, cb = weight_bytes_per_frame(pipe.model.talker)
    pipe.close()
    del pipe
    from omnilab.bench.drivers import measure_gemv_bandwidth

    bw = measure_gemv_bandwidth(threads=args.threads)["gbps"]
    res.update({"gemv_gbs": bw, "talker_bytes_per_frame_gb": tb / 1e9, "predictor_bytes_per_frame_gb": cb / 1e9,
                "talker_floor_ms": tb / bw / 1e6, "predictor_floor_ms": cb / bw / 1e6})
    res["predictor_vs_floor"] = res["code_predictor_ms"] / res["predictor_floor_ms"]
    res["talker_vs_floor"] = res["talker_step_ms"] / res["talker_floor_ms"]

    ref = None
    if Path(args.ref_python).exists():
        print("[bench] running the official qwen-tts on the same checkpoint ...", flush=True)
        cmd = [args.ref_python, str(ROOT / "scripts" / "reference" / "bench_reference.py"), str(ckpt),
               "--threads", str(args.threads), "--frames", str(args.frames)]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
        if p.returncode == 0:
            ref = json.loads(p.stdout.strip().splitlines()[-1])
        else:
            print(p.stderr[-2000:], file=sys.stderr)
    res["reference"] = ref

    rows = [("talker step (ms/frame)", res["talker_step_ms"], res["talker_floor_ms"], None),
            ("code predictor, 15 steps (ms/frame)", res["code_predictor_ms"], res["predictor_floor_ms"], None),
            ("talker + predictor (ms/frame)", res["talker_plus_predictor_ms"],
             res["talker_floor_ms"] + res["predictor_floor_ms"], ref and ref["talker_predictor_ms_per_frame"]),
            ("code2wav offline 25f (ms/frame)", res["code2wav_25f_ms_per_frame"], None,
             ref and ref["code2wav_25f_ms_per_frame"]),
            ("code2wav offline 100f (ms/frame)", res["code2wav_100f_ms_per_frame"], None,
             ref and ref["code2wav_100f_ms_per_frame"]),
            ("code2wav stream steady (ms/frame)", res["code2wav_stream_steady_ms_per_frame"], None, None),
            ("code2wav first 1-frame chunk (ms)", res["code2wav_stream_first_chunk_ms"], None,
             ref and ref["code2wav_1f_ms_per_chunk"])]
    fmt = lambda v: "-" if v is None else f"{v:8.1f}"  # noqa: E731
    print(f"\n0.6B CustomVoice, fp32, {args.threads} threads; GEMV bandwidth {bw:.1f} GB/s\n")
    print(f"{'measure':40} {'omnilab':>8} {'floor':>8} {'official':>8}")
    for name, ours, floor, off in rows:
        print(f"{name:40} {fmt(ours)} {fmt(floor)} {fmt(off)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
