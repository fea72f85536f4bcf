"""The memory-bandwidth floor of a talker step, measured on this machine (``omnilab bench`` puts one next to each row).

- ``bytes_per_frame``: weights the talker step reads per frame at batch 1 (checkpoint tensor shapes):
  1 talker decode + 15 code-predictor passes. code2wav is compute-bound and excluded.
- ``measure_gemv_bandwidth``: best ``W @ x`` throughput over a matrix far larger than the caches (the
  all-DRAM figure); ``measure_stream_read``: best ``x.sum()`` over such a tensor (the streaming read bandwidth).
- ``decode_bytes_per_frame``: those bytes as the loaded talker stores them (bf16 storage, quantized codes).
- ``measure_frame_floor``: the same bytes as one frame as pure GEMVs (a talker-sized matrix once, a
  predictor-sized matrix 15 times, so cache reuse counts as in the real step): the time a frame cannot beat.

Every probe reports the bytes it read and the seconds it took, and GB/s = bytes / seconds / 1e9 (10^9
bytes). A probe matrix is ``rows x 4096`` with ``rows = bytes // (4096 x element size)`` (at least 1),
so it reads the requested bytes less under one row. The clock is ``_clock`` (``time.perf_counter``;
tests replace it to check the arithmetic).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time
from pathlib import Path

_clock = time.perf_counter
COLS = 4096  # probe matrix width: one fp32 row is 16 KiB


def gemv_matrix(nbytes: float, dtype):
    """``(W [rows, 4096], x [4096])`` with ``W`` of ``nbytes`` rounded down to a whole row (at least one)."""
    import torch

    rows = max(int(nbytes) // (torch.finfo(dtype).bits // 8 * COLS), 1)
    return torch.full((rows, COLS), 0.5, dtype=dtype), torch.full((COLS,), 0.25, dtype=dtype)


@contextlib.contextmanager
def _threads(threads: int | None):
    """torch's intra-op threads set to ``threads`` (None: as they are) within the block; yields the count used."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield threads or old
    finally:
        torch.set_num_threads(old)


def measure_gemv_bandwidth(mib: int = 1024, reps: int = 5, threads: int | None = None) -> dict[str, float]:
    """DRAM bandwidth seen by an fp32 matrix-vector product: ``y = W @ x`` with ``W`` of ``mib`` MiB
    (far above the last-level cache), ``reps`` timed runs after one warm-up. ``gbps`` = W bytes / best
    run's seconds / 1e9, ``gbps_median`` likewise for the median run; ``bytes`` and ``seconds`` (best) are
    reported too."""
    import torch

    with _threads(threads) as used:
        w, x = gemv_matrix(mib * 2**20, torch.float32)
        torch.mv(w, x)
        times = []
        for _ in range(reps):
            t = _clock()
            torch.mv(w, x)
            times.append(_clock() - t)
        nbytes = w.numel() * w.element_size()
        del w
    times.sort()
    return {"gemv_mib": nbytes / 2**20, "bytes": float(nbytes), "seconds": times[0],
            "gbps": nbytes / times[0] / 1e9, "gbps_median": nbytes / times[len(times) // 2] / 1e9,
            "threads": used, "reps": reps}


def measure_stream_read(mib: int = 1024, reps: int = 5, threads: int | None = None) -> dict[str, float]:
    """The machine's streaming read bandwidth: ``x.sum()`` over an fp32 tensor of ``mib`` MiB (far above the
    last-level cache), ``reps`` timed runs after one warm-up; ``gbps`` = bytes / best run / 1e9. What a decode
    step's weight reads are measured against (``effective_gbps`` / ``stream_read_gbps``)."""
    import torch

    with _threads(threads) as used:
        x = torch.full((max(int(mib) * 2**20 // 4, 1),), 0.5, dtype=torch.float32)
        x.sum()
        times = []
        for _ in range(reps):
            t = _clock()
            x.sum()
            times.append(_clock() - t)
        nbytes = x.numel() * 4
        del x
    times.sort()
    return {"stream_mib": nbytes / 2**20, "bytes": float(nbytes), "seconds": times[0],
            "gbps": nbytes / times[0] / 1e9, "gbps_median": nbytes / times[len(times) // 2] / 1e9,
            "threads": used, "reps": reps}


def _nbytes(w) -> int:
    """Bytes a decode step streams for one matrix: a ``QuantizedWeight``'s codes + scales, a tensor's storage."""
    return int(w.nbytes) if not hasattr(w, "element_size") else w.numel() * w.element_size()


def decode_bytes_by_part(talker) -> dict[str, float] | None:
    """Weight bytes one frame's decode step reads at batch 1, from the loaded ``Talker`` as it is stored (bf16
    storage, quantized codes and scales), per part: ``talker`` (its decode matrices and codec head, once) and
    ``predictor`` (the code predictor's layers and projection once per predicted codebook (15), each head once).
    None when the talker lives in a worker process (not loaded here)."""
    if talker is None:
        return None
    from omnilab.tuning.storage import talker_streamed_name  # lazy: torch

    passes = len(talker.code_predictor.lm_head)
    parts = {"talker": 0.0, "predictor": 0.0}
    for mod_name, mod in talker.named_modules():
        w = mod.__dict__.get("weight") if "weight" not in mod._parameters else mod._parameters["weight"]
        name = f"{mod_name}.weight"
        if w is None or not talker_streamed_name(name):
            continue
        per_pass = name.startswith(("code_predictor.model.layers.", "code_predictor.small_to_mtp_projection."))
        parts["predictor" if name.startswith("code_predictor.") else "talker"] += _nbytes(w) * (passes if per_pass
                                                                                                   else 1)
    return parts


def decode_bytes_per_frame(talker) -> float | None:
    """The sum of :func:`decode_bytes_by_part`: what ``effective_gbps`` divides by the step time."""
    parts = decode_bytes_by_part(talker)
    return None if parts is None else parts["talker"] + parts["predictor"]


def measure_frame_floor(bpf: dict[str, float], dtype_name: str = "float32", reps: int = 5,
                        threads: int | None = None) -> dict[str, float]:
    """The bandwidth floor of one frame, measured: a GEMV over a matrix the size of the talker decode's
    weights, then ``predictor_passes`` GEMVs over one the size of a code-predictor pass (so the predictor
    is re-read from cache when it fits, as in the real step). The best of ``reps`` emulated frames (after a
    warm-up): ``floor_ms`` (whole frame), ``talker_floor_ms`` / ``predictor_floor_ms`` (its two parts),
    the bytes each part read (``talker_bytes``, ``predictor_bytes`` = passes x one pass) and their GB/s."""
    import torch

    dtype = getattr(torch, dtype_name)
    with _threads(threads) as used:
        wt, xt = gemv_matrix(bpf["talker_decode_bytes"], dtype)
        wp, xp = gemv_matrix(bpf["predictor_pass_bytes"], dtype)
        n = int(bpf["predictor_passes"])
        best = (math.inf, math.inf, math.inf)
        for i in range(reps + 1):
            t0 = _clock()
            torch.mv(wt, xt)
            t1 = _clock()
            for _ in range(n):
                torch.mv(wp, xp)
            t2 = _clock()
            if i and t2 - t0 < best[0]:
                best = (t2 - t0, t1 - t0, t2 - t1)
        tb, pb = wt.numel() * wt.element_size(), n * wp.numel() * wp.element_size()
        del wt, wp
    return {"floor_ms": 1e3 * best[0], "talker_floor_ms": 1e3 * best[1], "predictor_floor_ms": 1e3 * best[2],
            "talker_bytes": float(tb), "predictor_bytes": float(pb),
            "talker_gbps": tb / best[1] / 1e9, "predictor_gbps": pb / best[2] / 1e9 if n else math.nan,
            "reps": reps, "threads": used}


def bytes_per_frame(checkpoint: str | os.PathLike, dtype_bytes: int) -> dict[str, float]:
    """Weights read per frame at batch 1 by the talker step, from the checkpoint's tensor shapes
    (``model.safetensors`` header): one talker decode (``talker.model.layers.*``, final norm,
    ``codec_head``) and one code-predictor pass (its layers, norm, one ``lm_head``, projection) per
    predicted codebook (15). Embedding rows and KV-cache reads (< 1 % here) are not counted; code2wav
    is compute-bound and excluded."""
    path = Path(checkpoint) / "model.safetensors"
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    talker = pred = heads = head_params = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        numel = math.prod(info["shape"])
        if name.startswith(("talker.model.layers.", "talker.model.norm.", "talker.codec_head.")):
            talker += numel
        elif name.startswith("talker.code_predictor.lm_head."):
            heads, head_params = heads + 1, head_params + numel
        elif name.startswith(("talker.code_predictor.model.layers.", "talker.code_predictor.model.norm.",
                              "talker.code_predictor.small_to_mtp_projection.")):
            pred += numel
    pass_params = pred + (head_params / heads if heads else 0)
    return {"talker_decode_bytes": float(talker * dtype_bytes), "predictor_pass_bytes": float(pass_params * dtype_bytes),
            "predictor_passes": heads,
            "talker_bytes_per_frame": float((talker + heads * pass_params) * dtype_bytes)}


def dtype_bytes(dtype_name: str) -> int:
    """Bytes per weight of a compute dtype name (``float32`` 4, ``bfloat16`` / ``float16`` 2)."""
    sizes = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
    if dtype_name not in sizes:
        raise ValueError(f"dtype {dtype_name!r}; accepted: {', '.join(sizes)}")
    return sizes[dtype_name]
