"""Deploy profiles: how the talker and code2wav stages use this machine's CPUs and memory.

``plan(hardware, model_config)`` sizes threads per stage, CPU lists (inside one NUMA node, one thread per
physical core), CPUs reserved for the front-end, the talker KV budget, dtype, code2wav chunking and the
worker ``LD_PRELOAD``, each as ``Resolved(value, reason, source)``. ``resolve_profile(spec)`` accepts
``"auto"``, a preset name, a YAML path or a ``DeployProfile`` (what ``Pipeline.from_pretrained(...,
deploy_profile=...)`` takes). Profiles round-trip through vllm-omni-style deploy YAML
(``DeployProfile.to_yaml/from_yaml``). Plain Python + PyYAML: importing this imports no torch or vLLM.

Environment overrides (they win over arguments, presets and files):

  OMNILAB_STAGE_MODE           split | shared
  OMNILAB_TALKER_TP            tensor-parallel talker ranks, one per NUMA node
  OMNILAB_TALKER_THREADS       OpenMP threads per talker rank
  OMNILAB_TALKER_CPUS          talker CPU list(s), '|' between ranks ('0-13|28-41')
  OMNILAB_CODE2WAV_THREADS     code2wav OpenMP threads
  OMNILAB_CODE2WAV_CPUS        code2wav CPU list ('14-15')
  OMNILAB_RESERVED_CPUS        CPUs kept free for the notebook / front-end ('0', or 'none')
  OMNILAB_DTYPE                float32 | bfloat16
  OMNILAB_MAX_NUM_SEQS         concurrent talker sequences
  OMNILAB_MAX_MODEL_LEN        talker context length (tokens)
  OMNILAB_KV_CACHE_GIB         talker KV cache budget in GiB (float)
  OMNILAB_FIRST_CHUNK_FRAMES   frames in the first code2wav chunk
  OMNILAB_CHUNK_RAMP           chunk sizes after the first ('4,8,16', or 'none')
  OMNILAB_CHUNK_FRAMES         steady-state chunk size (frames)
  OMNILAB_LEFT_CONTEXT_FRAMES  code2wav left context (frames)
  OMNILAB_PRELOAD              worker LD_PRELOAD, ':'-separated, or 'none'
"""
from omnilab.profiles.cost import ModelGeometry, StageTimes, StreamEstimate
from omnilab.profiles.deploy_yaml import list_presets, resolve_profile
from omnilab.profiles.planner import as_geometry, plan
from omnilab.profiles.profile import STAGES, DeployProfile, Resolved
from omnilab.profiles.readback import (ProcessReadback, apply_to_current_process, check_process, compare_process,
                                       read_process)

__all__ = ["DeployProfile", "Resolved", "STAGES", "plan", "resolve_profile", "list_presets", "as_geometry",
           "ModelGeometry", "StageTimes", "StreamEstimate", "ProcessReadback", "read_process", "compare_process",
           "check_process", "apply_to_current_process"]
