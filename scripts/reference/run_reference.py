"""Run the official qwen-tts 0.1.1 on one checkpoint and record what omnilab must reproduce.

Runs INSIDE the reference env (`.venv-ref`, see setup_ref_env.sh); imports qwen_tts, torch,
numpy and safetensors only (no omnilab). Uses the public `Qwen3TTSModel` API plus hooks, never an
edited package:

- `model.model.talker.generate` is wrapped to capture the prompt the talker sees
  (`inputs_embeds` [L, H], the trailing-text queue [Ltr, H] and `tts_pad_embed` [H]);
- a forward hook on the talker captures the prefill logits and final-norm hidden of the last
  prompt position (for diagnosis);
- `model.model.generate` is wrapped to capture the greedy codes [T, 16] and, for Base, the
  voice-clone prompt (x-vector [H], ICL reference codes [Tr, 16]);
- `model.model.extract_speaker_embedding` is wrapped to capture the 24 kHz reference clip it gets (for a
  reference at another rate: the output of the official `librosa.resample(..., res_type="soxr_hq")`).

Usage:
    .venv-ref/bin/python scripts/reference/run_reference.py CKPT_DIR REQUESTS.json OUT_DIR

REQUESTS.json is a list of requests:
    {"name": str, "api": "custom_voice" | "voice_design" | "voice_clone",
     "text": str, "language": str, "speaker": str?, "instruct": str?,
     "ref_audio_file": str? (a .safetensors with tensor "wav" [N] fp32, relative to the JSON),
     "ref_sr": int?, "ref_text": str?, "x_vector_only_mode": bool?, "non_streaming_mode": bool?,
     "gen": {"do_sample": false, "subtalker_dosample": false, "max_new_tokens": int,
             "repetition_penalty": float, ...}}
For each request it writes OUT_DIR/<name>.safetensors (fp32/int64 tensors):
    prompt_embeds [L, H], trailing_text [Ltr, H], tts_pad_embed [H],
    prefill_logits [V], prefill_hidden [H], codes [T, 16],
    wav_api [N] (what the public API returns), wav_codes [T*1920] (speech-tokenizer decode of codes),
    spk_embedding [H] (Base), ref_codes [Tr, 16] (Base ICL), ref_wav_24k [N24] (Base: the speaker encoder's input),
and OUT_DIR/manifest.json with the inputs and the run settings.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def _capture_hooks(tts):
    """Install capture wrappers on the loaded model; return the dict they fill."""
    cap: dict = {}
    outer = tts.model               # Qwen3TTSForConditionalGeneration
    talker = outer.talker           # Qwen3TTSTalkerForConditionalGeneration

    orig_talker_generate = talker.generate

    def talker_generate(*args, **kwargs):
        cap["inputs_embeds"] = kwargs["inputs_embeds"].detach().clone()
        cap["attention_mask"] = kwargs["attention_mask"].detach().clone()
        cap["trailing_text_hidden"] = kwargs["trailing_text_hidden"].detach().clone()
        cap["tts_pad_embed"] = kwargs["tts_pad_embed"].detach().clone()
        cap["talker_kwargs"] = {k: v for k, v in kwargs.items()
                                if isinstance(v, (int, float, bool, str, type(None)))}
        return orig_talker_generate(*args, **kwargs)

    talker.generate = talker_generate

    def talker_forward_hook(module, args, kwargs, output):
        emb = kwargs.get("inputs_embeds")
        if emb is not None and emb.shape[1] > 1 and "prefill_logits" not in cap:
            cap["prefill_logits"] = output.logits[0, -1].detach().float().clone()
            cap["prefill_hidden"] = output.past_hidden[0, -1].detach().float().clone()

    handle = talker.register_forward_hook(talker_forward_hook, with_kwargs=True)

    orig_generate = outer.generate

    def outer_generate(*args, **kwargs):
        codes_list, hidden_list = orig_generate(*args, **kwargs)
        cap["codes"] = codes_list[0].detach().clone()
        vcp = kwargs.get("voice_clone_prompt")
        if vcp is not None:
            cap["spk_embedding"] = vcp["ref_spk_embedding"][0].detach().float().clone()
            if vcp["ref_code"] is not None and vcp["ref_code"][0] is not None:
                cap["ref_codes"] = vcp["ref_code"][0].detach().clone()
        return codes_list, hidden_list

    outer.generate = outer_generate

    # The 24 kHz clip the speaker encoder gets (for a non-24 kHz reference: the official librosa resampling).
    orig_spk = outer.extract_speaker_embedding

    def extract_speaker_embedding(audio, sr):
        cap["ref_wav_24k"] = np.array(audio, dtype=np.float32, copy=True)
        return orig_spk(audio=audio, sr=sr)

    outer.extract_speaker_embedding = extract_speaker_embedding
    return cap, handle


def _run_one(tts, req: dict, base_dir: Path) -> dict[str, torch.Tensor]:
    cap, handle = _capture_hooks(tts)
    gen = dict(req.get("gen", {}))
    api = req["api"]
    try:
        if api == "custom_voice":
            kw = {}
            if "non_streaming_mode" in req:
                kw["non_streaming_mode"] = req["non_streaming_mode"]
            wavs, sr = tts.generate_custom_voice(
                text=req["text"], speaker=req["speaker"], language=req.get("language"),
                instruct=req.get("instruct"), **kw, **gen)
        elif api == "voice_design":
            kw = {}
            if "non_streaming_mode" in req:
                kw["non_streaming_mode"] = req["non_streaming_mode"]
            wavs, sr = tts.generate_voice_design(
                text=req["text"], instruct=req.get("instruct", ""), language=req.get("language"),
                **kw, **gen)
        elif api == "voice_clone":
            ref = load_file(str(base_dir / req["ref_audio_file"]))["wav"].numpy().astype(np.float32)
            kw = {}
            if "non_streaming_mode" in req:
                kw["non_streaming_mode"] = req["non_streaming_mode"]
            wavs, sr = tts.generate_voice_clone(
                text=req["text"], language=req.get("language"),
                ref_audio=(ref, int(req["ref_sr"])), ref_text=req.get("ref_text"),
                x_vector_only_mode=bool(req.get("x_vector_only_mode", False)), **kw, **gen)
        else:
            raise ValueError(f"unknown api {api!r}")
    finally:
        handle.remove()
        # drop the instance-level wrappers so the next request starts clean
        for obj, name in ((tts.model.talker, "generate"), (tts.model, "generate"),
                          (tts.model, "extract_speaker_embedding")):
            obj.__dict__.pop(name, None)

    codes = cap["codes"].to(torch.int64)  # [T, 16]
    wav_codes, sr2 = tts.model.speech_tokenizer.decode([{"audio_codes": codes}])
    assert sr == sr2 == 24000, (sr, sr2)
    assert cap["attention_mask"].all(), "batch of one must have no padding"
    out = {
        "prompt_embeds": cap["inputs_embeds"][0].float().contiguous(),           # [L, H]
        "trailing_text": cap["trailing_text_hidden"][0].float().contiguous(),    # [Ltr, H]
        "tts_pad_embed": cap["tts_pad_embed"].reshape(-1).float().contiguous(),  # [H]
        "prefill_logits": cap["prefill_logits"].contiguous(),                    # [V]
        "prefill_hidden": cap["prefill_hidden"].contiguous(),                    # [H]
        "codes": codes.contiguous(),                                             # [T, 16]
        "wav_api": torch.from_numpy(np.ascontiguousarray(wavs[0], dtype=np.float32)),
        "wav_codes": torch.from_numpy(np.ascontiguousarray(wav_codes[0], dtype=np.float32)),
    }
    if "spk_embedding" in cap:
        out["spk_embedding"] = cap["spk_embedding"].contiguous()
    if "ref_codes" in cap:
        out["ref_codes"] = cap["ref_codes"].to(torch.int64).contiguous()
    if "ref_wav_24k" in cap:
        out["ref_wav_24k"] = torch.from_numpy(np.ascontiguousarray(cap["ref_wav_24k"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("requests")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    import qwen_tts
    import transformers
    from qwen_tts import Qwen3TTSModel

    req_path = Path(args.requests)
    requests = json.loads(req_path.read_text())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    tts = Qwen3TTSModel.from_pretrained(args.ckpt, device_map="cpu", dtype=torch.float32)
    tts.model.eval()
    print(f"[run_reference] loaded {args.ckpt} in {time.time() - t0:.1f}s", file=sys.stderr)

    manifest = {
        "ckpt": str(args.ckpt),
        "versions": {"qwen_tts": importlib.metadata.version("qwen-tts"),
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "attn_implementation": getattr(tts.model.config, "_attn_implementation", None),
        "requests": [],
    }
    for req in requests:
        t1 = time.time()
        with torch.no_grad():
            tensors = _run_one(tts, req, req_path.parent)
        save_file(tensors, str(out_dir / f"{req['name']}.safetensors"))
        info = {k: list(v.shape) for k, v in tensors.items()}
        manifest["requests"].append({"request": req, "shapes": info, "seconds": round(time.time() - t1, 2)})
        print(f"[run_reference] {req['name']}: codes {info['codes']} prompt {info['prompt_embeds']} "
              f"({time.time() - t1:.1f}s)", file=sys.stderr)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
