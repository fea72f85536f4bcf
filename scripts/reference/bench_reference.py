"""Time the official qwen-tts 0.1.1 on one checkpoint (runs INSIDE the reference env, no omnilab).

Usage: .venv-ref/bin/python scripts/reference/bench_reference.py CKPT_DIR --threads 2 --frames 24
Prints one JSON line: talker+predictor ms per frame through the official ``generate`` (greedy,
prefill included, as measured for docs/model.md#measured-reference-speed), and the official code2wav decoder's ms per
frame on 1-, 25- and 100-frame chunks (offline, no streaming context).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types


def _stub_torchaudio() -> None:
    try:
        import torchaudio  # noqa: F401
    except Exception:  # the 12 Hz path needs none of it; a broken wheel must not stop the import
        for name in [m for m in sys.modules if m.startswith("torchaudio")]:
            del sys.modules[name]
        mod = types.ModuleType("torchaudio")
        mod.compliance = types.SimpleNamespace(kaldi=types.SimpleNamespace())
        mod.functional = types.SimpleNamespace()
        mod.transforms = types.SimpleNamespace()
        sys.modules["torchaudio"] = mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--text", default="Hello from omnilab, running on the CPU.")
    ap.add_argument("--speaker", default="vivian")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    _stub_torchaudio()
    from qwen_tts import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(args.ckpt, device_map="cpu", dtype=torch.float32)
    model = tts.model
    timing: dict = {}
    orig = model.generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = orig(*a, **kw)
        timing["generate_s"] = time.perf_counter() - t0
        timing["frames"] = int(out[0][0].shape[0])
        return out

    model.generate = timed_generate
    gen = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=args.frames + 1, repetition_penalty=1.0)
    kind = model.tts_model_type
    if kind == "custom_voice":
        tts.generate_custom_voice(text=args.text, speaker=args.speaker, language="English", **gen)
    elif kind == "voice_design":
        tts.generate_voice_design(text=args.text, instruct="A calm voice.", language="English", **gen)
    else:
        raise SystemExit("bench_reference: use a custom_voice or voice_design checkpoint")
    res = {"threads": args.threads, "frames": timing["frames"],
           "talker_predictor_ms_per_frame": 1e3 * timing["generate_s"] / max(timing["frames"], 1)}

    dec = model.speech_tokenizer.model.decoder
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in (1, 25, 100):
            codes = torch.randint(0, 2048, (1, 16, n), generator=g)
            dec(codes)  # warm-up
            ts = []
            for _ in range(3 if n < 100 else 2):
                t0 = time.perf_counter()
                dec(codes)
                ts.append(time.perf_counter() - t0)
            res[f"code2wav_{n}f_ms_per_frame"] = 1e3 * statistics.median(ts) / n
            res[f"code2wav_{n}f_ms_per_chunk"] = 1e3 * statistics.median(ts)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
