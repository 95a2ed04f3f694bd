"""LoRA adapters (baton/model/lora.py) on a tiny seeded random Llama written by transformers, and
two random PEFT adapters written by `peft` (nonzero B: an adapter that changes nothing would
prove nothing): two adapters and the base in one batch, each greedy-exact against transformers
with the adapter applied unmerged by PEFT and against its merged model; no prefix-cache hit
across adapters; what does not fit the model is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from baton.engine import LLMEngine
from baton.model.lora import LoraError, read_adapter
from baton.sampling.params import SamplingParams
from tests.model.lora_files import write_adapter
from tests.model.test_families import VOCAB, _reference
from tests.threads import engine_config

NUM_NEW = 12


def _peft(base: Path, adapter: Path, merged: bool):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    return model.merge_and_unload() if merged else model


@pytest.fixture(scope="module")
def tiny(lora_folders):
    """The base folder, its transformers model, and each adapter's folder."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(lora_folders["base"]).eval()
    return lora_folders["base"], ref, {n: lora_folders[n] for n in ("alpha", "beta")}


def _engine(base: Path, **overrides) -> LLMEngine:
    return LLMEngine(engine_config(model=str(base), device="cpu", num_blocks=64, block_size=8,
                                   max_num_batched_tokens=128, **overrides))


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (9 + 4 * i,), generator=gen).tolist() for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def test_two_adapters_and_the_base_in_one_batch_match_peft(tiny) -> None:
    base, ref, folders = tiny
    engine = _engine(base)
    for name, folder in folders.items():
        engine.load_lora(name, str(folder))
    loras = ["alpha", "beta", "", "beta", "alpha"]
    prompts = _prompts(len(loras))
    outs = engine.generate(prompts, GREEDY, lora_names=loras)
    assert engine.num_prompt_steps == 1  # every row in one prefill, then decodes together
    refs = {name: (_peft(base, folder, merged=False), _peft(base, folder, merged=True))
            for name, folder in folders.items()}
    for lora, prompt, out in zip(loras, prompts, outs, strict=True):
        if not lora:
            assert out.token_ids == _reference(ref, prompt)
            continue
        unmerged, merged = refs[lora]
        assert out.token_ids == _reference(unmerged, prompt), lora
        assert out.token_ids == _reference(merged, prompt), lora
        assert out.token_ids != _reference(ref, prompt), f"{lora} changed nothing"


def test_no_prefix_hit_across_adapters(tiny) -> None:
    base, _, folders = tiny
    engine = _engine(base)
    for name, folder in folders.items():
        engine.load_lora(name, str(folder))
    prompt = _prompts(4)[3]  # 21 tokens: two full blocks of 8
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    cached = [engine.generate(prompt, params, lora_names=[lora])[0].num_cached_tokens
              for lora in ("alpha", "beta", "", "alpha", "beta", "")]
    assert cached == [0, 0, 0, 16, 16, 16]
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_load_unload_and_bad_names(tiny) -> None:
    base, _, folders = tiny
    engine = _engine(base)
    adapter_id = engine.load_lora("alpha", str(folders["alpha"]))
    assert engine.lora_adapters() == {"alpha": adapter_id}
    with pytest.raises(ValueError, match="'alpha' is already loaded"):
        engine.load_lora("alpha", str(folders["beta"]))
    with pytest.raises(ValueError, match="'gamma' is not loaded"):
        engine.unload_lora("gamma")
    with pytest.raises(ValueError, match="LoRA adapter 'gamma' is not loaded on this engine"):
        engine.add_request("r", [5, 6, 7], GREEDY, lora_name="gamma")
    with pytest.raises(LoraError, match="name 'a b'"):
        engine.load_lora("a b", str(folders["alpha"]))
    engine.add_request("r", [5, 6, 7], GREEDY, lora_name="alpha")
    with pytest.raises(ValueError, match="serves 1 running requests"):
        engine.unload_lora("alpha")
    while engine.has_unfinished():
        engine.step()
    engine.unload_lora("alpha")
    assert engine.lora_adapters() == {}
    # The same files under another name are the same adapter: the same KV, the same id.
    assert engine.load_lora("alpha2", str(folders["alpha"])) == adapter_id


def test_an_adapter_that_does_not_fit_is_refused_by_name(tiny, lora_folders,
                                                         tmp_path: Path) -> None:
    base, _, folders = tiny
    engine = _engine(base)
    # Another base's hidden size (32, the model's is 64).
    with pytest.raises(LoraError, match=r"'narrow': layers.0.self_attn.q_proj.lora_A has shape "
                       r"\(4, 32\), expected \(4, 64\)"):
        read_adapter("narrow", lora_folders["narrow"], engine.model_config)
    # The config's rank is not the tensors' rank.
    wrong_rank = tmp_path / "wrong_rank"
    wrong_rank.mkdir()
    raw = json.loads((folders["alpha"] / "adapter_config.json").read_text())
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**raw, "r": 6}))
    (wrong_rank / "adapter_model.safetensors").write_bytes(
        (folders["alpha"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoraError, match=r"'wrong_rank': layers.0.mlp.down_proj has rank 4 "
                       r"\(lora_A \(4, 96\), lora_B \(64, 4\)\); adapter_config.json says r=6"):
        engine.load_lora("wrong_rank", str(wrong_rank))
    # A target adapters are not served on (the LM head), DoRA, a folder without the files.
    write_adapter(base, tmp_path / "head", seed=4, r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match="'head': tensor .*lm_head.* not served on"):
        engine.load_lora("head", str(tmp_path / "head"))
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**raw, "use_dora": True}))
    with pytest.raises(LoraError, match="'wrong_rank': DoRA is not supported"):
        engine.load_lora("wrong_rank", str(wrong_rank))
    with pytest.raises(LoraError, match="'missing': cannot read .*adapter_config.json"):
        engine.load_lora("missing", str(tmp_path))
    assert engine.lora_adapters() == {}


def test_int4_adds_the_delta_on_the_kernels_output(tiny) -> None:
    """In int4 an adapter row runs the block kernels' base output plus the fp32 delta; the
    base rows of the same batch are those of a batch without adapters."""
    base, _, folders = tiny
    prompts = _prompts(3)
    plain = _engine(base, quantization="int4").generate(prompts, GREEDY)
    engine = _engine(base, quantization="int4")
    engine.load_lora("alpha", str(folders["alpha"]))
    outs = engine.generate(prompts, GREEDY, lora_names=["", "alpha", ""])
    assert [outs[0].token_ids, outs[2].token_ids] == [plain[0].token_ids, plain[2].token_ids]
    assert outs[1].token_ids != plain[1].token_ids


def test_the_router_keys_an_adapters_prompt_as_the_engine_does(tiny) -> None:
    """The router's cache-aware index (router/kv_index.py RequestKeys, with the digest the
    engine publishes) finds an adapter's prompt among the engine's cached keys, and neither
    the base's nor another adapter's keys of the same prompt."""
    from router.kv_index import RequestKeys

    base, _, folders = tiny
    engine = _engine(base)
    ids = {name: engine.load_lora(name, str(folder)) for name, folder in folders.items()}
    prompt = _prompts(4)[3]
    engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1), lora_names=["alpha"])
    cached = set(engine.scheduler.prefix_cache_keys().tolist())
    seed, size = engine.prefix_cache_seed, engine.config.block_size
    alpha = RequestKeys(prompt, "", "alpha", ids["alpha"]).keys_for(size, seed)
    assert len(alpha) == 2 and set(alpha) <= cached
    for other in (RequestKeys(prompt), RequestKeys(prompt, "", "beta", ids["beta"]),
                  RequestKeys(prompt, "tenant", "alpha", ids["alpha"])):
        assert not set(other.keys_for(size, seed)) & cached


def test_lora_modules_reach_every_engine_and_bad_ones_are_refused_before_start() -> None:
    from baton_cli.engine_args import lora_module
    from baton_cli.launcher import LaunchConfig, Launcher

    launcher = Launcher(LaunchConfig(lora_modules=["a=/x/a", "b=/x/b"]))
    try:  # _start_engine spawns the engine: stop them, so that no child outlives the test
        for command in ("prompt-engine", "completion-engine"):
            launcher._start_engine(command, command, 1, "")
        for child in launcher.children:
            i = child.argv.index("--lora-modules")
            assert child.argv[i + 1:i + 3] == ["a=/x/a", "b=/x/b"]
    finally:
        launcher.stop()
    assert lora_module("a=/x=y") == ("a", "/x=y")
    with pytest.raises(ValueError, match="--lora-modules: expected NAME=PATH.*'a'"):
        LaunchConfig(lora_modules=["a"])
    with pytest.raises(ValueError, match="give --lora-modules to `baton up` itself"):
        LaunchConfig(engine_args=["--lora-modules", "a=/x"])
    with pytest.raises(ValueError, match="--mock engines have no model to adapt"):
        LaunchConfig(mock="profile.json", lora_modules=["a=/x"])
