"""Typed facade over the compiled scheduler (csrc/scheduler/, module ``baton._scheduler``).

A request's life in one scheduler (rules S1-S41 and P1-P10: docs/scheduler.md):

1. ``add_sequence`` puts it in ``waiting``; nothing is allocated yet.
2. ``schedule()`` admits the head of ``waiting`` on a prompt step, allocating its
   KV blocks; a long prompt is cut into chunks, one chunk per step.
3. ``process_outputs()`` books the step: a finished prompt joins ``running``
   (NORMAL), or leaves with its blocks for the completion engine to pull
   (PROMPT: ``res.handed_off``, freed by ``release_handed_off``).
4. Decode steps run ``running`` youngest first; when no block is free the
   oldest are preempted (terminated, or recomputed from ``waiting``).
5. A COMPLETION engine gets sequences through ``allocate_prompted`` ->
   (KV transfer) -> ``commit_prompted``; ``free_prompted`` undoes a failed one.

Prefix caching (``enable_prefix_caching``, rules P1-P8): full blocks are keyed by a
hash chain over their tokens (``compute_block_keys``); admission pins the longest
cached run of a prompt's full blocks and computes only the rest, and a freed keyed
block stays *cached-free* (reusable, evicted least recently used first). Cached-free
blocks count as free: ``num_free_blocks()`` is plain free + cached-free, so a drained
scheduler still has ``num_free_blocks() == num_total_blocks()``; ``num_cached_blocks()``
says how many of them hold a prefix.

Array lifetime: every numpy array on ``SchedulerOutputs`` and ``ProcessResult`` is
a view over a C++ buffer; treat it as valid until the next ``schedule()`` or
``process_outputs()`` and copy what you keep longer.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from baton import _scheduler

logger = logging.getLogger(__name__)

SchedulerOutputs = _scheduler.SchedulerOutputs
ProcessResult = _scheduler.ProcessResult
BlockManager = _scheduler.BlockManager


def compute_block_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int) -> np.ndarray:
    """P1: one uint64 key per full block of ``token_ids``, ``key(i) = H(key(i-1), block i)``
    with ``key(-1) = seed``; the scheduler keys its blocks with the same function."""
    return _scheduler.compute_block_keys(token_ids, block_size, seed)


class EngineType(enum.IntEnum):
    NORMAL = 0  # prompts and completions
    PROMPT = 1  # prompts only: finished prompts are handed off with their blocks
    COMPLETION = 2  # completions only: KV arrives from a prompt engine


class SequenceStatus(enum.IntEnum):
    # Order matters: is_finished() is `status >= FINISHED_STOPPED` (S6).
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_PREEMPTED = 7
    FINISHED_SO_FAILED = 8
    FINISHED_VE_FAILED = 9

    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS: dict[SequenceStatus, str] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "ignored",  # "prompt_length_exceeded" when the prompt is too long
    SequenceStatus.FINISHED_PREEMPTED: "insufficient_system_resource",
    SequenceStatus.FINISHED_SO_FAILED: "structured_output_failed",
    SequenceStatus.FINISHED_VE_FAILED: "vision_encoder_failed",
}


class AllocStatus(enum.IntEnum):
    OK = 0  # allocated now
    LATER = 1  # not now; retry after blocks are freed
    NEVER = 2  # can never fit; waiting will not help


class PromptedAllocation(NamedTuple):
    """What `Scheduler.allocate_prompted` hands back."""

    status: AllocStatus
    block_ids: np.ndarray  # int32, the blocks the prompt's KV lands in (empty unless OK)
    seq_id: int  # the sequence's stable id (-1 unless OK)
    # block_ids[:num_cached_blocks] need no pull: the null block 0 where the sliding window
    # has passed already (S42: never allocated), then local prefix-cache hits (P7, P9);
    # block_ids[num_cached_blocks:] need the pull. Always < len(block_ids) when OK.
    num_cached_blocks: int = 0

    @property
    def num_out_of_window_blocks(self) -> int:
        """Leading entries that are the null block: before the sliding window (S42)."""
        return int(np.count_nonzero(self.block_ids[:self.num_cached_blocks] == 0))


@dataclasses.dataclass
class SchedulerConfig:
    engine_type: EngineType = EngineType.NORMAL
    num_blocks: int = 256  # KV blocks including the null block 0
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # running + admitted sequences
    max_num_batched_tokens: int = 2048  # token budget of one prompt step
    max_model_len: int = 2048  # prompt + output
    enable_chunked_prefill: bool = True  # long prompts span several steps
    stop_preempted_request: bool = False  # preemption terminates instead of recomputing
    num_state_slots: int = 0  # per-sequence state pool; 0 = the model needs none
    prefill_max_sum_seqlen_k: int = 0  # sum of K lengths of one prompt step; 0 = unlimited
    cp_size: int = 1  # context parallel size; chunks align to 2 * cp_size
    lookahead_tokens: int = 0  # smallest chunk worth scheduling is max(this, 1)
    watermark: float = 0.9  # prefill is wanted only at or below this cache usage
    prefill_attempt_interval: int = 70  # ALL vote every this many decode steps
    prefill_any_attempt_interval: int = 100  # ANY vote every this many decode steps
    num_speculative_tokens: int = 0  # most draft tokens per sequence and step
    image_token_id: int = -1  # image start token; -1 = text only
    image_pad_token_id: int = -1  # image patch token; chunks never split a run of them
    flops_per_token: float = 0.0  # for the FLOP estimates on SchedulerOutputs
    attn_flops_per_qk: float = 0.0
    enable_prefix_caching: bool = False  # P1-P8: reuse the KV of full blocks seen before
    prefix_cache_seed: int = 0  # uint64 key(-1) of the block-key chain: the model fingerprint
    # S40: decode steps after a prompt step before the next prefill attempt; 0 = none (prompt
    # steps back to back while prompts wait, the seed's rule)
    prefill_min_decode_steps: int = 0
    # S42: tokens a query sees (itself included) when every attention layer has that window
    # (`kv_window`); 0 = no window, or some layer reads everything: no block is released early
    sliding_window: int = 0

    def __post_init__(self) -> None:
        try:
            self.engine_type = EngineType(self.engine_type)
        except ValueError:
            raise ValueError(f"engine_type={self.engine_type!r} is not an EngineType") from None
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "cp_size", "prefill_attempt_interval",
                     "prefill_any_attempt_interval"):
            self._check_int(name, minimum=1)
        self._check_int("num_blocks", minimum=2)
        for name in ("num_state_slots", "prefill_max_sum_seqlen_k", "lookahead_tokens",
                     "num_speculative_tokens", "prefill_min_decode_steps", "sliding_window"):
            self._check_int(name, minimum=0)
        for name in ("image_token_id", "image_pad_token_id"):
            self._check_int(name, minimum=-1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
        self._check_int("prefix_cache_seed", minimum=0)
        if self.prefix_cache_seed >= 1 << 64:
            raise ValueError(f"prefix_cache_seed={self.prefix_cache_seed!r} must fit in 64 bits")
        if self.enable_prefix_caching and self.num_state_slots > 0:
            raise ValueError(
                f"enable_prefix_caching=True with num_state_slots={self.num_state_slots}: a "
                "per-sequence state is not in the KV blocks, so a prefix hit could not restore it")
        if not 0.0 < float(self.watermark) <= 1.0:
            raise ValueError(f"watermark={self.watermark!r} must be in (0, 1]")
        if self.engine_type == EngineType.COMPLETION and not self.stop_preempted_request:
            raise ValueError(
                "stop_preempted_request=False: a COMPLETION engine cannot recompute preempted "
                "requests (it has no prefill path); build it with stop_preempted_request=True")

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name}={value!r} must be an int")
        if value < minimum:
            raise ValueError(f"{name}={value!r} must be >= {minimum}")

    def to_native(self) -> _scheduler.SchedulerConfig:
        native = _scheduler.SchedulerConfig()
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "engine_type":
                value = _scheduler.EngineType(int(value))
            elif field.name == "prefix_cache_seed":
                value = int(value)
            setattr(native, field.name, value)
        native.validate()
        return native


def kv_window(layer_windows: Sequence[int | None]) -> int:
    """S42: the `SchedulerConfig.sliding_window` of a model whose layers see these windows
    (`ModelConfig.layer_windows`, None = full attention): the widest one when every layer has
    a window, else 0, since a full-attention layer (Gemma 2's global layers) reads every
    block of the sequence."""
    windows = list(layer_windows)
    if not windows or any(w is None for w in windows):
        return 0
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in windows):
        raise ValueError(f"layer windows {windows[:8]} must be positive ints or None")
    return max(windows)


AllReduceMin = Callable[[int], int]


class Scheduler:
    """The compiled scheduler. ``all_reduce_min`` is the data-parallel MIN all-reduce
    (``int -> int``); ``None`` means a single rank that votes with itself (S37)."""

    def __init__(self, config: SchedulerConfig, all_reduce_min: AllReduceMin | None = None) -> None:
        self.config = config
        self._impl = _scheduler.Scheduler(config.to_native(), all_reduce_min)
        logger.info("scheduler: %s", config)
        # Hot path: bind straight to the compiled methods.
        self.schedule: Callable[[], SchedulerOutputs] = self._impl.schedule
        self.process_outputs: Callable[[SchedulerOutputs, np.ndarray], ProcessResult] = (
            self._impl.process_outputs)
        # Plain free + cached-free (prefix caching): both can be handed out.
        self.num_free_blocks: Callable[[], int] = self._impl.num_free_blocks
        self.num_total_blocks: Callable[[], int] = self._impl.num_total_blocks

    # __init__ binds each instance straight to the compiled method; this one documents it.
    def process_outputs(self, outputs: SchedulerOutputs, sampled_token_ids: np.ndarray) -> ProcessResult:
        """Book a step. ``sampled_token_ids`` is int32 ``[n]``, or ``[n, 1+k]`` with drafts:
        column 0 is the sampled token, columns 1..k the verified drafts (-1 = rejected)."""
        return self._impl.process_outputs(outputs, sampled_token_ids)

    def add_sequence(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                     max_tokens: int, *, eos_token_ids: Iterable[int] = (),
                     stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                     schedulable: bool = True, chunk_checkpoints: Iterable[int] = (),
                     structured_output: bool = False, skip_prefix_cache: bool = False,
                     key_seed: int | None = None) -> int:
        """Queue a request; returns its stable integer ``seq_id``. ``skip_prefix_cache``: no
        prefix-cache hit and no key for it (prompt logprobs need every position's logits).
        ``key_seed``: key(-1) of its block-key chain (P1: a tenant's, from
        ``baton.engine.block_keys.key_seed``); None = the config's ``prefix_cache_seed``."""
        return self._impl.add_sequence(
            request_id, prompt_token_ids, max_tokens, eos_token_ids=tuple(eos_token_ids),
            stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos, schedulable=schedulable,
            chunk_checkpoints=list(chunk_checkpoints), structured_output=structured_output,
            skip_prefix_cache=skip_prefix_cache, key_seed=key_seed)

    def allocate_prompted(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                          first_token_id: int, max_tokens: int, *,
                          eos_token_ids: Iterable[int] = (), stop_token_ids: Iterable[int] = (),
                          ignore_eos: bool = False, schedulable: bool = True,
                          chunk_checkpoints: Iterable[int] = (),
                          structured_output: bool = False,
                          block_keys: Sequence[int] | np.ndarray = (),
                          key_seed: int | None = None) -> PromptedAllocation:
        """COMPLETION engine: allocate the blocks a prompt's KV lands in, all or nothing. OK
        gives the block ids and the sequence's ``seq_id``; LATER and NEVER change nothing.

        ``block_keys`` (the handle's keys of the prompt's full blocks, P7): with prefix caching
        on, the longest run of them held locally with the same tokens is pinned, at most all
        but the last prompt block; those are ``block_ids[:num_cached_blocks]`` and need no pull.
        With ``sliding_window`` (S42) the blocks before the first decode query's window are
        not allocated at all: they lead ``block_ids`` as the null block 0 and count as no pull.
        ``key_seed`` as in ``add_sequence``: the handle's keys are chained from it."""
        status, block_ids, seq_id, num_cached = self._impl.allocate_prompted(
            request_id, prompt_token_ids, first_token_id, max_tokens,
            eos_token_ids=tuple(eos_token_ids), stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos, schedulable=schedulable,
            chunk_checkpoints=list(chunk_checkpoints), structured_output=structured_output,
            block_keys=np.asarray(block_keys, dtype=np.uint64), key_seed=key_seed)
        return PromptedAllocation(AllocStatus(status), block_ids, int(seq_id), int(num_cached))

    def commit_prompted(self, request_id: str) -> None:
        """The KV landed: the sequence joins ``prompted``, then ``running``; with prefix
        caching its full prompt blocks get their keys."""
        self._impl.commit_prompted(request_id)

    def free_prompted(self, request_id: str) -> bool:
        """The transfer failed or the request was aborted: free everything (idempotent)."""
        return self._impl.free_prompted(request_id)

    def release_handed_off(self, request_id: str) -> None:
        """PROMPT engine: the lease on a handed-off prompt ended; its blocks return."""
        self._impl.release_handed_off(request_id)

    def abort_sequence(self, request_id: str) -> None:
        """Abort in any state; blocks return once no step in flight can read them."""
        self._impl.abort_sequence(request_id)

    def fail_sequence(self, request_id: str, status: SequenceStatus) -> None:
        """Finish a request that failed outside the scheduler (vision encoder, grammar)."""
        self._impl.fail_sequence(request_id, int(status))

    def set_schedulable(self, request_id: str, schedulable: bool = True) -> None:
        self._impl.set_schedulable(request_id, schedulable)

    def set_draft_tokens(self, request_id: str, draft_token_ids: Sequence[int]) -> None:
        """Drafts for the next decode step (at most ``num_speculative_tokens``)."""
        self._impl.set_draft_tokens(request_id, draft_token_ids)

    def set_structured_output_status(self, request_id: str, status: int) -> None:
        self._impl.set_structured_output_status(request_id, status)

    def fork_seq(self, parent_request_id: str, child_request_id: str, branch_id: str = "",
                 last_token_id: int = -1) -> int:
        """A branch sharing the parent's prefix KV (pinned blocks); returns its seq_id.
        ``last_token_id`` >= 0 replaces the child's newest output token (one without KV: an
        n > 1 choice's own first token); the stop check then runs on it."""
        return self._impl.fork_seq(parent_request_id, child_request_id, branch_id,
                                   last_token_id)

    def num_waiting(self) -> int:
        return self._impl.num_waiting()

    def num_running(self) -> int:
        return self._impl.num_running()

    def num_prompted(self) -> int:
        return self._impl.num_prompted()

    def num_handed_off(self) -> int:
        return self._impl.num_handed_off()

    def num_preemptions(self) -> int:
        """S27 preemptions since start (terminated or recomputed)."""
        return self._impl.num_preemptions()

    def has_unfinished(self) -> bool:
        return self._impl.has_unfinished()

    def get_gpu_cache_usage(self, n_planned: int = 0) -> float:
        return self._impl.get_gpu_cache_usage(n_planned)

    def decode_step(self) -> int:
        return self._impl.decode_step()

    def reset_prefix_cache(self, spill: bool = False) -> bool:
        """P8: every cached-free block loses its key (owned blocks keep theirs). Refused
        (False, nothing done) while an ``allocate_prompted`` allocation is uncommitted.
        ``spill``: the blocks go to the spill log as if evicted (P10: an engine closing keeps
        its cache on disk)."""
        return self._impl.reset_prefix_cache(spill)

    def num_cached_prompt_tokens(self, request_id: str) -> int:
        """Prompt tokens the last admission of this live or handed-off sequence took from
        the prefix cache (0 with caching off)."""
        return self._impl.num_cached_prompt_tokens(request_id)

    def block_keys(self, request_id: str) -> np.ndarray:
        """uint64 keys of the sequence's full prompt blocks (live or handed off), from its
        tokens; they stop before the first block holding an image token."""
        return self._impl.block_keys(request_id)

    def num_cached_blocks(self) -> int:
        """Cached-free blocks (counted in ``num_free_blocks`` too)."""
        return self._impl.num_cached_blocks()

    def prefix_cache_stats(self) -> dict[str, int]:
        """Totals since start: ``query_tokens`` (prompt tokens looked up at admissions) and
        ``hit_tokens`` (of those, found in the cache)."""
        return self._impl.prefix_cache_stats()

    def set_kv_event_capacity(self, capacity: int) -> None:
        """Record keys entering and leaving the prefix-cache index (cache-aware routing),
        at most ``capacity`` between two drains; 0 stops recording. Starts a fresh log."""
        self._impl.set_kv_event_capacity(capacity)

    def drain_kv_events(self) -> tuple[bool, np.ndarray, np.ndarray]:
        """``(ok, stored, removed)``: uint64 keys touched since the last drain that the index
        now holds / no longer holds; ``ok`` False (empty arrays) when the log overflowed."""
        return self._impl.drain_kv_events()

    def prefix_cache_keys(self) -> np.ndarray:
        """Every key the prefix-cache index holds (owned and cached-free blocks)."""
        return self._impl.prefix_cache_keys()

    def set_spill_capacity(self, capacity: int) -> None:
        """P10: note blocks evicted for reuse (for a lower tier to keep), at most ``capacity``
        between two drains (past it they are counted in ``num_spills_dropped``); 0 stops."""
        self._impl.set_spill_capacity(capacity)

    def drain_spills(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """P10: ``(keys, parents, block_ids, tokens[n, block_size])`` of the blocks evicted for
        reuse since the last drain. Their bytes are intact until the next step runs (or a pull
        lands): copy them out before that."""
        return self._impl.drain_spills()

    def num_spills_dropped(self) -> int:
        return self._impl.num_spills_dropped()

    def num_held_prefix_blocks(self, block_keys: Sequence[int] | np.ndarray) -> int:
        """P10: how many of a prompt's keys, from the first, the prefix cache holds."""
        return self._impl.num_held_prefix_blocks(np.asarray(block_keys, dtype=np.uint64))

    def adopt_blocks(self, token_ids: Sequence[int] | np.ndarray, seed: int, first_block: int,
                     reserve: int = 0) -> np.ndarray:
        """P10: key blocks ``[first_block, len(token_ids) // block_size)`` of ``token_ids``
        (chained from ``seed``) as cached-free, for the caller to fill before the next step;
        int32 ids, -1 for a block left out (no room beyond ``reserve``, or the run before
        ``first_block`` no longer held: then none)."""
        return self._impl.adopt_blocks(np.asarray(token_ids, dtype=np.int32), int(seed),
                                       int(first_block), int(reserve))

    def check_invariants(self) -> None:
        """Debug: ref counts equal owners, free xor owned, no sequence in two queues."""
        self._impl.check_invariants()

    def sequence_info(self, request_id: str) -> dict:
        """Debug snapshot of one live sequence's ledgers."""
        return self._impl.sequence_info(request_id)

    def __getattr__(self, name: str):
        # Remaining debug queries (waiting_ids, ref_count, ...) go to the compiled object.
        if name == "_impl":
            raise AttributeError(name)
        return getattr(self._impl, name)


__all__ = [
    "AllocStatus", "BlockManager", "EngineType", "FINISH_REASONS", "ProcessResult",
    "PromptedAllocation", "Scheduler", "SchedulerConfig", "SchedulerOutputs", "SequenceStatus",
    "compute_block_keys", "kv_window",
]
