"""A model runner without a model (torch-free): the engine core runs unchanged over it.

It fulfils `baton.engine.runner_api.Runner`: every sampled row gets a deterministic token (a
hash of the row's prompt length, its last prompt token and its output position, never an EOS
id), and each step costs what the profile predicts. Where that cost goes is the caller's
choice: the simulator hands the whole step's predicted time (forward and the engine's own work
around it) to its virtual clock (`on_step=clock`), since its engine core's own work takes no
virtual time; a mock engine process (`on_step=None`) sleeps the forward's share only, since its
engine core does that work for real around this call (the profile measured it as the engine
step's time outside the runner's `execute`: docs/profile.md), and a KV pull there takes at
least the profile's transfer time (`pull_s`, held by the completion engine's admission). A
mock engine process gets a tiny KV pool (`kv_pool=True`, a
numpy array NIXL registers like a real one) that each step fills with bytes fixed by the token
and its position, so a KV pull moves real bytes that a test can compare; the simulator's runner
has none (no bytes move in virtual time).
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
MOCK_HEAD_DIM = 8  # bytes per token per K or V in the mock pool (one layer, one head)
_FORGET_AFTER = 4096  # steps: a sequence not stepped for this long has no row to keep


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
    bytes_per_block: int  # the measured engine's: what a pull of one block costs in the profile
    # The mock pool's layout (kv_transfer's Fingerprint): never equal to a real engine's.
    dtype: str = "uint8"
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = MOCK_HEAD_DIM

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
                 on_step: Callable[[float], None] | None = None, kv_pool: bool = False,
                 structured: Callable[[int], bool] | None = None) -> None:
        """`num_blocks`: the pool (null block included), 0 = the profiled engine's.
        `on_step(seconds)`: where a step's predicted time goes; None sleeps it.
        `kv_pool`: allocate the tiny KV pool a mock engine process transfers.
        `structured(seq_id)`: whether that sequence's request asked for structured output: its
        sampled rows are charged `grammar_row_ms` too (the simulator's; mock tokens follow no
        grammar, so no grammar runs)."""
        m = profile.model
        self.profile = profile
        self.config = MockModelConfig(vocab_size=m.vocab_size, max_position=m.max_position)
        self.tokenizer = WordTokenizer(m.vocab_size)
        self.model_path = f"mock/{m.name}"
        self.quantization = m.quantization
        self.kv_spec = MockKvSpec(m.fingerprint, m.block_size, m.kv_bytes_per_block)
        self._num_blocks = num_blocks or m.num_blocks
        if self._num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (null block included), got {num_blocks}")
        # [blocks, layers=1, 2, block_size, kv_heads=1, head_dim] bytes, block-major as a real
        # pool (kv_transfer.config.PoolSpec); None: the simulator moves no bytes.
        self.kv_cache = (np.zeros((self._num_blocks, 1, 2, m.block_size, 1, MOCK_HEAD_DIM),
                                  dtype=np.uint8) if kv_pool else None)
        self.on_step = on_step
        self.structured = structured
        self.num_steps = 0
        self.busy_s = 0.0  # predicted time of every step run
        self.prefill_busy_s = 0.0  # of which prompt steps (the rest: decode steps)
        self.last_prompt_run = False  # whether the last step was a prompt step
        self.last_num_rows = 0  # and its sequences
        # The sequences this runner has stepped (id -> the step it last ran in): a decode row
        # of none (a completion engine's pulled request) costs the profile's `admit` more in
        # its first step, as the CPU backend gathers its decode row from the pool then
        # (baton/model/backends/cpu_decode_rows.py); a row that came out of a prompt step here
        # keeps it, whatever steps run between. Sequence ids only grow (the scheduler's);
        # ones not stepped for `_FORGET_AFTER` steps are forgotten (finished or preempted: a
        # preempted one comes back through a prompt step).
        self._seen: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def pull_s(self, num_blocks: int) -> float:
        """The profile's time of pulling `num_blocks` KV blocks: a mock completion engine's
        pull takes at least this long (its tiny pool moves in far less)."""
        return self.profile.transfer_ms(num_blocks) / 1e3

    def read_blocks(self, block_ids: np.ndarray) -> np.ndarray:
        assert self.kv_cache is not None, "the simulator's runner has no KV pool"
        return self.kv_cache.reshape(self._num_blocks, -1)[np.asarray(block_ids)]

    def write_blocks(self, block_ids: np.ndarray, data: np.ndarray) -> None:
        assert self.kv_cache is not None, "the simulator's runner has no KV pool"
        self.kv_cache.reshape(self._num_blocks, -1)[np.asarray(block_ids)] = data

    def execute(self, sched_out, seq_ids: np.ndarray,
                params: Sequence[SamplingParams | None],
                prompt_token_ids: Sequence[Sequence[int]],
                output_token_ids: Sequence[Sequence[int]],
                prompt_spans: Sequence[PromptSpan | None] | None = None,
                allowed_tokens: Sequence[np.ndarray | None] | None = None,
                choice_params: Sequence[list[SamplingParams] | None] | None = None,
                ) -> StepSamples:
        """Rows with params None (a prompt chunk that does not end its prompt) get a dummy 0."""
        start = time.perf_counter()
        if prompt_spans is not None and any(s is not None for s in prompt_spans):
            raise ValueError("the mock runner computes no prompt logprobs")
        if allowed_tokens is not None and any(a is not None for a in allowed_tokens):
            raise ValueError("the mock runner runs no grammar")
        if choice_params is not None and any(c for c in choice_params):
            raise ValueError("the mock runner draws no extra choices (n > 1)")
        if self.kv_cache is not None:
            self._write_kv(sched_out)
        n = len(seq_ids)
        tokens = np.zeros(n, dtype=np.int32)
        vocab = self.config.vocab_size
        num_sampled = num_grammar = 0
        for i, p in enumerate(params):
            if p is None:
                continue
            num_sampled += 1
            num_grammar += self.structured is not None and self.structured(int(seq_ids[i]))
            prompt = prompt_token_ids[i]
            tokens[i] = mock_token(len(prompt), prompt[-1] if len(prompt) else 0,
                                   len(output_token_ids[i]), vocab)
        prof = self.profile
        seconds = prof.step_ms(bool(sched_out.prompt_run), sched_out.seqlens_q,
                               sched_out.seqlens_k, num_sampled, num_grammar) / 1e3
        seconds += self._new_rows_ms(sched_out, seq_ids) / 1e3
        self.num_steps += 1
        self.busy_s += seconds
        self.last_prompt_run = bool(sched_out.prompt_run)
        self.last_num_rows = n
        if sched_out.prompt_run:
            self.prefill_busy_s += seconds
        if self.on_step is None:
            # The call takes the forward's predicted time, this mock's own work in it (the
            # KV bytes, the tokens) included; the engine's own share runs for real around it.
            forward_s = seconds - prof.own_work_ms(num_sampled, num_grammar) / 1e3
            time.sleep(max(0.0, forward_s - (time.perf_counter() - start)))
        else:
            self.on_step(seconds)
        return StepSamples(token_ids=tokens, logprobs=np.zeros(n, dtype=np.float32),
                           top=[None] * n, prompt=[None] * n)

    def _new_rows_ms(self, sched_out, seq_ids: np.ndarray) -> float:
        """The profile's `admit` of this step's decode rows new to this runner (0 without it)."""
        step, seen, ms = self.num_steps, self._seen, 0.0
        admit = not sched_out.prompt_run and self.profile.admit is not None
        for i, s in enumerate(np.asarray(seq_ids).tolist()):
            if admit and s not in seen:
                ms += self.profile.admit_ms(int(sched_out.seqlens_k[i]))
            seen[s] = step
        if step % _FORGET_AFTER == 0:
            for s in [s for s, last in seen.items() if step - last > _FORGET_AFTER]:
                del seen[s]
        return ms

    def _write_kv(self, sched_out) -> None:
        """Each token's K/V bytes: its id and position, as a model's would depend on them.
        A fork's tail block is copied first (S16), as the real runner does."""
        pool = self.kv_cache
        for src, dst in np.asarray(sched_out.clone_blocks).reshape(-1, 2).tolist():
            if dst:
                pool[dst] = pool[src]
        slots = np.asarray(sched_out.slot_mapping, dtype=np.int64)
        if not len(slots):
            return
        bs = self.kv_spec.block_size
        values = mock_kv_bytes(np.asarray(sched_out.input_ids, dtype=np.int64),
                               np.asarray(sched_out.positions, dtype=np.int64))
        pool[slots // bs, 0, :, slots % bs, 0, :] = values[:, None, :]


def mock_kv_bytes(token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[tokens, MOCK_HEAD_DIM] bytes a mock engine stores for these tokens."""
    h = (token_ids * 0x9E3779B1 + positions * 0x85EBCA77) & 0xFFFFFFFF
    shifts = np.arange(MOCK_HEAD_DIM, dtype=np.int64) * 4
    return ((h[:, None] >> shifts[None, :]) & 0xFF).astype(np.uint8)
