"""The kernel cache loads only libraries this user built (omnilab/kernels/trust.py, build.py;
docs/kernels.md#build-and-cache): a library planted at the cached path never runs, a group-writable file or folder
and a changed file are rebuilt, a missing symbol lets ``auto`` fall back to torch with the reason, folders are 0700
under any umask, and an unusable ``OMNILAB_CACHE`` is a ``ConfigError`` naming it."""
from __future__ import annotations

import os
import stat
import subprocess
import warnings
from pathlib import Path

import pytest

from omnilab.errors import ConfigError
from omnilab.hardware import cpu_flags
from omnilab.kernels import snake
from omnilab.kernels.build import build_library, find_compiler, library_path, select_isa
from omnilab.kernels.trust import KernelTrustError, digest_path, open_library, record_digest, untrusted_reason
from omnilab.paths import private_dir

from _deps import missing  # noqa: E402
from _kernel_common import skip_without_isa  # noqa: E402

skip_without_isa()
CXX = find_compiler()
if CXX is None:
    missing("no C++ compiler: the kernels are not built here", "apt-get install g++")
ISA = select_isa(cpu_flags())[0]

PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("constructor ran", f); fclose(f); }
}
int not_an_omnilab_symbol(void) { return 1; }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh ``OMNILAB_CACHE``; yields ``(snake library path, marker path, plant())``."""
    monkeypatch.setenv("OMNILAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(snake.ENV, raising=False)
    snake.reset()
    out = library_path("snake", ISA, CXX)
    marker = tmp_path / "marker"
    src = tmp_path / "planted.c"
    src.write_text(PLANTED)

    def plant(path: Path = out) -> bytes:
        private_dir(path.parent)
        subprocess.run([CXX, "-x", "c", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(path)],
                       check=True, capture_output=True)
        return path.read_bytes()

    yield out, marker, plant
    snake.reset()


def test_planted_library_never_runs_and_auto_gets_a_fresh_build(cache):
    out, marker, plant = cache
    planted = plant()
    assert "no digest recorded" in untrusted_reason(out)
    with pytest.raises(KernelTrustError, match="no digest recorded"):
        open_library(out)
    choice, lib = snake.resolve(env="auto")  # the path gemv/snake take on first use
    assert choice.mode == "omnilab" and choice.library == str(out)
    assert not marker.exists(), "the planted library's constructor ran"
    assert out.read_bytes() != planted and untrusted_reason(out) is None
    assert lib.isa == ISA


def test_group_writable_or_linked_library_is_refused_then_rebuilt(cache):
    out, marker, plant = cache
    record_digest(out, plant())  # even with a matching digest ...
    os.chmod(out, 0o775)         # ... a file others may rewrite is not loaded
    assert "group- or world-writable" in untrusted_reason(out)
    with pytest.raises(KernelTrustError, match=r"not loaded: the file is group- or world-writable \(mode 0775\)"):
        open_library(out)
    with pytest.warns(RuntimeWarning, match="not used .*group- or world-writable.*compiling a fresh one"):
        assert build_library("snake", ISA) == out
    assert untrusted_reason(out) is None and stat.S_IMODE(out.stat().st_mode) == 0o700
    snake._Lib(out)
    assert not marker.exists()

    other = out.with_name("elsewhere.so")  # a symlink at the cached path: never followed
    os.replace(out, other)
    os.symlink(other, out)
    with pytest.raises(KernelTrustError, match="without following links"):
        open_library(out)


def test_group_writable_folder_is_refused_then_made_private(cache):
    out, marker, plant = cache
    build_library("snake", ISA)
    os.chmod(out.parent, 0o775)
    with pytest.raises(KernelTrustError, match="its folder .* is group- or world-writable"):
        open_library(out)
    build_library("snake", ISA)  # the user's own folder is tightened; every file in it is still checked
    assert stat.S_IMODE(out.parent.stat().st_mode) == 0o700
    snake._Lib(out)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a folder's owner needs root")
def test_folder_of_another_user_is_refused(cache):
    out, marker, plant = cache
    private_dir(out.parent)
    os.chown(out.parent, 65534, 65534)
    with pytest.raises(KernelTrustError, match="belongs to uid 65534, not to this user"):
        build_library("snake", ISA)
    with pytest.warns(RuntimeWarning, match="unavailable .*belongs to uid 65534"):
        choice, lib = snake.resolve(env="auto")
    assert choice.mode == "torch" and lib is None


def test_changed_content_is_rebuilt(cache):
    out, marker, plant = cache
    build_library("snake", ISA)
    good = out.read_bytes()
    plant(out.with_name("tmp.so"))
    with open(out, "r+b") as fh:  # rewrite this user's file in place: owner and mode stay, the digest does not match
        fh.write(out.with_name("tmp.so").read_bytes())
        fh.truncate()
    assert "differs from the digest recorded at build time" in untrusted_reason(out)
    with pytest.raises(KernelTrustError, match="sha256 .* differs from the digest"):
        open_library(out)
    with pytest.warns(RuntimeWarning, match="differs from the digest"):
        build_library("snake", ISA)
    assert out.read_bytes() == good and not marker.exists()
    digest_path(out).write_text("0" * 64 + "\n")  # a digest edited by hand: rebuilt too
    assert "differs" in untrusted_reason(out)


def test_missing_symbol_falls_back_to_torch_with_the_reason(cache):
    out, marker, plant = cache
    record_digest(out, plant())  # a library this user vouched for that is not omnilab's build
    with pytest.warns(RuntimeWarning, match="has no symbol 'omnilab_snake'"):
        choice, lib = snake.resolve(env="auto")
    assert choice.mode == "torch" and lib is None and "has no symbol 'omnilab_snake'" in choice.reason
    with pytest.raises(RuntimeError, match="OMNILAB_CPU_SNAKE=omnilab: kernel library .* has no symbol"):
        snake.resolve(env="omnilab")


def test_cache_folders_are_private_under_umask_002(tmp_path, monkeypatch):
    root = tmp_path / "a" / "b"
    monkeypatch.setenv("OMNILAB_CACHE", str(root))
    old = os.umask(0o002)
    try:
        out = build_library("snake", ISA)
        from omnilab.stages.vllm.view import view_dir
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        view = view_dir(ckpt, {"talker_config": {k: 1 for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta")}})
    finally:
        os.umask(old)
    for d in (tmp_path / "a", root, out.parent, view.parent, view):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f, mode in ((out, 0o700), (digest_path(out), 0o600), (out.parent / ".lock", 0o600)):
        assert stat.S_IMODE(f.stat().st_mode) == mode, f


def test_unusable_cache_is_a_config_error_naming_it(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("OMNILAB_CACHE", str(blocker))
    with pytest.raises(ConfigError, match=f"OMNILAB_CACHE='{blocker}' cannot be used: .*accepted: OMNILAB_CACHE set "
                                          "to a writable directory"):
        build_library("snake", ISA)
    from omnilab.checkpoint.random import default_checkpoint
    with pytest.raises(ConfigError, match="OMNILAB_CACHE="):
        default_checkpoint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="OMNILAB_CACHE="):  # auto does not hide a broken cache setting
            snake.resolve(env="auto")
