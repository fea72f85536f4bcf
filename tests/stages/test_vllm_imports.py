"""A closed and dropped in-process vLLM pipeline frees its model (omnilab/stages/vllm/imports.py).

vLLM keeps the exception of a failed optional import (``_torchcodec_import_exc``); its traceback pinned every frame
that was on the stack at vLLM's first import, which is inside ``Pipeline.from_pretrained``, so the stage, the loaded
model and the engine stayed alive for the life of the process (3.4 GB on the 0.6B checkpoint). The first test runs
the user's path in a fresh interpreter (where the first import of vLLM happens during the build, as in a notebook);
the second checks the mechanism on a module made up for the test."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import types
import weakref

import pytest

from _deps import need  # noqa: E402

from omnilab.stages.vllm.imports import drop_import_tracebacks


class _Big:
    pass


def test_an_exception_kept_by_a_module_no_longer_pins_the_importing_frames():
    mod = types.ModuleType("vllm._omnilab_test_kept")

    def build():
        big = _Big()  # a local of a frame that is on the stack while the "import" fails
        try:
            raise ModuleNotFoundError("No module named 'optional_dep'")
        except ImportError as exc:
            mod.kept_exc = exc
        return weakref.ref(big)

    sys.modules[mod.__name__] = mod
    try:
        ref = build()
        gc.collect()
        assert ref() is not None  # the kept traceback holds build()'s frame and its locals
        assert drop_import_tracebacks() >= 1
        gc.collect()
        assert ref() is None
        assert str(mod.kept_exc) == "No module named 'optional_dep'" and mod.kept_exc.__traceback__ is None
        assert drop_import_tracebacks() == 0  # nothing left to clear
    finally:
        del sys.modules[mod.__name__]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_closed_in_process_vllm_pipeline_is_freed(tiny_ckpt):
    need("vllm")
    script = textwrap.dedent(f"""
        import gc, sys, weakref
        from omnilab.pipeline import Pipeline

        def build():
            pipe = Pipeline.from_pretrained({str(tiny_ckpt("custom_voice"))!r}, backend="vllm", dtype="float32",
                                            deploy_profile=None, deploy=dict(max_model_len=256, block_size=32))
            pipe.generate("Hello.", speaker="vivian", max_new_tokens=3, do_sample=False, subtalker_do_sample=False)
            refs = [weakref.ref(pipe.model), weakref.ref(pipe.model.talker), weakref.ref(pipe._talker)]
            pipe.close()
            return refs

        if __name__ == "__main__":
            assert "vllm" not in sys.modules  # the first import of vLLM happens in the build, as for a user
            refs = build()
            gc.collect()
            alive = [type(r()).__name__ for r in refs if r() is not None]
            print("ALIVE", alive)
            sys.exit(1 if alive else 0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
