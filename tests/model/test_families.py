"""Each supported model family from a tiny random Hugging Face checkpoint, written by
transformers inside the test (once per module): greedy tokens through `LLMEngine.generate`
(exact mode, co-located, prompts batched and chunked), from the folder and from the same weights
in llama.cpp's GGUF layout, identical to transformers' own greedy decoding of the folder; the
quantized modes within Llama's quality gate."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from baton.engine import LLMEngine
from baton.model import ModelLoadError, load_model
from baton.model.backends import CPUBackend
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

from .reference import teacher_forced_top1_many
from .tiny_gguf import write_family_gguf

VOCAB = 2048  # the models' and the word-level tokenizer's
NUM_NEW = 12
# Three prompts batched together, all longer than the sliding windows below: the first step
# packs 12, 13 and the first 7 tokens of 40 into one padded prefill call (max_num_batched_tokens
# 32); the rest of the 40 follows in chunks over its cached part beside the others' decodes.
PROMPT_LENS = (12, 13, 40)
GATE_SEQ_LEN, GATE_NUM_SEQS = 256, 8  # the quality gate's tokens: 8 x 255 predictions
CHUNK = 16  # the gate's teacher-forced chunks, a decode batch's size (as Llama's)
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' near-zero init (std 0.02 makes every logit a near tie);
    norm weights near 1 (near 0 for Gemma's 1 + weight norms)."""
    gen = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def _write(folder: Path, config_class: str, model_class: str, **overrides):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**{**SMALL, **overrides})
    model = getattr(transformers, model_class)(cfg).eval()
    _randomize(model, seed=len(model_class))
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    return model


def _write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over exactly the model's vocabulary (every id decodes): the
    default model's 49152-token one takes seconds to read out of its GGUF file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                             "eos_token": "</s>"}))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _reference(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check_family(model_path: Path, expected: list[list[int]]) -> list:
    engine = LLMEngine(engine_config(model=str(model_path), device="cpu", num_blocks=64,
                                     block_size=16, max_num_batched_tokens=32))
    outs = engine.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NUM_NEW,
                                                      ignore_eos=True))
    assert [out.token_ids for out in outs] == expected
    return outs


FAMILIES = {  # name -> transformers config class, model class, what differs from SMALL
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM",
                    dict(sliding_window=8, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(sliding_window=12, pad_token_id=0, tie_word_embeddings=False)),
    # soft-caps low enough that tanh bends the scores and logits
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=0,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # local and global layers, their RoPE bases apart from each other and from the loader's
    # default, linear scaling on the global one; soft-capping off (Gemma 3's default)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=64, sliding_window=8, pad_token_id=0,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1000.0}})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False)),
}


@dataclass
class Checkpoint:
    folder: Path  # the HF folder transformers wrote
    model: torch.nn.Module  # transformers' model of it

    @functools.cached_property
    def expected(self) -> list[list[int]]:
        """transformers' greedy tokens for `_prompts()`."""
        return [_reference(self.model, p) for p in _prompts()]


# Llama's own layer (quantizable since int4 shipped): the quantized modes' figure on a tiny
# random checkpoint, against which each family's is measured.
CONTROL = ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """family (or "llama") -> its `Checkpoint`, built once per module (the family's tests share
    it)."""
    built: dict[str, Checkpoint] = {}

    def get(family: str) -> Checkpoint:
        if family not in built:
            config_class, model_class, overrides = {**FAMILIES, "llama": CONTROL}[family]
            folder = tmp_path_factory.mktemp(family)
            built[family] = Checkpoint(folder, _write(folder, config_class, model_class,
                                                      **overrides))
        return built[family]
    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_greedy_matches_transformers(family: str, checkpoint) -> None:
    outs = _check_family(checkpoint(family).folder, checkpoint(family).expected)
    assert outs[0].text.split() == [f"t{t}" for t in outs[0].token_ids]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "qwen3_moe"])
def test_family_gguf_matches_transformers(family: str, checkpoint, tmp_path: Path) -> None:
    """The same checkpoint as llama.cpp's converter lays it out in GGUF (F32), loaded through
    the GGUF path: the tokens transformers decodes from the HF folder."""
    ckpt = checkpoint(family)
    path = write_family_gguf(tmp_path / f"{family}.gguf", ckpt.model)
    assert load_model(path, device="cpu").config.architecture == \
        type(ckpt.model).__name__
    _check_family(path, ckpt.expected)


def _gate(folder: Path) -> dict[str, tuple[float, float]]:
    """mode -> (its teacher-forced top-1 agreement with the exact mode, with its own weights'
    dense float math) over GATE_NUM_SEQS seeded random sequences, every row through the block
    kernels in decode-sized chunks (Llama's measure, tests/model/test_quantization.py)."""
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, VOCAB, (GATE_SEQ_LEN,), generator=gen).tolist()
            for _ in range(GATE_NUM_SEQS)]
    exact = teacher_forced_top1_many(load_model(folder, device="cpu"), seqs, GATE_SEQ_LEN)
    assert len(exact) >= 2000
    out = {}
    for mode in ("int8", "int4"):
        loaded = load_model(folder, device="cpu", quantization=mode)
        got = teacher_forced_top1_many(loaded, seqs, CHUNK, CPUBackend(kernel_rows="all"))
        dense = teacher_forced_top1_many(loaded, seqs, GATE_SEQ_LEN)  # prefill rows: dense
        out[mode] = (float((got == exact).float().mean()), float((got == dense).float().mean()))
        print(f"{folder.name} {mode}: top-1 agreement {out[mode][0]:.4f} with exact, "
              f"{out[mode][1]:.4f} with its dense weights, over {len(exact)} tokens")
    return out


@pytest.fixture(scope="module")
def llama_gate(checkpoint) -> dict[str, tuple[float, float]]:
    return _gate(checkpoint("llama").folder)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_quantized_modes_meet_llamas_gate(family: str, checkpoint, llama_gate) -> None:
    """On SmolLM2 the gate is >= 98% agreement with the exact mode; a tiny random checkpoint
    is far more sensitive to its weights' rounding (Llama's own layer: ~94% int8, ~40% int4),
    so here each family's agreement with the exact mode is at least the tiny Llama's less 3
    points, and the kernels agree >= 98% with the same blocks' dense float math (what is the
    family's own: fused parts, biases, norms, experts)."""
    for mode, (vs_exact, vs_dense) in _gate(checkpoint(family).folder).items():
        assert vs_dense >= 0.98, (mode, vs_dense)
        assert vs_exact >= llama_gate[mode][0] - 0.03, (mode, vs_exact, llama_gate[mode][0])


def test_quantized_experts_through_the_engine_and_the_load_cache(checkpoint,
                                                                 tmp_path: Path) -> None:
    """int4 Qwen3-MoE (each expert a block weight) through `LLMEngine`: a load-cache miss and
    then a hit decode the fresh load's tokens."""
    folder = checkpoint("qwen3_moe").folder

    def greedy(cache_dir: Path | None) -> tuple[list[list[int]], str]:
        engine = LLMEngine(engine_config(model=str(folder), device="cpu", quantization="int4",
                                         num_blocks=64, block_size=16, max_num_batched_tokens=32,
                                         load_cache_dir=cache_dir and str(cache_dir)))
        outs = engine.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NUM_NEW,
                                                          ignore_eos=True))
        return [o.token_ids for o in outs], engine.runner.startup["load cache"]

    want, off = greedy(None)
    first, miss = greedy(tmp_path)
    got, hit = greedy(tmp_path)
    assert (off, miss, hit) == ("off", "miss", "hit")
    assert first == want and got == want


def test_unsupported_gguf_architecture_lists_the_supported(tmp_path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'.*llama, "
                       "qwen2, qwen3, phi3, qwen3moe"):
        load_model(tmp_path / "gpt2.gguf", device="cpu")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_is_refused_with_the_reason(arch: str, tmp_path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=f"GGUF architecture '{arch}' is not loaded: the "
                       "header has no query_pre_attn_scalar.*Hugging Face folder"):
        load_model(tmp_path / f"{arch}.gguf", device="cpu")


_GEMMA3_RAW = {**{k: v for k, v in SMALL.items() if k != "rope_theta"}, "num_hidden_layers": 7,
               "head_dim": 16, "sliding_window": 8, "architectures": ["Gemma3ForCausalLM"]}


@pytest.mark.parametrize("keys", [
    {},  # transformers' defaults: bases 1e6 / 1e4, every 6th layer global
    # the published checkpoints' keys (transformers 4.5x): linear scaling on the global layers
    dict(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
         rope_scaling={"rope_type": "linear", "factor": 8.0}),
    dict(rope_theta=5e5, layer_types=["full_attention"] + ["sliding_attention"] * 6),
])
def test_gemma3_layers_and_rope_as_transformers_reads_them(keys: dict) -> None:
    """Each layer's window and (RoPE base, linear factor) from config.json, the older keys and
    the `rope_parameters` per layer type that transformers 5 writes back, as
    `Gemma3TextConfig` derives them."""
    import transformers

    from baton.model.loader import _hf_config

    ref = transformers.Gemma3TextConfig.from_dict({**_GEMMA3_RAW, **keys})
    want_rope = tuple((p["rope_theta"], p.get("factor", 1.0) if p["rope_type"] == "linear"
                       else 1.0) for p in (ref.rope_parameters[t] for t in ref.layer_types))
    want_windows = tuple(8 if t == "sliding_attention" else None for t in ref.layer_types)
    assert "full_attention" in ref.layer_types and "sliding_attention" in ref.layer_types
    for raw in ({**_GEMMA3_RAW, **keys}, json.loads(ref.to_json_string())):
        config = _hf_config(Path("gemma3"), raw, torch.float32)
        assert config.layer_rope == want_rope
        assert config.layer_windows == want_windows
        assert (config.qk_norm, config.attention_scale, config.attn_softcap,
                config.final_softcap) == (True, 256 ** -0.5, None, None)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 8.0},
                                     {"type": "dynamic", "factor": 2.0}])
def test_gemma3_other_rope_scaling_is_refused_by_name(scaling: dict) -> None:
    from baton.model.loader import _hf_config

    with pytest.raises(ModelLoadError, match=f"Gemma 3: .*unsupported rope scaling "
                       f"'{scaling.get('rope_type', scaling.get('type'))}' on the full_attention"):
        _hf_config(Path("gemma3"), {**_GEMMA3_RAW, "rope_scaling": scaling}, torch.float32)


def test_unsupported_architecture_lists_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel.*"
                       "LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(tmp_path, device="cpu")
