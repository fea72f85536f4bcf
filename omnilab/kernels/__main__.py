"""``python -m omnilab.kernels``: resolve (and build) every kernel and say which is used and why: the rows of
:func:`omnilab.kernels.kernel_choices` for an fp32 talker (the list ``pipe.deployment`` shows), then which
quantized-GEMV kernel ``quantization=`` would use, the dtype code2wav's conv decoder computes in
(``tuning.code2wav_timing``) and the talker dtype ``dtype="auto"`` gets from the timing of this machine."""
import torch

from omnilab.kernels import kernel_choices


def say(title: str, choice) -> None:
    """One choice: its label and source, then its reason."""
    print(f"{title}: {choice.label} ({choice.source})")
    print(f"  reason: {choice.reason}")


if __name__ == "__main__":
    print("kernel choices for an fp32 talker (pipe.deployment shows the same rows):")
    for row in kernel_choices(torch.float32):
        say(row.title, row.choice)
        if row.key == "gemv" and row.choice.library:
            print(f"  library: {row.choice.library}")
    from omnilab.kernels.qgemv import qgemv_choice
    from omnilab.kernels.quant import quantization_choice
    say("quantized decode linears (quantization=int8/int4)", qgemv_choice())
    say("quantization of this environment", quantization_choice())
    from omnilab.tuning.code2wav_timing import timed_code2wav_dtype
    say("code2wav dtype for dtype='auto'", timed_code2wav_dtype())  # what a pipeline gets: its timing where it decides
    from omnilab.checkpoint.load import resolve_dtype
    dt, why = resolve_dtype(None)
    print(f"talker dtype for dtype='auto': {str(dt).replace('torch.', '')}")
    print(f"  reason: {why}")
