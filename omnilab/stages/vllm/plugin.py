"""vLLM plugin entry point (``vllm.general_plugins``: ``omnilab_talker = omnilab.stages.vllm.plugin:register``).

``register()`` makes the omnilab talker architecture and the ``"omnilab"`` load format known to vLLM in
the calling process. vLLM calls it in every process it starts when omnilab is installed; the worker
module and the engine client also call it directly, so a source checkout on ``PYTHONPATH`` works too.
In the processes vLLM spawns for a ``deploy="workers"`` client (``OMNILAB_WORKER_PARENT`` set), it first makes the
process die with its parent (:func:`omnilab.stages.lifecycle.adopt_parent_from_env`): the engine core with the
client, the talker worker with the engine core. Idempotent.
"""
from __future__ import annotations

from omnilab.stages.lifecycle import adopt_parent_from_env

_done = False


def register() -> None:
    global _done
    adopt_parent_from_env()
    if _done:
        return
    from vllm import ModelRegistry

    from omnilab.stages.vllm.model import ARCH, OmnilabTalkerForVLLM  # lazy: vllm; also registers the load format

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, OmnilabTalkerForVLLM)
    _done = True
