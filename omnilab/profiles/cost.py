"""Per-stage cost model and a playback simulator for chunk planning. Plain Python, no torch.

Contract: ``ModelGeometry`` holds the shapes that set memory and time (from a ``Qwen3TTSConfig`` or the
released 0.6B/1.7B numbers). ``CostModel`` turns geometry + hardware (or measured ``StageTimes``) into
milliseconds: the talker step (1 talker decode + 15 code-predictor passes) is bandwidth-bound, so its
time is weight bytes / per-thread bandwidth; code2wav is compute-bound, so a chunk costs GFLOP /
per-thread GFLOP/s (docs/model.md#bytes-and-flops-per-frame). Thread scaling is Amdahl's law with a cap past which more
threads are assumed to bring nothing (peers report the talker step stops scaling beyond 16 threads).
``simulate_stream`` plays a chunk schedule against those times and reports TTFA, stall and RTF.

One copy of three facts the planner and the engine share: ``kv_bytes_per_token`` (head size padded to what
vLLM's CPU attention supports, ``SUPPORTED_HEAD_SIZES``) and ``kv_cache_bytes_for`` (whole ``BLOCK_SIZE``
blocks + vLLM's reserve block) size the talker's KV cache in ``memory.py`` and in
``omnilab.stages.vllm.config``; ``chunk_schedule`` / ``chunk_frames`` are the streaming chunk rule of
``DeployProfile.chunk_sizes`` and ``omnilab.models.code2wav_stream.ChunkSchedule``.

Calibration: a frame is its decode weight bytes (bf16 storage 2 bytes a weight, int8 1, int4 0.5 + 2 / group) at
an effective bandwidth plus a fixed :data:`FRAME_FIXED_MS`; the bandwidth is this machine's path timing times
:data:`FRAME_BANDWIDTH_FACTOR` when the planner has one, else ``_CORE_PERF``'s per-thread figure. code2wav is GFLOP
per chunk (its frames + ``chunk_fixed_frames``) at a per-thread rate. The fitted figures and the machines they come
from: docs/profiles.md#cost-model. Pass ``StageTimes`` to use measured numbers instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from omnilab import settings
from omnilab.config import DEFAULT_INT4_GROUP_SIZE, QUANT_RECIPES, parse_quantization, stored_quantization
from omnilab.errors import ConfigError
from omnilab.profiles.timing import CODE2WAV_ENV, code2wav_dtype_rule

BLOCK_SIZE = 128  # KV block size in tokens: vLLM CPU default (a multiple of 32 for its CPU attention)
# Head sizes vLLM's CPU attention supports (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes; tests/stages/test_vllm_env.py compares with the installed vLLM).
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

if TYPE_CHECKING:
    from omnilab.config import Code2WavConfig, Qwen3TTSConfig
    from omnilab.hardware import HardwareInfo

FRAME_MS = 80.0
TALKER_SERIAL, TALKER_MAX_THREADS = 0.08, 16
CODE2WAV_SERIAL, CODE2WAV_MAX_THREADS = 0.03, 32
CHUNK_OVERHEAD_MS = 1.0        # per-chunk hop between the stages (shared memory, ~1 ms measured by peers)
SHARED_PENALTY = 1.10          # context switches + cache interference when both stages share cores


def padded_head_size(head_dim: int) -> int:
    """Smallest head size vLLM's CPU attention supports that holds ``head_dim``: the talker's attention runs
    (and its KV cache is sized) at this size, the extra dims zero."""
    for s in SUPPORTED_HEAD_SIZES:
        if s >= head_dim:
            return s
    raise ConfigError(f"head_dim {head_dim} is larger than vLLM's CPU attention supports "
                      f"(at most {SUPPORTED_HEAD_SIZES[-1]})")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Paged KV cache bytes per token of one request, as vLLM sizes it: layers x 2 (K and V) x kv_heads x
    the padded head size x dtype bytes. The one formula: the planner and the vLLM engine both call it."""
    return layers * 2 * kv_heads * padded_head_size(head_dim) * dtype_bytes


def kv_cache_bytes_for(per_token_bytes: int, seqs: int, length: int, block_size: int = BLOCK_SIZE) -> int:
    """KV bytes that hold ``seqs`` sequences of ``length`` tokens: whole blocks per sequence, plus the one
    block vLLM keeps in reserve."""
    return (seqs * -(-length // block_size) + 1) * block_size * per_token_bytes


def _layer_params(h: int, inter: int, heads: int, kv: int, hd: int) -> int:
    return h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * inter + 2 * h + 2 * hd


@dataclass(frozen=True)
class ModelGeometry:
    """Shapes that set KV bytes, resident weights and bytes streamed per frame."""
    name: str
    talker_layers: int = 28
    talker_hidden: int = 1024
    talker_intermediate: int = 3072
    talker_heads: int = 16
    talker_kv_heads: int = 8
    talker_head_dim: int = 128
    codec_vocab: int = 3072
    text_vocab: int = 151936
    text_hidden: int = 2048
    max_position_embeddings: int = 32768
    predictor_layers: int = 5
    predictor_hidden: int = 1024
    predictor_intermediate: int = 3072
    predictor_heads: int = 16
    predictor_kv_heads: int = 8
    predictor_head_dim: int = 128
    num_code_groups: int = 16
    decoder_params: int = 114_323_137
    decoder_gflop_per_frame: float = 4.96     # steady state, 96 % in the conv decoder
    chunk_fixed_frames: float = 1.0           # per streamed chunk, in frames of work (see chunk_gflop)
    stored_quantization: str = "none"         # decode matrices as the checkpoint stores them (pack-quantized file)

    @classmethod
    def released(cls, size: str = "0b6") -> "ModelGeometry":
        if size == "1b7":
            return cls("Qwen3-TTS 1.7B (released geometry)", talker_hidden=2048, talker_intermediate=6144)
        return cls("Qwen3-TTS 0.6B (released geometry)")

    @classmethod
    def from_config(cls, cfg: "Qwen3TTSConfig", decoder: "Code2WavConfig | None" = None,
                    name: str = "") -> "ModelGeometry":
        t, p = cfg.talker, cfg.code_predictor
        extra = {}
        if decoder is not None:
            scale = (decoder.decoder_dim / 1536) ** 2
            extra = dict(decoder_gflop_per_frame=4.96 * scale, decoder_params=int(114_323_137 * scale))
        extra["stored_quantization"] = stored_quantization(cfg.quantization_config)
        if not name:  # the config's size field names the family; a reduced test geometry says so (and its shape)
            rel = cls.released(cfg.tts_model_size)
            name = f"{cfg.tts_model_type} {cfg.tts_model_size}"
            if (t.num_hidden_layers, t.hidden_size) != (rel.talker_layers, rel.talker_hidden):
                name = f"{cfg.tts_model_type}, reduced geometry ({t.num_hidden_layers} layers x {t.hidden_size})"
        return cls(name, t.num_hidden_layers, t.hidden_size,
                   t.intermediate_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.vocab_size,
                   t.text_vocab_size, t.text_hidden_size, t.max_position_embeddings, p.num_hidden_layers,
                   p.hidden_size, p.intermediate_size, p.num_attention_heads, p.num_key_value_heads, p.head_dim,
                   t.num_code_groups, **extra)

    def decode_input_widths(self) -> tuple[int, ...]:
        """Input width K of every decode matrix (talker and predictor q/k/v/gate/up take the hidden width, o_proj
        heads x head_dim, down_proj the intermediate width; codec head, predictor heads and the projection the
        hidden widths): int4 groups must divide each (``omnilab.config.int4_groups_fitting``)."""
        return (self.talker_hidden, self.talker_heads * self.talker_head_dim, self.talker_intermediate,
                self.predictor_hidden, self.predictor_heads * self.predictor_head_dim, self.predictor_intermediate)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Talker KV per token (:func:`kv_bytes_per_token`: head size padded as vLLM's CPU attention pads it)."""
        return kv_bytes_per_token(self.talker_layers, self.talker_kv_heads, self.talker_head_dim, dtype_bytes)

    @property
    def _talker_layer(self) -> int:
        return _layer_params(self.talker_hidden, self.talker_intermediate, self.talker_heads,
                             self.talker_kv_heads, self.talker_head_dim)

    @property
    def _predictor_pass(self) -> int:
        proj = self.talker_hidden * self.predictor_hidden if self.talker_hidden != self.predictor_hidden else 0
        return (self.predictor_layers * _layer_params(self.predictor_hidden, self.predictor_intermediate,
                                                      self.predictor_heads, self.predictor_kv_heads,
                                                      self.predictor_head_dim)
                + 2048 * self.predictor_hidden + proj)

    def streamed_params_by_part(self) -> tuple[int, int, int]:
        """Weights read per 80 ms frame at batch 1: (talker step, 15 predictor passes, decoder share)."""
        talker = self.talker_layers * self._talker_layer + self.codec_vocab * self.talker_hidden
        return talker, (self.num_code_groups - 1) * self._predictor_pass, self.decoder_params // 25

    def streamed_params_per_frame(self) -> int:
        """Weights read per 80 ms frame at batch 1: talker step + 15 predictor passes (+ decoder share)."""
        return sum(self.streamed_params_by_part())

    def resident_bytes(self, dtype_bytes: int) -> int:
        """Weights held in memory by both stages (text embedding included, decoder always fp32)."""
        t = self.talker_hidden
        talker = (self.talker_layers * self._talker_layer + 2 * self.codec_vocab * t + self.text_vocab
                  * self.text_hidden + self.text_hidden * (self.text_hidden + t))
        heads = self.num_code_groups - 1  # 15 embeddings (talker width) and 15 lm_heads
        pred = self._predictor_pass - 2048 * self.predictor_hidden + heads * 2048 * (t + self.predictor_hidden)
        return (talker + pred) * dtype_bytes + self.decoder_params * 4

    def chunk_gflop(self, frames: int) -> float:
        """code2wav work for one streamed chunk, as GFLOP: its frames plus a fixed part per chunk. The stateful
        decoder recomputes nothing (``Code2WavState`` carries the conv contexts and the attention cache), but each
        chunk reads the decoder's weights once (0.44 GB in fp32) and runs its GEMMs on few columns, which costs
        ``chunk_fixed_frames`` frames of work (fitted: docs/profiles.md#cost-model)."""
        return self.decoder_gflop_per_frame * (frames + self.chunk_fixed_frames)


@dataclass(frozen=True)
class StageTimes:
    """Measured per-frame times, to replace the estimates. code2wav is per frame of audio at
    ``code2wav_chunk_frames``-frame chunks."""
    talker_ms_per_frame: float
    code2wav_ms_per_frame: float
    talker_threads: int = 1
    code2wav_threads: int = 1
    code2wav_chunk_frames: int = 25

    def __post_init__(self):
        for name in ("talker_ms_per_frame", "code2wav_ms_per_frame", "talker_threads", "code2wav_threads",
                     "code2wav_chunk_frames"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"StageTimes.{name} must be > 0, got {getattr(self, name)!r}")


# (per-thread effective GB/s of a decode frame after Amdahl, per-thread GFLOP/s in the conv decoder, label); x86:
# fitted (see the module docstring), the others scaled from it (assumptions)
_CORE_PERF = {
    "arm_sve": (19.0, 40.0, "aarch64 SVE"), "arm": (16.0, 20.0, "aarch64 NEON"),
    "amx": (15.0, 152.0, "x86 AMX"), "avx512_bf16": (15.0, 79.0, "x86 AVX512_BF16"),
    "avx512": (15.0, 76.0, "x86 AVX-512"), "avx2": (15.0, 50.0, "x86 AVX2"), "none": (11.0, 10.0, "no SIMD flags"),
}
FRAME_FIXED_MS = 14.0          # per frame, not scaling with bytes (fitted: see the module docstring)
FRAME_BANDWIDTH_FACTOR = 1.37  # a frame's effective bandwidth / the path timing's DRAM GEMV bandwidth (fitted)


@dataclass(frozen=True)
class Bandwidth:
    """A measured decode bandwidth: ``gbps`` through the GEMV kernel at ``threads`` threads (1 row)."""
    gbps: float
    threads: int
    label: str


def bandwidth_from_times(times) -> Bandwidth | None:
    """A path timing's (``profiles.timing.PathTimes``) 1-row GEMV bandwidth over bf16 decode matrices, or None."""
    rows = times.decode.get("fp32-kernel") if times is not None else None
    if not rows or 1 not in rows:
        return None
    return Bandwidth(times.gbps("fp32-kernel"), times.threads, "path timing, GEMV kernel from DRAM")


def code2wav_dtype_for(hw: "HardwareInfo", asked: str, env=None, times=None) -> str:
    """What code2wav will compute in under the profile's dtype (``asked``: the dtype field when set, else ""), by
    the rule ``tuning.code2wav_dtype`` applies (``OMNILAB_CODE2WAV_DTYPE`` from ``env``, default os.environ;
    ``times``: this machine's code2wav timing, ``tuning.code2wav_timing``; None: the ISA prior)."""
    raw = (settings.raw(CODE2WAV_ENV, env) or "auto").strip().lower()
    if raw not in ("auto", "float32", "bfloat16"):
        raw = "auto"  # code2wav's own choice names the bad value when the pipeline starts
    return code2wav_dtype_rule(raw, frozenset(hw.flags), hw.arch, asked, times)[0]


def amdahl(threads: int, serial: float, max_threads: int) -> float:
    """Fraction of 1-thread time left at ``threads`` threads."""
    n = max(1, min(threads, max_threads))
    return serial + (1 - serial) / n


def geometry_gb_per_frame(geometry: ModelGeometry, quantization: str = "none") -> float:
    """GB of decode weights one frame reads at batch 1: bf16 storage (2 bytes a weight) unquantized, else each part as
    the recipe (``config.QUANT_RECIPES``) stores it: int8 1 byte a weight, int4 0.5 + 2 / group (fp16 scales)."""
    talker, predictor, decoder = geometry.streamed_params_by_part()
    recipe, group = parse_quantization(quantization, "quantization")
    if recipe == "none":
        return (talker + predictor + decoder) * 2.0 / 1e9
    g = group or DEFAULT_INT4_GROUP_SIZE

    def per_weight(fmt: str) -> float:
        return 1.0 if fmt == "int8" else 0.5 + 2 / g

    fmt = QUANT_RECIPES[recipe]  # talker layers, codec head, predictor layers, predictor heads
    return (talker * per_weight(fmt[0]) + (predictor + decoder) * per_weight(fmt[2])) / 1e9


@dataclass(frozen=True)
class CostModel:
    """1-thread costs; ``talker_ms(n)`` and ``chunk_ms(frames, n)`` scale them."""
    geometry: ModelGeometry
    talker_ms_1: float            # talker + predictor per frame, 1 thread (the part that scales with threads)
    ms_per_gflop_1: float         # code2wav, 1 thread
    source: str                   # how the numbers were obtained, for reasons
    fixed_ms: float = 0.0         # per frame, whatever the threads (estimates: FRAME_FIXED_MS; measured: 0)

    @classmethod
    def build(cls, geometry: ModelGeometry, hardware: "HardwareInfo", dtype: str,
              measured: StageTimes | None = None, quantization: str = "none", bandwidth: Bandwidth | None = None,
              code2wav_dtype: str | None = None) -> "CostModel":
        """``quantization`` (a profile spelling): the decode matrices' bytes per weight in the estimate, per part as
        the recipe stores it (:func:`geometry_gb_per_frame`); ``bandwidth``: a measured one (the planner's path timing)
        instead of ``_CORE_PERF``'s; ``code2wav_dtype``: what code2wav computes in (default: ``dtype``); measured
        times are taken as they are."""
        if measured is not None:
            t1 = measured.talker_ms_per_frame / amdahl(measured.talker_threads, TALKER_SERIAL, TALKER_MAX_THREADS)
            c = measured.code2wav_chunk_frames
            chunk_ms = measured.code2wav_ms_per_frame * c - CHUNK_OVERHEAD_MS
            g1 = chunk_ms / amdahl(measured.code2wav_threads, CODE2WAV_SERIAL, CODE2WAV_MAX_THREADS)
            return cls(geometry, t1, max(g1, 1e-6) / geometry.chunk_gflop(c),
                       f"measured (talker {measured.talker_ms_per_frame:g} ms/frame at {measured.talker_threads} "
                       f"thr, code2wav {measured.code2wav_ms_per_frame:g} ms/frame at "
                       f"{measured.code2wav_threads} thr)")
        bw, _, label = _CORE_PERF[_perf_key(hardware, dtype)]
        c2w = code2wav_dtype or dtype
        _, gflops, _ = _CORE_PERF[_perf_key(hardware, c2w)]
        native = hardware.native_bf16()[0]
        if c2w == "bfloat16" and not native:
            gflops /= 3  # emulated bf16 (docs/model.md#bf16-emulation-cost)
        gb = geometry_gb_per_frame(geometry, quantization)
        qlabel = f" {quantization} weights" if quantization != "none" else ""
        if bandwidth is not None:
            bw = bandwidth.gbps * FRAME_BANDWIDTH_FACTOR * amdahl(bandwidth.threads, TALKER_SERIAL, TALKER_MAX_THREADS)
            bw_why = (f"{bw:.1f} GB/s per thread ({bandwidth.label}: {bandwidth.gbps:.1f} GB/s at "
                      f"{bandwidth.threads} thread(s), x{FRAME_BANDWIDTH_FACTOR:g} in a frame)")
        else:
            bw_why = f"{bw:g} GB/s per thread ({label} prior)"
        return cls(geometry, gb / bw * 1e3, 1e3 / gflops,
                   f"estimated for {dtype}{qlabel}: {gb:.2f} GB/frame at {bw_why} + {FRAME_FIXED_MS:g} ms fixed, "
                   f"code2wav ({c2w}) {geometry.decoder_gflop_per_frame:.2f} GFLOP/frame at {gflops:g} GFLOP/s per "
                   f"thread", FRAME_FIXED_MS)

    def talker_ms(self, threads: int) -> float:
        return self.talker_ms_1 * amdahl(threads, TALKER_SERIAL, TALKER_MAX_THREADS) + self.fixed_ms

    def chunk_ms(self, frames: int, threads: int) -> float:
        return (self.geometry.chunk_gflop(frames) * self.ms_per_gflop_1
                * amdahl(threads, CODE2WAV_SERIAL, CODE2WAV_MAX_THREADS) + CHUNK_OVERHEAD_MS)

    def code2wav_ms_per_frame(self, threads: int, chunk_frames: int = 25) -> float:
        return self.chunk_ms(chunk_frames, threads) / chunk_frames

    def frame_ms(self, mode: str, talker_threads: int, code2wav_threads: int, chunk_frames: int = 25) -> float:
        """Steady-state wall time per frame: pipelined (split) or serialised on shared cores."""
        t, c = self.talker_ms(talker_threads), self.code2wav_ms_per_frame(code2wav_threads, chunk_frames)
        return max(t, c) if mode == "split" else (t + c) * SHARED_PENALTY


def _perf_key(hw: "HardwareInfo", dtype: str) -> str:
    f = hw.flags
    if hw.is_arm:
        return "arm_sve" if "sve" in f else "arm"
    if dtype == "bfloat16" and "amx_bf16" in f:
        return "amx"
    if dtype == "bfloat16" and "avx512_bf16" in f:
        return "avx512_bf16"
    return "avx512" if "avx512f" in f else "avx2" if "avx2" in f else "none"


# ---------------------------------------------------------------- streaming playback simulation
def check_chunks(first: int, ramp: Sequence[int], steady: int, error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` unless ``first >= 0`` (0: no first chunk, start with the ramp) and every ramp and the
    steady size are ``>= 1``."""
    if first < 0 or steady < 1 or any(r < 1 for r in ramp):
        raise error(f"chunk sizes: first_frames must be >= 0 and ramp/steady_frames >= 1 "
                    f"(got {first}, {tuple(ramp)}, {steady})")


def chunk_frames(first: int, ramp: Sequence[int], steady: int, index: int) -> int:
    """Size of chunk ``index`` (0-based) of an unbounded stream: first (skipped when 0), the ramp, then steady."""
    head = ((first,) if first else ()) + tuple(ramp)
    return head[index] if index < len(head) else steady


def chunk_schedule(first: int, ramp: Sequence[int], steady: int, total_frames: int) -> list[int]:
    """Chunk sizes covering ``total_frames``: the :func:`chunk_frames` sequence, the last chunk cut short. The
    one chunk rule: ``DeployProfile.chunk_sizes``, the playback simulation and
    ``omnilab.models.code2wav_stream.ChunkSchedule`` (what the pipeline streams with) all use it. Every size is
    >= 1 and they sum to ``total_frames``."""
    check_chunks(first, ramp, steady)
    if total_frames < 0:
        raise ConfigError(f"chunk sizes: total_frames must be >= 0, got {total_frames}")
    sizes, done = [], 0
    while done < total_frames:
        sizes.append(min(chunk_frames(first, ramp, steady, len(sizes)), total_frames - done))
        done += sizes[-1]
    return sizes


@dataclass(frozen=True)
class StreamEstimate:
    """Predicted streaming behaviour for one request (prefill excluded)."""
    talker_ms_per_frame: float
    code2wav_ms_per_frame: float     # steady chunks, overhead included
    frame_ms: float                  # wall time per frame in steady state
    rtf: float                       # wall / audio (lower is better; > 1 = slower than real time)
    ttfa_ms: float                   # first audio after prefill
    stall_ms: float                  # playback stall over the horizon
    horizon_frames: int
    source: str

    def describe(self) -> str:
        return (f"talker {self.talker_ms_per_frame:.0f} ms/frame, code2wav {self.code2wav_ms_per_frame:.0f} ms/frame"
                f" -> {self.frame_ms:.0f} ms per 80 ms frame, RTF {self.rtf:.2f} (wall/audio), TTFA "
                f"{self.ttfa_ms:.0f} ms after prefill, stall {self.stall_ms:.0f} ms over "
                f"{self.horizon_frames * FRAME_MS / 1000:.0f} s [{self.source}]")


def simulate_stream(cost: CostModel, mode: str, talker_threads: int, code2wav_threads: int,
                    sizes: Sequence[int]) -> tuple[float, float, float]:
    """(ttfa_ms, stall_ms, wall_ms) for chunk ``sizes``. Split: the stages run concurrently; shared:
    decoding a chunk holds up the talker (serialised, with ``SHARED_PENALTY``)."""
    p = cost.talker_ms(talker_threads)
    t_talk = t_dec = 0.0
    play_end, stall, ttfa = None, 0.0, 0.0
    for c in sizes:
        d = cost.chunk_ms(c, code2wav_threads)
        if mode == "split":
            t_talk += c * p
            t_dec = max(t_dec, t_talk) + d
        else:
            t_talk += (c * p + d) * SHARED_PENALTY
            t_dec = t_talk
        if play_end is None:
            ttfa, play_end = t_dec, t_dec
        elif t_dec > play_end:
            stall += t_dec - play_end
            play_end = t_dec
        play_end += c * FRAME_MS
    return ttfa, stall, t_dec


def estimate(cost: CostModel, mode: str, talker_threads: int, code2wav_threads: int, first: int,
             ramp: Sequence[int], steady: int, horizon_frames: int = 250) -> StreamEstimate:
    sizes = chunk_schedule(first, ramp, steady, horizon_frames)
    ttfa, stall, _ = simulate_stream(cost, mode, talker_threads, code2wav_threads, sizes)
    frame = cost.frame_ms(mode, talker_threads, code2wav_threads, steady)
    return StreamEstimate(cost.talker_ms(talker_threads), cost.code2wav_ms_per_frame(code2wav_threads, steady),
                          frame, frame / FRAME_MS, ttfa, stall, horizon_frames,
                          cost.source.split(" ")[0])


def doubling_ramp(first: int, steady: int) -> tuple[int, ...]:
    """Chunk sizes between the first and the steady chunk: first x 2, x 4, ... while below steady."""
    out, c = [], first * 2
    while c < steady:
        out.append(c)
        c *= 2
    return tuple(out)


__all__ = ["ModelGeometry", "StageTimes", "CostModel", "StreamEstimate", "simulate_stream", "estimate",
           "chunk_schedule", "chunk_frames", "check_chunks", "doubling_ramp", "amdahl", "FRAME_MS", "BLOCK_SIZE",
           "SUPPORTED_HEAD_SIZES", "padded_head_size", "kv_bytes_per_token", "kv_cache_bytes_for"]
