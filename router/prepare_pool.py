"""Where request bodies are parsed, validated and tokenized: worker processes, off the loop.

tokenizers' `encode` and pydantic's validation hold the GIL for the whole call (0.5 s for a
640k-character prompt, 0.1 s for a 4 MiB array of ids), so on a thread they would still stall
every stream the event loop serves; in a worker process they do not. A worker gets the
tokenizer once, as its JSON (no model file is read again), and then only raw bodies in and
`Prepared` requests (or an APIError) out.

A body of at most INLINE_BYTES is prepared on the event loop itself: a few milliseconds at
most, and it never queues behind a heavy body in the workers (a small request's latency must
not depend on what others send). `num_workers=0` prepares every body on one thread of this
process instead: the same code, for tests that build many apps and for embedding; it bounds
nothing about the GIL.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from router.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from router.prepare import Prepared, prepare_chat, prepare_completion
from router.text import ModelInfo

logger = logging.getLogger(__name__)

_KINDS = {"completion": (CompletionRequest, prepare_completion),
          "chat": (ChatCompletionRequest, prepare_chat)}
_worker_info: ModelInfo | None = None  # set once in each worker process
# 8 KiB of text tokenizes in ~5 ms (640k characters take 0.5 s), the chat template as fast.
INLINE_BYTES = 8 * 1024


def prepare_raw(raw: bytes, kind: str, info: ModelInfo | None = None,
                adapters: tuple[str, ...] = ()) -> Prepared:
    """A raw body of endpoint `kind` ("completion", "chat") -> Prepared, or APIError;
    `adapters`: the LoRA adapters served now (a body's `model` may name one)."""
    model, prepare = _KINDS[kind]
    return prepare(parse_body(raw, model), info or _worker_info, adapters)


class PreparePool:
    def __init__(self, info: ModelInfo, num_workers: int):
        self.info = info
        self.num_workers = num_workers
        self._executor = self._new_executor()

    def _new_executor(self) -> Executor:
        if not self.num_workers:
            return ThreadPoolExecutor(1, thread_name_prefix="router-prepare")
        return ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(_portable(self.info),))

    async def start(self) -> None:
        """Start every worker now rather than on the first requests."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._executor, _ping)
                               for _ in range(max(1, self.num_workers))))

    async def prepare(self, raw: bytes, kind: str, adapters: tuple[str, ...] = ()) -> Prepared:
        if len(raw) <= INLINE_BYTES and self.num_workers:
            return prepare_raw(raw, kind, self.info, adapters)
        loop = asyncio.get_running_loop()
        call = (functools.partial(prepare_raw, raw, kind, None, adapters) if self.num_workers
                else functools.partial(prepare_raw, raw, kind, self.info, adapters))
        executor = self._executor
        try:
            return await loop.run_in_executor(executor, call)
        except BrokenProcessPool:
            logger.error("a prepare worker died; starting a fresh pool")
            if self._executor is executor:
                self._executor = self._new_executor()
                executor.shutdown(wait=False, cancel_futures=True)
            raise APIError(503, "The router's tokenizer worker failed on this request; retry",
                           "service_unavailable", code="prepare_worker_failed") from None

    def close(self) -> None:
        # Waits for the workers to exit (they are idle by now: the server has stopped), so a
        # stopped router leaves no process behind.
        self._executor.shutdown(wait=True, cancel_futures=True)


def _portable(info: ModelInfo) -> tuple:
    tok = info.tokenizer
    return (info.name, info.max_model_len, list(info.stop_token_ids), info.max_token_chars,
            type(tok), tok.backend.to_str(), tok.bos_token_id, tok.eos_token_id,
            tok.chat_template, tok.add_bos_token, info.max_n)


def _init_worker(portable: tuple) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    from baton.ops.supervisor import die_with_parent

    die_with_parent()  # a router that is killed (or exits without closing us) takes us along

    global _worker_info
    (name, max_model_len, stop_ids, max_token_chars, tokenizer_type, backend, bos, eos,
     template, add_bos, max_n) = portable
    tokenizer = tokenizer_type(HFTokenizer.from_str(backend), bos_token_id=bos,
                               eos_token_id=eos, chat_template=template, add_bos_token=add_bos)
    _worker_info = ModelInfo(name=name, tokenizer=tokenizer, max_model_len=max_model_len,
                             stop_token_ids=stop_ids, max_token_chars=max_token_chars,
                             max_n=max_n)


def _ping() -> bool:
    return True
