"""``compare(ref_pipe, test_pipe, texts, **generation) -> QualityReport`` (docs/quality.md).

Contract, per text (one request at a time, so every run is batch 1):

1. The reference runs free and greedy: ``ref_pipe.generate(text, do_sample=False, subtalker_do_sample=False,
   **generation)``, through its own backend (eager or vLLM); its frames ``codes`` ``[T, 16]`` and its audio
   are kept.
2. Both pipelines' talkers are teacher-forced on those frames (:func:`omnilab.quality.teacher.teacher_force`,
   eagerly, on each pipeline's own modules): frame t's codebook-0 scores given frames < t, and the code
   predictor's argmax of codebooks 1..15 given the reference's codes 0..i-1 of frame t. The reference side is
   forced too, so both score vectors come from the same procedure: a pipeline compared with itself agrees
   exactly, whichever backend generated the frames.
3. The reference codes are decoded by ``test_pipe.code2wav`` and compared with the reference's own audio
   (decoded by ``ref_pipe.code2wav`` from the same codes): the waveform SNR.

``generation`` takes ``Pipeline.generate``'s keywords (``speaker``, ``language``, ``instruct``, ``ref_audio``,
``ref_text``, ``max_new_tokens``, ``repetition_penalty``, ...); a list gives one value per text.
``do_sample`` / ``subtalker_do_sample`` other than False are refused: the metrics are defined on greedy
decoding. ``c0_scores``: ``"processed"`` (default: the scores greedy decoding takes the argmax of, after the
repetition penalty over the reference's c0 history, the ``min_new_tokens`` EOS mask and the suppression of
ids >= 2048 but EOS; both sides get the same processing) or ``"raw"`` (the talker's fp32 logits).
Both pipelines must share one model geometry (``model.config``), else :class:`~omnilab.errors.ConfigError`.

``reference(ref_pipe, texts, **generation) -> ReferenceRun`` does steps 1-2 for the reference side once;
``compare(run, test_pipe)`` then costs only the test side's forcing and decode, for as many test pipelines as
wanted (the reference's frames, scores and audio are the same objects for each).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from omnilab.errors import ConfigError, InputError
import omnilab.quality.metrics as metrics
from omnilab.quality.report import COLUMNS, QualityReport
from omnilab.models.prompt import PromptRequest
from omnilab.quality.teacher import Forced, forcing_talker, teacher_force
from omnilab.requests import UserRequest, build_request
from omnilab.sampling import SamplingParams

__all__ = ["C0_SCORES", "ReferenceRun", "compare", "describe", "reference"]

C0_SCORES = ("processed", "raw")
_GREEDY_KEYS = ("do_sample", "subtalker_do_sample")
_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(UserRequest) if f.name not in ("text", "input_ids"))
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def describe(pipe: Any) -> str:
    """A pipeline in words for the report: backend, compute dtype and quantization, e.g. ``eager float32 int4``."""
    model = getattr(pipe, "model", None)
    dtype = str(getattr(model, "dtype", "?")).replace("torch.", "")
    q = getattr(model, "quantization", None)
    quant = f" {q.method}" + (f"-g{q.group_size}" if q.group_size else "") if q is not None and q.enabled else ""
    return f"{getattr(pipe, 'backend', '?')} {dtype}{quant}"


def _per_text(texts: Sequence[str], generation: dict[str, Any]) -> list[dict[str, Any]]:
    n = len(texts)
    out = []
    for i in range(n):
        kw = {}
        for k, v in generation.items():
            if isinstance(v, list) and k != "input_ids":
                if len(v) != n:
                    raise InputError(f"{k} is a list of {len(v)} values but there are {n} texts")
                v = v[i]
            kw[k] = v
        out.append(kw)
    return out


def _check_pair(ref_pipe: Any, test_pipe: Any) -> None:
    rc, tc = ref_pipe.model.config, test_pipe.model.config
    if rc != tc:
        raise ConfigError(f"compare needs two pipelines of one model geometry; the reference is "
                          f"{rc.tts_model_size} {rc.tts_model_type} ({ref_pipe.model.path}) and the test "
                          f"{tc.tts_model_size} {tc.tts_model_type} ({test_pipe.model.path}); accepted: the same "
                          "checkpoint (any backend, dtype or quantization) or one with an identical config")


@dataclass(frozen=True, eq=False)
class ReferenceRun:
    """The reference side of :func:`compare`, computed once by :func:`reference` and reusable against any number
    of test pipelines (the bench measures several numerics settings against one reference): per text, the
    greedy result, the request as parsed, the sampling values and the reference's own teacher-forced scores."""
    pipe: Any
    texts: tuple[str, ...]
    c0_scores: str
    items: tuple[tuple[Any, PromptRequest, SamplingParams, Forced], ...]   # (result, request, params, forced)
    seconds: Mapping[str, float]

    def __len__(self) -> int:
        return len(self.items)

    def top1_prob(self) -> np.ndarray:
        """Mean softmax probability of the reference's own greedy decisions per codebook ``[16]`` (codebook 0: its
        scores as compared, ``c0_scores``; 1..15: the code predictor's fp32 logits), pooled over every frame: how
        confident the decisions are, so how large a flip-free perturbation is (docs/quality.md#confident-random-
        checkpoints)."""
        c0 = [torch.softmax(fr.c0_scores, dim=-1).amax(-1) for *_, fr in self.items]  # [T] each
        cp = [fr.cp_top1_prob for *_, fr in self.items]  # [T, 15] each
        return torch.cat([torch.cat(c0)[:, None], torch.cat(cp)], dim=1).double().mean(0).numpy()

    def __repr__(self) -> str:
        frames = sum(len(res.codes) for res, *_ in self.items)
        return f"ReferenceRun({describe(self.pipe)}, {len(self.items)} texts, {frames} frames)"


def reference(ref_pipe: Any, texts: str | Sequence[str], *, c0_scores: str = "processed",
              **generation: Any) -> ReferenceRun:
    """Steps 1-2 of the contract for the reference side alone: greedy runs and their forced scores."""
    if c0_scores not in C0_SCORES:
        raise InputError(f"c0_scores {c0_scores!r} is not known; accepted: {', '.join(C0_SCORES)}")
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise InputError("texts is empty; give at least one sentence")
    for k in _GREEDY_KEYS:
        if generation.get(k, False) is not False:
            raise InputError(f"{k}={generation[k]!r}: compare scores greedy decoding; "
                             "accepted: False (or leave it out)")
    if "input_ids" in generation:
        raise InputError("compare takes texts, not input_ids")
    ref_talker, cfg = forcing_talker(ref_pipe), ref_pipe.model.config
    seconds = {"reference": 0.0, "forcing": 0.0}
    items = []
    for text, kw in zip(texts, _per_text(texts, generation)):
        kw = {**kw, "do_sample": False, "subtalker_do_sample": False}
        t0 = time.perf_counter()
        res = ref_pipe.generate(text, **kw)
        seconds["reference"] += time.perf_counter() - t0

        # the request and the sampling values the reference ran with (same parsing as Pipeline.generate)
        preq, _ = build_request(ref_pipe.model, UserRequest(text=text, **{k: kw.get(k) for k in _REQUEST_FIELDS}),
                                warn=False)
        params = SamplingParams.from_defaults(ref_pipe.model.generation,
                                              **{k: kw.get(k) for k in _SAMPLING_FIELDS if k in kw})
        t0 = time.perf_counter()
        fr = teacher_force(ref_talker, cfg, preq, _codes(res), params, stop_step=res.finish_reason == "eos",
                           raw=c0_scores == "raw")
        seconds["forcing"] += time.perf_counter() - t0
        items.append((res, preq, params, fr))
    return ReferenceRun(ref_pipe, tuple(texts), c0_scores, tuple(items), seconds)


def _codes(res: Any) -> torch.Tensor:
    return torch.as_tensor(res.codes, dtype=torch.long)  # [T, 16]


def compare(ref: Any, test_pipe: Any, texts: str | Sequence[str] | None = None, *, c0_scores: str = "processed",
            **generation: Any) -> QualityReport:
    """Fidelity of ``test_pipe`` against ``ref`` on ``texts`` (see the module docstring). ``ref`` is a reference
    pipeline, or a :class:`ReferenceRun` from :func:`reference` (then ``texts`` and ``generation`` are its own:
    giving them again is an error)."""
    if isinstance(ref, ReferenceRun):
        if texts is not None or generation or c0_scores != "processed":
            raise InputError("compare(reference_run, test_pipe) takes no texts or generation keywords: the "
                             "ReferenceRun has its own; accepted: compare(run, test_pipe)")
        _check_pair(ref.pipe, test_pipe)
        run = ref
    else:
        if texts is None:
            raise InputError("texts is missing; give at least one sentence (or a ReferenceRun as ref)")
        _check_pair(ref, test_pipe)  # before the reference's greedy runs
        run = reference(ref, texts, c0_scores=c0_scores, **generation)
    test_talker, cfg = forcing_talker(test_pipe), run.pipe.model.config
    seconds = {"reference": 0.0, "forcing": 0.0, "decode": 0.0}
    t_start = time.perf_counter()
    rows = []
    for i, (res, preq, params, fr) in enumerate(run.items):
        codes = _codes(res)
        t0 = time.perf_counter()
        ft = teacher_force(test_talker, cfg, preq, codes, params, stop_step=res.finish_reason == "eos",
                           raw=run.c0_scores == "raw")
        seconds["forcing"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        test_audio = test_pipe.code2wav.decode(res.codes, prefix_codes=preq.ref_codes) if len(codes) else \
            np.zeros(0, dtype=np.float32)
        seconds["decode"] += time.perf_counter() - t0
        rows.append(_row(f"req-{i}", res, codes, fr, ft, test_audio))
    seconds["total"] = time.perf_counter() - t_start
    if run is not ref:  # computed here: its cost is this comparison's
        seconds["reference"] = run.seconds["reference"]
        seconds["forcing"] += run.seconds["forcing"]
        seconds["total"] += run.seconds["reference"] + run.seconds["forcing"]
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    return QualityReport(table, describe(run.pipe), describe(test_pipe), run.c0_scores, seconds)


def _row(request: str, res: Any, codes: torch.Tensor, fr, ft, test_audio: np.ndarray) -> dict:
    """One report row from the reference result, both forced runs and the test decode."""
    n = codes.shape[0]
    kl = metrics.kl_per_frame(fr.c0_scores, ft.c0_scores)  # [T]
    by_cb = metrics.code_agreement(fr.cp_argmax, ft.cp_argmax)  # [15]
    replay = metrics.code_agreement(codes.reshape(-1, 1), fr.argmax.reshape(-1, 1))[0] if n else float("nan")
    stop = None
    if fr.stop_scores is not None:
        stop = bool(int(ft.stop_scores.argmax()) == int(fr.stop_scores.argmax()))
    return {
        "request": request, "text": res.text, "frames": int(n),
        "c0_agreement": metrics.top1_agreement(fr.c0_scores, ft.c0_scores),
        "c0_kl_mean": float(kl.mean()) if n else float("nan"),
        "c0_kl_max": float(kl.max()) if n else float("nan"),
        "cp_agreement": float(np.mean(by_cb)) if n else float("nan"),
        "cp_agreement_by_codebook": [float(x) for x in by_cb],
        "stop_agreement": stop, "replay_agreement": float(replay),
        "wave_snr_db": metrics.wave_snr_db(res.audio, test_audio), "finish_reason": res.finish_reason,
    }
