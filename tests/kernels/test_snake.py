"""omnilab's fused SnakeBeta kernel: accuracy, chunk/batch/thread invariance, dispatch (choice rules:
test_choice.py)."""
from __future__ import annotations

import pytest
import torch

from omnilab.kernels import snake
from omnilab.models.code2wav_layers import SnakeBeta

from _kernel_common import fixtures, skip_without_isa  # noqa: E402

skip_without_isa()
lib, fresh_choice = fixtures(snake, "snake")


def _data(b, c, n, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, n, generator=g) * scale
    alpha = torch.exp(torch.randn(c, 1, generator=g) * 0.3)
    inv_beta = 1.0 / (torch.exp(torch.randn(c, 1, generator=g) * 0.3) + 1e-9)
    return x, alpha, inv_beta


def _exact(x, alpha, inv_beta):
    x64 = x.double()
    return x64 + inv_beta.double() * torch.sin(alpha.double() * x64) ** 2


@pytest.mark.parametrize("b,c,n", [(1, 96, 1920), (3, 5, 1), (2, 7, 15), (1, 4, 16), (1, 3, 17), (2, 2, 33)])
def test_matches_the_exact_value_like_torch(lib, b, c, n):
    """Within a few ulp of the float64 value (as torch's op is), every tail length included."""
    x, a, ib = _data(b, c, n)
    got = snake.snake_beta(x, a, ib, lib=lib)
    exact = _exact(x, a, ib)
    tol = 4e-7 * (1 + exact.abs())  # ~4 ulp of the result, plus the sine's few ulp scaled by inv_beta
    assert ((got.double() - exact).abs() <= tol).all()
    torch.testing.assert_close(got, snake.snake_torch(x, a, ib), rtol=1e-6, atol=1e-6)


def test_large_arguments_are_reduced_correctly(lib):
    x = torch.tensor([[[1e3, -2.5e4, 1e5, 3.3e6, 0.0, -0.0, 1e-30]]])
    a, ib = torch.ones(1, 1), torch.ones(1, 1)
    got = snake.snake_beta(x, a, ib, lib=lib)
    torch.testing.assert_close(got.double(), _exact(x, a, ib), rtol=1e-6, atol=1e-6)


def test_element_results_do_not_depend_on_chunking_batch_or_threads(lib):
    """An element's value depends only on its input and channel: any split of L (streaming chunks), any batch
    and 1 or 2 threads give bitwise the same output."""
    x, a, ib = _data(3, 6, 101)
    whole = snake.snake_beta(x, a, ib, lib=lib)
    for cuts in ((0, 1, 17, 101), (0, 50, 51, 100, 101), (0, 16, 32, 101)):
        parts = [snake.snake_beta(x[..., s:e].contiguous(), a, ib, lib=lib) for s, e in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts, -1), whole), cuts
    for i in range(3):
        assert torch.equal(snake.snake_beta(x[i:i + 1], a, ib, lib=lib), whole[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(snake.snake_beta(x, a, ib, lib=lib), whole)
    finally:
        torch.set_num_threads(threads)


def test_inplace_overwrites_the_input(lib):
    x, a, ib = _data(1, 8, 40)
    want = snake.snake_beta(x, a, ib, lib=lib)
    y = snake.snake_beta(x, a, ib, inplace=True, lib=lib)
    assert y is x and torch.equal(x, want)


def test_dispatch_falls_back_to_torch_where_the_kernel_does_not_apply(fresh_choice):
    """Non-contiguous, float64, 2-D and autograd inputs take torch's op (same result, gradients flow)."""
    assert snake.snake_choice().mode == "omnilab"
    calls = []
    real = snake.snake_torch
    fresh_choice.setattr(snake, "snake_torch", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, a, ib = _data(2, 4, 30)
    snake.snake_beta(x, a, ib)
    assert calls == []
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(snake.snake_beta(strided, a, ib), snake.snake_beta(x, a, ib), rtol=1e-6, atol=1e-6)
    assert calls == [1]
    snake.snake_beta(x.double(), a.double(), ib.double())
    xg = x.clone().requires_grad_()
    snake.snake_beta(xg, a, ib).sum().backward()
    assert xg.grad is not None and len(calls) == 3


def test_snakebeta_module_uses_the_choice(fresh_choice):
    """code2wav's SnakeBeta runs the kernel by default and torch's op under OMNILAB_CPU_SNAKE=torch."""
    m = SnakeBeta(6)
    torch.nn.init.normal_(m.alpha, 0, 0.2)
    torch.nn.init.normal_(m.beta, 0, 0.2)
    x = _data(1, 6, 50)[0]
    calls = []
    real = snake.snake_torch
    fresh_choice.setattr(snake, "snake_torch", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fused = m(x)
        assert calls == [] and snake.snake_choice().mode == "omnilab"
        snake.reset()
        fresh_choice.setenv(snake.ENV, "torch")
        plain = m(x)
    assert calls == [1] and snake.snake_choice().mode == "torch" and snake.ENV in snake.snake_choice().reason
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
