"""``python -m omnilab.kernels``: resolve (and build) the decode-linear kernel and say which is used and why."""
from omnilab.kernels import gemv_choice

if __name__ == "__main__":
    c = gemv_choice()
    print(f"decode linears: {c.label} ({c.source})")
    print(f"  reason: {c.reason}")
    if c.library:
        print(f"  library: {c.library}")
