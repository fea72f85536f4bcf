"""Import hygiene for vLLM in a long-lived process (a notebook kernel, the bench).

Some vLLM modules keep the exception of an optional import that failed, to raise it later with a helpful message:
``vllm.multimodal.media.audio`` keeps ``_torchcodec_import_exc`` (omnilab's setup removes torchcodec). A kept
exception keeps its traceback, and the traceback keeps every frame that was on the stack while that module was
first imported, each with its local variables as they were when the function returned. vLLM is first imported
while a pipeline is being built (``VllmTalkerStage._build_engine`` -> ``Pipeline.from_pretrained`` -> the user's
code), so those frames held the stage, its loaded model and the engine: measured on the 0.6B random checkpoint,
an in-process vLLM pipeline closed and dropped left 3.4 GB resident, for the life of the process (the bench's
official-reference step then ran out of memory).

:func:`drop_import_tracebacks` clears the traceback of every exception a ``vllm`` module holds at module level
(and of its causes): the message, type and cause stay, so vLLM's later error is the same, only without the
frames of omnilab's first import. The engine calls it after each build (more modules import lazily then).
"""
from __future__ import annotations

import sys

__all__ = ["drop_import_tracebacks"]


def _exceptions(value: object):
    """``value`` and the exceptions chained to it (cause, context), each once."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def drop_import_tracebacks(prefix: str = "vllm") -> int:
    """Clear the traceback of each exception held by a module named ``prefix`` or ``prefix.*``; returns how many
    tracebacks were cleared."""
    cleared = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for value in list(getattr(mod, "__dict__", {}).values()):
            for e in _exceptions(value):
                if e.__traceback__ is not None:
                    e.__traceback__ = None
                    cleared += 1
    return cleared
