"""``python -m omnilab.kernels``: resolve (and build) the decode-linear kernel and say which is used and why, and
how an fp32 talker's decode matrices would be stored, which quantized-GEMV kernel ``quantization=`` would use, the
decoder's RMSNorm, one-token attention and one-call decode stack, which SnakeBeta code2wav runs and in which dtype
its conv decoder computes (``models.code2wav_timing``), the linear paths (bf16 decode rows, prefill GEMMs) and the
talker dtype ``dtype="auto"`` gets, from the timing of this machine (``kernels.timing``)."""
from omnilab.kernels import gemv_choice


def say(title: str, choice) -> None:
    """One choice: its label and source, then its reason."""
    print(f"{title}: {choice.label} ({choice.source})")
    print(f"  reason: {choice.reason}")


if __name__ == "__main__":
    c = gemv_choice()
    say("decode linears", c)
    if c.library:
        print(f"  library: {c.library}")
    import torch

    from omnilab.kernels.attention import attention_choice
    from omnilab.kernels.norm import norm_choice
    from omnilab.kernels.qgemv import qgemv_choice
    from omnilab.kernels.quant import quantization_choice
    from omnilab.kernels.snake import snake_choice
    from omnilab.kernels.stack import stack_choice
    from omnilab.kernels.storage import weight_storage_choice
    say("decode weights of an fp32 talker", weight_storage_choice(torch.float32))
    say("quantized decode linears (quantization=int8/int4)", qgemv_choice())
    say("quantization of this environment", quantization_choice())
    say("decoder RMSNorm", norm_choice())
    say("decoder one-token attention", attention_choice())
    say("decoder stack step (all layers in one call) and SwiGLU", stack_choice())
    say("code2wav SnakeBeta", snake_choice())
    from omnilab.kernels.code2wav_conv import conv_choice
    say("code2wav fp32 convolutions", conv_choice())
    from omnilab.models.code2wav_timing import timed_code2wav_dtype
    say("code2wav dtype for dtype='auto'", timed_code2wav_dtype())  # what a pipeline gets: its timing where it decides
    from omnilab.checkpoint.load import resolve_dtype
    from omnilab.kernels.timing import linear_paths
    lp = linear_paths()  # measures (a few seconds) on first use, unless OMNILAB_PLAN_TIMING=off or cached
    print(f"linear paths: {lp.label} ({lp.source})")
    print(f"  reason: {lp.reason}")
    dt, why = resolve_dtype(None)
    print(f"talker dtype for dtype='auto': {str(dt).replace('torch.', '')}")
    print(f"  reason: {why}")
