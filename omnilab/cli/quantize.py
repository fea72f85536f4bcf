"""``omnilab quantize SRC DST --method int8|int4 [--group-size N] [--overwrite]``: write a quantized copy of a
checkpoint (compressed-tensors ``pack-quantized``; :func:`omnilab.checkpoint.write_quantized.quantize_checkpoint`,
docs/quantization.md). Prints one JSON line: the destination, the scheme and the bytes of both
``model.safetensors`` files. Errors (bad method or group size, existing destination, an already quantized
source) exit with status 2 and a message naming the accepted values."""
from __future__ import annotations

import argparse
import json
from typing import Sequence

from omnilab.cli.main import Formatter
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity


def quantize_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab quantize", formatter_class=Formatter, description="Write a quantized copy of a checkpoint: the "
                                 "talker's decode matrices in compressed-tensors pack-quantized format (W8A16 per "
                                 "output channel, W4A16 group-wise); every other file copied unchanged.")
    ap.add_argument("src", help="checkpoint directory (or hub id) to quantize")
    ap.add_argument("dst", help="directory to write (refused if it exists and is not empty, unless --overwrite)")
    ap.add_argument("--method", required=True, choices=("int8", "int4", "int4-all"),
                    help="int8: W8A16, one scale per output channel; int4: W4A16 group-wise talker with an int8 code "
                         "predictor; int4-all: int4 everywhere (required)")
    ap.add_argument("--group-size", type=int, default=None,
                    help="int4 only: 32 | 64 | 128 (default: 128, or the largest of 64 / 32 "
                    "dividing every K)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (also OMNILAB_PROGRESS=0)")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)
    from omnilab.checkpoint.quantized import read_scheme  # lazy: torch
    from omnilab.checkpoint.write_quantized import quantize_checkpoint  # lazy: torch

    dst = quantize_checkpoint(args.src, args.dst, args.method, args.group_size, overwrite=args.overwrite,
                              progress=False if args.no_progress else None)
    scheme = read_scheme(dst)
    from omnilab.checkpoint.load import resolve_checkpoint  # lazy: torch

    src = resolve_checkpoint(args.src)
    print(json.dumps({"path": str(dst), "method": scheme.method, "group_size": scheme.group_size,
                      "format": "compressed-tensors pack-quantized", "ignore": list(scheme.ignore),
                      "src_model_bytes": sum(p.stat().st_size for p in src.glob("model*.safetensors")),
                      "dst_model_bytes": (dst / "model.safetensors").stat().st_size}))
    return 0
