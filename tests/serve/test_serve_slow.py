"""The speech server's expensive checks: every format on every variant, an uploaded voice across a restart, the
page streaming in Chromium, the load-run tool, and on vLLM: concurrent streams, disconnect, a killed engine core
(503, then recovery) and SIGTERM (drains, exits, leaves no process)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import soundfile as sf
from playwright.sync_api import sync_playwright

from _serve_common import servers  # noqa: F401  (the fixture)
from _serve_common import (API_KEY, SlowSteps, ThreadServer, clip_wav_bytes, data_url, free_port, tiny_config,
                           wait_idle)

pytestmark = pytest.mark.slow
FRAME_SAMPLES = 1920
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required"]


def _voice_body(variant: str) -> dict:
    if variant == "custom_voice":
        return {"voice": "serena"}
    if variant == "voice_design":
        return {"task_type": "VoiceDesign", "instructions": "A bright, quick voice."}
    return {"ref_audio": data_url(clip_wav_bytes()), "x_vector_only_mode": True}


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design", "base"])
def test_round_trips_in_wav_pcm_flac(servers, variant):
    s = servers(variant)
    with s.client() as c:
        for fmt in ("wav", "pcm", "flac"):
            for rate in (24000, 8000):
                body = {"input": "Round trip.", "response_format": fmt, "sample_rate": rate, "max_new_tokens": 5,
                        "seed": 7, **_voice_body(variant)}
                r = c.post("/v1/audio/speech", json=body)
                assert r.status_code == 200, (fmt, rate, r.text)
                frames = int(r.headers["x-vllm-omni-output-tokens"])
                n24 = frames * FRAME_SAMPLES
                want = n24 if rate == 24000 else -(-n24 * rate // 24000)
                if fmt == "pcm":
                    assert r.headers["content-type"] == "audio/pcm" and len(r.content) == 2 * want
                else:
                    wav, sr = sf.read(io.BytesIO(r.content), dtype="float32")
                    assert sr == rate and len(wav) == want, (fmt, rate, len(wav), want)
                if variant == "base":
                    assert r.headers["x-vllm-omni-input-audio-tokens"] == "0"  # x-vector only: no ICL codes
    if variant == "base":  # in-context cloning from a file:// clip under the allowed directory
        clip = Path(s.config.allowed_media_dir) / "ref.wav"
        clip.write_bytes(clip_wav_bytes(seconds=0.6))
        with s.client() as c:
            r = c.post("/v1/audio/speech", json={"input": "Cloned.", "ref_audio": f"file://{clip}",
                                                 "ref_text": "A reference.", "max_new_tokens": 4})
        assert r.status_code == 200, r.text
        assert int(r.headers["x-vllm-omni-input-audio-tokens"]) > 0  # the clip's codec frames


def test_uploaded_voice_survives_a_restart(tiny_ckpt, tmp_path):
    cfg = tiny_config(tiny_ckpt("base"), tmp_path)
    s = ThreadServer(cfg).start()
    try:
        with s.client() as c:
            files = {"audio_sample": ("me.wav", clip_wav_bytes(seconds=0.8), "audio/wav")}
            r = c.post("/v1/audio/voices", files=files,
                       data={"name": "narrator", "consent": "consent-1", "speaker_description": "warm"})
            assert r.status_code == 200, r.text
            info = r.json()["voice"]
            assert info["name"] == "narrator" and info["consent"] == "consent-1" and "ref_text" not in info
            r = c.post("/v1/audio/voices", files=files, data={"name": "narrator", "consent": "consent-1"})
            assert r.status_code == 409 and "already exists" in r.text
            assert c.post("/v1/audio/speech", json={"input": "Mine.", "voice": "narrator",
                                                    "max_new_tokens": 4}).status_code == 200
    finally:
        s.stop()
    assert (tmp_path / "voices" / "narrator.safetensors").is_file()
    s = ThreadServer(tiny_config(tiny_ckpt("base"), tmp_path)).start()
    try:
        with s.client() as c:
            listed = c.get("/v1/audio/voices").json()
            assert listed["voices"] == ["narrator"] and listed["uploaded_voices"] == [info]
            r = c.post("/v1/audio/speech", json={"input": "Still mine.", "voice": "narrator", "max_new_tokens": 4})
            assert r.status_code == 200, r.text
            assert c.delete("/v1/audio/voices/narrator").json()["success"] is True
            assert c.get("/v1/audio/voices").json()["uploaded_voices"] == []
        assert not (tmp_path / "voices" / "narrator.safetensors").exists()
    finally:
        s.stop()


def test_page_plays_a_stream_in_chromium(servers):
    s = servers("custom_voice")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(f"{s.url}/?api_key={API_KEY}", timeout=30_000)
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            assert page.locator("#voice option").count() >= 2
            page.fill("#text", "Played in the browser.")
            page.fill("#max", "12")
            with SlowSteps(s.engine, 0.05):
                page.click("#speak")
                page.wait_for_function("() => window.omnilabStats.state === 'done'", timeout=60_000)
            stats = page.evaluate("() => ({...window.omnilabStats})")
            assert stats["error"] is None and stats["chunks"] >= 2 and stats["ttfa_ms"] > 0, stats
            assert stats["samples"] % FRAME_SAMPLES == 0 and stats["samples"] > 0
            page.wait_for_function("() => window.omnilabStats.played === window.omnilabStats.chunks",
                                   timeout=30_000)  # every scheduled buffer played to its end
            assert "TTFA" in page.inner_text("#stats")
        finally:
            browser.close()


def test_page_clones_an_uploaded_clip_in_chromium(servers, tmp_path):
    s = servers("base")
    clip = tmp_path / "me.wav"
    clip.write_bytes(clip_wav_bytes(seconds=0.6))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(f"{s.url}/?api_key={API_KEY}", timeout=30_000)
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            assert page.is_visible("#clip") and not page.is_visible("#instructions")
            page.set_input_files("#clip", str(clip))
            page.fill("#max", "4")
            page.click("#speak")
            page.wait_for_function("() => ['done', 'error'].includes(window.omnilabStats.state)", timeout=60_000)
            stats = page.evaluate("() => ({...window.omnilabStats})")
            assert stats["state"] == "done" and stats["samples"] > 0 and stats["ttfa_ms"] > 0, stats
        finally:
            browser.close()


def test_bench_against_the_server_reports_every_level(tiny_ckpt, tmp_path, capsys):
    from omnilab.cli.main import main

    s = ThreadServer(tiny_config(tiny_ckpt("custom_voice"), tmp_path, max_concurrency=8, max_queue=8)).start()
    try:
        out = tmp_path / "bench.json"
        rc = main(["bench", "--server", s.url, "--api-key", API_KEY, "--concurrency", "1,4,8", "--requests", "1",
                   "--max-new-tokens", "4", "--timeout-s", "120", "--out", str(out)])
    finally:
        s.stop()
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4, 8]
    for lv in res["levels"]:
        assert lv["errors"] == 0 and lv["ok"] == lv["concurrency"] and lv["ttfa_ms_p50"] > 0 and lv["frames"] > 0
        assert lv["ttfa_ms_p95"] >= lv["ttfa_ms_p50"] and lv["rtf_p50"] > 0 and lv["frames_per_s"] > 0
    assert "TTFA p50 ms" in text and "frames/s" in text


# ---- vLLM ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_server(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-vllm")
    cfg = tiny_config(tiny_ckpt("custom_voice"), tmp, backend="vllm", deploy="workers", deploy_profile="auto",
                      max_concurrency=4, max_queue=4)
    s = ThreadServer(cfg).start()
    yield s
    s.stop()


@pytest.mark.vllm
def test_vllm_concurrent_streams_then_disconnect(vllm_server):
    s = vllm_server
    results = {}

    def one(i):
        with s.client() as c:
            results[i] = c.post("/v1/audio/speech", json={"input": f"Request {i}.", "max_new_tokens": 6, "seed": i,
                                                          "response_format": "pcm"})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == [0, 1, 2]
    for r in results.values():
        assert r.status_code == 200, r.text
        assert len(r.content) == 2 * FRAME_SAMPLES * int(r.headers["x-vllm-omni-output-tokens"]) > 0
    assert wait_idle(s.engine)
    talker = s.engine.pipe.talker
    with SlowSteps(s.engine, 0.1):
        c = s.client()
        with c.stream("POST", "/v1/audio/speech", json={"input": "Cut short.", "max_new_tokens": 64,
                                                        "stream_format": "audio", "response_format": "pcm"}) as r:
            next(r.iter_raw())
        c.close()
        t0 = time.monotonic()
        while (talker.num_live or s.engine.running) and time.monotonic() - t0 < 1.0:
            time.sleep(0.01)
        assert talker.num_live == 0 and s.engine.running == 0


@pytest.mark.vllm
def test_vllm_killed_engine_core_is_503_then_recovers(vllm_server):
    s = vllm_server
    core = next(pid for pid, role in s.engine.pipe.processes().items() if role == "talker-engine-core")
    os.kill(core, signal.SIGKILL)
    with s.client() as c:
        r = c.post("/v1/audio/speech", json={"input": "After the crash.", "max_new_tokens": 4})
        assert r.status_code == 503, r.text
        assert "engine" in r.json()["error"]["message"] and r.headers.get("retry-after")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            h = c.get("/health")
            if h.status_code == 200:
                break
            assert h.status_code == 503 and h.json()["status"] in ("restarting", "ready")
            time.sleep(0.5)
        assert c.get("/health").json() == {"status": "ok"}
        r = c.post("/v1/audio/speech", json={"input": "Back again.", "max_new_tokens": 4})
        assert r.status_code == 200, r.text
        assert 'omnilab:engine_restarts_total{model_name="tiny"} 1.0' in c.get("/metrics").text
    assert core not in s.engine.pipe.processes()


@pytest.mark.vllm
def test_sigterm_drains_in_flight_requests_and_leaves_no_process(tiny_ckpt, tmp_path):
    port = free_port()
    env = {**os.environ, "OMNILAB_API_KEY": API_KEY, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    entry = "import sys; from omnilab.cli.main import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", entry, "serve", "--model", str(tiny_ckpt("custom_voice")),
           "--port", str(port), "--backend", "vllm", "--deploy", "workers", "--dtype", "float32", "--threads", "1",
           "--voices-dir", str(tmp_path / "voices"), "--drain-timeout-s", "60"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not up in 600 s"
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "vLLM workers expected"
        got = {}

        def slow_request():
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
                got["r"] = c.post("/v1/audio/speech", json={"input": "Finish me first.", "max_new_tokens": 40,
                                                            "response_format": "pcm"})
        t = threading.Thread(target=slow_request)
        t.start()
        time.sleep(0.3)  # admitted
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert got["r"].status_code == 200, got["r"].text
        assert len(got["r"].content) == 2 * FRAME_SAMPLES * int(got["r"].headers["x-vllm-omni-output-tokens"])
        assert proc.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
