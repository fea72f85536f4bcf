"""What ``omnilab bench`` prints and writes: one table (a line per configuration) and one JSON file.

The JSON (``BenchResult.to_dict``; read back with ``load_bench``):

- ``command``: the exact command line (``omnilab bench ...``) and ``environment``: the ``OMNILAB_*`` and ISA-cap
  variables it ran under; ``meta``: machine, checkpoint, settings, bandwidth probe, bytes per frame, notes;
- ``points``: one per configuration in a fixed shape (``BenchResult.points``: backend, dtype asked and run,
  quantization, ms per frame, RTF, frames/s, TTFA, ``effective_gbps`` at one stream and ``n_effective_gbps`` at the
  largest concurrency (weight bytes per step / step time: N rows share one read), ``fidelity``, and with
  ``--interleave`` ``step_vs_auto`` / ``ttfa_vs_auto``: the row / its ``+auto`` sibling, paired per round), beside
  ``gemv_gbps`` and ``stream_read_gbps`` (the machine's bandwidth probes);
- ``rows``: one per configuration (and the reference row), each with the keys the table prints
  (``TABLE_COLUMNS``) and more (labels, ranges over rounds, code2wav chunk costs);
- ``rounds``: per round, the order the configurations ran in and the floor measured before it;
- ``summary``: one record per configuration x concurrency point x round; ``requests``: one per request.

Files written by the earlier ``omnilab bench`` (``summary``/``requests``/``meta`` only) load too.
"""
from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

WAIT_FLAG_PCT = 10.0  # run-queue wait above this share of a row's CPU time flags the row as noisy


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ms(v: float) -> str:
    """A time in ms to 3 significant digits at most (0.6B steps: 145; tiny: 21.1; floors of tiny: 0.24)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _fmt(fmt: str | Callable[[float], str], v: Any) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if not _num(v):
        return str(v)
    return fmt(v) if callable(fmt) else fmt.format(v)


def _ttfa(r: dict) -> str | None:
    if not _num(r.get("ttfa_ms")):
        return None
    parts = [r.get("prefill_ms"), r.get("first_chunk_ms")]
    return _ms(r["ttfa_ms"]) + (f" ({_ms(parts[0])} + {_ms(parts[1])})" if all(_num(p) for p in parts) else "")


def _ratios(r: dict) -> str | None:
    if not _num(r.get("speedup")):
        return None
    ceil = f" ({r['e2e_ceiling']:.2f})" if _num(r.get("e2e_ceiling")) else ""
    talker = f"{r['talker_speedup']:.2f}" if _num(r.get("talker_speedup")) else "-"
    return f"{r['speedup']:.2f} / {talker}{ceil}"


# (header, row keys it shows, format of one key or a function of the row). "N" in a header becomes the largest
# concurrency. Columns empty in every row are left out of the printed table (e.g. the code2wav chunk costs
# unless --code2wav-chunks, the N-stream columns with --concurrency 1).
TABLE_COLUMNS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("config", ("config",), "{}"), ("node", ("node",), "{}"), ("runs", ("runs",), "{:.0f}"),  # node: --address
    ("step ms", ("step_ms",), _ms), ("talker", ("talker_ms",), _ms), ("predictor", ("predictor_ms",), _ms),
    ("vLLM overhead %", ("overhead_pct",), "{:.1f}"),
    ("floor ms", ("floor_ms",), _ms), ("step / floor", ("step_floor_ratio",), "{:.2f}"),
    ("step / first row", ("step_ratio",), "{:.3f}"),  # --interleave: paired per round (bench.paired)
    ("step / auto", ("step_vs_auto",), "{:.3f}"), ("TTFA / auto", ("ttfa_vs_auto",), "{:.3f}"),
    ("code2wav ms/frame", ("code2wav_ms_per_frame",), _ms),
    ("TTFA ms (prefill + 1st chunk)", ("ttfa_ms", "prefill_ms", "first_chunk_ms"), _ttfa),
    ("RTF", ("rtf",), "{:.2f}"),
    ("N-stream step ms", ("n_step_ms",), _ms), ("N-stream frames/s", ("n_frames_per_s",), "{:.1f}"),
    ("N / 1: end to end / talker (ceiling)", ("speedup", "talker_speedup", "e2e_ceiling"), _ratios),
    ("c2w 25f ms/frame", ("code2wav_25f_ms_per_frame",), _ms),
    ("c2w 100f ms/frame", ("code2wav_100f_ms_per_frame",), _ms),
    ("c2w stream ms/frame", ("code2wav_stream_steady_ms_per_frame",), _ms),
    ("c2w 1-frame chunk ms", ("code2wav_1f_chunk_ms",), _ms),
    ("decode GB/s", ("effective_gbps",), "{:.1f}"), ("N-stream decode GB/s", ("n_effective_gbps",), "{:.1f}"),
    ("talker GB/s", ("talker_gbps",), "{:.1f}"), ("predictor GB/s", ("predictor_gbps",), "{:.1f}"),
    ("c0 agree", ("fidelity_c0_agreement",), "{:.3f}"), ("c0 KL", ("fidelity_c0_kl_mean",), "{:.2g}"),
    ("cp agree", ("fidelity_cp_agreement",), "{:.3f}"), ("wave SNR dB", ("fidelity_wave_snr_db",), "{:.1f}"),
    ("peak RSS GiB", ("peak_rss_gib",), "{:.2f}"), ("init s", ("init_s",), "{:.0f}"),
    ("run-queue wait %", ("wait_pct",), "{:.0f}"),
)


def table_keys() -> tuple[str, ...]:
    """Every row key the table shows."""
    return tuple(dict.fromkeys(k for _, keys, _ in TABLE_COLUMNS for k in keys))


def cell(column: tuple[str, tuple[str, ...], Any], row: dict) -> str | None:
    """One table cell (None: the row has no value for it)."""
    _, keys, fmt = column
    if callable(fmt) and len(keys) > 1:
        return fmt(row)
    return _fmt(fmt, row.get(keys[0]))


class BenchResult:
    """``rows`` (list of dicts, one per configuration), ``summary`` / ``requests`` (DataFrames), ``meta``,
    ``rounds`` and ``command``. Renders as the table in notebooks."""

    def __init__(self, rows: list[dict], summary, requests, meta: dict[str, Any], rounds: list[dict] | None = None,
                 command: str = "", environment: dict | None = None):
        self.rows, self.summary, self.requests, self.meta = rows, summary, requests, meta
        self.rounds, self.command, self.environment = rounds or [], command, environment or {}

    @property
    def wait_flag_pct(self) -> float:
        return float(self.meta.get("settings", {}).get("wait_flag_pct", WAIT_FLAG_PCT))

    def noisy(self) -> list[str]:
        """Configurations whose run-queue wait is above the flag: other load competed for the CPUs."""
        return [r["config"] for r in self.rows if _num(r.get("wait_pct")) and r["wait_pct"] > self.wait_flag_pct]

    def table(self) -> str:
        n = max((int(r["n_streams"]) for r in self.rows if _num(r.get("n_streams"))), default=0)
        cols = [(h.replace("N-stream", f"{n}-stream").replace("N / 1", f"{n} / 1"), k, f) for h, k, f in TABLE_COLUMNS]
        cells = [[cell(c, r) for c in cols] for r in self.rows]
        keep = [i for i in range(len(cols)) if i == 0 or any(c[i] is not None for c in cells)]
        flag = self.wait_flag_pct
        for r, c in zip(self.rows, cells):  # the flag on the wait column
            if _num(r.get("wait_pct")) and r["wait_pct"] > flag:
                c[-1] += " !"
        grid = [[cols[i][0] for i in keep]] + [[c[i] if c[i] is not None else "-" for i in keep] for c in cells]
        w = [max(len(g[i]) for g in grid) for i in range(len(keep))]
        lines = [" | ".join(x.ljust(w[i]) for i, x in enumerate(g)) for g in grid]
        lines.insert(1, "-|-".join("-" * x for x in w))
        sr = (self.meta.get("stream_read") or {}).get("gbps")
        if _num(sr):  # what the GB/s columns read against; a part above it is served (partly) from cache
            lines.append(f"streaming read (x.sum()): {sr:.1f} GB/s")
        b16 = self.meta.get("fidelity_bf16")
        if isinstance(b16, dict) and _num(b16.get("c0_agreement")):  # the rounding of bf16 compute alone, beside
            lines.append(f"bf16 compute, unquantized, on the same checkpoint: c0 agree {b16['c0_agreement']:.3f}, "
                         f"c0 KL {b16.get('c0_kl_mean', float('nan')):.2g}, cp agree "
                         f"{b16.get('cp_agreement', float('nan')):.3f}")
        if self.noisy():
            lines.append(f"! run-queue wait above {flag:g} %: other load competed for the CPUs during "
                         f"{', '.join(self.noisy())}; those figures are inflated (rerun on a quieter host)")
        return "\n".join(lines)

    def points(self) -> list[dict[str, Any]]:
        """One record per configuration in the published shape (``points`` of the JSON): what was asked and what
        ran, the speed figures of one stream, the largest concurrency's frames/s, fidelity, decode bandwidth."""
        out = []
        for r in self.rows:
            if r.get("config") == "reference":
                continue
            out.append({"config": r["config"], "backend": str(r["config"]).split("+")[0],
                        "dtype_requested": r.get("dtype_requested"), "dtype": r.get("dtype_ran"),
                        "quantization": r.get("quantization"), "talker_ms_per_frame": r.get("step_ms"),
                        "code2wav_ms_per_frame": r.get("code2wav_ms_per_frame"), "rtf_mean": r.get("rtf"),
                        "frames_per_s": r.get("frames_per_s"), "n_streams": r.get("n_streams"),
                        "n_frames_per_s": r.get("n_frames_per_s"), "ttfa_ms_p50": r.get("ttfa_ms"),
                        "decode_bytes_per_frame": r.get("decode_bytes_per_frame"),
                        "effective_gbps": r.get("effective_gbps"), "n_effective_gbps": r.get("n_effective_gbps"),
                        "talker_gbps": r.get("talker_gbps"), "predictor_gbps": r.get("predictor_gbps"),
                        "fidelity": r.get("fidelity"),
                        # --interleave with an +auto sibling: this row / auto, median of per-round ratios
                        "step_vs_auto": r.get("step_vs_auto"), "ttfa_vs_auto": r.get("ttfa_vs_auto"),
                        "wait_pct": r.get("wait_pct")})
        return out

    def to_dict(self) -> dict[str, Any]:
        bw, sr = self.meta.get("bandwidth") or {}, self.meta.get("stream_read") or {}
        return {"bench": "omnilab", "command": self.command, "environment": self.environment, "meta": self.meta,
                "gemv_gbps": bw.get("gbps"), "stream_read_gbps": sr.get("gbps"), "points": self.points(),
                "rows": self.rows, "rounds": self.rounds, "summary": self.summary.to_dict("records"),
                "requests": self.requests.to_dict("records")}

    def save(self, out_dir: str | os.PathLike, name: str) -> Path:
        """Write ``<out_dir>/<name>.json``; refuses to replace a file under the repository's ``data/``."""
        d = Path(out_dir)
        path = d / f"{name}.json"
        data_dir = Path(__file__).resolve().parents[2] / "data"
        if path.exists() and path.resolve().is_relative_to(data_dir.resolve()):
            raise FileExistsError(f"{path} exists under {data_dir} (committed results); choose another --out or --name")
        d.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(self.to_dict()), indent=1, default=_jsonable))
        return path

    def __repr__(self) -> str:
        return f"BenchResult(configs={[r['config'] for r in self.rows]}, points={len(self.summary)})"

    def _repr_html_(self) -> str:
        head = f"<b>omnilab bench</b>: <code>{html.escape(self.command or '(command not recorded)')}</code>"
        if not self.rows:  # a file of the earlier omnilab bench: its per-point summary
            return f"<div>{head}{self.summary.round(3).to_html(index=False, border=0)}</div>"
        return f"<div>{head}<pre>{html.escape(self.table())}</pre></div>"


def load_bench(path: str | os.PathLike) -> BenchResult:
    """Read a benchmark JSON written by :meth:`BenchResult.save` (or by the earlier ``omnilab bench``)."""
    import pandas as pd

    d = json.loads(Path(path).read_text())
    return BenchResult(d.get("rows", []), pd.DataFrame(d.get("summary", [])), pd.DataFrame(d.get("requests", [])),
                       d.get("meta", {}), d.get("rounds"), d.get("command", ""), d.get("environment"))


def _finite(v: Any) -> Any:
    """NaN and infinities as null (strict JSON readers refuse them)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    if isinstance(v, (set, tuple)):
        return list(v)
    return str(v)
