"""`EngineConfig`: model, cache and batching of one engine (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.proposers import SPECULATIVE_METHODS
from baton.engine.scheduler import EngineType, SchedulerConfig
from baton.model.modes import check_dtype_name, check_kv_cache_dtype, check_quantization
from baton.protocol import COMPLETION, NORMAL, PROMPT, ROLES

# Each role runs the scheduler in the mode of the same name.
# Drafts per step when speculating and num_speculative_tokens is 0: each step verifies those
# that pay (speculation.py StepCosts.plan). On the CPU backend an extra draft costs about 0.12
# of a plain c1 step, against 1.85 for a verified step with one draft, so 8 (a long copy
# verifies 9 tokens a step) over 4 (5).
DEFAULT_SPECULATIVE_TOKENS = 8
# The prompt step's token budget `baton engine` (and so `baton up`) runs with unless told:
# half the library default, a shorter prompt step between decode steps on a CPU. `baton sim`
# and `baton plan` default to it, so a simulated fleet is the one `baton up` starts.
SERVE_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_KV_DISK_BYTES = 16 << 30

ROLE_TYPES = {role: EngineType.__members__[role.upper()] for role in ROLES}


@dataclass
class EngineConfig:
    """Model, cache and batching of one engine."""

    model: str | None = None  # GGUF file or HF folder; None = SmolLM2-135M-Instruct
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str | None = None  # None = cuda when present, else cpu
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks incl. the null block; 0 = fill kv_cache_memory_bytes
    # Used when num_blocks == 0: the pool and the backend's copies of it together. With
    # decode_kv "pool" (the default; the quantized modes, plain attention) all of it goes to
    # the pool; where the CPU backend keeps dense decode rows (the exact mode, decode_kv
    # "rows"), which can hold each decoding token again, half does.
    kv_cache_memory_bytes: int = 2**30
    max_num_seqs: int = 64  # sequences in one decode batch
    max_num_batched_tokens: int = 2048  # tokens in one prompt step (chunk size)
    max_model_len: int = 0  # prompt + output; 0 = the model's context (capped by the pool)
    enable_chunked_prefill: bool = True
    # A single rank has no peers to agree with, and every decode step it delays a waiting
    # prompt is pure queueing latency, so it attempts a prefill at every step (the scheduler's
    # default of 70 is for data-parallel ranks voting to prefill together).
    prefill_attempt_interval: int = 1
    prefill_any_attempt_interval: int = 1
    # S40: decode steps after a prompt step before the next attempt, so a burst of long prompts
    # does not stall every running stream for the whole burst: 4 cut the streams' ITL p99
    # during a burst of 8 x 600-token prompts to 0.24x of 0 (back to back: 17.6 s -> 4.3 s),
    # the burst's mean TTFT 1.18x (bench/prefill_cadence.py; figures in the README).
    prefill_min_decode_steps: int = 4
    watermark: float = 0.9  # prefill only at or below this cache usage
    # Automatic prefix caching (docs/scheduler.md, P1-P8): full blocks keyed by a hash chain over
    # their tokens; a prompt's cached run is not computed again (nor pulled, on a completion
    # engine); freed keyed blocks stay cached until the pool needs them.
    enable_prefix_caching: bool = True
    num_threads: int = 2  # torch intra-op threads; 0 = leave torch's default (all cores)
    # Threads for a step with no prompt in it; 0 = auto: num_threads. A 1-row int4 step streams
    # every weight from memory, and one core reads ~13 GB/s here, two ~25: on the 2-core Xeon,
    # idle, a c1 step (256 tokens) took 6.5 ms on two threads against 9.5 on one, c32 81 against
    # 129 ms (bench/decode_step.py --decode-threads). (Until the block kernels were built with
    # OpenMP, their at::parallel_for ran on one thread whatever this said, and one thread was
    # the default in the quantized modes: a second only added barriers.) Each parallel region's
    # barrier waits for a thread that the router, a client or another process may hold, so on a
    # host whose cores are busy with other work 1 can be the faster choice (a c1 step beside a
    # busy loop on the other core: 24.6 ms on two threads, 9.4 on one). In the exact mode a
    # value other than num_threads lets MKL round a decode row differently in a decode-only step
    # (a completion engine) than beside a prompt (a normal engine).
    decode_threads: int = 0
    # What the quantized modes' decode attention reads a decoding sequence's K/V from: "pool"
    # (its blocks, through the block table: the whole KV budget buys unique blocks) or "rows"
    # (a dense copy per decoding sequence beside the pool: half the budget buys blocks, the
    # other half holds the same tokens again). Pool by default since the op stopped copying
    # the values into a scratch row: an int4 decode step over the pool took 0.72-0.98x the
    # rows' time at batch 1-32 x 256-1000 tokens of context (one decode thread, CPU time,
    # bench/results/decode_step_pool_after.json), where it had taken 0.97-1.36x. The exact
    # mode (float32, no quantization: the quality reference against transformers, eager
    # attention) and models with attention options the op lacks (soft-capping, a scale of
    # their own, sliding windows) keep dense rows whatever this says (cpu.py says why).
    decode_kv: str = "pool"
    # normal: prefill + decode; prompt: prefill only, prompts leave with their KV blocks;
    # completion: decode only, prompts arrive with KV pulled from a prompt engine.
    engine_type: str = NORMAL
    # Weight-only quantization: none | int8 | int4 (CPU kernels for decode steps,
    # `baton/model/quant.py`), or auto: int4 for a file whose layers are Q4 blocks, else none
    # (the servers' default). The exact mode: dtype float32, quantization none, which the
    # library keeps as its default (what its tests compare with transformers).
    quantization: str = "none"
    # The load cache (baton/load_cache.py): a model's first load in this dtype and quantization
    # writes what the loader produced here, later loads map it; None = no cache (the library's
    # default; the engine command's is ~/.cache/baton/load).
    load_cache_dir: str | None = None
    # The KV pool's element type (and the CPU backend's decode rows'), independent of the
    # weights': auto | float32 | bfloat16 | float16; auto = `dtype`. K/V are rounded to it when
    # computed and attention runs in `dtype` over the rounded values, so every path (a prefix
    # hit, a pulled prompt, a decode row) reads the same numbers. bfloat16 holds twice the
    # tokens of float32 in the same budget (quality gate: README, "KV cache dtype").
    kv_cache_dtype: str = "auto"
    # Speculative decoding (baton/engine/speculation.py): off, ngram (prompt lookup over each
    # request's own tokens) or suffix (the continuation of the longest repeated suffix of
    # them); the model verifies every draft of a step in one forward, and a batch drafts only
    # where the measured step times say it pays. Greedy and seeded outputs are those without.
    speculative: str = "off"
    # Most drafts per sequence and step; 0 = DEFAULT_SPECULATIVE_TOKENS when speculating.
    num_speculative_tokens: int = 0
    # 0: a decode batch drafts only where the engine's running averages of its step times say
    # verifying gives more tokens per second than a plain step (speculation.py StepCosts);
    # N > 0: a batch of N rows or more never drafts and a smaller one always does (a fixed
    # rule, vLLM's speculative_disable_by_batch_size).
    speculative_disable_by_batch_size: int = 0
    # The local disk tier (baton/engine/kv_disk.py, docs/scheduler.md P10): keyed blocks the
    # pool evicts are written here, and a later prompt loads them instead of recomputing;
    # "" = off. Needs prefix caching. The files outlive the engine (a restart finds them).
    kv_disk_dir: str = ""
    # Most bytes of files in kv_disk_dir; the least recently used files go first.
    kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES
    # The two-beat pipeline (baton/engine/pipeline.py, docs/scheduler.md S3): a plain decode
    # step's successor is scheduled and its inputs built while its forward runs on a worker
    # thread, and it is booked while the successor runs. Off by default: README, "The two-beat
    # pipeline", has the measurements. Refused on a prompt engine (no decode steps).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        check_quantization(self.quantization)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "prefill_attempt_interval", "prefill_any_attempt_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len", "num_threads",
                     "decode_threads", "prefill_min_decode_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.engine_type not in ROLE_TYPES:
            raise ValueError(f"EngineConfig.engine_type must be one of {sorted(ROLE_TYPES)}, "
                             f"got {self.engine_type!r}")
        self._check_speculative()
        if self.kv_disk_dir and not self.enable_prefix_caching:
            raise ValueError(f"EngineConfig.kv_disk_dir={self.kv_disk_dir!r} with prefix caching "
                             "off: the disk tier keeps and finds blocks by their prefix keys")
        if self.kv_disk_bytes <= 0:
            raise ValueError(f"EngineConfig.kv_disk_bytes must be > 0, got {self.kv_disk_bytes}")
        if self.num_blocks == 1:
            raise ValueError("EngineConfig.num_blocks must be 0 (auto) or >= 2, got 1")
        if self.async_scheduling and self.engine_type == PROMPT:
            raise ValueError("EngineConfig.async_scheduling=True on a prompt engine: it runs no "
                             "decode step to overlap (use it on the engines that decode)")

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"EngineConfig.speculative must be one of {list(SPECULATIVE_METHODS)}"
                             f", got {self.speculative!r}")
        if self.decode_kv not in ("pool", "rows"):
            raise ValueError(f"EngineConfig.decode_kv must be 'pool' or 'rows', got "
                             f"{self.decode_kv!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError("EngineConfig.num_speculative_tokens must be >= 0, got "
                             f"{self.num_speculative_tokens}")
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError("EngineConfig.speculative_disable_by_batch_size must be >= 0, got "
                             f"{self.speculative_disable_by_batch_size}")
        if self.speculative == "off" and self.speculative_disable_by_batch_size:
            raise ValueError("EngineConfig.speculative_disable_by_batch_size="
                             f"{self.speculative_disable_by_batch_size} with speculative='off'")
        if self.speculative == "off" and self.num_speculative_tokens:
            raise ValueError(f"EngineConfig.num_speculative_tokens={self.num_speculative_tokens}"
                             " with speculative='off': drafts need a proposer (speculative=ngram)")
        if self.speculative != "off" and self.engine_type == PROMPT:
            raise ValueError(f"EngineConfig.speculative={self.speculative!r} on a prompt engine: "
                             "it decodes no token after the first (speculate on the completion "
                             "engines)")

    @property
    def num_draft_tokens(self) -> int:
        """Drafts per sequence and step the scheduler allows (0 = speculation off)."""
        if self.speculative == "off":
            return 0
        return self.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS

    def scheduler_config(self, num_blocks: int, max_model_len: int, prefix_cache_seed: int,
                         sliding_window: int) -> SchedulerConfig:
        """The scheduler's part of this config, for a pool of `num_blocks`."""
        return SchedulerConfig(
            engine_type=ROLE_TYPES[self.engine_type], num_blocks=num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
            # A completion engine cannot recompute (it has no prefill path): a preempted
            # request finishes with insufficient_system_resource instead.
            stop_preempted_request=self.engine_type == COMPLETION, watermark=self.watermark,
            prefill_attempt_interval=self.prefill_attempt_interval,
            prefill_any_attempt_interval=self.prefill_any_attempt_interval,
            prefill_min_decode_steps=self.prefill_min_decode_steps,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_cache_seed=prefix_cache_seed,
            num_speculative_tokens=self.num_draft_tokens,
            sliding_window=sliding_window)
