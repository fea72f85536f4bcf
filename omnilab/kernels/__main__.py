"""``python -m omnilab.kernels``: resolve (and build) the decode-linear kernel and say which is used and why, and
how an fp32 talker's decode matrices would be stored, which quantized-GEMV kernel ``quantization=`` would use, the
decoder's RMSNorm and one-token attention, which SnakeBeta code2wav runs and in which dtype its conv decoder computes, the linear paths (bf16 decode rows,
prefill GEMMs) and the talker dtype ``dtype="auto"`` gets, from the timing of this machine (``kernels.timing``)."""
from omnilab.kernels import gemv_choice

if __name__ == "__main__":
    c = gemv_choice()
    print(f"decode linears: {c.label} ({c.source})")
    print(f"  reason: {c.reason}")
    if c.library:
        print(f"  library: {c.library}")
    import torch

    from omnilab.kernels.storage import weight_storage_choice
    w = weight_storage_choice(torch.float32)
    print(f"decode weights of an fp32 talker: {w.label} ({w.source})")
    print(f"  reason: {w.reason}")
    from omnilab.kernels.qgemv import qgemv_choice
    from omnilab.kernels.quant import quantization_choice
    qc = qgemv_choice()
    print(f"quantized decode linears (quantization=int8/int4): {qc.label} ({qc.source})")
    print(f"  reason: {qc.reason}")
    q = quantization_choice()
    print(f"quantization of this environment: {q.label} ({q.source})")
    print(f"  reason: {q.reason}")
    from omnilab.kernels.norm import norm_choice
    nc = norm_choice()
    print(f"decoder RMSNorm: {nc.label} ({nc.source})")
    print(f"  reason: {nc.reason}")
    from omnilab.kernels.attention import attention_choice
    ac = attention_choice()
    print(f"decoder one-token attention: {ac.label} ({ac.source})")
    print(f"  reason: {ac.reason}")
    from omnilab.kernels.snake import snake_choice
    s = snake_choice()
    print(f"code2wav SnakeBeta: {s.label} ({s.source})")
    print(f"  reason: {s.reason}")
    from omnilab.kernels.code2wav_dtype import code2wav_dtype_choice
    d = code2wav_dtype_choice()  # no pipeline here: the rule without a talker dtype
    print(f"code2wav dtype: {d.label} ({d.source})")
    print(f"  reason: {d.reason}")
    from omnilab.checkpoint.load import resolve_dtype
    from omnilab.kernels.timing import linear_paths
    lp = linear_paths()  # measures (a few seconds) on first use, unless OMNILAB_PLAN_TIMING=off or cached
    print(f"linear paths: {lp.label} ({lp.source})")
    print(f"  reason: {lp.reason}")
    dt, why = resolve_dtype(None)
    print(f"talker dtype for dtype='auto': {str(dt).replace('torch.', '')}")
    print(f"  reason: {why}")
