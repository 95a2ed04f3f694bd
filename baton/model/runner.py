"""The model runner: a scheduler step in, sampled tokens out (nano-vllm's `ModelRunner`).

It owns what the model needs from one step to the next on its device: the paged KV pool, the
backend (whose dense decode rows, where it keeps them, persist across steps) and the sampler. `execute` turns the
scheduler's numpy views into tensors, runs the model (the backend writes K/V into the pool),
and samples the rows the engine asks for; the engine never touches a tensor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from baton.model.backends import Backend, StepBatch, get_backend
from baton.model.kv_cache import KVCacheSpec, allocate_kv_cache
from baton.model.load_cache import load_with_cache
from baton.model.loader import LoadedModel
from baton.model.logprobs import token_logprobs, top_logprobs
from baton.model.lora import LoraSet
from baton.model.sampler import Sampler, sample_verified
from baton.sampling.params import SamplingParams
from baton.sampling.samples import PromptSpan, StepSamples

logger = logging.getLogger(__name__)


class ModelRunner:
    """One model, its KV pool and its backend on one device."""

    def __init__(self, loaded: LoadedModel, block_size: int = 16, num_blocks: int = 0,
                 kv_cache_memory_bytes: int = 0, backend: Backend | None = None,
                 kv_cache_dtype: torch.dtype | str | None = None,
                 decode_kv: str = "rows") -> None:
        """`num_blocks` (null block included), or 0 to fit `kv_cache_memory_bytes`: the pool
        and what the backend keeps beside it (`Backend.kv_memory_factor`) together.
        `kv_cache_dtype`: the pool's element type (None or "auto": the model's dtype).
        `decode_kv`: the device's backend's decode K/V source (EngineConfig.decode_kv), when
        no `backend` is given."""
        self.loaded = loaded  # another runner of the same weights (`baton profile`'s admit)
        self.model, self.config = loaded.model, loaded.config
        self.tokenizer, self.model_path = loaded.tokenizer, loaded.path
        self.quantization = loaded.quantization  # the mode it runs (auto resolved)
        self.device = self.model.device
        # Torch threads of a step with a prompt in it (True) and of a decode-only step (False);
        # torch's count is process-wide, so it is set for the step and restored after it.
        threads = torch.get_num_threads()
        self.step_threads = {True: threads, False: threads}
        # The quantized modes are not the exact one: they may take the fused decode kernels.
        self.backend = backend or get_backend(self.device, exact=loaded.quantization == "none",
                                              decode_kv=decode_kv)
        self.kv_spec = KVCacheSpec.from_model(
            self.config, block_size, None if kv_cache_dtype == "auto" else kv_cache_dtype)
        self.backend.set_model([self.config.attention_options(i)
                                for i in range(self.config.num_layers)],
                               self.config.dtype, self.kv_spec.dtype)
        if not num_blocks:
            pool_bytes = int(kv_cache_memory_bytes / (1.0 + self.backend.kv_memory_factor))
            num_blocks = self.kv_spec.num_blocks_for_budget(pool_bytes)
        self.kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        self.sampler = Sampler(eos_token_ids=self.config.eos_token_ids)
        self.lora = LoraSet(self.model)  # LoRA adapters served beside the base (baton/model/lora.py)
        self.startup: dict[str, float | str] = {}  # build_runner's phases (engine start-up log)
        factor = self.backend.kv_memory_factor
        logger.info("model runner: %s backend, %d KV blocks of %s, %d bytes each = %d tokens; "
                    "%s", self.backend.name, num_blocks,
                    str(self.kv_spec.dtype).removeprefix("torch."), self.kv_spec.bytes_per_block,
                    self.capacity_tokens,
                    "decode attention reads the pool (the whole KV budget holds its blocks)"
                    if factor == 0 else f"+{100 * factor:.0f}% of the pool for the backend's "
                    "dense decode rows (each decoding sequence's K/V again)")

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds (the null block excluded)."""
        return (self.num_blocks - 1) * self.kv_spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    def read_blocks(self, block_ids: np.ndarray) -> np.ndarray:
        rows = self.kv_cache.view(self.kv_cache.shape[0], -1).view(torch.uint8)
        return rows[torch.as_tensor(np.asarray(block_ids, dtype=np.int64))].cpu().numpy()

    def write_blocks(self, block_ids: np.ndarray, data: np.ndarray) -> None:
        rows = self.kv_cache.view(self.kv_cache.shape[0], -1).view(torch.uint8)
        index = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=rows.device)
        rows[index] = torch.from_numpy(np.ascontiguousarray(data)).to(rows.device)

    def _tensor(self, values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), device=self.device).long()

    def forward(self, input_ids, positions, slot_mapping, seqlens_q, seqlens_k, block_tables,
                seq_ids=None, logit_rows=None, decode_step: bool = False,
                lora_names: Sequence[str] | None = None) -> torch.Tensor:
        """Run one flat batch (array-likes as the scheduler gives them); fp32 logits [n, vocab]
        of each sequence's last token (or of the flat token indices `logit_rows`).
        `slot_mapping` is block_id * block_size + offset of each token; `seqlens_k` each
        sequence's context length after the step. `seq_ids` (the scheduler's, unique per live
        sequence) let the backend keep a decoding sequence's state (the CPU backend's dense
        rows) from step to step; without them nothing is kept. `decode_step`: every token is a
        decode token, drafts included (a speculative decode step's rows are longer than one).
        `lora_names[i]`: the LoRA adapter row i runs with ("" = the base model)."""
        batch = StepBatch(
            input_ids=self._tensor(input_ids), positions=self._tensor(positions),
            slot_mapping=self._tensor(slot_mapping), block_tables=self._tensor(block_tables),
            seqlens_q=np.asarray(seqlens_q, dtype=np.int64),
            seqlens_k=np.asarray(seqlens_k, dtype=np.int64),
            seq_ids=None if seq_ids is None else np.asarray(seq_ids, dtype=np.int64),
            decode_step=decode_step)
        num_tokens = int(batch.seqlens_q.sum())
        assert num_tokens == batch.input_ids.shape[0] == batch.positions.shape[0] \
            == batch.slot_mapping.shape[0], "ragged batch"
        meta = self.backend.prepare(batch, self.kv_cache, self.config.dtype)
        rows = None if logit_rows is None else self._tensor(logit_rows)
        hooked = lora_names is not None and self.lora.begin_step(lora_names, batch.seqlens_q)
        try:
            logits = self.model(batch.input_ids, batch.positions, self.kv_cache, meta,
                                self.backend, logit_rows=rows)
        finally:
            if hooked:
                self.lora.end_step()
        self.backend.finish_step(meta)
        return logits

    def execute(self, sched_out, seq_ids: np.ndarray,
                params: Sequence[SamplingParams | None],
                prompt_token_ids: Sequence[Sequence[int]],
                output_token_ids: Sequence[Sequence[int]],
                prompt_spans: Sequence[PromptSpan | None] | None = None,
                allowed_tokens: Sequence[np.ndarray | None] | None = None,
                choice_params: Sequence[list[SamplingParams] | None] | None = None,
                lora_names: Sequence[str] | None = None) -> StepSamples:
        """Run a scheduler step and sample row i with `params[i]` (None: a prompt chunk that
        does not end its prompt; it gets a dummy 0, which the scheduler ignores, and draws
        nothing); penalties, min_tokens and seeds read each row's prompt and output ids so far.
        `prompt_spans[i]` asks for prompt logprobs of row i's chunk positions [first, end);
        `allowed_tokens[i]` is row i's grammar mask (bool [vocab]); `choice_params[i]` draws
        more tokens from row i's logits, one per params (the other choices of an n > 1 prompt);
        `lora_names[i]` the LoRA adapter of row i ("" or None: the base model).
        Returns the token ids int32 [n], their log-probs fp32 [n] and what else was asked."""
        # The step's thread count for this step only (nothing else in the process, another
        # engine or a test's reference model, may inherit it); ~10 us each.
        threads, before = self.step_threads[bool(sched_out.prompt_run)], torch.get_num_threads()
        if threads != before:
            torch.set_num_threads(threads)
        try:
            masks = None if allowed_tokens is None else \
                [None if m is None else torch.from_numpy(m) for m in allowed_tokens]
            return self._execute(sched_out, seq_ids, params, prompt_token_ids, output_token_ids,
                                 prompt_spans, masks, choice_params, lora_names)
        finally:
            if threads != before:
                torch.set_num_threads(before)

    def _execute(self, sched_out, seq_ids, params, prompt_token_ids, output_token_ids,
                 prompt_spans, allowed_tokens, choice_params, lora_names) -> StepSamples:
        self._clone_blocks(np.asarray(sched_out.clone_blocks))
        seqlens_q = np.asarray(sched_out.seqlens_q, dtype=np.int64)
        if not sched_out.prompt_run and len(seqlens_q) and int(seqlens_q.max()) > 1:
            return self._execute_verify(sched_out, seq_ids, seqlens_q, params, prompt_token_ids,
                                        output_token_ids, allowed_tokens, lora_names)
        spans = list(prompt_spans) if prompt_spans is not None else [None] * len(params)
        logit_rows, last = self._logit_rows(seqlens_q, spans)
        logits = self.forward(sched_out.input_ids, sched_out.positions, sched_out.slot_mapping,
                              sched_out.seqlens_q, sched_out.seqlens_k, sched_out.block_tables,
                              seq_ids, logit_rows, lora_names=lora_names)
        n = len(params)
        out = StepSamples(np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.float32),
                          [None] * n, [None] * n)
        last_logits = logits if last is None else logits[last]
        rows = [i for i, p in enumerate(params) if p is not None]
        if rows:
            ids, lps = self.sampler(last_logits[rows], [params[i] for i in rows],
                                    prompt_token_ids=[prompt_token_ids[i] for i in rows],
                                    output_token_ids=[output_token_ids[i] for i in rows],
                                    allowed_tokens=None if allowed_tokens is None
                                    else [allowed_tokens[i] for i in rows])
            out.token_ids[rows] = ids.cpu().numpy()
            out.logprobs[rows] = lps.cpu().numpy()
        for i in rows:
            if params[i].top_logprobs:
                out.top[i] = top_logprobs(last_logits[i:i + 1], params[i].top_logprobs)
        if last is not None:
            self._prompt_logprobs(logits, seqlens_q, spans, out)
        if choice_params is not None:
            out.choices = [None if not extra else self._sample_choices(
                last_logits[i:i + 1], extra, prompt_token_ids[i], output_token_ids[i],
                None if allowed_tokens is None else allowed_tokens[i])
                for i, extra in enumerate(choice_params)]
        return out

    def _execute_verify(self, sched_out, seq_ids, seqlens_q, params, prompt_token_ids,
                        output_token_ids, allowed_tokens, lora_names=None) -> StepSamples:
        """A decode step whose rows carry drafts: logits at every position of every row, one
        forward, then `sample_verified` (the `[n, 1 + k]` rows the scheduler books)."""
        num_tokens = int(seqlens_q.sum())
        logits = self.forward(sched_out.input_ids, sched_out.positions, sched_out.slot_mapping,
                              sched_out.seqlens_q, sched_out.seqlens_k, sched_out.block_tables,
                              seq_ids, np.arange(num_tokens), decode_step=True,
                              lora_names=lora_names)
        input_ids = np.asarray(sched_out.input_ids)
        starts = np.cumsum(seqlens_q) - seqlens_q
        drafts = [input_ids[s + 1:s + q].tolist() for s, q in zip(starts, seqlens_q, strict=True)]
        tokens, logprobs, kept = sample_verified(
            self.sampler, logits, params, prompt_token_ids, output_token_ids, drafts,
            allowed_tokens)
        top: list = [None] * len(params)
        for i, p in enumerate(params):
            if p.top_logprobs:  # positions 0..kept: the kept drafts', then the sampled token's
                first = int(starts[i])
                top[i] = top_logprobs(logits[first:first + kept[i] + 1], p.top_logprobs)
        return StepSamples(tokens, logprobs, top, [None] * len(params))

    def _sample_choices(self, row: torch.Tensor, params: list[SamplingParams],
                        prompt_ids: Sequence[int], output_ids: Sequence[int],
                        allowed: torch.Tensor | None) -> tuple[list[int], list[float]]:
        """More draws from one row's logits (a copy per draw: the sampler edits its rows)."""
        k = len(params)
        ids, lps = self.sampler(row.repeat(k, 1), params, prompt_token_ids=[prompt_ids] * k,
                                output_token_ids=[output_ids] * k,
                                allowed_tokens=None if allowed is None else [allowed] * k)
        return [int(t) for t in ids.tolist()], [float(lp) for lp in lps.tolist()]

    def _clone_blocks(self, pairs: np.ndarray) -> None:
        """S16: a fork admitted this step gets a private copy of its half-written tail block,
        before the step writes either copy; `dst == 0` only releases `src` (nothing to copy)."""
        for src, dst in pairs.reshape(-1, 2).tolist():
            if dst:
                self.kv_cache[dst].copy_(self.kv_cache[src])

    @staticmethod
    def _logit_rows(seqlens_q: np.ndarray, spans: list[PromptSpan | None]):
        """Flat token indices to run the LM head on, and where each row's last token lies in
        them; (None, None) = only the last tokens, the model's default."""
        if all(span is None for span in spans):
            return None, None
        ends = np.cumsum(seqlens_q)
        logit_rows, last = [], []
        for i, span in enumerate(spans):
            if span is not None:  # the whole chunk: its last position is the row's last token
                logit_rows.extend(range(int(ends[i] - seqlens_q[i]), int(ends[i])))
            else:
                logit_rows.append(int(ends[i]) - 1)
            last.append(len(logit_rows) - 1)
        return logit_rows, last

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, seqlens_q: np.ndarray,
                         spans: list[PromptSpan | None], out: StepSamples) -> None:
        offset = 0
        for i, span in enumerate(spans):
            q = int(seqlens_q[i]) if span is not None else 1
            if span is not None and span.targets:
                rows = logits[offset + span.first:offset + span.first + len(span.targets)]
                out.prompt[i] = token_logprobs(rows, span.targets, span.num_top)
            offset += q


def build_runner(config, loaded: LoadedModel | None = None,
                 backend: Backend | None = None) -> ModelRunner:
    """The runner an `EngineConfig` asks for: torch threads set, the model loaded (through the
    load cache when `config.load_cache_dir` names one; or `loaded` reused: tests, benchmarks),
    the KV pool sized, each step kind's thread count chosen. `backend`: None = the device's
    (`get_backend`), or one a test or benchmark built (`CPUBackend(decode_kv="rows")`).
    `runner.startup` holds the seconds of its phases and what the load cache did."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    t0 = time.perf_counter()
    outcome = "given"
    if loaded is None:
        loaded, outcome = load_with_cache(config.model, config.dtype, config.device,
                                          config.quantization, config.load_cache_dir)
    t1 = time.perf_counter()
    runner = ModelRunner(loaded, config.block_size, config.num_blocks,
                         config.kv_cache_memory_bytes, backend=backend,
                         kv_cache_dtype=config.kv_cache_dtype, decode_kv=config.decode_kv)
    threads = torch.get_num_threads()
    # Decode steps run on num_threads unless told otherwise (see EngineConfig.decode_threads
    # for the measurements).
    decode = config.decode_threads or threads
    runner.step_threads = {True: threads, False: decode}
    runner.startup = {"weights": t1 - t0, "kv pool + runner": time.perf_counter() - t1,
                      "load cache": outcome}
    return runner
