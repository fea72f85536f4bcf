"""``omnilab bench --server URL``: a bounded load run against a running ``omnilab serve`` over HTTP.

At each concurrency level (default 1, 4, 8) that many clients each send ``--requests`` streamed speech requests
back to back (raw PCM); per level it reports TTFA p50/p95 (first audio byte at the client), RTF (wall / audio),
frames/s over the level's wall time, and errors; writes JSON and prints a table. Every request has a timeout and
the whole run a deadline, so it always ends."""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

from omnilab import settings
from omnilab.cli.main import Formatter
from omnilab.config import SAMPLE_RATE, SAMPLES_PER_FRAME as FRAME_SAMPLES


def load_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omnilab bench --server", formatter_class=Formatter,
                                 description="Load a running omnilab serve: concurrent streamed requests per level, "
                                             "TTFA p50/p95, RTF, frames/s and errors per level (JSON + table).")
    a = ap.add_argument
    a("--server", required=True, help="base URL, e.g. http://127.0.0.1:8091")
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


def run_level(url: str, headers: dict, clients: int, per_client: int, body: dict, timeout_s: float) -> dict[str, Any]:
    import httpx

    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as c:
            for k in range(per_client):
                res = one_request(c, {**body, "seed": 1000 * i + k})
                with lock:
                    results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s * per_client + 10)
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    ttfa = [r["ttfa_s"] * 1e3 for r in ok if r["ttfa_s"] is not None]
    rtf = [r["wall_s"] / r["audio_s"] for r in ok if r["audio_s"] > 0]
    frames = sum(r["frames"] for r in ok)
    errors = [r for r in results if not r["ok"]] + [{"error": "unfinished"}] * (clients * per_client - len(results))
    return {"concurrency": clients, "requests": clients * per_client, "ok": len(ok), "errors": len(errors),
            "error_samples": [e.get("error") for e in errors[:3]],
            "ttfa_ms_p50": percentile(ttfa, 0.5), "ttfa_ms_p95": percentile(ttfa, 0.95),
            "rtf_p50": percentile(rtf, 0.5), "rtf_p95": percentile(rtf, 0.95),
            "frames": frames, "frames_per_s": frames / wall if wall > 0 else None, "wall_s": wall}


def table(levels: list[dict[str, Any]]) -> str:
    cols = [("clients", "concurrency", "{}"), ("reqs", "requests", "{}"), ("errors", "errors", "{}"),
            ("TTFA p50 ms", "ttfa_ms_p50", "{:.0f}"), ("TTFA p95 ms", "ttfa_ms_p95", "{:.0f}"),
            ("RTF p50", "rtf_p50", "{:.3f}"), ("RTF p95", "rtf_p95", "{:.3f}"), ("frames/s", "frames_per_s", "{:.1f}")]
    rows = [[h for h, _, _ in cols]] + [[("-" if lv[k] is None else f.format(lv[k])) for _, k, f in cols]
                                        for lv in levels]
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)


def load_main(argv: list[str] | None = None) -> int:
    import httpx

    args = load_parser().parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or args.requests < 1:
        print("omnilab bench --server: --concurrency takes integers >= 1 (e.g. 1,4,8) and --requests >= 1")
        return 2
    url = args.server.rstrip("/")
    key = args.api_key or settings.raw("OMNILAB_API_KEY")
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(table([lv for lv in out_levels if "skipped" not in lv]))
    print(f"json: {out}")
    return 0 if all(lv.get("errors", 0) == 0 for lv in out_levels) else 1
