"""Regenerate the parity goldens in ``tests/golden/parity/`` from the official qwen-tts 0.1.1.

Runs in omnilab's ``.venv`` (it needs ``omnilab.checkpoint.random`` to build the random checkpoints) and calls
``run_reference.py`` in the reference env (``.venv-ref``, made by ``setup_ref_env.sh``) as a subprocess.

For every case in :data:`CASES` it records, from the official package on the same random checkpoint:
the talker prompt (prompt embeddings [L, H], trailing text queue [N, H], tts_pad [H]), the prefill logits
and hidden state (for diagnosis), the greedy codes [T, 16], the official code2wav waveform of the
first :data:`WAV_FRAMES` frames of those codes, and for Base the x-vector and the ICL reference codes.
Base cases may give the reference clip at another rate (``ref_sr``: the same synthetic voice made at that
rate); the official package then resamples it to 24 kHz (librosa ``soxr_hq``) and ``cases.json`` records
the length and sha256 of that 24 kHz clip (omnilab's ``load_audio`` is checked against it here too).
The checkpoint is identified by the factory arguments (size, variant, seed) and a sha256 over its
files, so ``tests/test_parity.py`` can tell a factory change from a model regression.

Usage (from the repo root):
    bash scripts/reference/setup_ref_env.sh                # once
    .venv/bin/python scripts/reference/make_goldens.py     # all cases, ~2-4 min on 2 cores
    .venv/bin/python scripts/reference/make_goldens.py --only tiny_cv_vivian_en   # a subset (merged)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GOLDEN_DIR = REPO / "tests" / "golden" / "parity"
FORMAT_VERSION = 1
MAX_NEW_TOKENS = 41          # HF counts talker tokens: 41 tokens -> 40 frames (the last token's frame is never made)
WAV_FRAMES = 20              # waveform stored for the first 20 frames (20 * 1920 samples)
SAMPLES_PER_FRAME = 1920
REF_SR = 24000               # rate of ``ref_audio.safetensors``; cases may ask for another (``ref_sr``)
REF_SECONDS = 0.9

GREEDY = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": MAX_NEW_TOKENS,
          "repetition_penalty": 1.05}

# name -> (checkpoint (size, variant, seed), request). "slow" cases use the mid geometry.
CASES: list[dict] = [
    # --- tiny (tts_model_size 0b6: CustomVoice ignores instruct) ---------------------------------------
    dict(name="tiny_cv_vivian_en", ckpt=("tiny", "custom_voice", 0),
         req=dict(api="custom_voice", text="Hello, world! This is a test.", speaker="Vivian", language="English")),
    dict(name="tiny_cv_eric_zh_dialect_stream", ckpt=("tiny", "custom_voice", 1),
         req=dict(api="custom_voice", text="你好，世界。今天天气很好。", speaker="eric", language="chinese",
                  non_streaming_mode=False)),
    dict(name="tiny_cv_dylan_auto_dialect", ckpt=("tiny", "custom_voice", 1),
         req=dict(api="custom_voice", text="The quick brown fox jumps over 13 lazy dogs.", speaker="dylan",
                  language="auto")),
    dict(name="tiny_cv_camelcase_text", ckpt=("tiny", "custom_voice", 0),
         req=dict(api="custom_voice", text="My iPhone runs JavaScript and HelloWorld apps.", speaker="ryan",
                  language="english")),
    dict(name="tiny_vd_instruct_en", ckpt=("tiny", "voice_design", 2),
         req=dict(api="voice_design", text="Good morning, how are you today?",
                  instruct="A calm, low male voice, speaking slowly.", language="english")),
    dict(name="tiny_base_xvec_en", ckpt=("tiny", "base", 3),
         req=dict(api="voice_clone", text="Hello, world! This is a test.", language="english",
                  x_vector_only_mode=True)),
    dict(name="tiny_base_icl_en", ckpt=("tiny", "base", 3),
         req=dict(api="voice_clone", text="Hello, world! This is a test.", language="english",
                  ref_text="This is the reference voice.", x_vector_only_mode=False)),
    # Base with the reference clip at 16 kHz / 44.1 kHz: the official package resamples it (librosa soxr_hq)
    # for both the x-vector and the ICL reference codes.
    dict(name="tiny_base_icl_ref16k", ckpt=("tiny", "base", 3), ref_sr=16000,
         req=dict(api="voice_clone", text="Hello, world! This is a test.", language="english",
                  ref_text="This is the reference voice.", x_vector_only_mode=False)),
    dict(name="tiny_base_icl_ref44k1", ckpt=("tiny", "base", 3), ref_sr=44100,
         req=dict(api="voice_clone", text="Cloning a voice from a clip at another rate.", language="english",
                  ref_text="This is the reference voice.", x_vector_only_mode=False)),
    # --- mid (tts_model_size 1b7: small_to_mtp_projection, CustomVoice takes instruct) --------------
    dict(name="mid_cv_ryan_instruct", ckpt=("mid", "custom_voice", 0), slow=True,
         req=dict(api="custom_voice", text="She sells seashells by the seashore.", speaker="ryan",
                  language="english", instruct="Speak with excitement.")),
    dict(name="mid_vd_auto_stream", ckpt=("mid", "voice_design", 1), slow=True,
         req=dict(api="voice_design", text="Numbers like 42 and 3.14 should be read clearly.",
                  instruct="A bright young female voice.", language="auto", non_streaming_mode=False)),
    dict(name="mid_base_icl_nonstream", ckpt=("mid", "base", 2), slow=True,
         req=dict(api="voice_clone", text="This sentence continues the cloned voice.", language="english",
                  ref_text="Reference speech for cloning.", x_vector_only_mode=False, non_streaming_mode=True)),
    dict(name="mid_base_xvec_zh", ckpt=("mid", "base", 2), slow=True,
         req=dict(api="voice_clone", text="我们今天去公园散步吧。", language="chinese", x_vector_only_mode=True)),
    dict(name="mid_base_xvec_ref44k1", ckpt=("mid", "base", 2), slow=True, ref_sr=44100,
         req=dict(api="voice_clone", text="The reference clip was recorded at a higher rate.", language="english",
                  x_vector_only_mode=True)),
]


def ckpt_key(size: str, variant: str, seed: int) -> str:
    return f"{size}-{variant}-s{seed}"


def checkpoint_hashes(path: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint directory, by relative path (sorted)."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[p.relative_to(path).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def combined_hash(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def make_ref_audio(seconds: float = REF_SECONDS, sr: int = REF_SR, seed: int = 1234) -> np.ndarray:
    """A short synthetic 'voice': a 150 Hz harmonic stack with a slow vibrato, an envelope and noise."""
    t = np.arange(int(round(seconds * sr)), dtype=np.float64) / sr
    f0 = 150.0 * (1.0 + 0.03 * np.sin(2 * np.pi * 5.0 * t))
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wav = sum((0.25 / k) * np.sin(k * phase) for k in range(1, 7))
    env = np.minimum(1.0, np.minimum(t / 0.05, (seconds - t) / 0.05))
    wav = wav * env + 0.01 * np.random.default_rng(seed).standard_normal(t.size)
    return wav.astype(np.float32)


def ref_audio_file(sr: int) -> str:
    """Golden file name of the synthetic reference clip at ``sr`` Hz."""
    return "ref_audio.safetensors" if sr == REF_SR else f"ref_audio_{sr}.safetensors"


def _ref_request(case: dict) -> dict:
    req = dict(case["req"])
    req["name"] = case["name"]
    req["gen"] = dict(GREEDY)
    if req["api"] == "voice_clone":
        sr = int(case.get("ref_sr", REF_SR))
        req["ref_audio_file"] = ref_audio_file(sr)
        req["ref_sr"] = sr
    return req


def _sha256_f32(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, dtype="<f4").tobytes()).hexdigest()


def _ref_audio_entry(req: dict, ref_clips: dict[int, np.ndarray], official_24k: np.ndarray) -> dict:
    """cases.json entry of a Base case's reference clip: file, rate, and the official 24 kHz clip it became
    (length and sha256 of its float32 bytes; at 24 kHz the clip itself). Checks omnilab's ``load_audio``."""
    from omnilab.audio import load_audio

    sr = int(req["ref_sr"])
    clip = ref_clips[sr]
    ours = load_audio(clip, sr=sr)
    same = ours.shape == official_24k.shape and np.array_equal(ours, official_24k)
    if not same:
        print(f"[make_goldens]   WARNING {req['name']}: omnilab.audio.load_audio(clip, sr={sr}) differs from the "
              f"official 24 kHz clip ({ours.shape} vs {official_24k.shape})", flush=True)
    return {"file": ref_audio_file(sr), "sample_rate": sr, "samples": int(clip.shape[0]),
            "resampled_24k": {"samples": int(official_24k.shape[0]), "sha256": _sha256_f32(official_24k)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=GOLDEN_DIR)
    ap.add_argument("--ref-python", type=Path, default=REPO / ".venv-ref" / "bin" / "python")
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir, removed)")
    ap.add_argument("--only", nargs="*", default=None, help="case names to regenerate (others are kept)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from omnilab.checkpoint.random import make_random_checkpoint

    if not args.ref_python.exists():
        sys.exit(f"{args.ref_python} not found: run scripts/reference/setup_ref_env.sh first")
    cases = [c for c in CASES if args.only is None or c["name"] in args.only]
    unknown = set(args.only or []) - {c["name"] for c in CASES}
    if unknown:
        sys.exit(f"unknown case(s): {sorted(unknown)}")

    work = args.work or Path(tempfile.mkdtemp(prefix="omnilab-goldens-"))
    work.mkdir(parents=True, exist_ok=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")

    # The synthetic reference voice at every rate the chosen cases need (24 kHz always: ref_audio.safetensors).
    ref_rates = sorted({REF_SR} | {int(c.get("ref_sr", REF_SR)) for c in cases if c["req"]["api"] == "voice_clone"})
    ref_clips: dict[int, np.ndarray] = {}
    for sr in ref_rates:
        ref_clips[sr] = make_ref_audio(sr=sr)
        save_file({"wav": torch.from_numpy(ref_clips[sr])}, str(work / ref_audio_file(sr)),
                  metadata={"sample_rate": str(sr)})

    index_path = out / "cases.json"
    index = json.loads(index_path.read_text()) if (index_path.exists() and args.only) else {}
    index.setdefault("checkpoints", {})
    index.setdefault("cases", {})
    t0 = time.time()
    by_ckpt: dict[tuple, list[dict]] = {}
    for c in cases:
        by_ckpt.setdefault(tuple(c["ckpt"]), []).append(c)

    for (size, variant, seed), group in by_ckpt.items():
        key = ckpt_key(size, variant, seed)
        ckpt = work / key
        if not ckpt.exists():
            make_random_checkpoint(ckpt, size, variant, seed)
        files = checkpoint_hashes(ckpt)
        index["checkpoints"][key] = {"size": size, "variant": variant, "seed": seed,
                                     "sha256": combined_hash(files), "files": files}
        reqs = [_ref_request(c) for c in group]
        req_path = work / f"{key}.requests.json"
        req_path.write_text(json.dumps(reqs, indent=2, ensure_ascii=False))
        ref_out = work / f"{key}.out"
        cmd = [str(args.ref_python), str(Path(__file__).with_name("run_reference.py")), str(ckpt), str(req_path),
               str(ref_out), "--threads", str(args.threads)]
        print(f"[make_goldens] {key}: running the reference on {len(group)} request(s)", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            sys.exit(f"run_reference.py failed for {key}")
        manifest = json.loads((ref_out / "manifest.json").read_text())
        for c, req in zip(group, reqs):
            t = load_file(str(ref_out / f"{c['name']}.safetensors"))
            codes = t["codes"]
            frames = int(codes.shape[0])
            if frames != MAX_NEW_TOKENS - 1:
                sys.exit(f"{c['name']}: the reference stopped after {frames} frames (EOS); pick another seed/text")
            gold = {
                "prompt_embeds": t["prompt_embeds"], "trailing_text": t["trailing_text"],
                "tts_pad_embed": t["tts_pad_embed"], "prefill_logits": t["prefill_logits"],
                "prefill_hidden": t["prefill_hidden"], "codes": codes.to(torch.int64),
                "wav": t["wav_codes"][: WAV_FRAMES * SAMPLES_PER_FRAME].clone(),
            }
            if "spk_embedding" in t:
                gold["spk_embedding"] = t["spk_embedding"]
            if "ref_codes" in t:
                gold["ref_codes"] = t["ref_codes"].to(torch.int64)
                # The public API decodes ref ++ generated and cuts the reference part off.
                ref_frames = int(t["ref_codes"].shape[0])
                total = ref_frames + frames
                cut = int(ref_frames / max(total, 1) * (total * SAMPLES_PER_FRAME))
                gold["wav_api"] = t["wav_api"][: WAV_FRAMES * SAMPLES_PER_FRAME].clone()
                icl_cut = {"ref_frames": ref_frames, "cut_samples": cut,
                           "cut_is_exact": cut == ref_frames * SAMPLES_PER_FRAME}
            else:
                assert torch.equal(t["wav_api"], t["wav_codes"]), c["name"]
                icl_cut = None
            gold = {k: v.contiguous() for k, v in gold.items()}
            save_file(gold, str(out / f"{c['name']}.safetensors"))
            req_public = {k: v for k, v in req.items() if k not in ("name", "ref_audio_file")}
            index["cases"][c["name"]] = {
                "checkpoint": key, "slow": bool(c.get("slow", False)), "request": req_public,
                "frames": frames, "wav_frames": WAV_FRAMES,
                "num_unique_c0": int(codes[:, 0].unique().numel()),
                "prompt_len": int(t["prompt_embeds"].shape[0]), "trailing_len": int(t["trailing_text"].shape[0]),
                "icl": icl_cut,
            }
            if req["api"] == "voice_clone":
                index["cases"][c["name"]]["ref_audio"] = _ref_audio_entry(req, ref_clips, t["ref_wav_24k"].numpy())
            print(f"[make_goldens]   {c['name']}: prompt {list(t['prompt_embeds'].shape)}, "
                  f"codes {list(codes.shape)}, {index['cases'][c['name']]['num_unique_c0']} distinct c0", flush=True)
        index["reference"] = manifest["versions"] | {"attn_implementation": manifest["attn_implementation"]}

    for sr in ref_rates:
        shutil.copyfile(work / ref_audio_file(sr), out / ref_audio_file(sr))
    index["format"] = FORMAT_VERSION
    index["ref_audio"] = {"file": "ref_audio.safetensors", "sample_rate": REF_SR, "seconds": REF_SECONDS}
    index["generation"] = dict(GREEDY)
    # keep only checkpoints still referenced
    used = {c["checkpoint"] for c in index["cases"].values()}
    index["checkpoints"] = {k: v for k, v in sorted(index["checkpoints"].items()) if k in used}
    index["cases"] = dict(sorted(index["cases"].items()))
    index_path.write_text(json.dumps(index, indent=2, ensure_ascii=False) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"[make_goldens] wrote {len(cases)} case(s) to {out} ({total / 1e6:.2f} MB total) "
          f"in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
