"""The completion side of the hand-off: admit a prompt, pull its KV, commit it for decoding.

1. `add` queues a checked request (its KV handle decoded) in arrival order. A migrated request's
   earlier outputs are part of its KV (the handle covers prompt + them) and count as outputs.
2. `admit` (every loop iteration) allocates from the head: the scheduler allocates blocks for
   the whole prompt (`allocate_prompted`: OK, LATER = wait for room, keep the order; NEVER =
   cannot ever fit, finish with `insufficient_system_resource`), or, for a model with a sliding
   window on every layer, only for the blocks inside the first decode query's window (S42: the
   ones before it are neither allocated nor pulled), pinning the longest run of the
   handle's prefix-cache keys it holds (an earlier turn of the conversation left them here), the
   engine tracks the request (its first token, sampled by the prompt engine, is output 1) and
   the importer starts pulling the rest (at least the last block, so the lease is always
   claimed and released).
3. The importer's result: DONE (the pulled blocks verified against the prompt engine's
   checksums) -> `commit_prompted` (the sequence joins `prompted`, then `running` on the next
   decode step), on a mock engine not before the profile's transfer time since the pull
   started, nor before the pull admitted before it (`min_pull_s`: its tiny pool moves in far
   less than the modelled KV, and one pull follows another, as a real engine's do); FAILED ->
   `free_prompted` (blocks back, none of them keyed), finish with `kv_transfer_failed` and the
   importer's reason (peer gone, lease expired, timeout, checksum or fingerprint mismatch...):
   the router migrates the request (a new prefill and pull), so KV that is not what the prompt
   engine computed is never decoded.
4. `abort`: in admission the request just leaves; during the pull the importer is told and the
   blocks are freed once its result arrives (never while a NIXL read may still write into
   them); after the commit the engine's own abort applies (the caller's business).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from baton.engine import AllocStatus, LLMEngine
from baton.engine.block_keys import compute_block_keys
from baton.engine.choices import stops_at
from baton.protocol import GenerateRequest, TokenDelta
from baton.sampling.params import SamplingParams
from baton.service.worker import error_delta
from kv_transfer import protocol as kvproto
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferState
from kv_transfer.importer import KVImporter
from kv_transfer.integrity import FaultPlan
from kv_transfer.pulls import TransferResult

logger = logging.getLogger(__name__)

PullObserver = Callable[[TransferResult], None]  # every collected pull result (metrics)
MinPullTime = Callable[[int], float]  # blocks pulled -> seconds a pull takes at least (mock)


@dataclass
class _Admission:
    req: GenerateRequest
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a migrated request's earlier outputs
    handle: kvproto.KVHandle
    params: SamplingParams
    # (choice index, first token, its logprob): the pulled sequence is the first, the others
    # fork from it once its KV has landed (n > 1, baton/engine/choices.py).
    choices: list[tuple[int, int, float]]
    aborted: bool = False


def check_handle(req: GenerateRequest, block_size: int, vocab_size: int,
                 key_seed: int | None = None, keyed_as: str = "") -> kvproto.KVHandle:
    """The request's KV handle, decoded and checked against the tokens it covers, the prompt
    and any earlier outputs (with `key_seed`, their prefix-cache keys too, of the engine whose
    model fingerprint is `keyed_as`); ValueError if not."""
    if not req.kv_handle:
        raise ValueError("a completion engine needs the prompt's KV handle")
    try:
        handle = kvproto.decode_handle(req.kv_handle)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"undecodable KV handle: {exc}") from None
    tokens = [*req.prompt_token_ids, *req.output_token_ids]
    num_prompt = len(tokens)
    if handle.request_id != req.req_id:
        raise ValueError(f"KV handle is for {handle.request_id!r}, not {req.req_id!r}")
    if handle.num_tokens != num_prompt:
        raise ValueError(f"KV handle covers {handle.num_tokens} tokens, prompt has {num_prompt}")
    if len(handle.block_ids) != -(-num_prompt // block_size):
        raise ValueError(f"KV handle has {len(handle.block_ids)} blocks for {num_prompt} "
                         f"tokens of block size {block_size}")
    if handle.checksums and len(handle.checksums) != len(handle.block_ids):
        raise ValueError(f"KV handle has {len(handle.checksums)} block checksums for "
                         f"{len(handle.block_ids)} blocks")
    if not 0 <= req.first_token_id < vocab_size:
        raise ValueError(f"first token id {req.first_token_id} out of range")
    if handle.block_keys and key_seed is not None:
        want = compute_block_keys(tokens, block_size, key_seed)
        if [int(k) for k in want] != list(handle.block_keys):
            # The seed names the model, quantization and KV dtype: a prompt engine that differs
            # in any of them keys (and stores) blocks otherwise.
            raise ValueError("KV handle's block keys disagree with its prompt tokens as this "
                             f"engine keys them ({keyed_as or 'its own key seed'}): a prompt "
                             "engine of another model, quantization or KV cache dtype?")
    return handle


def check_choices(req: GenerateRequest, params: SamplingParams, vocab_size: int,
                  eos_token_ids: list[int], num_outputs: int) -> list[tuple[int, int, float]]:
    """The choices going on here (index, first token, logprob); ValueError unless they are
    distinct choices of the request's n, each with a token, and (n > 1) none ended by it: a
    choice forks from the pulled sequence, which must still be running then."""
    if not req.choice_indices:
        if params.n > 1:
            raise ValueError(f"n={params.n} needs the choices that go on (choice_indices)")
        return [(0, req.first_token_id, req.first_logprob)]
    indices, tokens = list(req.choice_indices), list(req.first_token_ids)
    logprobs = list(req.first_logprobs) or [0.0] * len(tokens)
    if len(tokens) != len(indices) or len(logprobs) != len(indices):
        raise ValueError(f"{len(indices)} choice indices, {len(tokens)} first tokens and "
                         f"{len(logprobs)} logprobs do not match")
    if len(set(indices)) != len(indices) or not all(0 <= i < params.n for i in indices):
        raise ValueError(f"choice indices {indices[:8]} are not distinct choices of n={params.n}")
    if tokens[0] != req.first_token_id:
        raise ValueError(f"first_token_id {req.first_token_id} is not the first choice's "
                         f"{tokens[0]}")
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise ValueError(f"first token id {token} out of range")
        if stops_at(params, eos_token_ids, token) or params.max_tokens - num_outputs <= 1:
            raise ValueError(f"choice with first token {token} is finished already")
    return list(zip(indices, tokens, logprobs, strict=True))


class Admission:
    """Prompts waiting for blocks (`queue`), prompts being pulled (`pulling`)."""

    def __init__(self, engine: LLMEngine, kv_cache, transfer: TransferConfig,
                 fingerprint: kvproto.Fingerprint, engine_id: str,
                 on_pull_result: PullObserver | None = None, faults: FaultPlan | None = None,
                 min_pull_s: MinPullTime | None = None):
        self.engine = engine
        self.on_pull_result = on_pull_result
        self.min_pull_s = min_pull_s
        self._link_free_at = 0.0  # a mock's: when its last pull's modelled bytes are in
        self._ready_at: dict[str, float] = {}  # req_id -> monotonic time its pull may land
        self._held: list[TransferResult] = []  # pulls done before their ready time
        self.importer = KVImporter(kv_cache, transfer, fingerprint, engine_id=engine_id,
                                   faults=faults)
        self.queue: collections.deque[_Admission] = collections.deque()
        self.pulling: dict[str, _Admission] = {}
        self.num_pulls_done = 0
        self.num_pulls_failed = 0
        self.num_blocks_pulled = 0  # KV blocks read from prompt engines
        self.num_blocks_reused = 0  # prompt blocks found in this engine's prefix cache

    def add(self, req: GenerateRequest, params: SamplingParams) -> None:
        """Queue a request; ValueError (nothing queued) when its prompt or handle does not
        check out."""
        engine = self.engine
        ids = engine.inputs.check_prompt(req.req_id, req.prompt_token_ids)
        outputs = engine.inputs.check_outputs(req.req_id, req.output_token_ids, params)
        # A prompt served by a LoRA adapter needs that adapter here (ValueError: refused).
        seed = engine.request_key_seed(req.req_id, req.cache_salt, req.lora_name)
        seed = engine.kv_keys.block_seed(seed) if engine.config.enable_prefix_caching else None
        handle = check_handle(req, engine.config.block_size, engine.model_config.vocab_size,
                              seed, engine.model_fingerprint)
        choices = check_choices(req, params, engine.model_config.vocab_size,
                                engine.model_config.eos_token_ids, len(outputs))
        for _, token, _ in choices:
            # The prompt engine sampled the first token under the same grammar: it must fit.
            engine.inputs.check_grammar(params, [*outputs, token])
        self.queue.append(_Admission(req, ids, outputs, handle, params, choices))

    def abort(self, req_id: str) -> list[TokenDelta] | None:
        """None when the request is past admission (decoding, or unknown)."""
        for adm in self.queue:
            if adm.req.req_id == req_id:
                self.queue.remove(adm)
                return [TokenDelta(req_id, finish_reason="abort")]
        if req_id in self.pulling:
            self.pulling[req_id].aborted = True
            self.importer.abort(req_id)  # blocks are freed when the pull's result arrives
            return []
        return None

    def admit(self) -> list[TokenDelta]:
        """Collect finished pulls, then allocate and start pulls from the head of the queue."""
        deltas = self._collect_pulls()
        while self.queue:
            adm = self.queue[0]
            try:
                status = self._allocate(adm)
            except ValueError as exc:  # its LoRA adapter was unloaded while it waited
                self.queue.popleft()
                deltas.append(error_delta(adm.req.req_id, str(exc), "bad_request"))
                continue
            if status == AllocStatus.LATER:
                break  # no room now: keep arrival order, retry when blocks free up
            self.queue.popleft()
            if status == AllocStatus.NEVER:
                deltas.append(error_delta(adm.req.req_id, "the prompt needs more KV blocks than "
                                          "this engine has", "insufficient_system_resource"))
        return deltas

    def _allocate(self, adm: _Admission) -> AllocStatus:
        req, engine, outputs = adm.req, self.engine, adm.output_token_ids
        index, first_token, first_logprob = adm.choices[0]
        alloc = engine.add_prompted_request(req.req_id, adm.prompt_token_ids, outputs,
                                            adm.params, first_token, first_logprob, index,
                                            block_keys=adm.handle.block_keys,
                                            cache_salt=req.cache_salt,
                                            lora_name=req.lora_name)
        if alloc.status == AllocStatus.OK:
            self.pulling[req.req_id] = adm
            # The first num_cached_blocks need no pull: those before the sliding window
            # (never allocated, S42) and local prefix-cache hits (P7, P9).
            hit = alloc.num_cached_blocks
            self.num_blocks_reused += hit - alloc.num_out_of_window_blocks
            self.num_blocks_pulled += len(alloc.block_ids) - hit
            block_ids = [int(b) for b in alloc.block_ids[hit:]]
            if self.min_pull_s is not None:
                # One pull after another, as a real engine's land (simulator/fleet.py
                # `retry_admissions`): the link is free when the pull before is done.
                start = max(time.monotonic(), self._link_free_at)
                self._link_free_at = start + self.min_pull_s(len(block_ids))
                self._ready_at[req.req_id] = self._link_free_at
            self.importer.start_pull(adm.handle, block_ids, first_block=hit)
        return alloc.status

    def _landed(self) -> list[TransferResult]:
        """The importer's results, a mock's done pulls held until their ready time (a failed
        or aborted one lands at once)."""
        results = self._held + self.importer.collect()
        if self.min_pull_s is None:
            return results
        now, self._held, landed = time.monotonic(), [], []
        for r in results:
            adm = self.pulling.get(r.request_id)
            if (r.state == TransferState.DONE and adm is not None and not adm.aborted
                    and now < self._ready_at.get(r.request_id, 0.0)):
                self._held.append(r)
            else:
                self._ready_at.pop(r.request_id, None)
                landed.append(r)
        return landed

    def _collect_pulls(self) -> list[TokenDelta]:
        deltas = []
        for result in self._landed():
            if self.on_pull_result is not None:
                self.on_pull_result(result)
            adm = self.pulling.pop(result.request_id, None)
            if adm is None:
                continue
            if result.state == TransferState.DONE and not adm.aborted:
                self.num_pulls_done += 1
                self.engine.commit_prompted(result.request_id, adm.choices[1:])
                continue
            self.engine.free_prompted(result.request_id)
            if adm.aborted:
                deltas.append(TokenDelta(result.request_id, finish_reason="abort"))
            else:
                self.num_pulls_failed += 1
                logger.warning("KV pull for %s failed: %s %s", result.request_id, result.reason,
                               result.message)
                deltas.append(error_delta(result.request_id,
                                          f"KV transfer failed ({result.reason}): {result.message}",
                                          "kv_transfer_failed"))
        return deltas

    @property
    def num_waiting(self) -> int:
        return len(self.queue) + len(self.pulling)

    def metrics(self) -> dict:
        return self.importer.metrics()

    def close(self) -> None:
        self.importer.close()
