"""Stages: the talker stage (autoregressive, one frame per step) and the code2wav stage (codes in, audio out).

``base`` is the stage contract (typing Protocols, ``FrameOutput``, limits) every stage follows; ``eager`` runs
the talker in plain torch in this process; ``vllm`` runs it inside vLLM's CPU engine (the only package that
imports vLLM); ``code2wav`` decodes in this process or in a worker process.

May import: ``checkpoint``, ``models``, ``kernels``, ``profiles`` and the leaves. Never ``pipeline``,
``deployment``, ``display`` or ``bench``.
"""
