"""What the engine core needs of a model runner: the contract a real runner
(`baton.model.runner.ModelRunner`, torch) and a mock one (no model) both fulfil."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from baton.sampling.params import SamplingParams
from baton.sampling.samples import PromptSpan, StepSamples


class Runner(Protocol):
    config: Any  # the model's shape: vocab_size, eos_token_ids, max_position
    tokenizer: Any  # encode/decode (baton.tokenizer.Tokenizer)
    model_path: str
    quantization: str  # the mode it runs: none | int8 | int4
    kv_spec: Any  # the KV layout: fingerprint(), dtype, num_layers, num_kv_heads, head_dim
    kv_cache: Any  # the paged pool the KV transfer registers

    @property
    def num_blocks(self) -> int: ...

    def execute(self, sched_out, seq_ids: np.ndarray,
                params: Sequence[SamplingParams | None],
                prompt_token_ids: Sequence[Sequence[int]],
                output_token_ids: Sequence[Sequence[int]],
                prompt_spans: Sequence[PromptSpan | None] | None = None,
                allowed_tokens: Sequence[np.ndarray | None] | None = None,
                choice_params: Sequence[list[SamplingParams] | None] | None = None,
                ) -> StepSamples:
        """Run a scheduler step and sample it. A decode step whose rows carry drafts (query
        length 1 + k: the engine runs `--speculative`) is verified in that one forward and
        answers the `[n, 1 + k]` rows the scheduler books (`StepSamples.token_ids`). A runner
        with LoRA adapters (a `lora` attribute: `baton.model.lora.LoraSet`) also takes
        `lora_names=`, each row's adapter ("" = the base), passed only when a row has one."""

    def read_blocks(self, block_ids: np.ndarray) -> np.ndarray:
        """A copy of the pool's blocks `block_ids`: uint8 `[n, bytes per block]` (a lower
        KV tier keeps them, docs/scheduler.md P10)."""

    def write_blocks(self, block_ids: np.ndarray, data: np.ndarray) -> None:
        """Fill the pool's blocks `block_ids` with `data` (uint8 `[n, bytes per block]`)."""
