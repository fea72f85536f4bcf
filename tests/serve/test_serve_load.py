"""``omnilab bench --serve ARGS``: starts a server, loads it (with the key ARGS gave it), compares it with the same
pipeline in this process in paired rounds, stops it (no process left); bad arguments are refused before anything
starts."""
from __future__ import annotations

import json

import psutil
import pytest

from omnilab.cli.main import main


@pytest.mark.parametrize("argv, msg", [
    (["--server", "http://127.0.0.1:9", "--serve", "--model x"], "not both"),
    (["--serve", "--model x --port 8091"], "--port is chosen by the bench"),
    (["--serve", "--model x", "--rounds", "0"], "--rounds"),
    (["--serve", "--model x", "--concurrency", "4,a"], "--concurrency takes integers"),
])
def test_bad_load_arguments_are_refused_before_a_server_starts(argv, msg, capsys):
    before = set(psutil.Process().children(recursive=True))
    assert main(["bench", *argv]) == 2
    assert msg in capsys.readouterr().out
    assert set(psutil.Process().children(recursive=True)) == before


def test_a_server_that_cannot_start_is_reported_with_its_output(tmp_path, capsys):
    before = set(psutil.Process().children(recursive=True))
    rc = main(["bench", "--serve", f"--model {tmp_path / 'missing'} --backend eager", "--start-timeout-s", "300",
               "--out", str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert rc == 2 and "exited with status" in out and "missing" in out, out
    assert set(psutil.Process().children(recursive=True)) == before


@pytest.mark.slow
def test_serve_mode_compares_the_server_with_the_same_pipeline_in_process(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "bench.json"
    before = set(psutil.Process().children(recursive=True))
    rc = main(["bench", "--serve", f"--model {tiny_ckpt('custom_voice')} --backend eager --deploy-profile none "
               f"--max-concurrency 4 --voices-dir {tmp_path / 'voices'} --api-key k-123", "--concurrency", "1,2", "--requests", "1",
               "--compare", "2", "--rounds", "2", "--max-new-tokens", "5", "--timeout-s", "120", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert res["server_command"].startswith("omnilab serve --model ")
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
    c = res["compare"]
    assert c["concurrency"] == 2 and len(c["rounds"]) == 2
    for r in c["rounds"]:
        for side in ("server", "inprocess"):
            lv = r[side]
            assert lv["errors"] == 0 and lv["ok"] == 2 and lv["frames"] > 0 and len(lv["ttfa_ms"]) == 2, (side, lv)
        assert r["ratio"] == pytest.approx(r["server"]["frames_per_s"] / r["inprocess"]["frames_per_s"])
    assert "paired rounds" in text and "server / in-process" in text
    assert set(psutil.Process().children(recursive=True)) == before, "the server process was left running"
