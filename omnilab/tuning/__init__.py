"""Per-machine tuning: which of the kernels' and torch's paths this process takes, and the short timings, cached
per machine, that some of those choices rest on. Each choice comes with a reason and the ``OMNILAB_*`` variable
that overrides it (docs/kernels.md).

- :mod:`omnilab.tuning.storage`: an fp32 talker keeps its decode matrices in the checkpoint's bf16 (half the bytes
  per decode step); ``OMNILAB_DECODE_WEIGHTS=auto|bf16|compute``.
- :mod:`omnilab.tuning.hugepages`: opt-in huge-page arena for those matrices (``OMNILAB_HUGEPAGES``).
- :mod:`omnilab.tuning.fuse`: q/k/v and gate/up read in one decode call each (``OMNILAB_FUSE_PROJECTIONS``).
- :mod:`omnilab.tuning.timing`: a cached timing of the linear paths on this machine, and the choice of bf16 decode
  rows and prefill GEMMs made from it (``OMNILAB_PLAN_TIMING``, ``OMNILAB_BF16_DECODE``, ``OMNILAB_PREFILL_GEMM``);
  :mod:`omnilab.tuning.timing_key`: what every cached timing is keyed on, its noise test and its cache file.
- :mod:`omnilab.tuning.prefetch`: the quantized GEMV's software-prefetch distances, timed or the prior
  (``OMNILAB_QGEMV_PREFETCH``).
- :mod:`omnilab.tuning.code2wav_dtype`: bf16 conv-decoder GEMMs for code2wav where measured faster
  (``OMNILAB_CODE2WAV_DTYPE``); :mod:`omnilab.tuning.code2wav_timing`: that measurement.
- :mod:`omnilab.tuning.code2wav_conv`: code2wav's fp32 convs on oneDNN's direct convolution for long inputs,
  per-tap GEMMs below (``OMNILAB_CODE2WAV_CONV``).

May import: the leaves (``errors``, ``paths``, ``config``, ``hardware``, ``settings``), ``profiles.timing`` (the
plain rules over measured times, shared with the planner) and ``kernels`` (the wrappers it times and chooses
among); ``code2wav_timing`` also ``models.code2wav_layers``, inside its functions (it times the real decoder
blocks). Never ``checkpoint``, ``stages``, the rest of ``profiles``, or ``display``. ``kernels`` reaches back only
inside functions: ``kernel_choices`` lists these choices, and the quantized GEMV reads its prefetch distances.
"""
