"""The vLLM view of a Qwen3-TTS checkpoint: a directory with a Qwen3 text ``config.json`` for the talker.

Contract: ``view_dir(checkpoint, tts_config_dict)`` writes (idempotently, atomically) a directory under
``omnilab.paths.cache_dir()/vllm-views/`` whose ``config.json`` is a plain ``qwen3`` config (so
transformers' ``AutoConfig`` parses it) with ``architectures = ["OmnilabQwen3TTSTalker"]``, the talker
geometry, no M-RoPE (text-only positions make it plain 1-D RoPE, docs/model.md#m-rope-equals-1-d-rope), the released
``config.json`` under ``omnilab_tts_config`` and the checkpoint directory under ``omnilab_checkpoint``.
No weights are linked: the ``"omnilab"`` load format reads them from the checkpoint itself.
Folders are private (0700, ``omnilab.paths.private_dir``). Making a new view prunes the old ones
(:func:`prune_views`): a view whose checkpoint directory no longer exists is removed, and of the rest the
``OMNILAB_VLLM_VIEWS_KEEP`` (default 64) most recently used are kept (a view is touched each time it is used).
Plain Python (no torch, no vLLM).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.paths import cache_dir, private_dir

ARCH = "OmnilabQwen3TTSTalker"
_VIEW_VERSION = 1
KEEP_ENV = "OMNILAB_VLLM_VIEWS_KEEP"
# One view per checkpoint path (a few hundred bytes each): 64 covers every checkpoint a notebook session
# switches between, and bounds the folder for sweeps over generated checkpoints.
DEFAULT_KEEP = 64


def talker_hf_config(checkpoint: str | os.PathLike, tts_config: dict[str, Any]) -> dict[str, Any]:
    tc = tts_config["talker_config"]
    return {
        "architectures": [ARCH],
        "model_type": "qwen3",
        "hidden_size": tc["hidden_size"],
        "intermediate_size": tc["intermediate_size"],
        "num_hidden_layers": tc["num_hidden_layers"],
        "num_attention_heads": tc["num_attention_heads"],
        "num_key_value_heads": tc["num_key_value_heads"],
        "head_dim": tc["head_dim"],
        "vocab_size": tc["vocab_size"],
        "max_position_embeddings": tc["max_position_embeddings"],
        "rms_norm_eps": tc["rms_norm_eps"],
        "rope_theta": tc["rope_theta"],
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "omnilab_view_version": _VIEW_VERSION,
        "omnilab_checkpoint": str(Path(checkpoint).resolve()),
        "omnilab_tts_config": tts_config,
    }


def view_dir(checkpoint: str | os.PathLike, tts_config: dict[str, Any] | None = None,
             root: str | os.PathLike | None = None) -> Path:
    """Directory to pass to vLLM as ``model`` for ``checkpoint`` (created or refreshed)."""
    checkpoint = Path(checkpoint).resolve()
    if tts_config is None:
        tts_config = json.loads((checkpoint / "config.json").read_text())
    cfg = talker_hf_config(checkpoint, tts_config)
    text = json.dumps(cfg, indent=1, sort_keys=True)
    if root is None:
        root = cache_dir() / "vllm-views"
    key = hashlib.sha1(text.encode()).hexdigest()[:16]
    path = Path(root) / f"{checkpoint.name}-{key}"
    target = path / "config.json"
    if target.is_file() and target.read_text() == text:
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used: kept by prune_views
        return path
    private_dir(path)
    tmp = path / f".config.json.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, target)
    prune_views(Path(root), keep_path=path)
    return path


def views_keep(environ: Any = None) -> int:
    """``OMNILAB_VLLM_VIEWS_KEEP`` (a positive integer), else :data:`DEFAULT_KEEP`."""
    raw = (settings.raw(KEEP_ENV, environ) or "").strip()
    if not raw:
        return DEFAULT_KEEP
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{KEEP_ENV}={raw!r}: expected a positive integer (views kept; default {DEFAULT_KEEP})")
    return int(raw)


def prune_views(root: Path, keep_path: Path | None = None, keep: int | None = None) -> list[Path]:
    """Remove the views under ``root`` whose checkpoint is gone, then all but the ``keep`` most recently used
    (``keep_path`` always stays). Only folders holding an omnilab view ``config.json`` are touched. Returns the
    removed folders."""
    import shutil

    keep = views_keep() if keep is None else keep
    alive: list[tuple[float, Path]] = []
    removed: list[Path] = []
    for d in root.iterdir() if root.is_dir() else ():
        try:
            cfg = json.loads((d / "config.json").read_text())
            source = cfg["omnilab_checkpoint"] if isinstance(cfg, dict) and "omnilab_view_version" in cfg else None
            mtime = d.stat().st_mtime
        except (OSError, ValueError, KeyError):
            continue  # not a view (or being written): leave it
        if source is None or d == keep_path:
            continue
        if not Path(source).is_dir():
            removed.append(d)
        else:
            alive.append((mtime, d))
    alive.sort(reverse=True)
    removed += [d for _, d in alive[max(keep - (keep_path is not None), 0):]]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed
