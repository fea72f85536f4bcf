"""The vLLM view of a Qwen3-TTS checkpoint: a directory with a Qwen3 text ``config.json`` for the talker.

Contract: ``view_dir(checkpoint, tts_config_dict)`` writes (idempotently, atomically) a directory under
``omnilab.paths.cache_dir()/vllm-views/`` whose ``config.json`` is a plain ``qwen3`` config (so
transformers' ``AutoConfig`` parses it) with ``architectures = ["OmnilabQwen3TTSTalker"]``, the talker
geometry, no M-RoPE (text-only positions make it plain 1-D RoPE, docs/model.md#m-rope-equals-1-d-rope), the released
``config.json`` under ``omnilab_tts_config`` and the checkpoint directory under ``omnilab_checkpoint``.
No weights are linked: the ``"omnilab"`` load format reads them from the checkpoint itself.
Plain Python (no torch, no vLLM).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

ARCH = "OmnilabQwen3TTSTalker"
_VIEW_VERSION = 1


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
        from omnilab.paths import cache_dir
        root = cache_dir() / "vllm-views"
    key = hashlib.sha1(text.encode()).hexdigest()[:16]
    path = Path(root) / f"{checkpoint.name}-{key}"
    target = path / "config.json"
    if target.is_file() and target.read_text() == text:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".config.json.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, target)
    return path
