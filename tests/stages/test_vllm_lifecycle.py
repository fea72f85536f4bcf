"""Worker lifecycle with vLLM: a poisoned (non-finite) request ends alone with an InputError and the engine lives
on; a killed engine core is a WorkerError naming it on that call and every later one, and ``pipe.restart()``
brings the pipeline back; killing the client mid-stream (SIGKILL, SIGTERM) leaves no worker alive after 10 s; a
script without a ``__main__`` guard gets a WorkerError saying so and leaks no shared memory."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from _deps import need  # noqa: E402
import torch

need("vllm")

from omnilab.errors import InputError, WorkerError  # noqa: E402
from omnilab.checkpoint.load import load_model  # noqa: E402
from omnilab.requests import UserRequest, build_request  # noqa: E402
from omnilab.stages.vllm.engine import VllmStageConfig, VllmTalkerStage  # noqa: E402

from _vllm_common import TEXT, _ref_audio, greedy, vllm_run  # noqa: E402
from test_worker_lifecycle import gone, run_client, wait_gone  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BASE_KW = dict(ref_audio=_ref_audio(), x_vector_only_mode=True, do_sample=False, subtalker_do_sample=False,
               max_new_tokens=6)


def _sampling(model, n: int = 6):
    return dataclasses.replace(greedy(model, n), do_sample=True, subtalker_do_sample=True, seed=3)


def test_nan_weights_in_process_are_input_error_and_engine_lives(tiny_ckpt):
    """Greedy over NaN weights used to return all-zero codes, sampling used to kill the engine."""
    model = load_model(tiny_ckpt("custom_voice"), dtype="float32")
    preq = build_request(model, UserRequest(text=TEXT, speaker="vivian", language="english"))[0]
    with VllmTalkerStage(model, VllmStageConfig(max_model_len=256, block_size=32)) as stage:
        ref, _ = vllm_run(stage, preq, greedy(model))
        # shared with the in-process worker; NaN keys/values in layer 0 land in KV blocks later requests reuse
        norm = model.talker.model.layers[0].input_layernorm.weight
        saved = norm.detach().clone()
        with torch.no_grad():
            norm.fill_(float("nan"))
        for params in (greedy(model), _sampling(model)):
            with pytest.raises(InputError, match=r"request 'p': the talker's logits at frame 0 are not finite"):
                vllm_run(stage, preq, params, rid="p")
            assert not stage.has_unfinished() and stage.summary()["states"] == []
        with torch.no_grad():
            norm.copy_(saved)
        got, _ = vllm_run(stage, preq, greedy(model))
        assert torch.equal(got, ref)


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    from omnilab.pipeline import Pipeline

    p = Pipeline.from_pretrained(tiny_ckpt("base"), backend="vllm", deploy="workers", dtype="float32")
    yield p
    p.close()


def test_poisoned_request_then_good_one_on_workers(pipe):
    ref = pipe.generate(TEXT, **BASE_KW).codes
    preq = build_request(pipe.model, UserRequest(text=TEXT, ref_audio=_ref_audio(), x_vector_only_mode=True))[0]
    bad = dataclasses.replace(preq, x_vector=torch.full_like(preq.x_vector, float("nan")))
    stage = pipe._talker
    with pytest.raises(InputError, match="not finite"):  # sampling over NaN used to kill the engine core
        pipe._owner.run(vllm_run, stage, bad, _sampling(pipe.model))
    assert pipe._owner.run(stage.summary)["states"] == []
    np.testing.assert_array_equal(pipe.generate(TEXT, **BASE_KW).codes, ref)


def test_killed_engine_core_is_worker_error_until_restart(pipe):
    ref = pipe.generate(TEXT, **BASE_KW).codes
    old = pipe.processes()
    core = next(pid for pid, role in old.items() if role == "talker-engine-core")
    it = pipe.stream(TEXT, **dict(BASE_KW, max_new_tokens=200))
    next(it)
    os.kill(core, signal.SIGKILL)
    cause = rf"engine-core process \(pid {core}\) was killed by SIGKILL"
    with pytest.raises(WorkerError, match=cause):
        for _ in it:
            pass
    for call in (lambda: pipe.generate(TEXT, **BASE_KW), lambda: list(pipe.stream(TEXT, **BASE_KW)),
                 lambda: pipe.talker.start(TEXT, **BASE_KW)):
        with pytest.raises(WorkerError, match=cause) as e:  # never vLLM's EngineDeadError
            call()
        assert "restart()" in str(e.value) and "EngineDead" not in str(e.value)
    pipe.restart()
    new = pipe.processes()
    assert set(new.values()) == set(old.values()) and not (set(new) - {os.getpid()}) & set(old)
    assert wait_gone([p for p in old if p != os.getpid()], 15.0) == []  # the talker worker died with its core
    np.testing.assert_array_equal(pipe.generate(TEXT, **BASE_KW).codes, ref)


def test_frozen_engine_core_times_out_until_restart(pipe, monkeypatch):
    ref = pipe.generate(TEXT, **BASE_KW).codes
    monkeypatch.setenv("OMNILAB_WORKER_TIMEOUT_S", "3")
    pipe.restart()  # the new stages read the variable, as a new pipeline would
    core = next(pid for pid, role in pipe.processes().items() if role == "talker-engine-core")
    old = [p for p in pipe.processes() if p != os.getpid()]
    os.kill(core, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        with pytest.raises(WorkerError, match=r"no step output within 3 s \(OMNILAB_WORKER_TIMEOUT_S\)"):
            pipe.generate(TEXT, **BASE_KW)
        assert time.perf_counter() - t0 < 30.0
        with pytest.raises(WorkerError, match="no step output within 3 s"):  # dead until restart
            pipe.generate(TEXT, **BASE_KW)
        monkeypatch.undo()
        pipe.restart()  # stops the frozen processes
        assert wait_gone(old, 15.0) == []
        np.testing.assert_array_equal(pipe.generate(TEXT, **BASE_KW).codes, ref)
    finally:
        for p in old:
            if not gone(p):
                os.kill(p, signal.SIGKILL)


CLIENT = textwrap.dedent("""
    import json, os, sys
    from omnilab.pipeline import Pipeline

    if __name__ == "__main__":
        pipe = Pipeline.from_pretrained(sys.argv[1], backend="vllm", deploy="workers", dtype="float32")
        it = pipe.stream("Hello world, this is a test.", speaker="vivian", max_new_tokens=2000)
        next(it)
        print(json.dumps({"pids": [p for p in pipe.processes() if p != os.getpid()]}), flush=True)
        for chunk in it:  # mid-stream when killed
            pass
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_worker_outlives_a_killed_client(sig, tmp_path, tiny_ckpt):
    proc, info = run_client(CLIENT, [str(tiny_ckpt("custom_voice"))], tmp_path)
    pids = info["pids"]
    try:
        assert len(pids) == 3  # engine core, talker worker, code2wav worker
        os.kill(proc.pid, sig)
        proc.wait(10.0)
        assert wait_gone(pids, 10.0) == [], f"workers outlived their client ({sig.name})"
    finally:
        proc.kill()
        for p in pids:
            if not gone(p):
                os.kill(p, signal.SIGKILL)


NO_GUARD = textwrap.dedent("""
    import sys
    from omnilab.pipeline import Pipeline

    deploy = "workers" if sys.argv[2] == "workers" else {"multiprocess": True, "code2wav": "inprocess"}
    pipe = Pipeline.from_pretrained(sys.argv[1], backend="vllm", deploy=deploy, dtype="float32")
    pipe.generate("Hello.", speaker="vivian", max_new_tokens=3)
    pipe.close()
""")


@pytest.mark.parametrize("deploy, first", [("workers", "code2wav worker"), ("talker-only", "vLLM engine core")])
def test_script_without_main_guard_gets_a_clear_error(deploy, first, tmp_path, tiny_ckpt):
    """``first``: the worker spawned first (code2wav's, or with code2wav in-process vLLM's engine core)."""
    path = tmp_path / "noguard.py"
    path.write_text(NO_GUARD)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(path), str(tiny_ckpt("custom_voice")), deploy], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and time.monotonic() - t0 < 300
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"omnilab.errors.WorkerError: the {first} could not start"), r.stderr[-3000:]
    assert str(path) in last and 'if __name__ == "__main__":' in last and "Fix:" in last
    assert "leaked shared_memory" not in r.stderr and "exited with code 1" not in r.stderr
