"""Progress bars (omnilab/instrument/progress.py) on the long jobs users wait for: random checkpoint creation,
loading, quantization and synthesis frames (``ProgressHook``). On when asked (``OMNILAB_PROGRESS=1``), off when
told (``OMNILAB_PROGRESS=0``, ``--no-progress``, verbosity ``error``) and in worker processes; otherwise tqdm's
terminal rule, so a pipe or a file (a CI log, ``capsys``) gets no bar."""
from __future__ import annotations

import multiprocessing

import pytest

from omnilab.errors import InputError
from omnilab.instrument import progress


@pytest.fixture
def prog(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.delenv("OMNILAB_LOG_LEVEL", raising=False)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)  # the tiny jobs end before the usual delay
    return monkeypatch


def _child(q):
    q.put(progress.progress_enabled())


def test_the_rule(prog):
    assert progress.progress_enabled() is None  # tqdm decides from the terminal
    assert progress.progress_enabled(True) is True and progress.progress_enabled(False) is False
    prog.setenv(progress.ENV, "1")
    assert progress.progress_enabled() is True and progress.progress_enabled(False) is False  # the argument wins
    prog.setenv(progress.ENV, "off")
    assert progress.progress_enabled() is False
    prog.setenv(progress.ENV, "maybe")
    with pytest.raises(InputError, match=r"OMNILAB_PROGRESS='maybe'; accepted: 1/on/true, 0/off/false"):
        progress.progress_enabled()
    prog.delenv(progress.ENV)
    prog.setenv("OMNILAB_LOG_LEVEL", "error")
    assert progress.progress_enabled() is False
    prog.delenv("OMNILAB_LOG_LEVEL")
    ctx = multiprocessing.get_context("spawn")  # a worker process: its stderr is not the user's
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    assert q.get(timeout=60) is False
    p.join(60)


def test_disabled_bar_still_iterates(prog):
    b = progress.bar(range(3), progress=False)
    assert list(b) == [0, 1, 2]
    b.update(2), b.set_postfix_str("x"), b.close()
    with progress.bar(total=3, progress=False) as b:
        b.update()


def test_checkpoint_creation_loading_and_quantization_show_bars(prog, tiny_ckpt, tmp_path, capsys):
    from omnilab.checkpoint.load import load_model
    from omnilab.checkpoint.random import make_random_checkpoint
    from omnilab.checkpoint.write_quantized import quantize_checkpoint

    make_random_checkpoint(tmp_path / "a", size="tiny", variant="custom_voice", seed=3, progress=True,
                           check_audio=False)
    err = capsys.readouterr().err
    assert "random tiny custom_voice checkpoint" in err and "step" in err
    ckpt = tiny_ckpt("custom_voice")
    prog.setenv(progress.ENV, "1")
    load_model(ckpt, dtype="float32")
    err = capsys.readouterr().err
    assert "model.safetensors (talker)" in err and "(decoder)" in err and "tensor" in err
    quantize_checkpoint(ckpt, tmp_path / "q", "int8")
    assert "quantize int8" in capsys.readouterr().err
    prog.setenv(progress.ENV, "0")  # told: silent
    load_model(ckpt, dtype="float32")
    assert capsys.readouterr().err == ""
    prog.delenv(progress.ENV)  # the default on a pipe (capsys): tqdm's rule, no bar
    assert list(progress.bar(range(3), desc="load")) == [0, 1, 2] and capsys.readouterr().err == ""


def test_progress_hook_counts_frames(prog, tiny_pipe, capsys):
    from omnilab.instrument.hooks import ProgressHook

    hook, seen = ProgressHook("synth", total=4, progress=True), []
    with tiny_pipe.hooks.using(hook, lambda span: seen.append(hook.bar.n)):  # the bar's count after each span
        res = tiny_pipe.generate("Hi.", speaker="vivian", max_new_tokens=4, do_sample=False, subtalker_do_sample=False)
    err = capsys.readouterr().err
    assert "synth" in err and "/4" in err and "frame/s" in err
    assert max(seen) == res.codes.shape[0] > 0  # one count per talker frame
    assert hook.bar is None  # closed when the synthesis ended
