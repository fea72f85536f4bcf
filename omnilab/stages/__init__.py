"""Stages: the talker stage (autoregressive, one frame per step) and the code2wav stage (codes in, audio out).

``base`` is the stage contract (typing Protocols, ``FrameOutput``, limits) every stage follows; ``eager`` runs
the talker in plain torch in this process; ``vllm`` runs it inside vLLM's CPU engine (the only package that
imports vLLM); ``code2wav`` decodes in this process or in a worker process; ``owner`` and ``talker_control`` run
every stage call of a pipeline on its one owner thread and route talker outputs to their requests; ``lifecycle``
makes worker processes die with their client, times out every wait on them, refuses to spawn from an unguarded
main script and restarts stages (``pipe.restart()``).

May import: ``checkpoint``, ``models``, ``kernels``, ``profiles`` and the leaves. Never ``pipeline``,
``deployment``, ``display`` or ``bench``.
"""
