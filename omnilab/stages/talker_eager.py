"""The eager (plain torch, in-process) talker stage: ``PromptRequest`` in, ``FrameOutput`` per step out.

Same contract as every talker stage: ``add_request``, ``step(return_hidden)``, ``abort``,
``has_unfinished``, ``close``. The prompt embeddings are built here from the request data, the way
the vLLM worker builds them worker-side.
"""
from __future__ import annotations

from typing import Hashable

from omnilab.engine.eager import EagerTalkerEngine, FrameOutput
from omnilab.loading import LoadedModel
from omnilab.models.prompt import PromptRequest, build_prompt
from omnilab.sampling import SamplingParams


class EagerTalkerStage:
    backend = "eager"

    def __init__(self, model: LoadedModel, *, batched: bool = True):
        self.model = model
        limit = int(model.generation.max_new_tokens) if model.generation.max_new_tokens else 8192
        self.engine = EagerTalkerEngine(model.talker, model.config, batched=batched,
                                        max_new_tokens_limit=max(limit, 8192))

    @property
    def max_new_tokens_limit(self) -> int:
        return self.engine.max_new_tokens_limit

    def add_request(self, request_id: Hashable, req: PromptRequest, params: SamplingParams) -> int:
        """Queue a request (prefilled on the next step). Returns the seed in use."""
        prompt = build_prompt(self.model.talker, self.model.config, req)
        return self.engine.add_request(request_id, prompt, params)

    def step(self, return_hidden: bool = False) -> list[FrameOutput]:
        return self.engine.step(return_hidden=return_hidden)

    def abort(self, request_id: Hashable) -> FrameOutput | None:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    @property
    def num_live(self) -> int:
        return self.engine.num_live

    def close(self) -> None:
        for rid in list(self.engine._waiting) + list(self.engine._live):
            self.engine.abort(rid)
