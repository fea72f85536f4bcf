"""omnilab: the Qwen3-TTS 12 Hz pipeline on CPUs, made for notebooks.

Public API (imported lazily so ``import omnilab`` stays light — no torch, vllm or matplotlib):

- ``Pipeline.from_pretrained(path_or_hub_id, device="cpu", backend=...)`` and ``SynthesisResult``
- ``make_random_checkpoint`` / ``default_checkpoint``: random-weight checkpoints in the released layout
- ``probe_hardware``, ``plan``, ``DeployProfile``: hardware probe and deploy profiles
- ``set_verbosity("error" | "warning" | "info" | "debug")``: how much omnilab and vLLM/torch/Triton print
  (``OMNILAB_LOG_LEVEL``; default ``warning``: omnilab's warnings, third-party errors only; ``omnilab.logs``)
"""
from __future__ import annotations

import importlib

from omnilab.logs import quiet_vllm_import as _quiet_vllm_import

_quiet_vllm_import()  # vLLM's import-time warnings stay out of cells and worker output (omnilab.logs)

__version__ = "0.1.0"

_LAZY = {
    "Pipeline": "omnilab.pipeline",
    "SynthesisResult": "omnilab.results",
    "AudioChunk": "omnilab.results",
    "make_random_checkpoint": "omnilab.checkpoint.random",
    "default_checkpoint": "omnilab.checkpoint.random",
    "probe_hardware": "omnilab.hardware",
    "plan": "omnilab.profiles",
    "DeployProfile": "omnilab.profiles",
    "set_verbosity": "omnilab.logs",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'omnilab' has no attribute {name!r}")
    try:
        module = importlib.import_module(mod)
    except AttributeError as e:  # do not let an error inside the import look like a missing name
        raise ImportError(f"importing {mod} failed: {e}") from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
