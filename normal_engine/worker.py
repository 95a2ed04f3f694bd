"""The NORMAL role: prefill and decode in one engine, the co-located baseline.

A request's life in this process:
1. `GenerateRequest` -> sampling options checked -> `LLMEngine.add_request` (scheduler
   `waiting`); a migrated request brings its earlier outputs, prefilled after the prompt.
2. Each step (NORMAL mode: a prompt step when S33's attempt intervals say so, else a decode
   step over `running`) turns the engine's outputs into `TokenDelta`s for the router; with
   n > 1 the choices fork from the prompt's last block once it is computed (S16).
3. EOS, a stop token or max_tokens finish it; an abort finishes it at once, and its final delta
   (reason `abort`) comes with the next step. Its blocks go back to the pool (keyed ones stay in
   the prefix cache).
This is what every disaggregation figure is compared with, and the path the router takes when
no prompt/completion pair is up.
"""

from __future__ import annotations

from baton.protocol import NORMAL
from baton.service.worker import EngineWorker


class NormalWorker(EngineWorker):
    """The base worker's whole request life, unchanged: nothing to hand off or pull."""

    role = NORMAL
