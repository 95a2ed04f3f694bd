"""Input processing (torch-free): a request's prompt, earlier outputs and grammar checked before
the scheduler sees it, the scheduler's stop settings for it, the engine's `Request` made of
it; and, per step, what the runner needs of each row beyond the scheduler's batch: the prompt
positions to score (prompt logprobs) and the grammar masks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from baton.engine.choices import choice_params
from baton.engine.grammar import GrammarCache
from baton.engine.pipeline import StepLaunch, fill_placeholders
from baton.engine.request import Request
from baton.engine.speculation import draft_masks, row_drafts
from baton.sampling.logprobs import PromptLogprobs
from baton.sampling.params import SamplingParams
from baton.sampling.samples import PromptSpan


class InputProcessor:
    """Checks of one engine's model: vocabulary, EOS ids, the tokenizer, compiled grammars."""

    def __init__(self, tokenizer, model_config) -> None:
        self.tokenizer, self.model_config = tokenizer, model_config
        self._grammars: GrammarCache | None = None  # built at the first structured request

    def check_prompt(self, request_id: str, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids; ValueError when it is empty or holds an id out of range."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if max(ids) >= self.model_config.vocab_size or min(ids) < 0:
            raise ValueError(f"request {request_id!r}: token id out of range "
                             f"[0, {self.model_config.vocab_size})")
        return ids

    def check_outputs(self, request_id: str, output_token_ids: Sequence[int],
                      params: SamplingParams) -> list[int]:
        """A migrated request's earlier outputs; ValueError when an id is out of range or
        nothing is left to generate (the router finishes such a request itself)."""
        outputs = [int(t) for t in output_token_ids]
        if outputs and (max(outputs) >= self.model_config.vocab_size or min(outputs) < 0):
            raise ValueError(f"request {request_id!r}: output token id out of range "
                             f"[0, {self.model_config.vocab_size})")
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"request {request_id!r}: {len(outputs)} earlier outputs leave "
                             f"nothing of max_tokens={params.max_tokens}")
        return outputs

    def stop_options(self, params: SamplingParams) -> dict:
        """The scheduler's stop settings (S31) for a request; a structured one is never
        recomputed (its matcher cannot be replayed): preempted, it finishes."""
        return {"eos_token_ids": self.model_config.eos_token_ids,
                "stop_token_ids": params.stop_token_ids, "ignore_eos": params.ignore_eos,
                "structured_output": bool(params.grammar)}

    @property
    def grammars(self) -> GrammarCache:
        """The grammar cache (built at the first structured request)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size,
                                          self.model_config.eos_token_ids)
        return self._grammars

    def check_request(self, request_id: str, prompt: str | Sequence[int],
                      output_token_ids: Sequence[int],
                      params: SamplingParams) -> tuple[list[int], list[int]]:
        """A new request's prompt ids and earlier outputs (a migrated request's), each checked;
        ValueError naming what is wrong."""
        ids = self.check_prompt(request_id, prompt)
        outputs = self.check_outputs(request_id, output_token_ids, params)
        if params.n > 1 and outputs:
            raise ValueError(f"request {request_id!r}: n={params.n} with earlier outputs (a "
                             "migrated request) is not supported")
        self.check_grammar(params, outputs)
        return ids, outputs

    def check_grammar(self, params: SamplingParams, token_ids: Sequence[int] = ()) -> None:
        """ValueError unless the request's grammar compiles and accepts `token_ids` (sampled
        elsewhere: a prompt engine's first token)."""
        if params.grammar:
            matcher = self.grammars.matcher(params.grammar)
            if token_ids and not matcher.consume_tokens([int(t) for t in token_ids]):
                raise ValueError(f"tokens {list(token_ids)} break the request's grammar: "
                                 f"{matcher.get_error()}")

    def request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                seq_id: int, token_ids: Sequence[int] = (), logprobs: Sequence[float] = (),
                index: int = 0, base_id: str = "", lora_name: str = "") -> Request:
        """The engine's state of a request the scheduler holds as `seq_id` (see
        `LLMEngine.track`); a structured one's matcher has consumed `token_ids`."""
        req = Request(request_id, prompt_token_ids, params, seq_id=seq_id,
                      num_given=len(token_ids), index=index, base_id=base_id,
                      base_sample_index=params.sample_index - index,
                      is_split=params.n == 1 or bool(token_ids), lora_name=lora_name)
        req.token_ids.extend(int(t) for t in token_ids)
        if params.logprobs:
            req.logprobs.extend(float(lp) for lp in logprobs)
        if params.prompt_logprobs >= 0:
            req.prompt_logprobs = PromptLogprobs()
        if params.grammar:  # checked by check_grammar: compiled, and takes token_ids
            req.matcher = self.grammars.matcher(params.grammar)
            req.matcher.consume_tokens([int(t) for t in token_ids])
        return req

    # ------------------------------------------------------------------ per step
    def step_launch(self, sched_out, seq_ids: np.ndarray, reqs: list[Request],
                    after: tuple[StepLaunch, np.ndarray] | None = None) -> StepLaunch:
        """A scheduled step's runner arguments (rows `reqs`). `after`: the step still in
        flight and its sampled tokens (two-beat), which fill this step's -1 input ids and
        count among the outputs its rows sample after."""
        seqlens_q, seqlens_k = np.asarray(sched_out.seqlens_q), np.asarray(sched_out.seqlens_k)
        run_out, so_far = sched_out, [r.token_ids for r in reqs]
        if after is not None:  # the outputs a row samples after: its booked ones and N's token
            run_out, filled = fill_placeholders(sched_out, seq_ids, *after)
            so_far = [[*r.token_ids, filled[int(s)]] if int(s) in filled else list(r.token_ids)
                      for r, s in zip(reqs, seq_ids, strict=True)]
        # Only a row whose context is complete is sampled: a non-final prompt chunk is not. A
        # decode row's context runs past the request's tokens by its drafts (q - 1).
        drafted = 0 if sched_out.prompt_run else seqlens_q - 1
        complete = [int(k) == len(r.prompt_token_ids) + len(t)
                    for r, t, k in zip(reqs, so_far, seqlens_k - drafted, strict=True)]
        spans = (self.prompt_spans(reqs, seqlens_q, seqlens_k) if sched_out.prompt_run
                 else None)
        verified = not sched_out.prompt_run and int(seqlens_q.max()) > 1
        args = (run_out, seq_ids,
                [r.params if c else None for r, c in zip(reqs, complete, strict=True)],
                [r.prompt_token_ids for r in reqs], so_far, spans,
                self.allowed_tokens(reqs, complete, row_drafts(sched_out) if verified else None),
                choice_params(reqs, complete))
        kwargs = ({"lora_names": [r.lora_name for r in reqs]}
                  if any(r.lora_name for r in reqs) else {})
        return StepLaunch(sched_out, seq_ids, reqs, seqlens_q, verified, args, kwargs)

    def allowed_tokens(self, reqs: list[Request], complete: list[bool],
                       drafts: list[list[int]] | None = None) -> list | None:
        """Each sampled structured row's grammar mask (bool [vocab]; [1 + k, vocab] for a row
        verifying k drafts: the mask at each of its positions); None when none."""
        if all(r.matcher is None for r in reqs):
            return None
        grammars = self.grammars
        return [None if r.matcher is None or not c else
                draft_masks(grammars, r.matcher, drafts[i]) if drafts and drafts[i] else
                grammars.allowed_tokens(r.matcher)
                for i, (r, c) in enumerate(zip(reqs, complete, strict=True))]

    @staticmethod
    def prompt_spans(reqs: list[Request], seqlens_q: np.ndarray,
                     seqlens_k: np.ndarray) -> list[PromptSpan | None] | None:
        """Prompt steps of requests asking prompt logprobs: which chunk positions predict the
        prompt tokens not scored yet (a recomputed prompt was scored the first time)."""
        spans: list[PromptSpan | None] = []
        for req, q, k in zip(reqs, seqlens_q, seqlens_k, strict=True):
            scored = req.prompt_logprobs
            start, num_prompt = int(k) - int(q), len(req.prompt_token_ids)
            end = min(int(k), num_prompt - 1)  # the last prompt position predicts an output
            if scored is None or len(scored.logprobs) >= end:
                spans.append(None)
                continue
            have = len(scored.logprobs)
            # The prompt skipped the prefix cache, so every position not scored is computed.
            assert start <= have, (req.request_id, start, have)
            spans.append(PromptSpan(have - start, req.prompt_token_ids[have + 1:end + 1],
                                    req.params.prompt_logprobs))
        return spans if any(s is not None for s in spans) else None
