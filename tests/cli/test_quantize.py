"""``omnilab quantize`` (omnilab/cli/quantize.py): writes the quantized copy and prints one JSON line, refuses an
existing destination without --overwrite and bad values with exit status 2 and the accepted ones; ``omnilab plan``
reads the quantized checkpoint's geometry like the source's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnilab.checkpoint.quantized import read_scheme
from omnilab.cli.main import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hardware" / "vm2_avx2.json"


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_quantize_writes_the_copy_and_refuses_to_overwrite(tiny_ckpt, tmp_path, capsys):
    src, dst = tiny_ckpt("custom_voice"), tmp_path / "q"
    rc, out, _ = _run(capsys, "quantize", str(src), str(dst), "--method", "int4", "--group-size", "32", "--no-progress")
    assert rc == 0
    info = json.loads(out.strip().splitlines()[-1])
    assert (info["path"], info["method"], info["group_size"]) == (str(dst.resolve()), "int4", 32)
    assert 0 < info["dst_model_bytes"] < info["src_model_bytes"]
    assert read_scheme(dst).group_size == 32 and (dst / "speech_tokenizer" / "model.safetensors").is_file()
    rc, _, err = _run(capsys, "quantize", str(src), str(dst), "--method", "int8", "--no-progress")
    assert rc == 2 and "already exists and is not empty" in err and "--overwrite" in err
    assert read_scheme(dst).method == "int4"  # untouched
    rc, out, _ = _run(capsys, "quantize", str(src), str(dst), "--method", "int8", "--no-progress", "--overwrite")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["method"] == "int8" and read_scheme(dst).method == "int8"
    rc, out, _ = _run(capsys, "plan", "--model", str(dst), "--root", str(FIXTURE), "--json")
    assert rc == 0
    rc, ref, _ = _run(capsys, "plan", "--model", str(src), "--root", str(FIXTURE), "--json")
    planned, plain = json.loads(out)["quantization"], json.loads(ref)["quantization"]
    assert (planned["value"], planned["source"]) == ("int8", "checkpoint")  # the plan says what the file stores
    assert plain["value"] == "none"


def test_quantize_bad_values_exit_2_naming_the_accepted_ones(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("custom_voice")
    rc, _, err = _run(capsys, "quantize", str(src), str(tmp_path / "a"), "--method", "int4", "--group-size", "48")
    assert rc == 2 and "quant_group_size=48; accepted: 32, 64, 128" in err
    rc, _, err = _run(capsys, "quantize", str(src), str(tmp_path / "b"), "--method", "int8", "--group-size", "64")
    assert rc == 2 and "applies to int4 only" in err
    with pytest.raises(SystemExit) as e:  # argparse: the choices are named
        main(["quantize", str(src), str(tmp_path / "c"), "--method", "fp8"])
    assert e.value.code == 2 and "invalid choice: 'fp8' (choose from" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
