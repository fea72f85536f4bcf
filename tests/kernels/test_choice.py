"""How each omnilab kernel is chosen (omnilab/kernels/choice.py), for the GEMV and the SnakeBeta kernels alike:
accepted modes, ISA rules, the fallback without a compiler, and switching for a block."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from omnilab.errors import ConfigError
from omnilab.kernels import gemv, snake
from omnilab.kernels.build import select_isa

from _kernel_common import skip_without_isa  # noqa: E402

skip_without_isa()


def _gemv_falls_back_to_torch() -> None:
    x, w = torch.randn(4, 32), torch.randn(64, 32)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))


def _snake_falls_back_to_torch() -> None:
    x, a, ib = torch.randn(1, 3, 20), torch.rand(3, 1) + 0.5, torch.rand(3, 1) + 0.5
    assert torch.equal(snake.snake_beta(x, a, ib), snake.snake_torch(x, a, ib))


KERNELS = {"gemv": (gemv, gemv.gemv_choice, gemv.use_gemv, _gemv_falls_back_to_torch),
           "snake": (snake, snake.snake_choice, snake.use_snake, _snake_falls_back_to_torch)}


@pytest.fixture(params=sorted(KERNELS))
def kernel(request, monkeypatch):
    """(module, choice(), use(mode), fallback check), the choice resolved anew and left behind unset."""
    module = KERNELS[request.param][0]
    monkeypatch.delenv(module.ENV, raising=False)
    module.reset()
    yield KERNELS[request.param]
    module.reset()


def test_bad_mode_names_accepted_values(kernel, monkeypatch):
    """A ConfigError (like every other bad override; still a ValueError) naming the variable, the value as
    given and the accepted modes."""
    module, choice, _, _ = kernel
    monkeypatch.setenv(module.ENV, " Fast")
    accepted = "auto, omnilab, omnilab-avx512, omnilab-avx2, torch"
    with pytest.raises(ConfigError, match=f"{module.ENV}=' Fast'.*{accepted}") as err:
        choice()
    assert isinstance(err.value, ValueError)


def test_missing_compiler(kernel, monkeypatch, tmp_path):
    """auto: torch with a warning that says why (and the op still works); an explicit omnilab mode: an error
    naming the compiler."""
    module, choice, _, falls_back = kernel
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("OMNILAB_CACHE", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=re.escape("no C++ compiler found")):
        c = choice()
    assert c.mode == "torch" and "no C++ compiler" in c.reason
    falls_back()
    module.reset()
    monkeypatch.setenv(module.ENV, "omnilab")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found .*no-such-compiler"):
        choice()


def test_isa_rules(kernel):
    module = kernel[0]
    with pytest.raises(RuntimeError, match=f"{module.ENV}=omnilab-avx512 needs a CPU with avx512"):
        module.resolve(env="omnilab-avx512", flags=frozenset({"avx2", "fma"}))
    with pytest.raises(RuntimeError, match="needs avx512f or avx2"):
        module.resolve(env="omnilab", flags=frozenset({"sse4_2"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c, lib = module.resolve(env="auto", flags=frozenset({"sse4_2"}))
    assert c.mode == "torch" and lib is None and "neither" in c.reason


def test_env_torch_and_switching_for_a_block(kernel, monkeypatch):
    module, choice, use, falls_back = kernel
    monkeypatch.setenv(module.ENV, "torch")
    c = choice()
    assert c.mode == "torch" and c.source == "env" and module.ENV in c.reason
    falls_back()
    with use("omnilab") as inside:
        assert inside.mode == "omnilab" and inside.source == "argument" and choice() is inside
    assert choice() is c


def test_select_isa():
    assert select_isa({"avx512f", "avx2", "fma"})[0] == "avx512"
    assert select_isa({"avx2", "fma"})[0] == "avx2"
    isa, reason = select_isa({"sse4_2"})
    assert isa is None and "neither" in reason
