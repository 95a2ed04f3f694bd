"""Shared by the model and engine tests: the real model (loaded once per process), the
transformers reference over the same GGUF (loaded once), and a tiny paged driver that plays the
scheduler's part (block allocator + flat batches) for phase-1 tests."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tests.threads import TEST_THREADS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(TEST_THREADS)  # its share of the cores (tests/threads.py)

BLOCK_SIZE = 16
LONG_TEXT = (
    "Paged attention stores the key and value cache of every sequence in fixed-size blocks, "
    "so that memory is allocated on demand and shared between requests. A scheduler decides "
    "at every step which sequences run: prompts are prefilled, possibly in chunks, and running "
    "sequences decode one token at a time. When the pool runs out of blocks, the youngest "
    "sequence is preempted and later recomputed from its prompt and the tokens it already "
    "produced. Disaggregated serving goes one step further: prefill runs on one machine, decode "
    "on another, and the cache moves between them over RDMA. The router streams the first token "
    "as soon as the prompt engine has it, then hands the request to a completion engine, which "
    "pulls the blocks, decodes the rest and streams every token back to the client. Metrics such "
    "as time to first token, inter-token latency and goodput tell the operator whether the split "
    "between prompt and completion engines matches the traffic. Long prompts favour more prompt "
    "engines; long answers favour more completion engines; a balanced deployment keeps both busy "
    "and neither waiting for the other to free its memory or to finish a transfer of blocks. "
) * 2


@functools.cache
def baton_model(dtype: str = "float32"):
    from baton.model import load_model

    return load_model(dtype=dtype, device="cpu")


@functools.cache
def reference_model():
    """transformers' own model of the default GGUF. Its GGUF reading takes ~25 s here (the
    `gguf` reader's field parsing and a tensor-name map rebuilt per tensor; the dequantization
    is 3 s of it), and several test processes need the model, so the first one saves what
    transformers read as a plain checkpoint (`save_pretrained`, fp32 safetensors: the same
    numbers) under the user's cache, keyed by the GGUF file and the transformers version;
    the others load that in a second or two."""
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from baton.model import default_model_path

    path = Path(default_model_path())
    stat = path.stat()
    key = hashlib.blake2b(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|"
                          f"{transformers.__version__}".encode(), digest_size=8).hexdigest()
    saved = Path.home() / ".cache" / "baton" / "test-reference" / key
    if (saved / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    partial = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=_mkdirs(saved.parent)))
    try:
        # save_pretrained refuses a model read from GGUF (its config says "quantized"): the
        # config without that, and the weights as read (shared tensors once).
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (partial / "config.json").write_text(json.dumps(config))
        save_model(model, str(partial / "model.safetensors"))
        model.generation_config.save_pretrained(partial)  # its EOS, as read from the GGUF
        os.replace(partial, saved)  # whole or not at all; another process may have won
    except OSError:
        pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return model


def _mkdirs(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def reference_greedy(prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """transformers' greedy continuation (stops at EOS like the model's generation config)."""
    model = reference_model()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt_ids),
                                                                        dtype=torch.long))
    return tuple(int(t) for t in out[0, len(prompt_ids):])


def prompt_of_length(n: int) -> list[int]:
    ids = baton_model().tokenizer.encode(LONG_TEXT)
    assert len(ids) >= n, len(ids)
    return ids[:n]


def chat_prompt() -> list[int]:
    tok = baton_model().tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    return tok.encode(text, add_special_tokens=False)


@dataclass
class PagedDriver:
    """Allocator + batch builder standing in for the scheduler: chunked prefill, batched decode."""

    num_blocks: int = 128
    block_size: int = BLOCK_SIZE
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        from baton.model.runner import ModelRunner

        self.runner = ModelRunner(baton_model(), self.block_size, num_blocks=self.num_blocks)
        self.free = list(range(self.num_blocks - 1, 0, -1))  # block 0 is the null block

    def _step(self, seqs: list[dict], chunks: list[list[int]]) -> torch.Tensor:
        ids, pos, slots, q, k = [], [], [], [], []
        for s, chunk in zip(seqs, chunks, strict=False):
            start = s["num_cached"]
            end = start + len(chunk)
            while len(s["blocks"]) * self.block_size < end:
                s["blocks"].append(self.free.pop())
            ids += chunk
            pos += range(start, end)
            slots += [s["blocks"][p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]
            q.append(len(chunk))
            k.append(end)
            s["num_cached"] = end
        width = max(len(s["blocks"]) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s["blocks"])] = s["blocks"]
        return self.runner.forward(np.array(ids, np.int32), np.array(pos, np.int32),
                                   np.array(slots, np.int64), np.array(q, np.int32),
                                   np.array(k, np.int32), tables)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int,
               chunk_size: int | list[int] | None = None) -> list[list[int]]:
        """Prefill every prompt in chunks of `chunk_size` (one size, or one per prompt; None =
        whole), one chunk of each unfinished prompt per step as a mixed batch; then decode all
        together. No EOS handling: callers compare the first tokens only."""
        seqs = [{"blocks": [], "num_cached": 0, "out": [], "prompt": p} for p in prompts]
        sizes = chunk_size if isinstance(chunk_size, list) else [chunk_size] * len(prompts)
        for s, size in zip(seqs, sizes, strict=True):
            s["chunk"] = size or len(s["prompt"])
        while todo := [s for s in seqs if s["num_cached"] < len(s["prompt"])]:
            logits = self._step(todo, [s["prompt"][s["num_cached"]:s["num_cached"] + s["chunk"]]
                                       for s in todo])
            for s, row in zip(todo, logits, strict=True):
                if s["num_cached"] == len(s["prompt"]):
                    s["out"].append(int(row.argmax()))
        for _ in range(max_new_tokens - 1):
            logits = self._step(seqs, [[s["out"][-1]] for s in seqs])
            for s, row in zip(seqs, logits, strict=False):
                s["out"].append(int(row.argmax()))
        for s in seqs:
            self.free.extend(s["blocks"])
        return [s["out"] for s in seqs]


def truncate_at_eos(tokens: list[int] | tuple[int, ...], eos: tuple[int, ...]) -> list[int]:
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos:
            break
    return out


def held_out_tokens(num_tokens: int) -> list[int]:
    """English prose no test or benchmark prompt uses: the Python reference manual's topics
    (shipped with the interpreter), from a fixed one on, as one token stream."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in ("assignment", "atom-identifiers", "class", "compound",
                                           "exceptions", "execmodel", "function", "import"))
    ids = baton_model().tokenizer.encode(text)
    assert len(ids) >= num_tokens, len(ids)
    return ids[:num_tokens]


def teacher_forced_top1(loaded, tokens: list[int], chunk: int = 512, backend=None) -> torch.Tensor:
    """The model's top-1 prediction after every prefix of `tokens` (teacher forcing: the text,
    not the model's own output, is fed back), as one sequence prefilled in chunks over a paged
    pool: int64 [len(tokens) - 1]."""
    return teacher_forced_top1_many(loaded, [tokens], chunk, backend)


def teacher_forced_top1_many(loaded, sequences: list[list[int]], chunk: int = 512,
                             backend=None) -> torch.Tensor:
    """`teacher_forced_top1` of several sequences of one length, side by side in each step (a
    chunk of each): their predictions one sequence after another."""
    from baton.model.backends import StepBatch
    from baton.model.runner import ModelRunner

    length = len(sequences[0])
    assert all(len(s) == length for s in sequences)
    num_blocks = -(-length // BLOCK_SIZE)
    runner = ModelRunner(loaded, BLOCK_SIZE, num_blocks=len(sequences) * num_blocks + 1,
                         backend=backend)
    table = torch.arange(1, len(sequences) * num_blocks + 1).view(len(sequences), num_blocks)
    out = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        pos = torch.arange(start, end)
        slots = torch.cat([row[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                           for row in table])
        n = len(sequences)
        batch = StepBatch(torch.tensor([t for s in sequences for t in s[start:end]]),
                          pos.repeat(n), slots, table, np.full(n, end - start),
                          np.full(n, end), None)
        meta = runner.backend.prepare(batch, runner.kv_cache, loaded.config.dtype)
        logits = runner.model(batch.input_ids, batch.positions, runner.kv_cache, meta,
                              runner.backend, logit_rows=torch.arange(n * (end - start)))
        runner.backend.finish_step(meta)
        out.append(logits.argmax(-1).view(n, -1))
    return torch.cat(out, dim=1)[:, :-1].reshape(-1)
