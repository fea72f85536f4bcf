"""Deploy profiles: how the talker and code2wav stages use this machine's CPUs and memory.

``plan(hardware, model_config)`` sizes threads per stage, CPU lists (inside one NUMA node, one thread per
physical core), CPUs reserved for the front-end, the talker KV budget, dtype, code2wav chunking and the
worker ``LD_PRELOAD``, each as ``Resolved(value, reason, source)``. ``resolve_profile(spec)`` accepts
``"auto"``, a preset name, a YAML path or a ``DeployProfile`` (what ``Pipeline.from_pretrained(...,
deploy_profile=...)`` takes). Profiles round-trip through vllm-omni-style deploy YAML
(``DeployProfile.to_yaml/from_yaml``). Plain Python + PyYAML: importing this imports no torch or vLLM.

May import: the leaves (``errors``, ``hardware``, ``html_tables``, ``config``). Never ``kernels``, ``models``,
``checkpoint``, ``stages``, ``pipeline`` or ``display``: the policy layer is plain Python.

Overrides, highest first: ``OMNILAB_*`` variables, then vLLM's own CPU variables (``VLLM_CPU_KVCACHE_SPACE``,
``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``; source ``env (vLLM) NAME``), then arguments,
then preset/file values, then the planner's own choice. An ``OMNILAB_*`` variable and the vLLM variable for the
same field that disagree are a ``ConfigError``. ``omnilab.profiles.overrides.env_help()`` (and ``omnilab plan
--help``) lists every variable.
"""
from omnilab.profiles.cost import ModelGeometry, StageTimes, StreamEstimate
from omnilab.profiles.resolve import list_presets, resolve_profile
from omnilab.profiles.planner import as_geometry, plan
from omnilab.profiles.profile import STAGES, DeployProfile, Resolved
from omnilab.profiles.readback import (ProcessReadback, apply_to_current_process, check_process, compare_process,
                                       read_process)

__all__ = ["DeployProfile", "Resolved", "STAGES", "plan", "resolve_profile", "list_presets", "as_geometry",
           "ModelGeometry", "StageTimes", "StreamEstimate", "ProcessReadback", "read_process", "compare_process",
           "check_process", "apply_to_current_process"]
