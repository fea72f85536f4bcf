"""Model networks in plain torch (no vLLM): talker, code predictor, prompt construction, code2wav (offline and
streaming state), Mimi encoder and speaker encoder, and the shared decoder layers.

May import: ``kernels`` (the decode linears, SnakeBeta), ``profiles.cost`` (the one chunk rule, plain Python)
and the leaves (``errors``, ``config``). Never ``checkpoint``, ``stages``, ``pipeline`` or ``display``.
"""
