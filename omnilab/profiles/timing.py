"""The compute dtype and the linear paths chosen from a short timing of the candidates on this machine.

Plain Python (no torch): :class:`PathTimes` holds what :func:`omnilab.tuning.timing.path_times` measured (ms over
the same decode matrices for each candidate; docs/kernels.md#measured-dtype-and-linear-paths), and the rules below
turn it into choices with the figures in their reasons. Both the planner (``dtype`` field) and
:func:`omnilab.checkpoint.load.resolve_dtype` (no profile) use :func:`dtype_from_times`, so the two agree.

- dtype: float32 unless the CPU has native bf16 *and* bf16 compute's fastest decode path beats fp32 compute's
  (bf16 storage through omnilab's kernel) by more than :data:`MARGIN` (a tie keeps the more exact fp32);
- bf16 decode linears (1-16 rows, bf16 compute): omnilab's kernel (x widened to fp32, bf16 weights expanded in
  registers, the result rounded to bf16) when it beats torch's bf16 GEMV, else torch;
- prefill GEMMs (more than 16 rows over bf16-stored matrices under fp32 compute): bf16 GEMM (x rounded to bf16,
  fp32 result) when it beats widening the matrix to fp32, else fp32.

Without a timing (``OMNILAB_PLAN_TIMING=off``, or no torch here) the ISA rule is the prior: bf16 where the CPU
has native bf16, the kernel for bf16 decode, fp32 prefill.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from omnilab.hardware import native_bf16

MARGIN = 0.97        # a candidate must be this much faster (3 %) to replace the more exact fp32 / torch default
TIMING_ENV = "OMNILAB_PLAN_TIMING"
TIMING_MODES = ("auto", "on", "off", "refresh")
NOISY_WAIT = 0.10    # run-queue wait above this share of a timing's CPU time: other load; the timing is not cached


@dataclass(frozen=True)
class PathTimes:
    """ms per pass over the timing's matrices: ``decode`` {candidate: {rows: ms}}, ``prefill`` {candidate: ms}."""
    decode: Mapping[str, Mapping[int, float]]   # "fp32-kernel" | "bf16-torch" | "bf16-kernel" -> {1: ms, 4: ms}
    prefill: Mapping[str, float]                # "fp32" | "bf16" -> ms for prefill_rows rows
    matrix_bytes: int                           # bf16 bytes of the matrices one decode pass reads
    prefill_rows: int
    threads: int
    key: str = ""                               # what the cache entry is keyed on (CPU, torch, kernel build)
    cached: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], cached: bool = False) -> "PathTimes":
        dec = {c: {int(r): float(ms) for r, ms in rows.items()} for c, rows in d["decode"].items()}
        return cls(dec, {c: float(v) for c, v in d["prefill"].items()}, int(d["matrix_bytes"]),
                   int(d["prefill_rows"]), int(d["threads"]), str(d.get("key", "")), cached)

    def to_dict(self) -> dict[str, Any]:
        return {"decode": {c: {str(r): ms for r, ms in rows.items()} for c, rows in self.decode.items()},
                "prefill": dict(self.prefill), "matrix_bytes": self.matrix_bytes, "prefill_rows": self.prefill_rows,
                "threads": self.threads, "key": self.key}

    def step_ms(self, candidate: str) -> float | None:
        """A decode candidate's cost: 1 row weighted 3 to 1 with 4 rows (one stream is the common case)."""
        rows = self.decode.get(candidate)
        if not rows or 1 not in rows:
            return None
        return (3 * rows[1] + rows.get(4, rows[1])) / 4

    def gbps(self, candidate: str, rows: int = 1) -> float:
        return self.matrix_bytes / (self.decode[candidate][rows] * 1e-3) / 1e9

    def describe(self) -> str:
        parts = [f"{c} {r[1]:.1f}/{r.get(4, float('nan')):.1f} ms" for c, r in self.decode.items() if 1 in r]
        pre = ", ".join(f"{c} {ms:.1f} ms" for c, ms in self.prefill.items())
        wait = self.extra.get("wait_share")
        noisy = wait is not None and wait > NOISY_WAIT
        how = "cached timing" if self.cached else "timing" + (
            f" (run-queue wait {100 * wait:.0f} %: noisy, not cached)" if noisy else "")
        return (f"{how} at {self.threads} thread(s) over {self.matrix_bytes / 2**20:.0f} MiB of bf16 decode matrices, "
                f"1/4 rows: {', '.join(parts)}; {self.prefill_rows}-row prefill: {pre}")


def dtype_from_times(native: bool, native_why: str, times: PathTimes | None) -> tuple[str, str]:
    """``(dtype name, reason)`` for ``dtype="auto"`` (see the module docstring)."""
    if times is None:
        if native:
            return "bfloat16", f"{native_why}: native bf16 halves the bytes per frame (ISA rule: no timing)"
        return "float32", f"{native_why}; fp32 (bf16 only with avx512_bf16, AMX or Arm bf16)"
    fp32 = times.step_ms("fp32-kernel")
    bf16 = min((t for t in (times.step_ms("bf16-torch"), times.step_ms("bf16-kernel")) if t), default=None)
    if not native:
        return "float32", f"{native_why}; fp32 ({times.describe()})"
    if fp32 is None or (bf16 is not None and bf16 < MARGIN * fp32):
        return "bfloat16", f"{native_why}; bf16 compute decodes fastest ({times.describe()})"
    return "float32", (f"{native_why}, but fp32 compute over bf16-stored matrices decodes as fast or faster "
                       f"({fp32:.1f} vs bf16 {bf16:.1f} ms per pass; {times.describe()})")


def bf16_decode_from_times(times: PathTimes | None) -> tuple[str, str]:
    """``("kernel" | "torch", reason)`` for bf16 compute's 1-16-row linears."""
    if times is None or times.step_ms("bf16-kernel") is None:
        return "kernel", "omnilab's kernel (fp32 accumulation over the bf16 weights; ISA rule: no timing)"
    k, t = times.step_ms("bf16-kernel"), times.step_ms("bf16-torch")
    if t is not None and t < MARGIN * k:
        return "torch", f"torch's bf16 GEMV is faster here ({t:.1f} vs kernel {k:.1f} ms per pass)"
    return "kernel", f"omnilab's kernel ({k:.1f} ms per pass vs torch's bf16 {t:.1f})"


def prefill_from_times(native: bool, times: PathTimes | None) -> tuple[str, str]:
    """``("bf16" | "fp32", reason)`` for fp32 compute's prefill GEMMs over bf16-stored matrices."""
    if times is None or "bf16" not in times.prefill or not native:
        why = "no native bf16" if not native else "ISA rule: no timing"
        return "fp32", f"matrices widened to fp32 for the call (exact; {why})"
    b, f = times.prefill["bf16"], times.prefill["fp32"]
    if b < MARGIN * f:
        return "bf16", (f"bf16 GEMM (activations rounded to bf16, fp32 results): {b:.1f} vs {f:.1f} ms for "
                        f"{times.prefill_rows} rows")
    return "fp32", f"widening to fp32 is as fast ({f:.1f} vs bf16 {b:.1f} ms for {times.prefill_rows} rows)"


# The figures the ISA prior rests on, quoted in its reasons: one per case, its machine and the tables' link.
MEASURED = ("Intel Xeon with AMX, 0.6B decoder, 2 threads: bf16 15.9 vs fp32 24.7 ms/frame in 25-frame blocks; "
            "docs/kernels.md#code2wav-bf16")
MEASURED_NO_AMX = ("Intel Xeon with oneDNN capped below AMX, 0.6B decoder, 1 thread: bf16 91.0 vs fp32 49.9 ms/frame "
                   "in 25-frame blocks; docs/kernels.md#code2wav-bf16")
EMULATED = "bf16 is emulated on this CPU (no avx512_bf16/AMX): expect it slower than fp32"


CODE2WAV_ENV = "OMNILAB_CODE2WAV_DTYPE"
# code2wav's bf16 GEMMs change the audio (~28 dB SNR from fp32): taken only where the timing has them clearly faster
# (x1.25; the shared 2-core machine's timings swing ~10 %), not for a tie
C2W_MARGIN = 0.8


def asks_fp32(asked: Any) -> bool:
    """Whether the pipeline's requested dtype (a name or torch dtype) is float32."""
    return str(asked).strip().lower().removeprefix("torch.") in ("float32", "fp32")


def code2wav_dtype_rule(raw: str, flags: frozenset[str], arch: str, asked: Any = "",
                        times: Mapping[str, Any] | None = None) -> tuple[str, bool, str]:
    """``(dtype, native bf16, reason)`` for code2wav's conv decoder: ``raw`` is ``OMNILAB_CODE2WAV_DTYPE``'s mode
    (auto / float32 / bfloat16, already checked), ``asked`` the pipeline's requested dtype (a name or torch dtype;
    "" = not asked), ``times`` this machine's timing (``tuning.code2wav_timing.code2wav_times``; None: none).
    auto, native bf16, float32 not asked: bf16 where the timing has it at most :data:`C2W_MARGIN` of fp32's time,
    else fp32; without a timing the ISA prior: bf16 with AMX (measured faster), fp32 with avx512_bf16 alone. The one
    copy of the rule: ``tuning.code2wav_dtype`` (what runs) and the planner's cost model (what it estimates, from
    the prior) both call it."""
    native, isa = native_bf16(flags, arch)
    if raw == "float32":
        return "float32", native, f"{CODE2WAV_ENV}=float32: fp32 everywhere (reference numerics)"
    if raw == "bfloat16":
        why = f"{CODE2WAV_ENV}=bfloat16: conv decoder GEMMs in bf16, fp32 elsewhere ({isa})"
        return "bfloat16", native, why if native else f"{why}; {EMULATED}"
    if not native:
        return "float32", False, f"{isa}: fp32 (bf16 GEMMs would be emulated)"
    if asks_fp32(asked):
        return "float32", True, (f"{isa}, but float32 was asked for the pipeline ({asked!r}): code2wav keeps fp32 "
                                 f"numerics too ({CODE2WAV_ENV}=bfloat16 forces bf16)")
    if times is not None:
        b, f = float(times["bfloat16"]), float(times["float32"])
        how = (f"{'cached timing' if times.get('cached') else 'timing'} here at {times.get('threads', '?')} "
               f"thread(s), conv decoder blocks on a {times.get('frames', '?')}-frame block: bf16 {b:.1f} vs fp32 "
               f"{f:.1f} ms/frame "
               f"(x{f / b:.2f})")
        if b <= C2W_MARGIN * f:
            return "bfloat16", True, (f"{isa}: conv decoder GEMMs in bf16, fp32 elsewhere: {how}, at least "
                                      f"x{1 / C2W_MARGIN:.2f}; audio ~28 dB SNR from fp32")
        return "float32", True, f"{isa}: fp32, bf16 not faster by x{1 / C2W_MARGIN:.2f} here: {how}"
    if "amx_bf16" not in flags:
        return "float32", True, f"{isa} but no AMX: fp32, bf16 GEMMs measured slower there ({MEASURED_NO_AMX})"
    return "bfloat16", True, (f"{isa}: conv decoder GEMMs in bf16 (AMX), fp32 elsewhere, measured faster "
                              f"({MEASURED}); audio ~28 dB SNR from fp32")
