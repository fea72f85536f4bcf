"""Reading batch manifests: the three formats agree, typed settings, every bad row named by its line."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from omnilab.batch.manifest import check_for_model, from_records, read_manifest
from omnilab.errors import InputError

ROWS = [
    {"id": "a1", "text": "Hello there.", "speaker": "vivian", "language": "english", "seed": 3, "temperature": 0.7,
     "do_sample": False, "max_new_tokens": 8},
    {"id": "a2", "text": "Second line.", "speaker": "ryan", "top_k": 20},
]


def _write_csv(path, text: str):
    path.write_text(text)
    return path


def test_csv_jsonl_parquet_give_the_same_utterances(tmp_path):
    cols = ["id", "text", "speaker", "language", "seed", "temperature", "do_sample", "max_new_tokens", "top_k"]
    df = pd.DataFrame(ROWS, columns=cols)
    df.to_csv(tmp_path / "m.csv", index=False)
    df.to_parquet(tmp_path / "m.parquet", index=False)
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    got = {fmt: read_manifest(tmp_path / f"m.{fmt}") for fmt in ("csv", "jsonl", "parquet")}
    for m in got.values():
        assert m.errors == ()
        assert [u.id for u in m.utterances] == ["a1", "a2"]
        assert dict(m.utterances[0].settings) == {"speaker": "vivian", "language": "english", "seed": 3,
                                                  "temperature": 0.7, "do_sample": False, "max_new_tokens": 8}
        assert dict(m.utterances[1].settings) == {"speaker": "ryan", "top_k": 20}  # empty cells: model defaults
        assert isinstance(m.utterances[0].settings["seed"], int)
    assert [u.line for u in got["csv"].utterances] == [2, 3]  # the header is line 1
    assert [u.line for u in got["jsonl"].utterances] == [1, 2]


def test_bad_rows_are_named_by_line_and_the_rest_is_kept(tmp_path):
    m = read_manifest(_write_csv(tmp_path / "m.csv", (
        'id,text,speaker,seed,temperature,do_sample\n'
        'ok1,"A quoted, multi\nline text.",vivian,1,,\n'       # lines 2-3
        'bad-temp,Warm.,vivian,2,hot,\n'                       # line 4
        ',No id.,vivian,3,,\n'                                 # line 5
        'ok1,Duplicate.,vivian,4,,\n'                          # line 6
        'has space,Bad id.,vivian,5,,\n'                       # line 7
        'bad-bool,Flag.,vivian,6,,maybe\n'                     # line 8
        'short,Too few cells\n'                                # line 9
        '\n'
        'ok2,Fine.,ryan,1.0,0.5,yes\n')))                      # line 11
    assert [(u.id, u.line) for u in m.utterances] == [("ok1", 2), ("ok2", 11)]
    assert m.utterances[0].text == "A quoted, multi\nline text."
    assert dict(m.utterances[1].settings) == {"speaker": "ryan", "seed": 1, "temperature": 0.5, "do_sample": True}
    errs = {e.line: str(e) for e in m.errors}
    assert sorted(errs) == [4, 5, 6, 7, 8, 9]
    assert errs[4] == "line 4 (id 'bad-temp'): temperature 'hot' is not a finite number"
    assert "id is empty" in errs[5]
    assert "duplicate id 'ok1' (first on line 2)" in errs[6]
    assert "cannot name a file" in errs[7]
    assert "maybe" in errs[8] and "true/false" in errs[8]
    assert "2 cells but the header has 6" in errs[9]


def test_jsonl_and_parquet_errors_carry_their_line_or_row(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"id": "a", "text": "One."}\n\n{"id": "b", "text": \n[1, 2]\n'
                                      '{"id": "c", "text": "Three.", "seed": "x"}\n{"id": "d", "txt": "typo"}\n')
    m = read_manifest(tmp_path / "m.jsonl")
    assert [u.id for u in m.utterances] == ["a"]
    assert [(e.line, e.id) for e in m.errors] == [(3, None), (4, None), (5, "c"), (6, "d")]
    assert "not valid JSON" in m.errors[0].message and "unknown field(s) ['txt']" in m.errors[3].message
    pd.DataFrame([{"id": "p1", "text": "Hi."}, {"id": "p2", "text": ""}]).to_parquet(tmp_path / "m.parquet")
    p = read_manifest(tmp_path / "m.parquet")
    assert [str(e) for e in p.errors] == ["row 2 (id 'p2'): text is empty; give the sentence to speak"]


def test_what_refuses_the_whole_manifest(tmp_path):
    with pytest.raises(InputError, match=r"unknown column\(s\) \['tempreature'\].*accepted columns"):
        read_manifest(_write_csv(tmp_path / "a.csv", "id,text,tempreature\nx,Hi.,0.5\n"))
    with pytest.raises(InputError, match=r"missing column\(s\) \['text'\]"):
        read_manifest(_write_csv(tmp_path / "b.csv", "id,speaker\nx,vivian\n"))
    with pytest.raises(InputError, match="unknown format '.txt'"):
        read_manifest(_write_csv(tmp_path / "c.txt", "id,text\n"))
    with pytest.raises(InputError, match="empty"):
        read_manifest(_write_csv(tmp_path / "d.csv", ""))


def test_ref_audio_is_a_path_relative_to_the_manifest(tmp_path):
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "r.wav").write_bytes(b"RIFF")
    m = read_manifest(_write_csv(tmp_path / "m.csv", "id,text,ref_audio\nx,Hi.,refs/r.wav\ny,Hi.,refs/missing.wav\n"))
    assert m.utterances[0].settings["ref_audio"] == str(tmp_path.resolve() / "refs" / "r.wav")
    assert [(e.line, e.id) for e in m.errors] == [(3, "y")] and "no such file" in m.errors[0].message


def test_the_manifest_fields_are_generate_s_keywords():
    from omnilab.batch.manifest import REQUEST_FIELDS, SAMPLING_TYPES
    from omnilab.pipeline import _REQUEST_KEYS, _SAMPLING_KEYS

    assert REQUEST_FIELDS == _REQUEST_KEYS and tuple(SAMPLING_TYPES) == _SAMPLING_KEYS


def test_rows_the_model_would_refuse_are_found_before_anything_runs(tiny_ckpt):
    rows = [{"id": "ok", "text": "Hi.", "speaker": "vivian"}, {"id": "nospk", "text": "Hi."},
            {"id": "who", "text": "Hi.", "speaker": "nobody"}, {"id": "lang", "text": "Hi.", "speaker": "ryan",
                                                               "language": "klingon"}]
    m = check_for_model(from_records(rows), tiny_ckpt("custom_voice"))
    assert [u.id for u in m.utterances] == ["ok"]
    assert [(e.line, e.id) for e in m.errors] == [(2, "nospk"), (3, "who"), (4, "lang")]
    assert "accepted: " in m.errors[1].message and "klingon" in m.errors[2].message
    vd = check_for_model(from_records([{"id": "v", "text": "Hi.", "speaker": "vivian"},
                                       {"id": "w", "text": "Hi.", "instruct": "Calm."}]), tiny_ckpt("voice_design"))
    assert [u.id for u in vd.utterances] == ["w"] and "no built-in speakers" in vd.errors[0].message
