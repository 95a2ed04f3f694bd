"""Model benchmark: Baton's engine vs transformers `generate` on the same GGUF weights, same
threads, same process. Prints a table and writes bench/results/model.json.

Rows:
  prefill_tok_s_len{128,1024}   one prompt, tokens/s.
  decode_tok_s_batch{1,8,32}    a uniform batch: equal prompt lengths, equal output lengths, so
                                transformers pays no padding and no early finish; both run the
                                same GEMMs, so this shows the runtime's own overhead.
  mixed_tok_s_batch{8,32}       requests as a server sees them: 4 x batch requests, prompt lengths
                                drawn from 16..256 and output lengths from 8..128 (seeded).
                                transformers runs them in arrival order as static batches of
                                `batch` (left padding, each batch decodes until its longest
                                request is done); Baton batches continuously with
                                max_num_seqs = batch (paged KV: no padding, a finished request's
                                place is taken at the next step). Output tokens/s, prefill
                                included, counting only the tokens each request asked for.
  mode_{int8,int4}_*            Baton in a quantized mode (--quantization) against Baton's exact
                                mode (fp32, no quantization), interleaved: the "transformers"
                                column of these rows is the exact mode.

    .venv/bin/python bench/model_bench.py [--threads 2] [--decode-tokens 32] [--repeats 3]
        [--modes int8,int4] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
logger = logging.getLogger(__name__)
RESULTS = Path(__file__).parent / "results" / "model.json"


def make_prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    base = tokenizer.encode("The history of computing is a story of people and machines. " * 200)
    return [base[i:i + length] for i in range(num)]  # distinct prompts, same length


def baton_prefill(engine, prompt: list[int]) -> float:
    from baton.sampling.params import SamplingParams

    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return len(prompt) / (time.perf_counter() - start)


def baton_decode(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s: time of (prefill + N tokens) minus (prefill + 1 token)."""
    from baton.sampling.params import SamplingParams

    def run(n: int) -> float:
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    return len(prompts) * (new_tokens - 1) / (run(new_tokens) - run(1))


def hf_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                       do_sample=False)
    return len(prompt) / (time.perf_counter() - start)


def hf_decode(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_length=0, do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - start

    return len(prompts) * (new_tokens - 1) / (run(new_tokens) - run(1))


@dataclass
class MixedWorkload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.max_tokens)


def make_mixed(tokenizer, batch: int, seed: int = 0) -> MixedWorkload:
    rng = random.Random(seed)
    base = tokenizer.encode("The history of computing is a story of people and machines. " * 200)
    n = 4 * batch
    prompts = [base[i:i + rng.randint(16, 256)] for i in range(n)]
    return MixedWorkload(prompts, [rng.randint(8, 128) for _ in range(n)])


def baton_mixed(engine, work: MixedWorkload) -> float:
    from baton.sampling.params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == work.max_tokens
    return work.num_tokens / elapsed


def hf_mixed(model, work: MixedWorkload, batch: int) -> float:
    """Static batches in arrival order, left-padded as transformers requires for decoder-only
    generation; each batch runs to its longest request's max_tokens."""
    start = time.perf_counter()
    for b in range(0, len(work.prompts), batch):
        group = work.prompts[b:b + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(work.max_tokens[b:b + batch]),
                           min_length=0, do_sample=False, eos_token_id=None, pad_token_id=0)
    return work.num_tokens / (time.perf_counter() - start)


def mode_rows(exact, args) -> list[dict]:
    """Each quantized mode against the exact engine: prefill 128 and decode at each batch."""
    from baton.engine import EngineConfig, LLMEngine

    rows = []
    for mode in (m for m in args.modes.split(",") if m):
        engine = LLMEngine(EngineConfig(num_threads=args.threads, max_num_seqs=64,
                                        kv_cache_memory_bytes=1536 * 2**20, quantization=mode))
        prompt = make_prompts(engine.tokenizer, 1, 128)[0]
        b, e = alternate(partial(baton_prefill, engine, prompt), partial(baton_prefill, exact, prompt),
                         args.repeats)
        rows.append({"metric": f"mode_{mode}_prefill_tok_s_len128", "baton": b, "transformers": e})
        for batch in (int(x) for x in args.batches.split(",")):
            prompts = make_prompts(engine.tokenizer, batch, args.decode_prompt_len)
            b, e = alternate(partial(baton_decode, engine, prompts, args.decode_tokens),
                             partial(baton_decode, exact, prompts, args.decode_tokens), args.repeats)
            rows.append({"metric": f"mode_{mode}_decode_tok_s_batch{batch}", "baton": b,
                         "transformers": e})
            logger.info("%s", rows[-1])
        del engine
    return rows


def alternate(baton_run, hf_run, repeats: int) -> tuple[float, float]:
    """Medians of `repeats` runs of each, interleaved."""
    b, h = [], []
    for _ in range(repeats):
        b.append(baton_run())
        h.append(hf_run())
    return statistics.median(b), statistics.median(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--mixed-batches", default="8,32", help="batch sizes of the mixed workload; '' skips it")
    ap.add_argument("--repeats", type=int, default=3,
                    help="median of this many runs, Baton and transformers alternating, so a "
                         "shared machine's load falls on both alike")
    ap.add_argument("--modes", default="int8,int4",
                    help="quantized modes measured against the exact mode; '' skips them")
    ap.add_argument("--skip-transformers", action="store_true",
                    help="only the mode rows (no transformers reference)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from baton.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(num_threads=args.threads, max_num_seqs=64,
                                    kv_cache_memory_bytes=1536 * 2**20))
    path = Path(engine.model_path)
    if args.skip_transformers:
        args.mixed_batches = ""
    hf = None if args.skip_transformers else AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    rows = []
    for length in () if hf is None else (128, 1024):
        prompt = make_prompts(engine.tokenizer, 1, length)[0]
        baton_prefill(engine, prompt[:16]), hf_prefill(hf, prompt[:16])  # warm-up
        b, h = alternate(partial(baton_prefill, engine, prompt), partial(hf_prefill, hf, prompt),
                         args.repeats)
        rows.append({"metric": f"prefill_tok_s_len{length}", "baton": b, "transformers": h})
    for batch in () if hf is None else (int(x) for x in args.batches.split(",")):
        prompts = make_prompts(engine.tokenizer, batch, args.decode_prompt_len)
        b, h = alternate(partial(baton_decode, engine, prompts, args.decode_tokens),
                         partial(hf_decode, hf, prompts, args.decode_tokens), args.repeats)
        rows.append({"metric": f"decode_tok_s_batch{batch}", "baton": b, "transformers": h})
        logger.info("%s", rows[-1])
    for batch in (int(x) for x in args.mixed_batches.split(",") if x):
        # max_num_seqs = batch: Baton may never run more requests at once than transformers does.
        mixed_engine = LLMEngine(EngineConfig(num_threads=args.threads, max_num_seqs=batch,
                                              kv_cache_memory_bytes=1536 * 2**20))
        work = make_mixed(engine.tokenizer, batch)
        b, h = alternate(partial(baton_mixed, mixed_engine, work), partial(hf_mixed, hf, work, batch),
                         args.repeats)
        assert mixed_engine.num_free_blocks() == mixed_engine.num_total_blocks()
        del mixed_engine
        rows.append({"metric": f"mixed_tok_s_batch{batch}", "baton": b, "transformers": h})
        logger.info("%s", rows[-1])
    rows += mode_rows(engine, args)
    for r in rows:
        r["ratio"] = r["baton"] / r["transformers"]
    assert engine.num_free_blocks() == engine.num_total_blocks()
    print(f"{'metric':<26}{'baton':>10}{'transformers':>14}{'ratio':>8}")
    for r in rows:
        print(f"{r['metric']:<26}{r['baton']:>10.1f}{r['transformers']:>14.1f}{r['ratio']:>8.2f}")
    result = {"model": path.name, "dtype": "float32", "threads": args.threads,
              "decode_tokens": args.decode_tokens, "repeats": args.repeats, "decode_prompt_len": args.decode_prompt_len,
              "torch": torch.__version__, "machine": platform.machine(),
              "cpu_count": os.cpu_count(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
