"""``omnilab serve``: the speech API (vLLM-Omni's routes) on one Pipeline, under uvicorn (docs/serving.md)."""
from __future__ import annotations

import argparse
import signal

from omnilab import settings
from omnilab.cli.main import Formatter
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity
from omnilab.serve.config import DEFAULT_PORT, ServeConfig


def serve_parser() -> argparse.ArgumentParser:
    d = ServeConfig()
    ap = argparse.ArgumentParser(prog="omnilab serve", formatter_class=Formatter,
                                 description="Serve /v1/audio/speech, /v1/audio/voices, WebSocket "
                                             "/v1/audio/speech/stream, /v1/models, /health, /metrics and a page at / "
                                             "from one Pipeline. SIGTERM drains in-flight requests, then exits.")
    a = ap.add_argument
    a("--model", default=None, help="checkpoint dir or hub id (default: the embedded tiny checkpoint)")
    a("--host", default=d.host, help="address to bind (loopback unless told otherwise)")
    a("--port", type=int, default=DEFAULT_PORT, help="port (0: any free one, printed at start)")
    a("--api-key", default=None, help="Bearer key on every route but /health (default: $OMNILAB_API_KEY; unset: open)")
    a("--backend", default=d.backend, choices=("vllm", "eager"), help="vllm: concurrent requests share vLLM's "
      "continuous batching; eager: plain torch")
    a("--deploy-profile", default=d.deploy_profile, help="auto | a preset name | a deploy YAML path | none")
    a("--deploy", default=None, choices=("auto", "inprocess", "workers"), help="vLLM: where the stages run")
    a("--quantization", default=None,
      help="decode matrix recipe: none | int8 | int4 | int4-all, int4 ones with a group suffix -g32 | -g64 | -g128")
    a("--dtype", default=None, help="float32 | bfloat16 (default: auto, chosen per CPU)")
    a("--threads", type=int, default=None, help="talker threads (default: the deploy profile's)")
    a("--max-concurrency", type=int, default=d.max_concurrency, help="requests generating at once")
    a("--max-queue", type=int, default=d.max_queue, help="requests waiting for a slot; beyond it: 429")
    a("--max-input-chars", type=int, default=d.max_input_chars, help="longest input text")
    a("--max-new-tokens", type=int, default=d.max_new_tokens, help="largest max_new_tokens a request may ask")
    a("--max-upload-bytes", type=int, default=d.max_upload_bytes, help="largest voice upload / ref_audio")
    a("--voices-dir", default=None, help="uploaded voices, one safetensors file each (default: $OMNILAB_CACHE/voices)")
    a("--allowed-media-dir", default=None, help="file:// ref_audio must lie under this directory (default: file:// refused)")
    a("--drain-timeout-s", type=float, default=d.drain_timeout_s, help="SIGTERM: seconds in-flight requests may "
      "finish before they are ended")
    a("--served-model-name", default=None, help="the id in /v1/models (default: the --model name)")
    add_verbosity(ap)
    return ap


def serve_main(argv: list[str] | None = None) -> int:
    args = serve_parser().parse_args(argv)
    apply_verbosity(args)
    run(config_from_args(args))
    return 0


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` of parsed ``omnilab serve`` arguments (also what ``omnilab bench --serve`` builds its
    in-process twin from)."""
    return ServeConfig(model=args.model, host=args.host, port=args.port,
                       api_key=args.api_key or settings.raw("OMNILAB_API_KEY") or None, backend=args.backend,
                       deploy_profile=args.deploy_profile, deploy=args.deploy, quantization=args.quantization,
                       dtype=args.dtype, threads=args.threads, max_concurrency=args.max_concurrency,
                       max_queue=args.max_queue,
                       max_input_chars=args.max_input_chars, max_new_tokens=args.max_new_tokens,
                       max_upload_bytes=args.max_upload_bytes, voices_dir=args.voices_dir,
                       allowed_media_dir=args.allowed_media_dir, drain_timeout_s=args.drain_timeout_s,
                       served_model_name=args.served_model_name)


def run(config: ServeConfig) -> None:
    """uvicorn in this process; SIGINT/SIGTERM stop accepting, wait for in-flight requests (at most
    ``drain_timeout_s``), close the pipeline (its workers exit with it) and return."""
    import uvicorn

    from omnilab.serve.app import create_app  # lazy: fastapi

    class Server(uvicorn.Server):
        """SIGTERM is the ordinary way to stop a service: after the drain the process exits with status 0
        (uvicorn would raise the signal again and die by it). SIGINT keeps uvicorn's behaviour."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and self._captured_signals and self._captured_signals[-1] == sig:
                self._captured_signals.pop()

    app = create_app(config)
    Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          timeout_graceful_shutdown=int(config.drain_timeout_s) + 1, ws="websockets-sansio")).run()
