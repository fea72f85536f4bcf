#!/usr/bin/env bash
# Run omnilab's test suite (sets up .venv first if it is missing). Extra arguments go to pytest.
#
#   ./scripts/test.sh                      the suite as this machine runs it (2 threads, native ISA kernels)
#   ./scripts/test.sh --avx2-one-thread    the suite as an AVX2-only machine runs it, at one thread: omnilab's
#                                          GEMV, quantized GEMV, RMSNorm, attention, decode-stack and SnakeBeta kernels in their AVX2 builds, MKL and oneDNN
#                                          capped to AVX2, fp32 compute, OMP_NUM_THREADS=1 (CI runs both)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || ./scripts/setup.sh
if [ "${1:-}" = "--avx2-one-thread" ]; then
  shift
  # OMNILAB_DTYPE=float32: what dtype="auto" gives on an AVX2-only CPU (no native bf16). Without it, an AMX machine
  # still plans bf16 from its cpuinfo flags, and vLLM's bf16 CPU attention then runs AMX tiles that oneDNN, capped
  # to AVX2, never asked the kernel's permission for: SIGILL (seen on an Intel Xeon with AMX, notebook 03).
  export OMNILAB_DTYPE=float32 \
         OMNILAB_CPU_GEMV=omnilab-avx2 OMNILAB_CPU_SNAKE=omnilab-avx2 OMNILAB_CPU_QGEMV=omnilab-avx2 \
         OMNILAB_CPU_NORM=omnilab-avx2 OMNILAB_CPU_ATTN=omnilab-avx2 OMNILAB_CPU_STACK=omnilab-avx2 \
         MKL_ENABLE_INSTRUCTIONS=AVX2 \
         ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1
  echo "[test] AVX2 kernels, MKL/oneDNN capped to AVX2, fp32 compute, one thread"
fi
exec .venv/bin/python -m pytest "$@"
