"""``omnilab.batch.synthesize`` on a two-node Ray cluster started on this machine (1 CPU per node).

Twelve rows over the three variants (one manifest per checkpoint), each output once and equal to a local
``generate`` with the same settings; an actor killed mid-run is restarted and nothing is lost or duplicated;
a rerun redoes only what is missing.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pandas as pd
import pytest

from _deps import need  # noqa: E402
import soundfile as sf

ray = need("ray")
pytestmark = pytest.mark.slow

RUN = dict(backend="eager", dtype="float32", progress=False)
ROWS = {
    "custom_voice": [dict(id="cv1", text="Hello from the cluster.", speaker="vivian", seed=1),
                     dict(id="cv2", text="A second sentence.", speaker="ryan", seed=2, temperature=0.7),
                     dict(id="cv3", text="Greedy this time.", speaker="serena", do_sample=False,
                          subtalker_do_sample=False),
                     dict(id="cv4", text="And the last one.", speaker="aiden", language="english", seed=4)],
    "voice_design": [dict(id="vd1", text="Designed voice one.", instruct="A calm, low voice.", seed=5),
                     dict(id="vd2", text="Designed voice two.", instruct="A bright, fast voice.", seed=6),
                     dict(id="vd-bad", text="Bad row.", instruct="Any.", top_k="abc"),
                     dict(id="vd3", text="Designed voice three.", instruct="Whispering.", seed=7, top_k=10),
                     dict(id="vd4", text="Designed voice four.", instruct="Loud.", seed=8)],
    "base": [dict(id="b1", text="Cloned, with the transcript.", ref_audio="ref.wav", ref_text="A short reference.",
                  seed=9),
             dict(id="b2", text="Cloned from the embedding.", ref_audio="ref.wav", seed=10),
             dict(id="b3", text="Another clone.", ref_audio="ref.wav", ref_text="A short reference.", seed=11),
             dict(id="b4", text="The last clone.", ref_audio="ref.wav", x_vector_only_mode=True, seed=12)],
}
COLS = ["id", "text", "speaker", "instruct", "language", "ref_audio", "ref_text", "x_vector_only_mode", "seed",
        "temperature", "top_k", "do_sample", "subtalker_do_sample", "max_new_tokens"]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of 1 CPU each on this machine (``local_cluster``: fixed agent ports, a longer raylet start
    wait and retries, for a loaded host)."""
    from omnilab.batch.cluster import local_cluster

    c = local_cluster(2, cpus_per_node=1)
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


def _manifest(path, rows):
    t = np.arange(36000) / 24000
    sf.write(path.parent / "ref.wav", (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24000, subtype="FLOAT")
    pd.DataFrame([{"max_new_tokens": 8, **r} for r in rows], columns=COLS).to_csv(path, index=False)
    return path


def _local(ckpt, rows, base_dir):
    import torch

    from omnilab.pipeline import Pipeline

    threads, out = torch.get_num_threads(), {}
    try:
        with Pipeline.from_pretrained(ckpt, backend="eager", dtype="float32", num_threads=1) as pipe:
            for r in rows:
                kw = {k: v for k, v in r.items() if k not in ("id", "text")}
                if "ref_audio" in kw:
                    kw["ref_audio"] = str(base_dir / kw["ref_audio"])
                out[r["id"]] = pipe.generate(r["text"], max_new_tokens=8, **kw).audio
    finally:
        torch.set_num_threads(threads)
    return out


def test_twelve_rows_over_three_variants_on_two_nodes(cluster, tiny_ckpt, tmp_path):
    from omnilab.batch import synthesize

    nodes, total = set(), 0
    for variant, rows in ROWS.items():
        d = tmp_path / variant
        d.mkdir()
        m = _manifest(d / "manifest.csv", rows)
        logs = []
        rep = synthesize(m, tiny_ckpt(variant), d / "out", address=cluster.address, log=logs.append, **RUN)
        good = [r for r in rows if r["id"] != "vd-bad"]
        assert rep.mode == "ray" and rep.restarts == 0 and len(rep.actors) == 2
        assert len({a["node"] for a in rep.actors}) == 2, rep.actors  # one actor per Ray node
        assert all(a["threads"] == 1 for a in rep.actors)  # the node's 1 CPU
        assert sorted(rep.done) == sorted(r["id"] for r in good)
        if variant == "voice_design":  # the malformed row is reported with its line; the rest ran
            assert [(e.line, e.id) for e in rep.failed] == [(4, "vd-bad")] and "top_k 'abc'" in rep.failed[0].message
            assert any("skipped line 4 (id 'vd-bad')" in s for s in logs)
        else:
            assert rep.failed == ()
        assert sorted(os.listdir(d / "out" / "wav")) == sorted(f"{r['id']}.wav" for r in good)
        df = pd.read_parquet(d / "out" / "metrics.parquet")
        assert sorted(df["id"]) == sorted(r["id"] for r in good) and df["id"].is_unique
        assert df[["frames", "audio_s", "ttfa_ms", "rtf", "node", "actor", "profile", "settings"]].notna().all().all()
        nodes |= set(df["node"])
        ref = _local(tiny_ckpt(variant), good, d)
        for rid, audio in ref.items():
            wav, sr = sf.read(d / "out" / "wav" / f"{rid}.wav", dtype="float32")
            assert sr == 24000 and np.array_equal(wav, audio), f"{variant} {rid}: differs from a local generate"
        total += len(good)
    assert total == 12 and len(nodes) == 2


def test_a_killed_actor_is_restarted_and_a_rerun_resumes(cluster, tiny_ckpt, tmp_path):
    from omnilab.batch import synthesize

    rows = [dict(id=f"k{i}", text=f"Sentence number {i}.", speaker="vivian", seed=i) for i in range(8)]
    m = _manifest(tmp_path / "m.csv", rows)
    out, killed = tmp_path / "out", []

    def kill_first_a0(rec):
        if not killed and rec["actor"] == "a0":
            killed.append(rec["pid"])
            os.kill(rec["pid"], signal.SIGKILL)  # it holds its next row: that row must be run again elsewhere

    rep = synthesize(m, tiny_ckpt(), out, address=cluster.address, on_record=kill_first_a0, log=lambda s: None,
                     **RUN)
    assert killed and rep.restarts == 1 and rep.failed == ()
    assert sorted(rep.done) == sorted(r["id"] for r in rows) and len(rep.done) == len(set(rep.done))
    assert sorted(os.listdir(out / "wav")) == sorted(f"{r['id']}.wav" for r in rows)  # no .part left behind
    df = pd.read_parquet(out / "metrics.parquet")
    assert sorted(df["id"]) == sorted(r["id"] for r in rows) and df["id"].is_unique
    assert "a0.r1" in set(df["actor"]) and killed[0] not in set(df.loc[df["actor"] == "a0.r1", "pid"])

    # rerun after losing two outputs: only those two are synthesized, the others are left as they were
    for rid in ("k2", "k5"):
        (out / "wav" / f"{rid}.wav").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in (out / "wav").iterdir()}
    again = synthesize(m, tiny_ckpt(), out, address=cluster.address, log=lambda s: None, **RUN)
    assert sorted(again.done) == ["k2", "k5"] and len(again.skipped) == 6
    assert {n: (out / "wav" / n).stat().st_mtime_ns for n in before} == before
    df2 = pd.read_parquet(out / "metrics.parquet")
    runs = dict(zip(df2["id"], df2["run_id"]))
    assert len(df2) == 8 and {k for k, v in runs.items() if v == again.run_id} == {"k2", "k5"}
    assert all(runs[k] == rep.run_id for k in runs if k not in ("k2", "k5"))
    # and with nothing left to do no actor is started
    third = synthesize(m, tiny_ckpt(), out, address=cluster.address, log=lambda s: None, **RUN)
    assert third.done == () and len(third.skipped) == 8 and third.mode == "none" and third.actors == ()
