"""Talker engines: drive the talker + code predictor frame by frame (no vLLM here)."""
from omnilab.engine.eager import EagerTalkerEngine, FrameOutput, run_to_completion

__all__ = ["EagerTalkerEngine", "FrameOutput", "run_to_completion"]
