"""The ``omnilab`` command line: ``omnilab --help`` lists the commands, ``omnilab help COMMAND`` (or
``omnilab COMMAND --help``) shows one, ``omnilab --version`` prints the version.

Contract: ``main(argv) -> exit status``; every command parses its own options (``*_main(argv)``, help and the
default on every option); an :class:`~omnilab.errors.OmnilabError` ends the command with its message on stderr and
status 2, argparse errors with status 2 too. ``-v/--verbose`` (before or after the command) shows vLLM's warnings
and omnilab's info (``omnilab.logs``); by default third-party libraries print only errors.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omnilab import __version__
from omnilab.errors import OmnilabError
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity

DEFAULT_TEXT = "Hello from omnilab, running on the CPU."
# one line per command for ``omnilab --help`` (COMMANDS below maps each to its entry point)
SUMMARIES = {
    "synth": "synthesize one sentence to a WAV file and print its latency summary",
    "speakers": "list a checkpoint's speakers and languages (and how VoiceDesign / Base choose a voice)",
    "make-checkpoint": "write a random-weight checkpoint in the released layout",
    "quantize": "write an int8 / int4 (compressed-tensors pack-quantized) copy of a checkpoint",
    "probe": "describe this machine's CPUs, NUMA nodes, cgroup limits and memory",
    "plan": "plan threads, CPU lists, KV budget, dtype and chunking for both stages",
    "bench": "benchmark configurations (eager, vllm, vllm-workers, ...) side by side on one checkpoint",
    "batch": "synthesize a manifest (CSV / JSONL / Parquet) on Ray actors, or in this process without Ray",
    "serve": "serve the speech API (vLLM-Omni's /v1/audio/speech, voices, WebSocket) and a page on one Pipeline",
    "settings": "list every OMNILAB_* environment variable with its value here and its source",
    "help": "show the help of a command: omnilab help COMMAND",
}


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows an option's default where it has a value (a help that names its default in words says it itself),
    keeps descriptions' line breaks, and lays the help out in 100 columns whatever the terminal."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 30, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, width or 100)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if (action.default is None or action.default is False or action.default is argparse.SUPPRESS
                or isinstance(action, argparse._CountAction) or action.default in ([], ())
                or "(default:" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _progress(args: argparse.Namespace) -> bool | None:
    return False if getattr(args, "no_progress", False) else None


def synth_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab synth", formatter_class=Formatter,
                                 description="Synthesize one sentence: writes <out>/<name>.wav and <out>/<name>_latency.csv "
                                             "(one row per timing span) and prints a summary table.")
    a = ap.add_argument
    a("text", nargs="?", default=DEFAULT_TEXT, help="the text to speak")
    a("--model", default=None, help="checkpoint directory or hub id (default: the embedded tiny checkpoint, random "
      "weights)")
    a("--out", default="out", help="output directory")
    a("--name", default="omnilab_demo", help="output file stem")
    a("--speaker", default=None, help="CustomVoice speaker, as omnilab speakers lists them (default: the first)")
    a("--language", default="auto", help="language name (omnilab speakers lists them) or auto")
    a("--instruct", default=None, help="voice / style description for VoiceDesign and CustomVoice 1.7B (default: none)")
    a("--ref-audio", default=None, help="reference audio file to clone, for Base checkpoints (default: none)")
    a("--ref-text", default=None, help="transcript of --ref-audio, for in-context cloning (default: x-vector only)")
    a("--max-new-tokens", type=int, default=None, help="talker tokens at most, one 80 ms frame each (default: the "
      "checkpoint's limit; 75 on the embedded checkpoint, whose random weights rarely stop)")
    a("--greedy", action="store_true", help="greedy decoding (talker and sub-talker)")
    a("--seed", type=int, default=0, help="sampling seed")
    a("--dtype", default=None, help="float32 | bfloat16 (default: chosen for this CPU by a short, cached timing)")
    a("--quantization", default=None, metavar="Q", help="decode matrix recipe: none | int8 | int4 (int4 "
      "talker, int8 code predictor) | int4-all, int4 ones with a group suffix -g32 | -g64 | -g128 (default: the deploy "
      "profile's, none unless asked; a quantized checkpoint as stored)")
    a("--threads", type=int, default=None, help="talker threads (default: the deploy profile's)")
    a("--backend", default="vllm", choices=("vllm", "eager"), help="vllm: the talker in vLLM's CPU engine; eager: "
      "plain torch in this process")
    a("--deploy-profile", default="auto", help="auto | a preset name | a deploy YAML path | none")
    a("--deploy", default=None, choices=("auto", "inprocess", "workers"),
      help="vLLM backend: where the stages run (default: auto, from the deploy profile)")
    a("--stream", action="store_true", help="stream the audio chunk by chunk (reports TTFA)")
    a("--no-progress", action="store_true", help="no progress bars (also OMNILAB_PROGRESS=0)")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)

    from omnilab.instrument.hooks import ProgressHook  # lazy: numpy
    from omnilab.pipeline import Pipeline  # lazy: torch

    max_new = args.max_new_tokens
    if max_new is None and args.model is None:
        max_new = 75  # the embedded checkpoint has random weights that rarely emit EOS: cap at ~6 s
    profile = None if args.deploy_profile.lower() == "none" else args.deploy_profile
    pipe = Pipeline.from_pretrained(args.model, backend=args.backend, dtype=args.dtype, num_threads=args.threads,
                                    deploy_profile=profile, deploy=args.deploy, quantization=args.quantization,
                                    hooks=ProgressHook("synth", total=max_new, progress=_progress(args)))
    with pipe:
        cfg = pipe.model.config
        speaker = args.speaker
        if speaker is None and cfg.tts_model_type == "custom_voice":
            speaker = cfg.speakers[0]
        kw = dict(speaker=speaker, language=args.language, instruct=args.instruct, ref_audio=args.ref_audio,
                  ref_text=args.ref_text, max_new_tokens=max_new, seed=args.seed)
        if args.greedy:
            kw.update(do_sample=False, subtalker_do_sample=False)
        if args.stream:
            from omnilab.results import SynthesisResult  # lazy: numpy

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
    ap = argparse.ArgumentParser(prog="omnilab make-checkpoint", formatter_class=Formatter,
                                 description="Write a random-weight checkpoint in the released layout; prints one JSON "
                                             "line (path, size, variant, seed).")
    ap.add_argument("path", help="directory to write")
    ap.add_argument("--size", default="tiny", choices=("tiny", "mid", "0.6b", "1.7b"),
                    help="geometry: tiny / mid (tests), 0.6b / 1.7b (the released ones)")
    ap.add_argument("--variant", default="custom_voice", choices=("custom_voice", "voice_design", "base"),
                    help="checkpoint variant")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (same seed, byte-identical files)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing non-empty directory")
    ap.add_argument("--calibrated", action="store_true",
                    help="confident weights: greedy decisions with a trained model's margins, for fidelity "
                         "measurements (docs/quality.md#confident-random-checkpoints)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (also OMNILAB_PROGRESS=0)")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)
    from omnilab.checkpoint.random import make_random_checkpoint  # lazy: torch

    p = make_random_checkpoint(args.path, size=args.size, variant=args.variant, seed=args.seed,
                               overwrite=args.overwrite, progress=_progress(args), calibrated=args.calibrated)
    print(json.dumps({"path": str(p), "size": args.size, "variant": args.variant, "seed": args.seed,
                      "calibrated": args.calibrated}))
    return 0


def _lazy(module: str, func: str):
    def run(argv):
        import importlib

        return getattr(importlib.import_module(module), func)(argv)
    return run


COMMANDS = {
    "synth": synth_main,
    "speakers": _lazy("omnilab.cli.speakers", "speakers_main"),
    "make-checkpoint": make_checkpoint_main,
    "quantize": _lazy("omnilab.cli.quantize", "quantize_main"),
    "probe": _lazy("omnilab.cli.profile", "probe_main"),
    "plan": _lazy("omnilab.cli.profile", "plan_main"),
    "bench": _lazy("omnilab.bench.run", "bench_main"),
    "batch": _lazy("omnilab.cli.batch", "batch_main"),
    "serve": _lazy("omnilab.cli.serve", "serve_main"),
    "settings": _lazy("omnilab.cli.settings", "settings_main"),
}


def parser() -> argparse.ArgumentParser:
    """The top-level parser: global options and the command list (each command parses the rest itself)."""
    ap = argparse.ArgumentParser(prog="omnilab", formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Qwen3-TTS 12 Hz on CPUs: synthesize, inspect checkpoints, plan deployments "
                                             "and benchmark.",
                                 epilog="examples:\n  omnilab synth \"Hello there.\" --out out/\n"
                                        "  omnilab speakers --model DIR\n  omnilab help bench")
    ap.add_argument("--version", action="version", version=f"omnilab {__version__}")
    add_verbosity(ap)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, summary in SUMMARIES.items():
        sub.add_parser(name, help=summary, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = next((i for i, x in enumerate(argv) if not x.startswith("-")), len(argv))
    ap = parser()
    top = ap.parse_args(argv[:split])  # -h / --version exit here (status 0)
    if split == len(argv):
        ap.print_help()
        return 2
    if top.verbose:
        apply_verbosity(top)
    cmd, rest = argv[split], argv[split + 1:]
    if cmd == "help":
        if not rest:
            ap.print_help()
            return 0
        if rest[0] not in COMMANDS:
            print(f"omnilab help: unknown command {rest[0]!r}; accepted: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        cmd, rest = rest[0], ["--help"]
    if cmd not in COMMANDS:
        print(f"omnilab: unknown command {cmd!r}; accepted: {', '.join(SUMMARIES)} (omnilab --help)", file=sys.stderr)
        return 2

    try:
        return int(COMMANDS[cmd](rest) or 0)
    except OmnilabError as e:
        print(f"omnilab {cmd}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, message already on stderr)
        if argv[split] == "help" and e.code == 0:
            return 0
        raise


if __name__ == "__main__":
    sys.exit(main())
