"""The ``omnilab`` dispatcher (omnilab/cli/main.py): ``--help`` lists every command with a one-line summary,
``--version``, ``help [COMMAND]``, unknown commands refused with the accepted ones, every option of every command
with help text and its default shown, ``-v`` before or after the command."""
from __future__ import annotations

import os
import re

import pytest

import omnilab
from omnilab.cli.main import COMMANDS, SUMMARIES, main


@pytest.fixture(autouse=True)
def _level(monkeypatch):
    monkeypatch.delenv("OMNILAB_LOG_LEVEL", raising=False)  # -v writes it; monkeypatch puts it back


def test_help_lists_every_command_with_its_summary(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: omnilab")
    flat = " ".join(out.split())  # argparse wraps the summaries
    for name in [*COMMANDS, "help"]:
        assert f" {name} {' '.join(SUMMARIES[name].split())}" in flat, name
    assert "``" not in out and "--version" in out and "--verbose" in out
    assert main([]) == 2 and "usage: omnilab" in capsys.readouterr().out  # no command: the help, status 2
    assert main(["help"]) == 0 and "commands:" in capsys.readouterr().out


def test_version_and_unknown_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"omnilab {omnilab.__version__}"
    assert main(["synthesize"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'synthesize'" in err and "accepted: synth, speakers," in err
    assert main(["help", "nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["synth", "speakers", "make-checkpoint", "quantize", "probe", "plan", "bench"])
def test_every_option_has_help_and_a_shown_default(cmd, capsys):
    assert main(["help", cmd]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: omnilab {cmd}") and "``" not in out
    body = out.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]  # the option entries, one per "  -" line
    entries = [e for e in re.split(r"\n(?=  -)", body) if not e.startswith("  -h, --help")]
    assert len(entries) >= 2, out
    for e in entries:  # help text beside the flags, then its default
        flags, _, text = e.strip().partition("  ")
        assert text.strip() and "(default:" in " ".join(e.split()), (cmd, e)
    assert "--verbose" in out


def test_verbose_before_or_after_the_command(tiny_ckpt, capsys):
    assert main(["speakers", "--model", str(tiny_ckpt("custom_voice")), "-v"]) == 0
    assert os.environ["OMNILAB_LOG_LEVEL"] == "info"
    os.environ.pop("OMNILAB_LOG_LEVEL")
    assert main(["-vv", "speakers", "--model", str(tiny_ckpt("custom_voice"))]) == 0
    assert os.environ["OMNILAB_LOG_LEVEL"] == "debug" and "vivian" in capsys.readouterr().out
    from omnilab import logs
    logs.set_verbosity("warning")
