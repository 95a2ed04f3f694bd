"""S42 end to end, co-located: a tiny seeded Mistral checkpoint whose sliding window is three
blocks, prompts longer than the window, greedy tokens identical to transformers' while the
engine holds only the window's blocks (the released ones never read: the CPU backend asserts
it at every attention call). The disaggregated path: tests/services/test_families_disaggregated.py."""

from __future__ import annotations

from pathlib import Path

import torch

from baton.engine import LLMEngine
from baton.sampling.params import SamplingParams
from tests.model.test_families import VOCAB, _reference, _write
from tests.threads import engine_config

BLOCK, WINDOW = 4, 12  # three blocks
NUM_NEW = 12
PROMPT_LENS = (40, 27, 9)  # two past the window (one in chunks), one inside it


def test_s42_long_prompt_decodes_exactly_in_fewer_blocks(tmp_path: Path) -> None:
    ref = _write(tmp_path, "MistralConfig", "MistralForCausalLM", sliding_window=WINDOW,
                 tie_word_embeddings=False)
    engine = LLMEngine(engine_config(model=str(tmp_path), device="cpu", num_blocks=64,
                                     block_size=BLOCK, max_num_batched_tokens=32))
    assert engine.scheduler.config.sliding_window == WINDOW
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    sched, total = engine.scheduler, engine.num_total_blocks()
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        sched.check_invariants()
        live = [r for r in sched.live_request_ids() if r in sched.running_ids()]
        if len(live) == len(prompts):  # all three decoding: the pool holds only their windows
            held = total - engine.num_free_blocks()
            most_held = max(most_held, held)
            for rid in live:
                info = sched.sequence_info(rid)
                first = info["swa_valid_start"] // BLOCK
                assert info["block_table"][:first] == [0] * first
                # Never more than the window's blocks, the block it starts in, and the next one.
                assert sum(1 for b in info["block_table"] if b) <= WINDOW // BLOCK + 2
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == _reference(ref, prompt), len(prompt)
    # Without the window the three would hold every block of prompt + output: 13 + 10 + 6.
    without = sum(-(-(n + NUM_NEW - 1) // BLOCK) for n in PROMPT_LENS)
    assert 0 < most_held <= 3 * (WINDOW // BLOCK + 2) < without
    assert engine.num_free_blocks() == total


def test_s42_verified_drafts_over_released_blocks_stay_exact(tmp_path: Path) -> None:
    """Speculative decoding (n-gram drafts, verified as short chunks over the pool) with the
    window releasing blocks under it: still transformers' greedy tokens, and drafts were
    verified on the way (a repeated prompt makes the proposer find matches)."""
    ref = _write(tmp_path, "MistralConfig", "MistralForCausalLM", sliding_window=WINDOW,
                 tie_word_embeddings=False)
    engine = LLMEngine(engine_config(model=str(tmp_path), device="cpu", num_blocks=64,
                                     block_size=BLOCK, speculative="ngram"))
    gen = torch.Generator().manual_seed(12)
    prompt = torch.randint(3, VOCAB, (6,), generator=gen).tolist() * 6  # 36 tokens
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    assert out.token_ids == _reference(ref, prompt)
    assert engine.speculator.stats.num_verify_rows > 0
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_s42_a_window_on_some_layers_only_releases_nothing() -> None:
    """The families' config readers to the scheduler's window: Gemma 2 alternates local and
    global layers and Qwen windows only the layers from max_window_layers on, so a global
    layer reads every block and none may go; Mistral windows every layer."""
    from baton.engine.scheduler import kv_window
    from baton.model.families import _mistral_config
    from baton.model.gemma2 import gemma2_config
    from baton.model.qwen import qwen_windows

    layers = dict(num_hidden_layers=4, sliding_window=8)
    assert kv_window(gemma2_config(layers)["layer_windows"]) == 0
    assert kv_window(qwen_windows({**layers, "use_sliding_window": True,
                                   "max_window_layers": 2})) == 0
    assert kv_window(qwen_windows({**layers, "use_sliding_window": True,
                                   "max_window_layers": 0})) == 8
    assert kv_window(_mistral_config(layers)["layer_windows"]) == 8
    assert kv_window(_mistral_config({**layers, "sliding_window": None})["layer_windows"]) == 0
