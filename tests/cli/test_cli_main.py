"""The ``omnilab`` dispatcher (omnilab/cli/main.py): ``--help`` lists every command with a one-line summary,
``--version``, ``help [COMMAND]``, unknown commands refused with the accepted ones, every option of every command
with help text and its default shown, ``-v`` before or after the command."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import omnilab
from omnilab.cli.main import COMMANDS, SUMMARIES, main, synth_main


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


@pytest.mark.parametrize("cmd", ["synth", "speakers", "make-checkpoint", "quantize", "probe", "plan", "bench", "batch"])
def test_every_option_has_help_and_a_shown_default(cmd, capsys):
    """Every option has help in words; one that takes a value shows its default (a value, or words such as "the
    deploy profile's"); a flag needs none. No help says "None" (what argparse prints for an unset default)."""
    assert main(["help", cmd]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: omnilab {cmd}") and "``" not in out
    body = out.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]  # the option entries, one per "  -" line
    entries = [e for e in re.split(r"\n(?=  -)", body) if not e.startswith("  -h, --help")]
    assert len(entries) >= 2, out
    for e in entries:  # help text beside the flags, then its default
        flat = " ".join(e.split())
        flags, _, text = e.strip().partition("  ")
        assert text.strip(), (cmd, e)
        assert not re.search(r"\bNone\b", flat), (cmd, e)
        takes_value = bool(re.match(r"(?:-\w, )?--[\w-]+ \S", flags.strip())) and "--verbose" not in flags
        if takes_value:
            assert "(default:" in flat or "(required)" in flat, (cmd, e)
    assert "--verbose" in out


def test_verbose_before_or_after_the_command(tiny_ckpt, capsys):
    assert main(["speakers", "--model", str(tiny_ckpt("custom_voice")), "-v"]) == 0
    assert os.environ["OMNILAB_LOG_LEVEL"] == "info"
    os.environ.pop("OMNILAB_LOG_LEVEL")
    assert main(["-vv", "speakers", "--model", str(tiny_ckpt("custom_voice"))]) == 0
    assert os.environ["OMNILAB_LOG_LEVEL"] == "debug" and "vivian" in capsys.readouterr().out
    from omnilab import logs
    logs.set_verbosity("warning")


# ---------------------------------------------------------------- one vocabulary across the commands
@pytest.mark.parametrize("cmd", ["synth", "plan", "bench", "batch"])
def test_every_command_names_the_deploy_profile_alike(cmd, capsys):
    assert main(["help", cmd]) == 0
    out = capsys.readouterr().out
    assert "--deploy-profile" in out and not re.search(r"--profile\b", out)


def test_plan_profile_is_the_former_name_of_deploy_profile(capsys):
    from omnilab.cli.profile import plan_main

    fixture = str(Path(__file__).resolve().parents[1] / "fixtures/hardware/vm2_avx2.json")
    assert plan_main(["--root", fixture, "--deploy-profile", "vm-2core", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    with pytest.warns(FutureWarning, match="--profile is deprecated; use --deploy-profile"):
        assert plan_main(["--root", fixture, "--profile", "vm-2core", "--json"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert old == new
    with pytest.raises(SystemExit) as e:
        plan_main(["--root", fixture, "--profile", "vm-2core", "--deploy-profile", "edge"])
    assert e.value.code == 2 and "disagree" in capsys.readouterr().err


def test_bench_without_dtype_runs_what_synth_runs():
    """``omnilab bench`` without ``--dtype`` asks for ``auto``: each configuration is built with ``dtype=None``, as
    ``omnilab synth`` builds its pipeline, and keeps its name (no suffix)."""
    from omnilab.bench import backends as be, run as bench

    cfg = bench.config_from_args(bench.parser().parse_args([]))
    assert cfg.dtype == "auto" and cfg.configs == bench.DEFAULT_CONFIGS and cfg.floor_dtype == "float32"
    assert all(be.parse_config(c).dtype_arg(cfg.dtype) is None for c in cfg.configs)
    # synth passes its --dtype (default None) to from_pretrained as it is
    assert [a.default for a in _parser_of(synth_main) if a.dest == "dtype"] == [None]
    one = bench.config_from_args(bench.parser().parse_args(["--dtype", "float32"]))
    assert one.dtype == "float32" and one.configs == bench.DEFAULT_CONFIGS
    two = bench.config_from_args(bench.parser().parse_args(["--configs", "eager", "--dtype", "auto,bfloat16"]))
    assert two.configs == ("eager+auto", "eager+bf16")


def _parser_of(command_main) -> list:
    """The argparse actions a ``*_main(argv)`` builds (captured from its ``--help``)."""
    import argparse

    seen = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        seen.extend(self._actions)
        raise SystemExit(0)
    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            command_main(["--help"])
    finally:
        argparse.ArgumentParser.parse_args = real
    return seen


def test_help_bench_fits_a_screen(capsys):
    assert main(["help", "bench"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 60 and "docs/benchmarks.md" in out
    assert "+huge-pages" not in out  # the configuration suffixes are listed in docs/benchmarks.md
