"""A model runner without a model (torch-free): the engine core runs unchanged over it.

It fulfils `baton.engine.runner_api.Runner`: every sampled row gets a deterministic token (a
hash of the row's prompt length, its last prompt token and its output position, never an EOS
id), and each step costs what the profile predicts. Where that cost goes is the caller's
choice: a mock engine process sleeps it (`on_step=None`), the simulator hands it to its
virtual clock (`on_step=clock`). Its KV pool is a placeholder: no bytes move in the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from baton.perf.profile import Profile
from baton.sampling.params import SamplingParams
from baton.sampling.samples import PromptSpan, StepSamples
from baton.workload.words import WordTokenizer

EOS_TOKEN_ID = 0


@dataclass
class MockModelConfig:
    vocab_size: int
    max_position: int
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,)


@dataclass
class MockKvSpec:
    """The measured engine's KV layout, named by its fingerprint (so mock engines of one
    profile share prefix-cache keys, and never with a real engine's)."""

    profile_fingerprint: str
    block_size: int
    bytes_per_block: int

    def fingerprint(self) -> str:
        return f"mock-{self.profile_fingerprint}"


def mock_token(prompt_len: int, last_prompt_token: int, position: int, vocab_size: int) -> int:
    """The token a mock row samples: fixed by the request and the output position."""
    h = (prompt_len * 0x9E3779B1 + last_prompt_token * 0x85EBCA77 + position * 0xC2B2AE3D) \
        & 0xFFFFFFFF
    h ^= h >> 15
    return 1 + (h * 0x2C1B3C6D & 0xFFFFFFFF) % (vocab_size - 1)


class MockRunner:
    """Deterministic tokens at the profile's predicted step time."""

    def __init__(self, profile: Profile, num_blocks: int = 0,
                 on_step: Callable[[float], None] | None = None) -> None:
        """`num_blocks`: the pool (null block included), 0 = the profiled engine's.
        `on_step(seconds)`: where a step's predicted time goes; None sleeps it."""
        m = profile.model
        self.profile = profile
        self.config = MockModelConfig(vocab_size=m.vocab_size, max_position=m.max_position)
        self.tokenizer = WordTokenizer(m.vocab_size)
        self.model_path = f"mock/{m.name}"
        self.quantization = m.quantization
        self.kv_spec = MockKvSpec(m.fingerprint, m.block_size, m.kv_bytes_per_block)
        self.kv_cache = None  # nothing to register: the simulator moves no bytes
        self._num_blocks = num_blocks or m.num_blocks
        if self._num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (null block included), got {num_blocks}")
        self.on_step = on_step
        self.num_steps = 0
        self.busy_s = 0.0  # predicted time of every step run

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def execute(self, sched_out, seq_ids: np.ndarray,
                params: Sequence[SamplingParams | None],
                prompt_token_ids: Sequence[Sequence[int]],
                output_token_ids: Sequence[Sequence[int]],
                prompt_spans: Sequence[PromptSpan | None] | None = None,
                allowed_tokens: Sequence[np.ndarray | None] | None = None,
                choice_params: Sequence[list[SamplingParams] | None] | None = None,
                ) -> StepSamples:
        """Rows with params None (a prompt chunk that does not end its prompt) get a dummy 0."""
        if prompt_spans is not None and any(s is not None for s in prompt_spans):
            raise ValueError("the mock runner computes no prompt logprobs")
        if allowed_tokens is not None and any(a is not None for a in allowed_tokens):
            raise ValueError("the mock runner runs no grammar")
        if choice_params is not None and any(c for c in choice_params):
            raise ValueError("the mock runner draws no extra choices (n > 1)")
        n = len(seq_ids)
        tokens = np.zeros(n, dtype=np.int32)
        vocab = self.config.vocab_size
        num_sampled = 0
        for i, p in enumerate(params):
            if p is None:
                continue
            num_sampled += 1
            prompt = prompt_token_ids[i]
            tokens[i] = mock_token(len(prompt), prompt[-1] if len(prompt) else 0,
                                   len(output_token_ids[i]), vocab)
        seconds = self.profile.step_ms(bool(sched_out.prompt_run), sched_out.seqlens_q,
                                       sched_out.seqlens_k, num_sampled) / 1e3
        self.num_steps += 1
        self.busy_s += seconds
        if self.on_step is None:
            time.sleep(seconds)
        else:
            self.on_step(seconds)
        return StepSamples(token_ids=tokens, logprobs=np.zeros(n, dtype=np.float32),
                           top=[None] * n, prompt=[None] * n)
