"""The vLLM view folders (omnilab/stages/vllm/view.py) do not pile up: making a view removes those whose checkpoint
is gone and keeps at most ``OMNILAB_VLLM_VIEWS_KEEP`` of the rest, the most recently used."""
from __future__ import annotations

import os
import stat

import pytest

from omnilab.errors import ConfigError
from omnilab.stages.vllm.view import DEFAULT_KEEP, view_dir, views_keep

TALKER = {k: 1 for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                         "rope_theta")}


def _ckpt(tmp_path, name):
    d = tmp_path / "ckpts" / name
    d.mkdir(parents=True)
    return d


def test_views_of_deleted_checkpoints_are_pruned(tmp_path, monkeypatch):
    monkeypatch.delenv("OMNILAB_VLLM_VIEWS_KEEP", raising=False)
    root = tmp_path / "views"
    gone, kept = _ckpt(tmp_path, "gone"), _ckpt(tmp_path, "kept")
    v_gone = view_dir(gone, {"talker_config": TALKER}, root=root)
    v_kept = view_dir(kept, {"talker_config": TALKER}, root=root)
    (root / "not-a-view").mkdir()  # folders that are not views are never touched
    gone.rmdir()
    new = view_dir(_ckpt(tmp_path, "new"), {"talker_config": TALKER}, root=root)
    assert not v_gone.exists() and v_kept.is_dir() and new.is_dir() and (root / "not-a-view").is_dir()
    assert stat.S_IMODE(new.stat().st_mode) == 0o700


def test_at_most_keep_views_stay_most_recent_first(tmp_path, monkeypatch):
    monkeypatch.delenv("OMNILAB_VLLM_VIEWS_KEEP", raising=False)
    root = tmp_path / "views"
    views = []
    for i in range(3):
        views.append(view_dir(_ckpt(tmp_path, f"c{i}"), {"talker_config": TALKER}, root=root))
        os.utime(views[-1], (1000 + i, 1000 + i))
    assert view_dir(tmp_path / "ckpts" / "c0", {"talker_config": TALKER}, root=root) == views[0]  # used: newest
    monkeypatch.setenv("OMNILAB_VLLM_VIEWS_KEEP", "2")
    views.append(view_dir(_ckpt(tmp_path, "c3"), {"talker_config": TALKER}, root=root))
    assert [v.exists() for v in views] == [True, False, False, True]


def test_keep_must_be_a_positive_integer():
    assert views_keep({}) == DEFAULT_KEEP and views_keep({"OMNILAB_VLLM_VIEWS_KEEP": "5"}) == 5
    for bad in ("0", "-1", "many", "2.5"):
        with pytest.raises(ConfigError, match=rf"OMNILAB_VLLM_VIEWS_KEEP='{bad}': expected a positive integer"):
            views_keep({"OMNILAB_VLLM_VIEWS_KEEP": bad})
