"""``omnilab speakers --model DIR`` (omnilab/cli/speakers.py): a checkpoint's speakers and languages from its
config, and for VoiceDesign / Base (no speakers) how a voice is chosen instead."""
from __future__ import annotations

import json

from omnilab.cli.main import main


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_custom_voice_lists_speakers_and_languages(tiny_ckpt, capsys):
    path = tiny_ckpt("custom_voice")
    rc, out, _ = _run(capsys, "speakers", "--model", str(path))
    rows = dict(ln.split(None, 1) for ln in out.strip().splitlines())
    assert rc == 0 and str(path) in rows["checkpoint"] and "custom_voice" in rows["checkpoint"]
    assert "vivian" in rows["speakers"].split(", ") and "eric (sichuan_dialect)" in rows["speakers"]
    assert rows["languages"].startswith("auto, ") and "english" in rows["languages"]
    assert "--speaker" in rows["voice"]
    rc, out, _ = _run(capsys, "speakers", "--model", str(path), "--json")
    d = json.loads(out)
    from omnilab.config import Qwen3TTSConfig
    cfg = Qwen3TTSConfig.load(path / "config.json")
    assert d["speakers"] == list(cfg.speakers) and d["languages"] == list(cfg.languages)
    assert d["dialects"] == {"eric": "sichuan_dialect", "dylan": "beijing_dialect"} and d["variant"] == "custom_voice"


def test_voice_design_and_base_say_how_they_choose_a_voice(tiny_ckpt, capsys):
    rc, out, _ = _run(capsys, "speakers", "--model", str(tiny_ckpt("voice_design")), "--json")
    d = json.loads(out)
    assert rc == 0 and d["speakers"] == [] and "--instruct" in d["voice"] and d["accepts_instruct"]
    rc, out, _ = _run(capsys, "speakers", "--model", str(tiny_ckpt("base")))
    rows = dict(ln.split(None, 1) for ln in out.strip().splitlines())
    assert rc == 0 and rows["speakers"] == "none" and "--ref-audio" in rows["voice"] and "english" in rows["languages"]


def test_not_a_checkpoint_exits_2_with_the_reason(tmp_path, capsys):
    rc, _, err = _run(capsys, "speakers", "--model", str(tmp_path))
    assert rc == 2 and f"{tmp_path}: no config.json" in err
