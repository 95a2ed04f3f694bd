"""Model benchmark: Baton's engine vs transformers `generate` on the same GGUF weights, same
threads, same process. Prefill tokens/s (128- and 1024-token prompts) and decode tokens/s at
batch 1, 8, 32. Prints a table and writes bench/results/model.json.

    .venv/bin/python bench/model_bench.py [--threads 2] [--decode-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
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
    from baton.sampler import SamplingParams

    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return len(prompt) / (time.perf_counter() - start)


def baton_decode(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s: time of (prefill + N tokens) minus (prefill + 1 token)."""
    from baton.sampler import SamplingParams

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
    ap.add_argument("--repeats", type=int, default=3,
                    help="median of this many runs, Baton and transformers alternating, so a "
                         "shared machine's load falls on both alike")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from baton.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(num_threads=args.threads, max_num_seqs=64,
                                    kv_cache_memory_bytes=768 * 2**20))
    path = Path(engine.model_path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    rows = []
    for length in (128, 1024):
        prompt = make_prompts(engine.tokenizer, 1, length)[0]
        baton_prefill(engine, prompt[:16]), hf_prefill(hf, prompt[:16])  # warm-up
        b, h = alternate(partial(baton_prefill, engine, prompt), partial(hf_prefill, hf, prompt),
                         args.repeats)
        rows.append({"metric": f"prefill_tok_s_len{length}", "baton": b, "transformers": h})
    for batch in (int(x) for x in args.batches.split(",")):
        prompts = make_prompts(engine.tokenizer, batch, args.decode_prompt_len)
        b, h = alternate(partial(baton_decode, engine, prompts, args.decode_tokens),
                         partial(hf_decode, hf, prompts, args.decode_tokens), args.repeats)
        rows.append({"metric": f"decode_tok_s_batch{batch}", "baton": b, "transformers": h})
        logger.info("%s", rows[-1])
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
