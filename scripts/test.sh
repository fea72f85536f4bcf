#!/usr/bin/env bash
# Run omnilab's tests (sets up .venv first if it is missing). Tiers and timings: docs/testing.md.
#
#   ./scripts/test.sh                      the fast tier (-m "not slow"): every path once, within 15 min on 2 cores
#   ./scripts/test.sh --all                every test
#   ./scripts/test.sh --avx2-one-thread    as an AVX2-only machine at one thread runs them: omnilab's kernels in
#                                          their AVX2 builds, MKL and oneDNN capped to AVX2, fp32 compute,
#                                          OMP_NUM_THREADS=1 (combine with --all; CI runs it over the numeric tests)
#   ./scripts/test.sh tests/kernels -k gemv    further arguments go to pytest (a path, -k, -x, another -m ...)
#
# CI=true turns a skip for a missing dependency (vllm, ray, playwright, chromium, a C++ compiler) into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || ./scripts/setup.sh
tier=(-m "not slow")
label="fast tier"
args=()
for a in "$@"; do
  case "$a" in
    --all) tier=(); label="all tests" ;;
    --avx2-one-thread)
      # OMNILAB_DTYPE=float32: what dtype="auto" gives on an AVX2-only CPU (no native bf16). Without it, an AMX
      # machine still plans bf16 from its cpuinfo flags, and vLLM's bf16 CPU attention then runs AMX tiles that
      # oneDNN, capped to AVX2, never asked the kernel's permission for: SIGILL (seen on an Intel Xeon with AMX).
      export OMNILAB_DTYPE=float32 \
             OMNILAB_CPU_GEMV=omnilab-avx2 OMNILAB_CPU_SNAKE=omnilab-avx2 OMNILAB_CPU_QGEMV=omnilab-avx2 \
             OMNILAB_CPU_NORM=omnilab-avx2 OMNILAB_CPU_ATTN=omnilab-avx2 OMNILAB_CPU_STACK=omnilab-avx2 \
             MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1
      label="$label, AVX2 kernels, MKL/oneDNN capped to AVX2, fp32 compute, one thread" ;;
    *) args+=("$a") ;;
  esac
done
echo "[test] $label"
t0=$(date +%s)
rc=0
.venv/bin/python -m pytest "${tier[@]}" --durations=25 "${args[@]}" || rc=$?
t=$(( $(date +%s) - t0 ))
printf '[test] %s: %dm%02ds, exit %d\n' "$label" $((t / 60)) $((t % 60)) "$rc"
exit "$rc"
