"""``omnilab speakers [--model DIR] [--json]``: the voices and languages a checkpoint accepts, from its config.json.

Contract: ``speakers_main(argv) -> 0``; prints a table (or one JSON object with ``--json``: ``path``, ``variant``,
``size``, ``speakers``, ``dialects``, ``languages``, ``accepts_instruct``, ``voice``). CustomVoice lists its built-in
speakers (a dialect speaker's dialect beside its name); VoiceDesign and Base have none and the ``voice`` line says
how they choose a voice instead (``--instruct``; ``--ref-audio`` / ``--ref-text``). A missing or invalid checkpoint
raises :class:`~omnilab.errors.CheckpointError` / :class:`~omnilab.errors.ConfigError` (status 2). Reads only the
config; no weights are loaded.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from omnilab.cli.main import Formatter
from omnilab.config import Qwen3TTSConfig
from omnilab.errors import CheckpointError
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity

VOICE = {
    "custom_voice": "a built-in speaker: synth --speaker NAME (Python: speaker=NAME)",
    "voice_design": "no built-in speakers: describe the voice, synth --instruct \"A calm, low voice.\" "
                    "(Python: instruct=...)",
    "base": "no built-in speakers: clone a voice from a reference clip, synth --ref-audio FILE [--ref-text TRANSCRIPT] "
            "(Python: ref_audio=path or (wav, sample_rate), ref_text=...)",
}


def describe(path: str | Path) -> dict[str, Any]:
    """What :func:`speakers_main` prints, for the checkpoint directory ``path``."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; accepted: a checkpoint directory (omnilab make-checkpoint "
                              "writes one)")
    cfg = Qwen3TTSConfig.load(path / "config.json")
    dialects = {k: v for k, v in cfg.talker.spk_is_dialect.items() if v and k in cfg.talker.spk_id}
    return {"path": str(path), "variant": cfg.tts_model_type, "size": cfg.tts_model_size,
            "speakers": list(cfg.speakers), "dialects": dialects, "languages": list(cfg.languages),
            "accepts_instruct": cfg.accepts_instruct, "voice": VOICE[cfg.tts_model_type]}


def speakers_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab speakers", formatter_class=Formatter,
                                 description="List a checkpoint's speakers and languages (from its config.json) and say "
                                             "how its variant chooses a voice.")
    ap.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the embedded tiny "
                    "checkpoint)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)
    if args.model is None:
        from omnilab.checkpoint.random import default_checkpoint  # lazy: torch
        path: Path = default_checkpoint()
    elif Path(args.model).expanduser().is_dir():
        path = Path(args.model)
    else:  # a hub id (or a path that is not there: the resolver says so)
        from omnilab.checkpoint.load import resolve_checkpoint  # lazy: torch
        path = resolve_checkpoint(args.model)
    d = describe(path)
    if args.json:
        print(json.dumps(d))
        return 0
    names = [f"{s} ({d['dialects'][s]})" if s in d["dialects"] else s for s in d["speakers"]]
    rows = [("checkpoint", f"{d['size']} {d['variant']} ({d['path']})"),
            ("speakers", ", ".join(names) if names else "none"),
            ("languages", ", ".join(d["languages"]) + "  (synth --language NAME)"),
            ("instruct", "accepted" if d["accepts_instruct"] else "not accepted (dropped with a warning)"),
            ("voice", d["voice"])]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    return 0
