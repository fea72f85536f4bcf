"""Shared fixtures: tiny random checkpoints (one per variant, built once per session)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# The suite's numerics must not follow a timing taken on a shared host (dtype="auto", the bf16 prefill GEMM): it runs
# the ISA rule (OMNILAB_PLAN_TIMING=off, docs/kernels.md#measured-dtype-and-linear-paths). The timing itself and the
# choices made from it are tested with injected figures (tests/profiles/test_timing.py) and one real, small timing
# (tests/kernels/test_linear_timing.py).
os.environ.setdefault("OMNILAB_PLAN_TIMING", "off")

# The variables that choose this machine's kernel builds: a run under caps (``scripts/test.sh --avx2-one-thread``)
# sets them for every process, and the choice is cached per process, so a test that clears the environment
# keeps them (else a worker process would resolve another kernel than this one).
KERNEL_VARS = ("OMNILAB_CPU_GEMV", "OMNILAB_CPU_SNAKE", "OMNILAB_CPU_QGEMV", "OMNILAB_CPU_NORM", "OMNILAB_CPU_ATTN",
               "OMNILAB_CPU_STACK", "OMNILAB_CACHE",
               "OMNILAB_PLAN_TIMING")
VLLM_CPU_VARS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                 "VLLM_OMNI_CPU_INDUCTOR")


def clear_override_env(monkeypatch, extra: tuple[str, ...] = ()) -> None:
    """Delete every ``OMNILAB_*`` override (profile, dtype, ...) and vLLM's CPU variables for one test, keeping
    the kernel choices of the run (``KERNEL_VARS``)."""
    for k in list(os.environ):
        if (k.startswith("OMNILAB_") and k not in KERNEL_VARS) or k in VLLM_CPU_VARS or k in extra:
            monkeypatch.delenv(k)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """``tiny_ckpt(variant="custom_voice", seed=0) -> Path`` of a tiny random checkpoint (cached per session)."""
    from omnilab.checkpoint.random import make_random_checkpoint

    made = {}

    def get(variant: str = "custom_voice", seed: int = 0):
        key = (variant, seed)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{variant}-{seed}")
            made[key] = make_random_checkpoint(path, size="tiny", variant=variant, seed=seed, overwrite=True)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_pipe(tiny_ckpt):
    """An eager fp32 pipeline on the tiny CustomVoice checkpoint."""
    from omnilab.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32")
    yield pipe
    pipe.close()
