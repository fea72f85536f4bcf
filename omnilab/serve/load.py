"""``omnilab bench --server URL`` / ``--serve ARGS``: a bounded load run against ``omnilab serve`` over HTTP.

At each concurrency level (default 1, 4, 8) that many clients each send ``--requests`` streamed speech requests
back to back (raw PCM); per level it reports TTFA p50/p95 (first audio byte at the client), RTF (wall / audio),
frames/s over the level's wall time, and errors; writes JSON and prints a table. Every request has a timeout and
the whole run a deadline, so it always ends.

``--serve ARGS`` starts ``omnilab serve ARGS`` on a free loopback port itself, builds the same pipeline in this
process from the same arguments (``Engine.start``), and times the ``--compare`` level both ways in paired rounds
(order alternating): the server over HTTP, and as many threads each iterating ``Engine.start_stream`` (the
server's own way in, ``Pipeline.stream``) in this process. The ratio is the server's cost: HTTP, the event loop,
the hand-off to worker threads. Then SIGTERM stops the server."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from omnilab import settings
from omnilab.bench.memory import schedstat_snapshot, wait_pct
from omnilab.cli.main import Formatter
from omnilab.cli.serve import config_from_args, serve_parser
from omnilab.config import SAMPLE_RATE, SAMPLES_PER_FRAME as FRAME_SAMPLES
from omnilab.serve.config import ServeConfig


def load_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omnilab bench --server", formatter_class=Formatter,
                                 description="Load a running omnilab serve (--server URL), or start one and compare it "
                                             "with the same pipeline in this process (--serve ARGS): concurrent "
                                             "streamed requests per level, TTFA p50/p95, RTF, frames/s and errors per "
                                             "level (JSON + table).")
    a = ap.add_argument
    a("--server", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8091")
    a("--serve", default=None, metavar="ARGS",
      help="start `omnilab serve ARGS` on a free loopback port instead (quoted, e.g. \"--model DIR --quantization "
           "int4 --max-concurrency 8\"), compare it with the same pipeline in this process, stop it at the end")
    a("--compare", type=int, default=4, help="with --serve: the client count timed beside the in-process twin "
                                             "(0: no comparison)")
    a("--rounds", type=int, default=3, help="with --serve: paired rounds (server, in-process) of --compare")
    a("--start-timeout-s", type=float, default=900.0, help="with --serve: how long the server may take to start")
    a("--api-key", default=None, help="Bearer key (default: $OMNILAB_API_KEY)")
    a("--concurrency", default="1,4,8", help="comma-separated client counts, one level each")
    a("--requests", type=int, default=4, help="requests per client per level")
    a("--text", default="Hello from omnilab, running on the CPU.", help="input of every request")
    a("--voice", default=None, help="voice (default: the server's default voice)")
    a("--max-new-tokens", type=int, default=50, help="frames per request at most")
    a("--timeout-s", type=float, default=300.0, help="per-request timeout")
    a("--deadline-s", type=float, default=1800.0, help="the whole run's deadline; levels not started are skipped")
    a("--out", default="out/serve_bench.json", help="JSON result path")
    return ap


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def one_request(client, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttfa = None
    n = 0
    try:
        with client.stream("POST", "/v1/audio/speech", json=body) as r:
            if r.status_code != 200:
                r.read()
                return {"ok": False, "status": r.status_code, "error": r.text[:300]}
            for part in r.iter_raw():
                if part and ttfa is None:
                    ttfa = time.perf_counter() - t0
                n += len(part)
    except Exception as e:  # a timeout or a dropped connection counts as an error of its level
        return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}
    wall = time.perf_counter() - t0
    samples = n // 2
    return {"ok": True, "status": 200, "ttfa_s": ttfa, "wall_s": wall, "frames": samples // FRAME_SAMPLES,
            "audio_s": samples / SAMPLE_RATE}


def one_inprocess(engine, ctx, body: dict[str, Any], rid: str) -> dict[str, Any]:
    """``one_request``'s figures for the same body streamed in this process (``Engine.start_stream``)."""
    from omnilab.serve.speech import parse_speech  # lazy: numpy

    t0 = time.perf_counter()
    ttfa, frames, samples = None, 0, 0
    try:
        for chunk in engine.start_stream(parse_speech(body, ctx), rid):
            if ttfa is None and len(chunk.audio):
                ttfa = time.perf_counter() - t0
            frames += chunk.frame_end - chunk.frame_start
            samples += len(chunk.audio)
    except Exception as e:  # counted as an error of its level, as over HTTP
        return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "status": 200, "ttfa_s": ttfa, "wall_s": time.perf_counter() - t0, "frames": frames,
            "audio_s": samples / SAMPLE_RATE}


def run_level(url: str, headers: dict, clients: int, per_client: int, body: dict, timeout_s: float,
              inprocess: tuple | None = None) -> dict[str, Any]:
    """``clients`` threads each send ``per_client`` requests back to back: to the server at ``url``, or with
    ``inprocess=(engine, ctx)`` through that engine in this process. Run-queue wait over the level is kept."""
    import httpx

    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        if inprocess is not None:
            for k in range(per_client):
                res = one_inprocess(*inprocess, {**body, "seed": 1000 * i + k}, f"inprocess-{next(_IDS)}")
                with lock:
                    results.append(res)
            return
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as c:
            for k in range(per_client):
                res = one_request(c, {**body, "seed": 1000 * i + k})
                with lock:
                    results.append(res)

    snap = schedstat_snapshot()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s * per_client + 10)
    wall = time.perf_counter() - t0
    wait = wait_pct(snap, schedstat_snapshot())
    ok = [r for r in results if r["ok"]]
    ttfa = [r["ttfa_s"] * 1e3 for r in ok if r["ttfa_s"] is not None]
    rtf = [r["wall_s"] / r["audio_s"] for r in ok if r["audio_s"] > 0]
    frames = sum(r["frames"] for r in ok)
    errors = [r for r in results if not r["ok"]] + [{"error": "unfinished"}] * (clients * per_client - len(results))
    return {"concurrency": clients, "requests": clients * per_client, "ok": len(ok), "errors": len(errors),
            "error_samples": [e.get("error") for e in errors[:3]],
            "ttfa_ms_p50": percentile(ttfa, 0.5), "ttfa_ms_p95": percentile(ttfa, 0.95),
            "rtf_p50": percentile(rtf, 0.5), "rtf_p95": percentile(rtf, 0.95),
            "frames": frames, "frames_per_s": frames / wall if wall > 0 else None, "wall_s": wall,
            "wait_pct": wait, "ttfa_ms": [round(x, 1) for x in ttfa]}


_IDS = itertools.count()


def table(levels: list[dict[str, Any]]) -> str:
    cols = [("clients", "concurrency", "{}"), ("reqs", "requests", "{}"), ("errors", "errors", "{}"),
            ("TTFA p50 ms", "ttfa_ms_p50", "{:.0f}"), ("TTFA p95 ms", "ttfa_ms_p95", "{:.0f}"),
            ("RTF p50", "rtf_p50", "{:.3f}"), ("RTF p95", "rtf_p95", "{:.3f}"), ("frames/s", "frames_per_s", "{:.1f}"),
            ("wait %", "wait_pct", "{:.0f}")]
    rows = [[h for h, _, _ in cols]] + [[("-" if lv.get(k) is None else f.format(lv[k])) for _, k, f in cols]
                                        for lv in levels]
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)


def load_main(argv: list[str] | None = None) -> int:
    args = load_parser().parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or args.requests < 1 or args.rounds < 1 or args.compare < 0:
        print("omnilab bench --server: --concurrency takes integers >= 1 (e.g. 1,4,8), --requests and --rounds "
              "integers >= 1, --compare an integer >= 0")
        return 2
    if (args.server is None) == (args.serve is None):
        print("omnilab bench: give --server URL (a running server) or --serve ARGS (start one), not both")
        return 2
    if args.serve is None:
        return _load(args, levels, args.server.rstrip("/"), None, None)
    serve_argv = shlex.split(args.serve)
    bad = [x for x in serve_argv if x.split("=")[0] in ("--port", "--host")]
    if bad:
        print(f"omnilab bench --serve: {bad[0]} is chosen by the bench (a free loopback port); leave it out")
        return 2
    server = ServerProcess(serve_argv)
    try:
        try:
            server.start(args.start_timeout_s)
        except RuntimeError as e:
            print(f"omnilab bench --serve: {e}")
            return 2
        # the server parsed these already; the in-process twin and the client's key come from the same config
        return _load(args, levels, server.url, serve_argv, config_from_args(serve_parser().parse_args(serve_argv)))
    finally:
        server.stop()


def _load(args: argparse.Namespace, levels: list[int], url: str, serve_argv: list[str] | None,
          config: ServeConfig | None) -> int:
    """The levels against ``url``; with ``config`` (the started server's) also the paired in-process comparison."""
    import httpx

    # a started server's key is the one its ARGS gave it (--api-key or $OMNILAB_API_KEY, as config_from_args reads)
    key = args.api_key or (config.api_key if config is not None else settings.raw("OMNILAB_API_KEY"))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        info = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()
    except Exception as e:
        print(f"omnilab bench --server: {url} does not answer /v1/models ({type(e).__name__}: {e})")
        return 2
    body = {"input": args.text, "max_new_tokens": args.max_new_tokens, "response_format": "pcm",
            "stream_format": "audio"}
    if args.voice:
        body["voice"] = args.voice
    deadline = time.monotonic() + args.deadline_s
    out_levels = []
    for n in levels:
        if time.monotonic() > deadline:
            out_levels.append({"concurrency": n, "skipped": "deadline"})
            continue
        out_levels.append(run_level(url, headers, n, args.requests, body, args.timeout_s))
    res = {"server": url, "model": (info.get("data") or [{}])[0].get("id"), "body": body,
           "requests_per_client": args.requests, "levels": out_levels}
    if config is not None:
        res["server_command"] = "omnilab serve " + shlex.join(serve_argv)
        if args.compare:
            res["compare"] = compare_inprocess(url, headers, config, args, body, deadline)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(table([lv for lv in out_levels if "skipped" not in lv]))
    if "compare" in res:
        print(compare_line(res["compare"]))
    print(f"json: {out}")
    lv_ok = all(lv.get("errors", 0) == 0 for lv in out_levels)
    cmp_ok = all(r[k].get("errors", 0) == 0 for r in res.get("compare", {}).get("rounds", [])
                 for k in ("server", "inprocess"))
    return 0 if lv_ok and cmp_ok else 1


def compare_inprocess(url: str, headers: dict, config: ServeConfig, args: argparse.Namespace, body: dict,
                      deadline: float) -> dict[str, Any]:
    """Paired rounds of ``args.compare`` clients: over HTTP, and through the same pipeline built in this process
    from the server's ``config`` (order alternating per round). Ratio = server frames/s / in-process frames/s."""
    from omnilab.serve.app import speech_context  # lazy: fastapi
    from omnilab.serve.engine import Engine  # lazy: numpy

    engine = Engine(config)
    engine.start()
    try:
        twin = (engine, speech_context(config, engine, lambda name: None))
        rounds = []
        for r in range(args.rounds):
            if time.monotonic() > deadline:
                break
            got = {}
            for side in (("server", "inprocess") if r % 2 == 0 else ("inprocess", "server")):
                got[side] = run_level(url, headers, args.compare, args.requests, body, args.timeout_s,
                                      inprocess=twin if side == "inprocess" else None)
            s, i = got["server"]["frames_per_s"], got["inprocess"]["frames_per_s"]
            rounds.append({**got, "ratio": s / i if s and i else None})
    finally:
        engine.close()
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    med = lambda side, k: statistics.median([r[side][k] for r in rounds if r[side][k] is not None]) \
        if rounds else None  # noqa: E731
    return {"concurrency": args.compare, "rounds": rounds,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "server_frames_per_s": med("server", "frames_per_s"),
            "inprocess_frames_per_s": med("inprocess", "frames_per_s"),
            "server_ttfa_ms_p50": med("server", "ttfa_ms_p50"),
            "inprocess_ttfa_ms_p50": med("inprocess", "ttfa_ms_p50"),
            "server_wait_pct": med("server", "wait_pct"), "inprocess_wait_pct": med("inprocess", "wait_pct")}


def compare_line(c: dict[str, Any]) -> str:
    f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
    return (f"{c['concurrency']} clients, {len(c['rounds'])} paired rounds (medians): server "
            f"{f(c['server_frames_per_s'], '{:.1f}')} frames/s, same pipeline in-process "
            f"{f(c['inprocess_frames_per_s'], '{:.1f}')} frames/s, server / in-process "
            f"{f(c['ratio_median'], '{:.3f}')}; TTFA p50 {f(c['server_ttfa_ms_p50'], '{:.0f}')} vs "
            f"{f(c['inprocess_ttfa_ms_p50'], '{:.0f}')} ms; run-queue wait {f(c['server_wait_pct'], '{:.0f}')} vs "
            f"{f(c['inprocess_wait_pct'], '{:.0f}')} %")


ENTRY = "import sys; from omnilab.cli.main import main; sys.exit(main(sys.argv[1:]))"


class ServerProcess:
    """``omnilab serve ARGS`` in a child process on a free loopback port; its output goes to a temporary log that
    a failed start prints the end of. ``stop()``: SIGTERM (the server drains and exits), then a kill after 120 s."""

    def __init__(self, serve_argv: list[str]):
        self.serve_argv = serve_argv
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="omnilab-serve-", suffix=".log", delete=False)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> None:
        import httpx

        cmd = [sys.executable, "-c", ENTRY, "serve", *self.serve_argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        t_end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`omnilab serve {shlex.join(self.serve_argv)}` exited with status "
                                   f"{self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > t_end:
                raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s "
                                   f"(--start-timeout-s):\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n_chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n_chars:]

    def stop(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=30)
        finally:
            self.log.close()
            os.unlink(self.log.name)
