"""The multi-process deployment: vLLM engine-core + talker worker process + code2wav worker process.

Codes equal the eager backend's (greedy, every variant), thread binding reads back as planned, an aborted
stream leaves no state and no extra process, ``close()`` stops every process, and a dead worker raises
``WorkerError`` within 15 s.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

from _deps import need  # noqa: E402
import torch

need("vllm")

from omnilab.errors import WorkerError  # noqa: E402
from omnilab.checkpoint.load import load_model  # noqa: E402
from omnilab.profiles.readback import read_process  # noqa: E402
from omnilab.requests import build_request  # noqa: E402
from omnilab.stages.vllm.deploy import VllmDeploy  # noqa: E402
from omnilab.stages.vllm.engine import VllmStageConfig, VllmTalkerStage  # noqa: E402

from _vllm_common import TEXT, eager_codes, greedy, user_requests, vllm_run  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
_CPUS = sorted(os.sched_getaffinity(0))
TALKER_CPUS, CODE2WAV_CPUS = (_CPUS[0],), (_CPUS[-1],)
KW = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=9)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def ref(tiny_ckpt):
    """The eager backend's result, its code2wav run on as many threads as the code2wav worker's, so the
    audio is equal by construction: same machine, same kernels, same shapes, same thread count (MKL and
    oneDNN choose their blocking, hence the summation order, per CPU, shape and thread count)."""
    from omnilab.pipeline import Pipeline

    with Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32") as eager:
        eager.code2wav.threads = len(CODE2WAV_CPUS)
        return eager.generate(TEXT, **KW), np.concatenate([c.audio for c in eager.stream(TEXT, **KW)])


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    from omnilab.pipeline import Pipeline

    deploy = VllmDeploy(VllmStageConfig(multiprocess=True, talker_cpus=TALKER_CPUS, talker_threads=1,
                                        max_model_len=256, block_size=32),
                        code2wav="process", code2wav_cpus=CODE2WAV_CPUS, code2wav_threads=1)
    p = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="vllm", dtype="float32", deploy=deploy)
    yield p
    p.close()


def test_codes_and_audio_equal_eager(pipe, ref):
    res_ref, stream_ref = ref
    assert pipe.model.talker is None, "the client should not keep a copy of the talker weights"
    res = pipe.generate(TEXT, **KW)
    np.testing.assert_array_equal(res.codes, res_ref.codes)
    np.testing.assert_array_equal(res.audio, res_ref.audio)
    chunks = list(pipe.stream(TEXT, **KW))
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), res_ref.codes)
    np.testing.assert_array_equal(np.concatenate([c.audio for c in chunks]), stream_ref)
    names = {s.name for s in chunks[-1].trace.spans}
    assert {"hop", "code2wav_chunk", "step"} <= names
    remote = [s for s in chunks[-1].trace.spans if s.name == "code2wav_chunk" and s.pid != os.getpid()]
    assert remote, "the code2wav worker's own chunk spans are missing from the trace"


def test_processes_and_thread_binding_read_back(pipe):
    procs = pipe.processes()
    roles = {r: pid for pid, r in procs.items()}
    assert {"client", "talker-engine-core", "talker", "code2wav"} <= set(roles)
    assert len(set(procs)) == 4 and set(procs) - {os.getpid()} <= _children()
    talker = pipe._talker.summary()
    assert talker["pid"] == roles["talker"]
    assert tuple(talker["affinity"]) == TALKER_CPUS and talker["torch_threads"] == len(TALKER_CPUS)
    assert talker["omp_num_threads"] == str(len(TALKER_CPUS)) and talker["omp_bind"] == ",".join(map(str, TALKER_CPUS))
    rb = read_process(roles["talker"])  # the OpenMP threads are pinned inside the plan
    assert rb.cpus == TALKER_CPUS and set(rb.pinned_cpus) == set(TALKER_CPUS)
    c2w = pipe.code2wav.info()
    assert c2w["pid"] == roles["code2wav"]
    assert tuple(c2w["affinity"]) == CODE2WAV_CPUS and c2w["torch_threads"] == len(CODE2WAV_CPUS)
    rb = read_process(roles["code2wav"])
    assert rb.cpus == CODE2WAV_CPUS and set(rb.thread_cpus) == {CODE2WAV_CPUS}


def test_abort_mid_stream_leaves_nothing(pipe, ref):
    before = _children()
    it = pipe.stream(TEXT, **dict(KW, max_new_tokens=60))
    first = next(it)
    assert first.frame_start == 0 and len(first.audio) == 1920
    it.close()
    assert pipe.talker.num_live == 0 and pipe.code2wav.num_sessions == 0
    res = pipe.generate(TEXT, **KW)
    np.testing.assert_array_equal(res.codes, ref[0].codes)
    assert pipe._talker.summary()["states"] == []
    assert pipe.code2wav.info()["sessions"] == []
    assert _children() == before


def test_dead_worker_raises_then_close_stops_everything(pipe):
    pids = set(pipe.processes()) - {os.getpid()}
    talker_pid = next(pid for pid, r in pipe.processes().items() if r == "talker")
    rid = pipe.talker.start(TEXT, **dict(KW, max_new_tokens=200))
    first = pipe.talker.step()
    os.kill(talker_pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError):
        for _ in range(200):
            pipe.talker.step()
    assert time.perf_counter() - t0 < 15.0
    # the id start() returned keys the step's output (one FrameOutput per live request) and has the
    # pipeline's form; earlier requests on this pipeline are finished, so it is the only live one
    assert rid.startswith("req-") and rid[4:].isdigit()
    assert set(first) == {rid} and first[rid].request_id == rid
    pipe.close()
    deadline = time.time() + 15
    while time.time() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                         for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


@pytest.mark.parametrize("kind", ["voice_design", "base"])
def test_other_variants_multiprocess_greedy_equal_eager(tiny_ckpt, kind):
    model = load_model(tiny_ckpt(kind), dtype="float32")
    preqs = [build_request(model, u)[0] for u in user_requests(kind)]
    refs = [eager_codes(model, p, greedy(model)) for p in preqs]
    cfg = VllmStageConfig(multiprocess=True, talker_cpus=TALKER_CPUS, max_model_len=256, block_size=32)
    model.talker = None
    with VllmTalkerStage(model, cfg) as stage:
        for preq, r in zip(preqs, refs):
            got, _ = vllm_run(stage, preq, greedy(model))
            assert torch.equal(got, r)
