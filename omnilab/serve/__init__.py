"""``omnilab serve``: vLLM-Omni's speech API (``/v1/audio/speech`` and friends) over one ``Pipeline``.

Contract: ``ServeConfig`` (frozen, every cap named) -> ``create_app(config)`` -> a FastAPI app whose lifespan
builds one pipeline and closes it; ``omnilab.cli.serve`` runs it under uvicorn. Importing this package imports no
FastAPI, torch or vLLM (the submodules do); docs/serving.md describes routes, caps and errors.
"""
from omnilab.serve.config import ServeConfig

__all__ = ["ServeConfig"]
