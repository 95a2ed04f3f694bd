"""Output processing: what a booked step made of each request, as `RequestOutput`s (torch-free).

A step's booking, for one request (`LLMEngine._book` calls these around the scheduler's
`process_outputs`, in this order):
1. `add_prompt_logprobs`: a prompt chunk's scored positions join the request's prompt logprobs.
2. `book_tokens`: the tokens the scheduler accepted (several when drafts were kept) join the
   request with their logprobs and top alternatives. Its first output says how many prompt
   tokens its admission found cached and, when it was prefilled here, carries its prompt
   logprobs. A structured request's matcher consumes them; a token it refuses (cannot happen
   under its own masks) finishes it with structured_output_failed.
3. `book_ends`: PROMPT mode's hand-offs leave the engine, their output naming the blocks; the
   finish reasons the scheduler gave (stop, length, ...) finish their requests, the last
   output saying why; an n > 1 prompt's other choices get their first tokens as outputs, and
   NORMAL forks those that go on (baton/engine/choices.py).
Stop strings are the router's (it holds the text); an engine's stops are token ids (S31).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from baton.engine.choices import choice_id, for_choice
from baton.engine.request import Request, RequestOutput, RequestTable
from baton.engine.speculation import booked_tokens
from baton.protocol import NORMAL
from baton.sampling.logprobs import TopLogprobs

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Books sampled tokens into the engine's requests and says what became of each.
    `track` / `untrack` are the engine's (a fork is a new request; a finished one leaves)."""

    def __init__(self, scheduler, requests: RequestTable, engine_type: str,
                 track: Callable[..., None], untrack: Callable[[str], None]) -> None:
        self.scheduler, self.requests, self.engine_type = scheduler, requests, engine_type
        self.track, self.untrack = track, untrack
        self.num_generated_tokens = 0  # tokens sampled

    def finish(self, req: Request, reason: str) -> RequestOutput:
        """Finish a request the scheduler no longer runs: its last output, saying why."""
        req.finish_reason = reason
        self.untrack(req.request_id)
        return RequestOutput(req.request_id, [], [] if req.params.logprobs else None, True,
                             reason, index=req.index, base_id=req.base_id)

    # ------------------------------------------------------------------ 1., 2. tokens
    @staticmethod
    def add_prompt_logprobs(reqs: list[Request], prompt: Sequence) -> None:
        for req, scored in zip(reqs, prompt, strict=True):
            if scored is not None:
                req.prompt_logprobs.logprobs.extend(scored.logprobs)
                req.prompt_logprobs.top.extend(scored.top)

    def book_tokens(self, reqs: list[Request], samples, accepted_counts) -> list[RequestOutput]:
        """The outputs of the rows whose tokens the scheduler accepted (`accepted_counts`,
        per row), of requests still here (one finished or aborted while its step was in
        flight gets nothing)."""
        outputs = []
        for i, (req, accepted) in enumerate(zip(reqs, accepted_counts, strict=True)):
            if accepted > 0 and self.requests.get(req.request_id) is req:
                tokens, logprobs = booked_tokens(samples, i, int(accepted))
                outputs.append(self._append(req, tokens, logprobs, samples.top[i]))
                if req.matcher is not None:
                    self._advance_matcher(req, outputs[-1])
        return outputs

    def _append(self, req: Request, tokens: list[int], logprobs: list[float],
                top: TopLogprobs | None = None) -> RequestOutput:
        """A step's tokens of one request (several when drafts were kept)."""
        self.num_generated_tokens += len(tokens)
        first = len(req.token_ids) == req.num_given
        req.token_ids.extend(tokens)
        if req.params.logprobs:
            req.logprobs.extend(logprobs)
        if top is not None and len(top.token_ids) > len(tokens):  # a stop among kept drafts
            top = TopLogprobs(top.token_ids[:len(tokens)], top.logprobs[:len(tokens)])
        out = RequestOutput(req.request_id, tokens, logprobs if req.params.logprobs else None,
                            top=top, index=req.index, base_id=req.base_id)
        if first:
            out.num_cached_tokens = req.num_cached_tokens or 0
            if not req.num_given:  # scored here: the prompt was prefilled on this engine
                out.prompt = req.prompt_logprobs
        return out

    def _advance_matcher(self, req: Request, out: RequestOutput) -> None:
        """Feed the matcher its row's tokens (kept drafts too); one it refuses finishes the
        request."""
        refused = next((t for t in out.new_token_ids if not req.matcher.consume_token(t)), None)
        if refused is None:
            return
        logger.warning("request %s: grammar refused token %d: %s", req.request_id,
                       refused, req.matcher.get_error())
        self.scheduler.abort_sequence(req.request_id)
        self.finish(req, "structured_output_failed")
        out.finished, out.finish_reason = True, "structured_output_failed"

    # ------------------------------------------------------------------ 3. ends
    def book_ends(self, outputs: list[RequestOutput], result, splits: list[tuple]) -> None:
        """After the tokens: the scheduler's hand-offs and finish reasons (`result`, its
        process_outputs), then the other choices of each n > 1 prompt that split this step
        (`splits`: choices.plan_splits)."""
        self._hand_off(outputs, result.handed_off)
        self._book_finished(outputs, dict(result.finished))
        for req, split, top in splits:
            self._split(req, split, top, outputs)

    def _hand_off(self, outputs: list[RequestOutput], handed_off) -> None:
        """PROMPT mode: prompts that left the scheduler with their blocks leave the engine too;
        their output names the blocks, for the prompt role to hold under a lease."""
        by_id = {out.request_id: out for out in outputs}
        for request_id, block_ids in handed_off:
            req = self.requests[request_id]
            self.untrack(request_id)
            out = by_id[request_id]
            out.handed_off_block_ids = [int(b) for b in block_ids]
            # The tokens whose K/V leaves: a migrated request's earlier outputs too.
            out.num_prompt_tokens = len(req.prompt_token_ids) + req.num_given

    def _book_finished(self, outputs: list[RequestOutput], finished: dict[str, str]) -> None:
        for out in outputs:
            reason = finished.pop(out.request_id, None)
            if reason is not None and out.request_id in self.requests:
                self.finish(self.requests[out.request_id], reason)
                out.finished, out.finish_reason = True, reason
        for request_id, reason in finished.items():  # finished without a token this step
            if request_id in self.requests:
                outputs.append(self.finish(self.requests[request_id], reason))

    def _split(self, req: Request, split, top: TopLogprobs | None,
               outputs: list[RequestOutput]) -> None:
        """The other choices' first tokens; NORMAL forks those that go on, a PROMPT engine
        hands them off with the carrier (its worker names them in the hand-off)."""
        forks = self.engine_type == NORMAL and req.request_id in self.requests
        for j in split.others():
            token, lp, reason = split.token_ids[j], split.logprobs[j], split.reasons[j]
            if forks and not reason:
                rid = self.fork(req, j, token, lp).request_id
            else:
                rid = choice_id(req.wire_id, j)
                if not reason and self.engine_type == NORMAL:
                    reason = req.finish_reason or "abort"  # the carrier failed: no fork
            self.num_generated_tokens += 1
            outputs.append(RequestOutput(rid, [token], [lp] if req.params.logprobs else None,
                                         bool(reason), reason or None, top=top, index=j,
                                         base_id=req.wire_id))

    # ------------------------------------------------------------------ n > 1 forks
    def fork(self, req: Request, index: int, token: int, logprob: float) -> Request:
        """Choice `index` of `req`'s request, forked from its sequence with its first token
        (the prompt's blocks shared, S16)."""
        cid = choice_id(req.wire_id, index)
        seq_id = self.scheduler.fork_seq(req.request_id, cid, "n", last_token_id=token)
        self.track(cid, req.prompt_token_ids, for_choice(req.params, req.base_sample_index, index),
                   int(seq_id), token_ids=[token], logprobs=[logprob], index=index,
                   base_id=req.wire_id, lora_name=req.lora_name)
        child = self.requests[cid]
        child.num_cached_tokens = req.num_cached_tokens
        child.prompt_logprobs = None  # the prompt was scored once, for the carrier
        return child
