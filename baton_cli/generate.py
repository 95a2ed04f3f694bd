"""`baton generate`: run one prompt through the offline engine and print the completion."""

from __future__ import annotations

import argparse
import logging
import sys
import time

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt, offline")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads (0 = all cores)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from baton.engine import EngineConfig, LLMEngine
    from baton.model import IncrementalDetokenizer, ModelLoadError
    from baton.sampling.params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens)
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype,
                                        num_threads=args.threads,
                                        kv_cache_memory_bytes=256 * 2**20))
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = engine.tokenizer.encode(prompt, add_special_tokens=not args.chat)
    start = time.perf_counter()
    engine.add_request("cli", ids, params)
    detok = IncrementalDetokenizer(engine.tokenizer)  # the engine streams token ids only
    num_tokens, reason = 0, None
    while engine.has_unfinished():
        for delta in engine.step():
            sys.stdout.write(detok.add(delta.new_token_ids) + (detok.flush() if delta.finished else ""))
            sys.stdout.flush()
            num_tokens += len(delta.new_token_ids)
            reason = delta.finish_reason or reason
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    logger.info("%d tokens in %.2fs (%.1f tok/s), finish reason %s", num_tokens, elapsed,
                num_tokens / max(elapsed, 1e-9), reason)
    return 0
