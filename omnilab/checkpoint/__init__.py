"""Checkpoints: the released file layout, loaded and made.

``load`` reads a checkpoint directory or hub id into the networks (strict names and shapes, safetensors only),
``random`` writes random-weight checkpoints in exactly the released layout (and the embedded default),
``configs`` holds every geometry (tiny, mid, 0.6b, 1.7b) and the released config files, ``tensor_index``
reads safetensors one tensor at a time, ``worker_weights`` loads one part of a checkpoint inside a stage
worker process, ``quantized`` reads compressed-tensors ``pack-quantized`` talker matrices (docs/quantization.md)
and ``write_quantized`` writes them (``omnilab quantize``).

May import: the leaves (``errors``, ``paths``, ``config``, ``tokenizer``, ``hardware``), ``kernels`` and
``models``. Never ``stages``, ``profiles``, ``pipeline`` or ``display``.
"""
