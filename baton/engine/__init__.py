"""The engine core: one step loop (scheduler + a model runner) every role runs, and the verbs of
the prefill/decode hand-off (`LLMEngine.add_prompted_request`, `commit_prompted`,
`free_prompted`, `block_keys`, `release_handed_off`). Importing it loads no torch: only building
the default model runner does (`baton.model.runner.build_runner`). Nothing outside this package
touches the scheduler."""

from __future__ import annotations

from baton.engine.config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.request import CompletionOutput, Request, RequestOutput
from baton.engine.scheduler import AllocStatus

__all__ = ["AllocStatus", "CompletionOutput", "EngineConfig", "LLMEngine", "Request", "RequestOutput"]
