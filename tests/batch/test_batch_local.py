"""``omnilab batch`` without Ray (``--address none``, or ray not installed): the files, resume, the CLI's refusals."""
from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest
import soundfile as sf

from omnilab.cli.main import main
from omnilab.errors import UnsupportedError

EAGER = dict(backend="eager", dtype="float32", threads=1, progress=False)
MANIFEST = ("id,text,speaker,language,seed,max_new_tokens,temperature\n"
            "u1,Hello there.,vivian,english,1,8,\n"
            "u2,Second one.,ryan,english,2,8,0.8\n"
            "u3,Bad setting.,ryan,english,3,8,hot\n"
            "u4,Fourth.,serena,auto,4,6,\n")


@pytest.fixture()
def manifest(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text(MANIFEST)
    return p


def test_sequential_run_writes_each_row_once_equal_to_generate_and_resumes(manifest, tiny_ckpt, tmp_path):
    import torch

    from omnilab.batch import synthesize
    from omnilab.pipeline import Pipeline

    out, logs = tmp_path / "out", []
    threads = torch.get_num_threads()
    rep = synthesize(manifest, tiny_ckpt(), out, address="none", log=logs.append, **EAGER)
    assert rep.mode == "sequential" and rep.done == ("u1", "u2", "u4") and rep.restarts == 0
    assert [(e.line, e.id) for e in rep.failed] == [(4, "u3")]
    assert any("skipped line 4 (id 'u3'): temperature 'hot'" in s for s in logs)
    assert sorted(p.name for p in (out / "wav").iterdir()) == ["u1.wav", "u2.wav", "u4.wav"]
    df = pd.read_parquet(out / "metrics.parquet")
    assert list(df["id"]) == ["u1", "u2", "u4"] and list(df["line"]) == [2, 3, 5]
    assert (df["frames"] > 0).all() and np.allclose(df["audio_s"], df["frames"] * 0.08)
    assert (df["rtf"] > 0).all() and (df["ttfa_ms"] > 0).all() and set(df["actor"]) == {"local"}
    assert df["profile"].str.startswith("auto: ").all()
    assert list(df["seed"]) == [1, 2, 4]
    assert '"temperature": 0.8' in df.loc[1, "settings"]
    try:
        with Pipeline.from_pretrained(tiny_ckpt(), backend="eager", dtype="float32", num_threads=1) as pipe:
            ref = pipe.generate("Second one.", speaker="ryan", language="english", seed=2, max_new_tokens=8,
                                temperature=0.8)
    finally:
        torch.set_num_threads(threads)
    wav, sr = sf.read(out / "wav" / "u2.wav", dtype="float32")
    assert sr == 24000 and np.array_equal(wav, ref.audio)

    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "wav").iterdir()}
    (out / "wav" / "u4.wav").unlink()
    (out / "wav" / "u9.wav.part").write_bytes(b"half")  # a stopped run's partial file is never taken as done
    again = synthesize(manifest, tiny_ckpt(), out, address="none", log=logs.append, **EAGER)
    assert again.done == ("u4",) and again.skipped == ("u1", "u2")
    assert {n: t for n, t in mtimes.items() if n != "u4.wav"} == \
        {p.name: p.stat().st_mtime_ns for p in (out / "wav").iterdir() if p.name != "u4.wav"}
    df2 = pd.read_parquet(out / "metrics.parquet")
    assert list(df2["id"]) == ["u1", "u2", "u4"] and not list((out / "wav").glob("*.part"))
    assert dict(zip(df2["id"], df2["run_id"])) == {"u1": rep.run_id, "u2": rep.run_id, "u4": again.run_id}


def test_without_ray_the_same_call_runs_in_this_process_and_says_so(manifest, tiny_ckpt, tmp_path, monkeypatch):
    from omnilab.batch import synthesize

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    logs = []
    rep = synthesize(manifest, tiny_ckpt(), tmp_path / "o", log=logs.append, **EAGER)
    assert rep.mode == "sequential" and len(rep.done) == 3
    assert any("ray is not installed: running sequentially" in s for s in logs)
    with pytest.raises(UnsupportedError, match="needs Ray, which is not installed"):
        synthesize(manifest, tiny_ckpt(), tmp_path / "o2", address="auto", log=logs.append, **EAGER)


def test_cli_strict_refuses_before_starting_and_lists_lines(manifest, tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["batch", str(manifest), "--model", str(tiny_ckpt()), "--out", str(out), "--strict",
               "--address", "none", "--backend", "eager"])
    err = capsys.readouterr().err
    assert rc == 2 and "1 bad row(s)" in err and "line 4 (id 'u3')" in err
    assert not (out / "wav").exists() or not list((out / "wav").iterdir())


def test_cli_runs_the_good_rows_and_exits_1_for_the_bad_one(manifest, tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["batch", str(manifest), "--model", str(tiny_ckpt()), "--out", str(out), "--address", "none",
               "--backend", "eager", "--dtype", "float32", "--threads", "1", "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 1 and "failed  line 4 (id 'u3')" in cap.out and "mode              sequential" in cap.out
    assert sorted(p.stem for p in (out / "wav").iterdir()) == ["u1", "u2", "u4"]
