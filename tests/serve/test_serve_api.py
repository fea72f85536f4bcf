"""The speech server's fast checks on tiny eager checkpoints, one server per variant for the module: a round trip,
streaming (first bytes before the third frame, SSE events), disconnect freeing the engine, the WebSocket, and a
batch of bad requests each answered 4xx with a clear message while the server keeps serving."""
from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import pytest
import soundfile as sf
from websockets.sync.client import connect as ws_connect

from _serve_common import servers  # noqa: F401  (the fixture)
from _serve_common import API_KEY, SlowSteps, clip_wav_bytes, data_url, wait_idle

FRAME_SAMPLES = 1920


def test_round_trip_wav_with_usage_and_timing_headers(servers):
    s = servers("custom_voice")
    with s.client() as c:
        r = c.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "ryan", "max_new_tokens": 6, "seed": 1})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav"
    wav, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    frames = int(r.headers["x-vllm-omni-output-tokens"])
    assert sr == 24000 and 1 <= frames <= 6 and len(wav) == frames * FRAME_SAMPLES
    assert int(r.headers["x-vllm-omni-input-text-tokens"]) > 0
    assert int(r.headers["x-vllm-omni-total-tokens"]) == int(r.headers["x-vllm-omni-input-tokens"]) + frames
    assert float(r.headers["x-omnilab-ttfa-ms"]) > 0 and float(r.headers["x-omnilab-rtf"]) > 0


def test_streamed_first_bytes_arrive_before_the_third_frame(servers):
    s = servers("custom_voice")
    with SlowSteps(s.engine, 0.15) as ends, s.client() as c:
        body = {"input": "A streamed sentence.", "voice": "aiden", "max_new_tokens": 8, "seed": 2,
                "response_format": "pcm", "stream_format": "audio"}
        with c.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200, r.read()
            it = r.iter_raw()
            first = next(it)
            t_first = time.perf_counter()
            rest = b"".join(it)
    assert len(ends) >= 3, f"only {len(ends)} talker steps ran"
    assert t_first < ends[2], f"first bytes {ends[2] - t_first:.3f} s after the third frame"
    total = len(first) + len(rest)
    assert total % (2 * FRAME_SAMPLES) == 0 and total > 0


def test_sse_stream_has_deltas_then_done_with_usage(servers):
    s = servers("custom_voice")
    body = {"input": "Events please.", "max_new_tokens": 5, "seed": 3, "stream": True, "response_format": "pcm"}
    with s.client() as c:
        r = c.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] >= 1
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == done["usage"]["output_tokens"] * FRAME_SAMPLES * 2
    assert done["ttfa_ms"] > 0 and done["rtf"] > 0


def test_disconnect_mid_stream_frees_the_request_within_one_second(servers):
    s = servers("custom_voice")
    talker = s.engine.pipe.talker
    assert wait_idle(s.engine)
    with SlowSteps(s.engine, 0.1):
        c = s.client()
        body = {"input": "A long sentence that is cut short.", "max_new_tokens": 64, "stream_format": "audio",
                "response_format": "pcm"}
        with c.stream("POST", "/v1/audio/speech", json=body) as r:
            next(r.iter_raw())
            assert talker.num_live == 1
        c.close()
        t0 = time.monotonic()
        while (talker.num_live or s.engine.running) and time.monotonic() - t0 < 1.0:
            time.sleep(0.01)
        assert talker.num_live == 0 and s.engine.running == 0, \
            f"{talker.num_live} live requests, {s.engine.running} slots 1 s after the disconnect"
        with s.client(timeout_s=0.8) as c:  # a gathered answer: the client gives up waiting
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/audio/speech", json={"input": "Too slow for me.", "max_new_tokens": 64})
        assert wait_idle(s.engine, 1.0), "a gathered request outlived its client by 1 s"
    with s.client() as c:  # still serving
        assert c.post("/v1/audio/speech", json={"input": "Next.", "max_new_tokens": 3}).status_code == 200


def test_over_the_concurrency_and_queue_caps_is_429_naming_them(servers):
    s = servers("custom_voice")  # --max-concurrency 2, --max-queue 2
    assert wait_idle(s.engine)
    codes = []

    def one():
        with s.client() as c:
            codes.append(c.post("/v1/audio/speech", json={"input": "Busy.", "max_new_tokens": 6}))
    with SlowSteps(s.engine, 0.1):
        threads = [threading.Thread(target=one) for _ in range(5)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=120)
    assert sorted(r.status_code for r in codes) == [200, 200, 200, 200, 429]
    busy = next(r for r in codes if r.status_code == 429)
    assert "--max-concurrency 2, --max-queue 2" in busy.json()["error"]["message"] and busy.headers["retry-after"]


def test_websocket_speaks_each_flushed_utterance(servers):
    s = servers("custom_voice")
    url = s.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with ws_connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "eric", "max_new_tokens": 4, "response_format": "pcm",
                            "stream_audio": True}))
        ws.send(json.dumps({"type": "input.text", "text": "Hello "}))
        ws.send(json.dumps({"type": "input.text", "text": "world."}))
        ws.send(json.dumps({"type": "input.done"}))
        start = json.loads(ws.recv(timeout=60))
        assert start["type"] == "audio.start" and start["sentence_text"] == "Hello world."
        audio, msg = b"", ws.recv(timeout=60)
        while isinstance(msg, bytes):
            audio += msg
            msg = ws.recv(timeout=60)
        done = json.loads(msg)
        assert done == {"type": "audio.done", "utterance_index": 0, "sentence_index": 0, "total_bytes": len(audio),
                        "error": False} and len(audio) % (2 * FRAME_SAMPLES) == 0 and audio
        assert json.loads(ws.recv(timeout=60)) == {"type": "session.done", "utterance_index": 0, "total_sentences": 1}
        ws.send(json.dumps({"type": "input.text", "text": 5}))
        assert "string" in json.loads(ws.recv(timeout=60))["message"]
        ws.send(json.dumps({"type": "session.close"}))


def test_websocket_disconnect_mid_utterance_frees_the_request_within_one_second(servers):
    s = servers("custom_voice")
    assert wait_idle(s.engine)
    url = s.url.replace("http://", "ws://") + f"/v1/audio/speech/stream?api_key={API_KEY}"
    with SlowSteps(s.engine, 0.1):
        with ws_connect(url, open_timeout=30) as ws:
            ws.send(json.dumps({"type": "session.config", "max_new_tokens": 64, "response_format": "pcm"}))
            ws.send(json.dumps({"type": "input.text", "text": "Never finished."}))
            ws.send(json.dumps({"type": "input.done"}))
            assert json.loads(ws.recv(timeout=60))["type"] == "audio.start"
            t0 = time.monotonic()
            while not s.engine.pipe.talker.num_live and time.monotonic() - t0 < 10:
                time.sleep(0.01)
        t0 = time.monotonic()  # the socket is closed: no binary frame was ever asked for
        assert wait_idle(s.engine, 1.0), f"still live {time.monotonic() - t0:.2f} s after the close"


def test_metrics_models_voices_and_health(servers):
    s = servers("custom_voice")
    with s.client() as c:
        text = c.get("/metrics").text
        for name in ("omnilab:speech_requests_total", "omnilab:time_to_first_audio_seconds_bucket",
                     "omnilab:real_time_factor_bucket", "omnilab:frames_per_second", "vllm:num_requests_running",
                     "vllm:num_requests_waiting", "omnilab:generation_frames_total"):
            assert name in text, name
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
        voices = c.get("/v1/audio/voices").json()
        assert "vivian" in voices["voices"] and voices["uploaded_voices"] == []
    with s.client(key=None) as c:
        assert c.get("/health").json() == {"status": "ok"}


def _bad_cases(tmp_outside):
    big = "x" * 301
    nan_clip = data_url(clip_wav_bytes(fill=float("nan")))
    good_clip = data_url(clip_wav_bytes())
    S = "/v1/audio/speech"
    return [  # (variant, request kwargs, status, words the message must hold)
        ("custom_voice", dict(json={"input": ""}), 400, "input: text is empty"),
        ("custom_voice", dict(json={"input": "   "}), 400, "empty"),
        ("custom_voice", dict(json={"input": big}), 400, "at most 300"),
        ("custom_voice", dict(json={"voice": "ryan"}), 400, "input is required"),
        ("custom_voice", dict(json={"input": 42}), 400, "input must be a string"),
        ("custom_voice", dict(json={"input": "Hi.", "voice": "nobody"}), 400, "accepted: "),
        ("custom_voice", dict(json={"input": "Hi.", "response_format": "mp3"}), 400, "accepted: wav, pcm, flac"),
        ("custom_voice", dict(json={"input": "Hi.", "response_format": "ogg"}), 400, "accepted: wav, pcm, flac"),
        ("custom_voice", dict(json={"input": "Hi.", "temperature": "hot"}), 400, "temperature must be"),
        ("custom_voice", dict(json={"input": "Hi.", "top_k": -1}), 400, "top_k must be"),
        ("custom_voice", dict(json={"input": "Hi.", "top_p": 1.5}), 400, "top_p must be in (0, 1]"),
        ("custom_voice", dict(json={"input": "Hi.", "seed": -1}), 400, "seed must be"),
        ("custom_voice", dict(json={"input": "Hi.", "stream": "yes"}), 400, "stream must be true, false or null"),
        ("custom_voice", dict(json={"input": "Hi.", "speed": 2.0}), 400, "accepted: 1.0"),
        ("custom_voice", dict(json={"input": "Hi.", "sample_rate": 16000}), 400, "accepted: 8000, 24000"),
        ("custom_voice", dict(json={"input": "Hi.", "max_new_tokens": 65}), 400, "cap of 64"),
        ("custom_voice", dict(json={"input": "Hi.", "max_new_tokens": 0}), 400, "max_new_tokens must be"),
        ("custom_voice", dict(json={"input": "Hi.", "colour": "blue"}), 400, "unknown field(s) ['colour']"),
        ("custom_voice", dict(json={"input": "Hi.", "language": "klingon"}), 400, "accepted: auto"),
        ("custom_voice", dict(json={"input": "Hi.", "stream_format": "mp4"}), 400, "accepted: audio, sse"),
        ("custom_voice", dict(json={"input": "Hi.", "stream": True, "response_format": "flac"}), 400,
         "streaming needs response_format pcm or wav"),
        ("custom_voice", dict(json={"input": "Hi.", "initial_codec_chunk_frames": 0}), 400, "in [1, 25]"),
        ("custom_voice", dict(json={"input": "Hi.", "model": "gpt-4o-mini-tts"}), 400, "accepted: tiny"),
        ("custom_voice", dict(json={"input": "Hi.", "task_type": "Base"}), 400, "accepted: CustomVoice"),
        ("custom_voice", dict(json={"input": "Hi.", "task_type": "Clone"}), 400, "accepted: CustomVoice, VoiceDesign"),
        ("custom_voice", dict(json={"input": "Hi.", "ref_audio": good_clip}), 400, "inferred"),
        ("custom_voice", dict(content=b"{not json", headers={"content-type": "application/json"}), 400, "not JSON"),
        ("custom_voice", dict(json=["Hi."]), 400, "must be a JSON object"),
        ("voice_design", dict(json={"input": "Hi.", "task_type": "VoiceDesign"}), 400,
         "instructions: instruct is required"),
        ("voice_design", dict(json={"input": "Hi.", "task_type": "VoiceDesign", "instructions": "Calm.",
                                    "voice": "vivian"}), 400, "voice: speaker: the voice_design model has no built-in"),
        ("voice_design", dict(json={"input": "Hi.", "instructions": "A calm voice."}), 400,
         "CustomVoice (inferred: give task_type explicitly)"),
        ("base", dict(json={"input": "Hi.", "task_type": "Base"}), 400, "ref_audio is required"),
        ("base", dict(json={"input": "Hi.", "ref_audio": nan_clip}), 400, "non-finite samples"),
        ("base", dict(json={"input": "Hi.", "ref_audio": "https://example.com/a.wav"}), 400,
         "http(s) URLs are refused"),
        ("base", dict(json={"input": "Hi.", "ref_audio": f"file://{tmp_outside}"}), 400,
         "outside the allowed media directory"),
        ("base", dict(json={"input": "Hi.", "ref_audio": "data:audio/wav;base64,@@@"}), 400, "not valid base64"),
        ("base", dict(json={"input": "Hi.", "ref_audio": "data:audio/wav;base64," + "A" * 600_000}), 413,
         "--max-upload-bytes"),
        ("base", dict(json={"input": "Hi.", "ref_audio": data_url(b"RIFF....nonsense")}), 400,
         "not a readable audio file"),
        ("base", dict(json={"input": "Hi.", "voice": "ghost"}), 400, "not an uploaded voice"),
        ("base", dict(json={"input": "Hi.", "ref_audio": good_clip, "x_vector_only_mode": "no"}), 400,
         "x_vector_only_mode must be"),
        ("base", dict(json={"input": "Hi.", "ref_audio": good_clip, "x_vector_only_mode": False}), 400,
         "ref_text (the transcript of ref_audio) is required"),
    ]


def test_bad_requests_are_4xx_naming_the_problem_and_the_server_keeps_serving(servers, tmp_path):
    outside = tmp_path / "outside.wav"
    outside.write_bytes(clip_wav_bytes())
    seen = 0
    for variant, kw, status, words in _bad_cases(outside):
        with servers(variant).client() as c:
            r = c.post("/v1/audio/speech", **kw)
        assert r.status_code == status, (variant, kw.get("json"), r.status_code, r.text)
        msg = r.json()["error"]["message"]
        assert words in msg, (variant, kw.get("json"), msg)
        seen += 1
    s, b = servers("custom_voice"), servers("base")
    with s.client(key=None) as c:
        r = c.post("/v1/audio/speech", json={"input": "Hi."})
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    with s.client(key="wrong") as c:
        assert c.get("/v1/models").status_code == 401 and c.get("/metrics").status_code == 401
    with b.client() as c:
        files = {"audio_sample": ("big.wav", b"0" * 500_000, "audio/wav")}
        r = c.post("/v1/audio/voices", files=files, data={"name": "big", "consent": "c1"})
        assert r.status_code == 413 and "--max-upload-bytes" in r.text
        files = {"audio_sample": ("a.wav", clip_wav_bytes(), "audio/wav")}
        r = c.post("/v1/audio/voices", files=files, data={"name": "no-consent"})
        assert r.status_code == 400 and "consent is required" in r.text
        r = c.post("/v1/audio/voices", files=files, data={"name": "../etc", "consent": "c1"})
        assert r.status_code == 400 and "is not accepted" in r.text
        r = c.post("/v1/audio/voices", files={"audio_sample": ("n.wav", clip_wav_bytes(fill=float("nan")))},
                   data={"name": "nan", "consent": "c1"})
        assert r.status_code == 400 and "non-finite" in r.text
        r = c.delete("/v1/audio/voices/ghost")
        assert r.status_code == 404 and "not found" in r.text
    assert seen + 8 >= 20
    with s.client() as c:  # still serving, and nothing is left running
        assert c.post("/v1/audio/speech", json={"input": "Still here.", "max_new_tokens": 3}).status_code == 200
        assert c.get("/health").json() == {"status": "ok"}
    for v in ("custom_voice", "voice_design", "base"):
        assert wait_idle(servers(v).engine) and servers(v).engine.waiting == 0, v


def test_pipeline_cancel_from_another_thread_ends_the_stream_at_its_next_step(servers):
    """``Pipeline.cancel``: what a disconnect calls; no wait for the owner thread, the request ends before the
    next talker step (here in the middle of a 40-frame chunk)."""
    from omnilab.errors import InputError
    from omnilab.models.code2wav_stream import ChunkSchedule

    pipe = servers("custom_voice").engine.pipe
    assert wait_idle(servers("custom_voice").engine)
    it = pipe.stream("Cancel me.", speaker="vivian", max_new_tokens=60, request_id="cancel-1",
                     chunk_schedule=ChunkSchedule(1, (), 40))
    with pytest.raises(InputError, match="request_id 'cancel-1' is already live"):
        pipe.stream("Twice.", speaker="vivian", request_id="cancel-1")
    assert next(it).frame_end == 1
    with SlowSteps(servers("custom_voice").engine, 0.05) as ends:
        import threading

        threading.Timer(0.2, pipe.cancel, args=("cancel-1",)).start()
        with pytest.raises(StopIteration):
            next(it)
    assert len(ends) <= 8, f"{len(ends)} steps ran after the cancel"
    assert pipe.talker.num_live == 0
