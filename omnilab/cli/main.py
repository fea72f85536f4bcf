"""``omnilab`` command line: ``synth`` (the main job), ``make-checkpoint``, ``quantize``, ``probe``, ``plan``,
``bench``.

``omnilab synth "text" --out out/`` synthesizes one sentence (default: the embedded tiny checkpoint),
writes ``<out>/<name>.wav`` and ``<out>/<name>_latency.csv`` (one row per timing span) and prints a
summary table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_TEXT = "Hello from omnilab, running on the CPU."


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def synth_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab synth", description="Synthesize one sentence to a WAV file.")
    ap.add_argument("text", nargs="?", default=DEFAULT_TEXT)
    ap.add_argument("--model", default=None, help="checkpoint dir or hub id (default: embedded tiny checkpoint)")
    ap.add_argument("--out", default="out", help="output directory")
    ap.add_argument("--name", default="omnilab_demo", help="output file stem")
    ap.add_argument("--speaker", default=None, help="CustomVoice speaker (default: the first one)")
    ap.add_argument("--language", default="auto")
    ap.add_argument("--instruct", default=None)
    ap.add_argument("--ref-audio", default=None, help="reference audio file (Base models)")
    ap.add_argument("--ref-text", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--greedy", action="store_true", help="greedy decoding (talker and sub-talker)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: auto per CPU)")
    ap.add_argument("--quantization", default=None, metavar="Q",
                    help="decode matrices: none | int8 | int4 | int4-g32 | int4-g64 | int4-g128 (default: the "
                         "profile's, none unless asked; a quantized checkpoint: as stored)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backend", default="vllm", choices=("vllm", "eager"))
    ap.add_argument("--deploy-profile", default="auto",
                    help="auto | a preset name | a deploy YAML path | none (default: auto)")
    ap.add_argument("--deploy", default=None, choices=("auto", "inprocess", "workers"),
                    help="vLLM backend: where the stages run (default: auto, from the profile)")
    ap.add_argument("--stream", action="store_true", help="stream the audio chunk by chunk (reports TTFA)")
    args = ap.parse_args(argv)

    from omnilab.pipeline import Pipeline

    profile = None if args.deploy_profile.lower() == "none" else args.deploy_profile
    pipe = Pipeline.from_pretrained(args.model, backend=args.backend, dtype=args.dtype, num_threads=args.threads,
                                    deploy_profile=profile, deploy=args.deploy, quantization=args.quantization)
    with pipe:
        cfg = pipe.model.config
        speaker = args.speaker
        if speaker is None and cfg.tts_model_type == "custom_voice":
            speaker = cfg.speakers[0]
        max_new = args.max_new_tokens
        if max_new is None and args.model is None:
            max_new = 75  # the embedded checkpoint has random weights that rarely emit EOS: cap at ~6 s
        kw = dict(speaker=speaker, language=args.language, instruct=args.instruct, ref_audio=args.ref_audio,
                  ref_text=args.ref_text, max_new_tokens=max_new, seed=args.seed)
        if args.greedy:
            kw.update(do_sample=False, subtalker_do_sample=False)
        if args.stream:
            from omnilab.results import SynthesisResult

            res = SynthesisResult.from_chunks(pipe.stream(args.text, **kw), text=args.text)
        else:
            res = pipe.generate(args.text, **kw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wav = res.save_wav(out / f"{args.name}.wav")
    csv = out / f"{args.name}_latency.csv"
    res.timings_frame().to_csv(csv, index=False)
    per_stage = res.stage_ms_per_frame()
    rows = [("model", f"{cfg.tts_model_size} {cfg.tts_model_type} ({pipe.model.path})"),
            *(pipe.deployment.rows() if pipe.deployment is not None else []),
            ("dtype", f"{str(pipe.model.dtype).replace('torch.', '')} "
                      f"({pipe.profile.dtype.reason if pipe.profile is not None else pipe.model.dtype_reason})"),
            ("text", res.text or args.text)]
    rows += [(k, str(v)) for k, v in res.summary().items() if k != "request_id"]
    rows += [(f"ms/frame {k}", f"{v:.1f}") for k, v in sorted(per_stage.items())]
    rows += [("wav", str(wav)), ("latency csv", str(csv))]
    print(_table(rows))
    return 0


def make_checkpoint_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab make-checkpoint",
                                 description="Write a random-weight checkpoint in the released layout.")
    ap.add_argument("path")
    ap.add_argument("--size", default="tiny", help="tiny | mid | 0.6b | 1.7b")
    ap.add_argument("--variant", default="custom_voice", help="custom_voice | voice_design | base")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    from omnilab.checkpoint.random import make_random_checkpoint

    p = make_random_checkpoint(args.path, size=args.size, variant=args.variant, seed=args.seed,
                               overwrite=args.overwrite)
    print(json.dumps({"path": str(p), "size": args.size, "variant": args.variant, "seed": args.seed}))
    return 0


def _lazy(module: str, func: str):
    def run(argv):
        import importlib

        return getattr(importlib.import_module(module), func)(argv)
    return run


COMMANDS = {
    "synth": synth_main,
    "make-checkpoint": make_checkpoint_main,
    "probe": _lazy("omnilab.cli.profile", "probe_main"),
    "plan": _lazy("omnilab.cli.profile", "plan_main"),
    "bench": _lazy("omnilab.bench.run", "bench_main"),
    "quantize": _lazy("omnilab.cli.quantize", "quantize_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: omnilab {" + ",".join(COMMANDS) + "} [options]\n\n" + __doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"omnilab: unknown command {cmd!r}; accepted: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from omnilab.errors import OmnilabError

    try:
        return int(COMMANDS[cmd](rest) or 0)
    except OmnilabError as e:
        print(f"omnilab {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
