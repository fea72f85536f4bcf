"""The code2wav stage: in this process (``stage``) or in its own worker process (``worker`` on the client side,
``worker_proc`` inside the process), offline decode and streaming sessions with explicit state.

May import: ``stages.base``, ``checkpoint``, ``models``, ``kernels`` and the leaves. Never ``stages.vllm``.
"""
