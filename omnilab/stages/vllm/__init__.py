"""The vLLM backend of the talker stage: the only code in omnilab that imports vLLM.

``config`` (engine settings, plain data), ``deploy`` (what to build from a profile), ``engine`` (the stage:
``vllm.LLMEngine`` behind the stage contract), ``plugin`` / ``model`` / ``view`` (registration of omnilab's model
class and the plain-qwen3 view of a checkpoint), ``worker`` / ``runner`` (``CPUWorker`` / ``CPUModelRunner``
subclasses), ``payload`` (what travels between client and worker).

May import: ``stages.base``, ``stages.code2wav``, ``checkpoint``, ``models``, ``kernels``, ``profiles`` and the
leaves. Nothing below ``stages`` imports it.
"""
