"""Loader: strict tensor checking, dtype resolution, encoders per variant, file validation, hub failures."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from omnilab.checkpoint import load as loading
from omnilab.checkpoint.random import make_random_checkpoint, write_safetensors
from omnilab.errors import CheckpointError, ConfigError
from omnilab.checkpoint.load import REQUIRED_FILES, load_model, resolve_checkpoint, resolve_dtype, validate_checkpoint_dir


@pytest.fixture(scope="module")
def ckpts(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("load")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNILAB_CACHE", str(request.config.cache.mkdir("omnilab-cache")))
        return {v: make_random_checkpoint(root / v, "tiny", v, seed=0) for v in ("custom_voice", "base")}


def _copy(src: Path, dst: Path) -> Path:
    """A writable copy whose big files are symlinks (tests edit configs or replace files)."""
    for p in src.rglob("*"):
        if p.is_file():
            q = dst / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            if p.suffix == ".json":
                shutil.copy(p, q)
            else:
                q.symlink_to(p)
    return dst


def _file_tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name)


# ---- loading ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loads_custom_voice_in_the_requested_dtype(ckpts, dtype):
    m = load_model(ckpts["custom_voice"], dtype=dtype)
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert m.dtype == want and m.dtype_reason.startswith("requested")
    from omnilab.tuning.storage import talker_streamed_name, weight_storage_choice

    storage = m.talker.weight_storage  # fp32 compute may keep the streamed matrices in the file's bf16
    assert storage == weight_storage_choice(want) and (storage.bf16 is False or want == torch.float32)
    for name, p in m.talker.named_parameters():  # and keeps the text and codec tables in bf16 (exact upcast)
        bf16 = storage.bf16 and talker_streamed_name(name) or name in loading.UPCAST_TABLES
        assert p.dtype == (torch.bfloat16 if bf16 else want), name
    assert m.talker.dtype == want
    assert m.talker.embed_codec([1, 2]).dtype == m.talker.embed_text([1, 2]).dtype == want
    assert {p.dtype for p in m.code2wav.parameters()} == {torch.float32}
    assert m.speaker_encoder is None and m.mimi_encoder is None
    assert not any(p.requires_grad for p in m.talker.parameters()) and not m.talker.training
    assert m.config.tts_model_type == "custom_voice" and m.generation.max_new_tokens == 8192
    assert m.tokenizer.chat_wrap_ids("Hi")[:3] == [151644, 77091, 198]
    w = _file_tensor(ckpts["custom_voice"] / "model.safetensors", "talker.model.text_embedding.weight")
    assert torch.equal(m.talker.model.text_embedding.weight.to(want), w.to(want))
    d = _file_tensor(ckpts["custom_voice"] / "speech_tokenizer/model.safetensors", "decoder.pre_conv.conv.weight")
    assert torch.equal(m.code2wav.pre_conv.conv.weight, d)
    wav = m.code2wav(torch.randint(0, 2048, (1, 16, 3)))
    assert wav.shape == (1, 1, 3 * 1920) and float(wav.abs().max()) > 0


def test_base_loads_both_encoders_by_default(ckpts):
    m = load_model(ckpts["base"], dtype="fp32")
    assert m.speaker_encoder is not None and m.mimi_encoder is not None
    x = m.speaker_encoder.embed_audio(torch.randn(24000) * 0.1)
    assert x.shape == (m.config.talker.hidden_size,)
    codes = m.mimi_encoder.encode(torch.randn(1, 1920 * 3) * 0.1)
    assert codes.shape == (1, 3, 16) and int(codes.min()) >= 0 and int(codes.max()) < 2048


def test_load_encoders_switch(ckpts):
    none = load_model(ckpts["base"], dtype="fp32", load_encoders=False)
    assert none.speaker_encoder is None and none.mimi_encoder is None
    cv = load_model(ckpts["custom_voice"], dtype="fp32", load_encoders=True)
    assert cv.mimi_encoder is not None and cv.speaker_encoder is None
    with pytest.raises(ConfigError, match="load_encoders"):
        load_model(ckpts["custom_voice"], load_encoders="yes")


def test_in_place_edits_do_not_touch_the_file(ckpts):
    m = load_model(ckpts["custom_voice"], dtype="bf16")  # same dtype as the file: memory-mapped
    before = _file_tensor(ckpts["custom_voice"] / "model.safetensors", "talker.codec_head.weight").clone()
    m.talker.codec_head.weight.add_(1.0)
    assert torch.equal(_file_tensor(ckpts["custom_voice"] / "model.safetensors", "talker.codec_head.weight"), before)


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> int:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name, t in sa.items():
        u = sb[name]
        assert t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u), name
        assert t.data_ptr() % 64 == 0 and u.data_ptr() % 64 == 0, f"{name} is not 64-byte aligned"
    assert {type(m) for m in a.modules()} == {type(m) for m in b.modules()}  # upcast embeddings in both
    return len(sa)


@pytest.mark.parametrize("storage", ["auto", "compute"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("hugepages", ["off", "auto"])
def test_client_and_worker_loads_are_identical(ckpts, monkeypatch, dtype, storage, hugepages):
    """One strict loader: the client (``load_model``, memory-mapped) and the stage workers (``worker_weights``,
    plain reads) get the same names, dtypes (bf16 storage, bf16 tables), values and 64-byte aligned data."""
    from omnilab.checkpoint.worker_weights import load_code2wav_weights, load_talker_weights
    from omnilab.tuning import hugepages as hp, storage as st

    monkeypatch.setenv(st.ENV, storage)
    monkeypatch.setenv(hp.ENV, hugepages)
    path = ckpts["custom_voice"]
    client = load_model(path, dtype=dtype)
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert _same_state(client.talker, load_talker_weights(path, client.config, want)) > 20
    assert _same_state(client.code2wav, load_code2wav_weights(path, client.speech_config)) > 20
    assert {t.dtype for t in client.talker.state_dict().values()} >= {want, torch.bfloat16}


def test_worker_loader_names_bad_tensors_like_the_client(ckpts, tmp_path):
    from omnilab.checkpoint.worker_weights import load_talker_weights
    from omnilab.config import Qwen3TTSConfig

    d = _copy(ckpts["custom_voice"], tmp_path / "depth")
    _edit_config(d, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"model\.safetensors \(talker\): .*missing tensor\(s\): "
                                              r"talker\.model\.layers\.2\."):
        load_talker_weights(d, Qwen3TTSConfig.load(d / "config.json"), torch.float32)


# ---- dtype ---------------------------------------------------------------------------------------------
def test_dtype_spellings_and_precedence(monkeypatch):
    monkeypatch.delenv("OMNILAB_DTYPE", raising=False)
    for spelling, want in [("fp32", torch.float32), ("float32", torch.float32), (torch.float32, torch.float32),
                           ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                           ("torch.float32", torch.float32)]:
        assert resolve_dtype(spelling)[0] == want
    monkeypatch.setattr("omnilab.tuning.timing.cpu_has_native_bf16", lambda: (False, "x86 without avx512_bf16"))
    d, why = resolve_dtype()  # the suite runs the ISA rule (OMNILAB_PLAN_TIMING=off, tests/conftest.py)
    assert d == torch.float32 and why.startswith("auto: x86 without avx512_bf16")
    monkeypatch.setattr("omnilab.tuning.timing.cpu_has_native_bf16", lambda: (True, "x86 with amx_bf16"))
    assert resolve_dtype()[0] == torch.bfloat16 and resolve_dtype("auto")[0] == torch.bfloat16
    monkeypatch.setenv("OMNILAB_DTYPE", "fp32")
    assert resolve_dtype() == (torch.float32, "OMNILAB_DTYPE=fp32")
    assert resolve_dtype("bf16")[0] == torch.bfloat16  # the argument wins over the environment


@pytest.mark.parametrize("bad", ["float16", "int8", "half", torch.float16, 32])
def test_bad_dtype_names_the_accepted_values(bad, monkeypatch):
    with pytest.raises(ConfigError, match="accepted: torch.float32, torch.bfloat16, 'float32'/'fp32'"):
        resolve_dtype(bad)
    monkeypatch.setenv("OMNILAB_DTYPE", "fp16")
    with pytest.raises(ConfigError, match="OMNILAB_DTYPE"):
        resolve_dtype()


# ---- validation and strict checking ---------------------------------------------------------------------
def test_every_missing_file_is_named(ckpts, tmp_path):
    d = _copy(ckpts["custom_voice"], tmp_path / "c")
    (d / "generation_config.json").unlink()
    (d / "vocab.json").unlink()
    shutil.rmtree(d / "speech_tokenizer")
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint_dir(d)
    for name in ("generation_config.json", "vocab.json", "speech_tokenizer/config.json",
                 "speech_tokenizer/model.safetensors"):
        assert name in str(e.value)
    assert "model.safetensors," not in str(e.value).replace("speech_tokenizer/model.safetensors", "")
    assert validate_checkpoint_dir(ckpts["custom_voice"]) == ckpts["custom_voice"]
    assert set(REQUIRED_FILES) <= {str(p.relative_to(ckpts["base"])) for p in ckpts["base"].rglob("*")}


def test_pickled_weights_are_never_loaded(ckpts, tmp_path):
    d = _copy(ckpts["custom_voice"], tmp_path / "c")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(CheckpointError, match="model.safetensors.*never loaded"):
        load_model(d)


def _edit_config(d: Path, **talker):
    cfg = json.loads((d / "config.json").read_text())
    cfg["talker_config"].update(talker)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def test_wrong_geometry_names_the_tensors(ckpts, tmp_path):
    d = _copy(ckpts["custom_voice"], tmp_path / "width")
    _edit_config(d, intermediate_size=96)
    with pytest.raises(ConfigError, match=r"talker\.model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight file \(\d+, \d+\) vs config"):
        load_model(d, dtype="fp32")
    d = _copy(ckpts["custom_voice"], tmp_path / "depth")
    _edit_config(d, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): talker\.model\.layers\.2\."):
        load_model(d, dtype="fp32")


def test_wrong_codec_geometry_is_caught(ckpts, tmp_path):
    d = _copy(ckpts["custom_voice"], tmp_path / "codec")
    st = json.loads((d / "speech_tokenizer/config.json").read_text())
    st["decoder_config"]["hidden_size"] = 48
    (d / "speech_tokenizer/config.json").write_text(json.dumps(st))
    with pytest.raises(ConfigError, match=r"decoder\.pre_transformer\."):
        load_model(d, dtype="fp32")


def test_unexpected_and_missing_tensors_are_named(ckpts, tmp_path):
    src = ckpts["custom_voice"] / "model.safetensors"
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    d = _copy(ckpts["custom_voice"], tmp_path / "extra")
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model.safetensors", list(tensors.items()) + [("talker.bogus.weight", torch.zeros(2))])
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): talker\.bogus\.weight"):
        load_model(d, dtype="fp32")
    d = _copy(ckpts["custom_voice"], tmp_path / "stray")
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model.safetensors", list(tensors.items()) + [("speaker_encoder.fc.weight", torch.zeros(2))])
    with pytest.raises(CheckpointError, match=r"outside talker\.: speaker_encoder\.fc\.weight"):
        load_model(d, dtype="fp32")
    d = _copy(ckpts["custom_voice"], tmp_path / "missing")
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model.safetensors", [kv for kv in tensors.items() if kv[0] != "talker.codec_head.weight"])
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): talker\.codec_head\.weight"):
        load_model(d, dtype="fp32")


def test_tokenizer_must_agree_with_the_config(ckpts, tmp_path):
    d = _copy(ckpts["custom_voice"], tmp_path / "ids")
    cfg = json.loads((d / "config.json").read_text())
    cfg["im_start_token_id"] = 151650
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"<\|im_start\|>"):
        load_model(d, dtype="fp32")


# ---- resolving ---------------------------------------------------------------------------------------
def test_missing_local_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint("./not/here")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_checkpoint(tmp_path / "f.json")


def test_hub_id_offline_fails_fast_and_explains(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        load_model("omnilab-test/does-not-exist")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "unreachable" in msg and "HF_HUB_OFFLINE" in msg and "local directory" in msg


def test_hub_id_with_a_hanging_network_fails_fast(monkeypatch, tmp_path):
    import socket

    def hang(*args, **kwargs):  # a firewall that drops packets: connect() never returns in time
        time.sleep(15)
        raise OSError("timed out")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", hang)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.invalid")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"hub \(https://hub\.example\.invalid\) is unreachable \(no answer within 2 s\)"):
        resolve_checkpoint("omnilab-test/does-not-exist", timeout_s=2.0)
    assert time.perf_counter() - t0 < 10


def test_hub_id_resolves_through_snapshot_download(ckpts, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("local_files_only", False)))
        return str(ckpts["custom_voice"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading, "_probe", lambda url, timeout_s: None)
    m = load_model("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", dtype="fp32")
    assert m.path == ckpts["custom_voice"] and calls == [("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", False)]
    # unreachable hub, but a snapshot cached earlier: it is used
    monkeypatch.setattr(loading, "_probe", lambda url, timeout_s: "no answer within 3 s")
    assert resolve_checkpoint("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice") == ckpts["custom_voice"]
    assert calls[-1] == ("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", True)


# ---- real geometry ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_0_6b_checkpoint_writes_and_loads(tmp_path, request, monkeypatch):
    monkeypatch.setenv("OMNILAB_CACHE", str(request.config.cache.mkdir("omnilab-cache")))
    t0 = time.perf_counter()
    d = make_random_checkpoint(tmp_path / "b06", "0.6b", "custom_voice")
    write_s = time.perf_counter() - t0
    assert (d / "model.safetensors").stat().st_size == 1_811_626_576  # the official file size
    assert abs((d / "speech_tokenizer/model.safetensors").stat().st_size - 682_293_092) < 256
    t0 = time.perf_counter()
    m = load_model(d, dtype="bf16")
    load_s = time.perf_counter() - t0
    assert m.talker.model.layers[27].mlp.up_proj.weight.shape == (3072, 1024)
    assert sum(p.numel() for p in m.talker.parameters()) == 905_788_672
    assert sum(p.numel() for p in m.code2wav.parameters()) == 114_323_137
    print(f"0.6b write {write_s:.1f} s, load {load_s:.1f} s")
