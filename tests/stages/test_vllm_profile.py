"""The vLLM backend under ``deploy_profile="auto"``: the default pipeline, and stage workers whose CPU
affinity and threads, read back from the running processes, equal the plan, and whose start environment holds
every ``profile.to_env(stage)`` value."""
from __future__ import annotations

import os

import numpy as np
import pytest

from _deps import need  # noqa: E402
from conftest import clear_override_env
import torch

need("vllm")

from omnilab.profiles.readback import compare_process, process_environ, read_process  # noqa: E402

from _vllm_common import TEXT  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
KW = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=6)


VLLM_VARS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
             "VLLM_OMNI_CPU_INDUCTOR")


@pytest.fixture(autouse=True)
def _no_profile_env(monkeypatch):
    """The plan here is the auto plan: no OMNILAB_* override and none of vLLM's CPU variables (tests of those
    are in test_vllm_env.py)."""
    clear_override_env(monkeypatch, VLLM_VARS)


@pytest.fixture(scope="module")
def eager_codes(tiny_ckpt):
    from omnilab.pipeline import Pipeline

    with Pipeline.from_pretrained(tiny_ckpt(), backend="eager", dtype="float32") as p:
        return p.generate(TEXT, **KW).codes


def test_default_pipeline_is_vllm_under_the_auto_profile(tiny_ckpt, eager_codes):
    from omnilab.pipeline import Pipeline

    before = torch.get_num_threads()
    try:
        with Pipeline.from_pretrained(tiny_ckpt(), dtype="float32") as pipe:
            assert pipe.backend == "vllm" and pipe.profile.name == "auto"
            assert pipe.profile.dtype.value == "float32" and pipe.model.dtype == torch.float32
            expect = "in-process" if pipe.profile.mode.value == "shared" else "workers"
            assert pipe.deployment.placement == expect
            cfg = pipe._talker.config
            assert cfg.kv_cache_memory_bytes == pipe.profile.kv_cache_bytes.value
            assert cfg.max_num_seqs == pipe.profile.max_num_seqs.value
            assert {"talker", "code2wav"} <= set(pipe.check_profile())  # + "not_applied" (readback.check_stages)
            np.testing.assert_array_equal(pipe.generate(TEXT, **KW).codes, eager_codes)
    finally:
        torch.set_num_threads(before)


def test_workers_under_auto_profile_read_back_equal_the_plan(tiny_ckpt, eager_codes):
    from omnilab.pipeline import Pipeline

    with Pipeline.from_pretrained(tiny_ckpt(), deploy="workers", dtype="float32") as pipe:
        prof = pipe.profile
        assert prof.name == "auto" and pipe.deployment.placement == "workers"
        roles = {role: pid for pid, role in pipe.processes().items()}
        assert {"talker", "code2wav", "talker-engine-core"} <= set(roles)
        readback = pipe.check_profile()  # raises WorkerError listing any difference
        for stage in ("talker", "code2wav"):
            rb = read_process(roles[stage])
            assert readback[stage].pid == rb.pid
            assert compare_process(prof, stage, rb) == []
            assert {c for m in rb.thread_cpus for c in m} == set(prof.cpus(stage))
        talker = pipe._talker.summary()
        assert set(talker["affinity"]) <= set(prof.cpus("talker"))  # the main thread is OpenMP thread 0, pinned
        assert talker["torch_threads"] == prof.threads("talker")
        assert talker["gemv"] == pipe.deployment.gemv.label  # the worker resolved the same decode-linear kernel
        assert talker["weights"] == pipe.deployment.weights.label  # ... and stores the decode matrices the same way
        assert talker["omp_num_threads"] == str(prof.threads("talker"))
        assert set(read_process(roles["talker"]).pinned_cpus) == set(prof.cpus("talker"))
        for stage in ("talker", "code2wav"):  # the planned preload (libiomp5 / tcmalloc) is mapped in
            maps = open(f"/proc/{roles[stage]}/maps").read()
            for lib in prof.preload.value:
                assert os.path.realpath(lib) in maps or lib in maps, f"{lib} not loaded in the {stage} worker"
        for stage in ("talker", "code2wav"):  # each worker started with the profile's to_env, value for value
            started, want = process_environ(roles[stage]), prof.to_env(stage)
            preload = want.pop("LD_PRELOAD", "")
            assert {k: started.get(k) for k in want} == want, stage
            # vLLM's CPU platform appends its libgomp / tcmalloc to LD_PRELOAD; the planned libraries stay in it
            assert set(filter(None, preload.split(":"))) <= set(started.get("LD_PRELOAD", "").split(":")), stage
        c2w = pipe.code2wav.info()
        assert tuple(c2w["affinity"]) == prof.cpus("code2wav") and c2w["torch_threads"] == prof.threads("code2wav")
        assert c2w["snake"] == pipe.deployment.snake.label  # the code2wav worker runs the same SnakeBeta
        assert dict(pipe.deployment.rows())["code2wav activation"].startswith(pipe.deployment.snake.label)
        np.testing.assert_array_equal(pipe.generate(TEXT, **KW).codes, eager_codes)
        # step-wise across processes: the hidden state comes back when asked for, from the first frame on
        rid = pipe.talker.start(TEXT, **KW)
        first = pipe.talker.step(return_hidden=True)[rid]
        assert first.frame_index == 0 and first.hidden.shape == (pipe.model.config.talker.hidden_size,)
        assert pipe.talker.step()[rid].hidden is None
        pipe.talker.abort(rid)
