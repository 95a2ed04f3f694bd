"""The load cache (baton/load_cache.py, baton/model/load_cache.py): a cached load is the fresh
load bit for bit and generates the same greedy tokens; a corrupted, truncated or mismatched
cache file is a miss with a warning, rebuilt, never used; concurrent writers leave one whole
file; the router's tokenizer comes from the cache too."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from baton import load_cache
from baton.engine import EngineConfig, LLMEngine
from baton.model.load_cache import load_with_cache
from baton.model.loader import load_model
from baton.model.quant import QuantizedWeight
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

from .tiny_gguf import write_tiny_gguf

PROMPTS = ["the thin man", "an inn in the hills"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model computes with, quantized weights' blocks and dense copies too."""
    out = {}
    for mod_name, mod in model.named_modules():
        for attr, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            out[f"{mod_name}.{attr}"] = t
        for attr, v in vars(mod).items():
            if isinstance(v, QuantizedWeight):
                out[f"{mod_name}.{attr}.blocks"] = v.blocks
                out[f"{mod_name}.{attr}.dense"] = v.dense
    return out


def _greedy(path: Path, quantization: str, cache_dir: Path | None) -> tuple[list, str]:
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", quantization=quantization,
                                    num_blocks=32, num_threads=1, load_cache_dir=cache_dir and
                                    str(cache_dir)))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                   ignore_eos=True))
    return [o.token_ids for o in outs], engine.runner.startup["load cache"]


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_cached_load_is_the_fresh_load(tiny: Path, tmp_path: Path, quantization: str) -> None:
    fresh = load_model(tiny, device="cpu", quantization=quantization)
    first, outcome = load_with_cache(tiny, "float32", "cpu", quantization, tmp_path)
    assert outcome == "miss" and len(list(tmp_path.glob("model-*.pt"))) == 1
    cached, outcome = load_with_cache(tiny, "float32", "cpu", quantization, tmp_path)
    assert outcome == "hit"
    assert (cached.quantization, cached.path, cached.config) == \
        (fresh.quantization, fresh.path, fresh.config)
    want, got = _tensors(fresh.model), _tensors(cached.model)
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for text in [*PROMPTS, "<|im_end|> Ünïcødé\n\tthe"]:
        assert cached.tokenizer.encode(text) == fresh.tokenizer.encode(text)
    assert cached.tokenizer.chat_template == fresh.tokenizer.chat_template
    # Greedy through a whole engine: fresh load, then a hit.
    want_ids, off = _greedy(tiny, quantization, None)
    got_ids, hit = _greedy(tiny, quantization, tmp_path)
    assert (off, hit) == ("off", "hit") and got_ids == want_ids


def _corrupt(file: Path, where: float) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip-tensor-byte", "flip-late-byte", "truncate"])
def test_damaged_cache_file_is_a_miss_and_rebuilt(tiny: Path, tmp_path: Path, damage: str,
                                                   caplog) -> None:
    load_with_cache(tiny, "float32", "cpu", "auto", tmp_path)
    (file,) = tmp_path.glob("model-*.pt")
    if damage == "truncate":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        _corrupt(file, 0.5 if damage == "flip-tensor-byte" else 0.97)
    with caplog.at_level(logging.WARNING, logger="baton.model.load_cache"):
        loaded, outcome = load_with_cache(tiny, "float32", "cpu", "auto", tmp_path)
    assert outcome == "bad" and "not used" in caplog.text
    fresh = load_model(tiny, device="cpu", quantization="auto")
    for name, t in _tensors(fresh.model).items():
        assert torch.equal(_tensors(loaded.model)[name], t), name
    assert load_with_cache(tiny, "float32", "cpu", "auto", tmp_path)[1] == "hit"  # rebuilt


def test_another_key_inside_is_a_miss(tiny: Path, tmp_path: Path, caplog) -> None:
    """A file holding another mode's load, under this mode's name, is never used."""
    load_with_cache(tiny, "float32", "cpu", "none", tmp_path)
    (none_file,) = tmp_path.glob("model-*.pt")
    key = load_cache.make_key(tiny, kind="model", dtype="float32", quantization="auto")
    auto_file = tmp_path / f"model-{load_cache.key_digest(key)}.pt"
    os.replace(none_file, auto_file)
    with caplog.at_level(logging.WARNING, logger="baton.model.load_cache"):
        loaded, outcome = load_with_cache(tiny, "float32", "cpu", "auto", tmp_path)
    assert outcome == "bad" and "another key" in caplog.text and loaded.quantization == "int4"


def test_key_follows_the_file_and_the_loader_code(tiny: Path, tmp_path: Path,
                                                  monkeypatch) -> None:
    copy = write_tiny_gguf(tmp_path / "copy.gguf")
    key = load_cache.make_key(copy, kind="model")
    assert key["weights"][0][1] == copy.stat().st_size
    write_tiny_gguf(copy, seed=1)  # other weights, same size
    assert load_cache.make_key(copy, kind="model") != key
    monkeypatch.setattr(load_cache, "_loader_version", "another-loader")
    assert load_cache.make_key(copy, kind="model")["loader"] == "another-loader"
    assert load_with_cache(copy, "float32", "cpu", "none", tmp_path / "c")[1] == "miss"
    monkeypatch.setattr(load_cache, "_loader_version", None)
    assert load_with_cache(copy, "float32", "cpu", "none", tmp_path / "c")[1] == "miss"


def test_concurrent_writers_leave_one_whole_file(tiny: Path, tmp_path: Path) -> None:
    """Two writers of the same cache file at once (threads here; two engine processes go
    through the same temporary-file-and-rename): a reader finds one whole file, no temp left."""
    from baton.model.load_cache import save

    loaded = load_model(tiny, device="cpu", quantization="auto")
    key = load_cache.make_key(tiny, kind="model", dtype="float32", quantization="auto")
    file = tmp_path / f"model-{load_cache.key_digest(key)}.pt"
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(3):
                save(file, key, loaded)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [p.name for p in tmp_path.iterdir()] == [file.name]
    assert load_with_cache(tiny, "float32", "cpu", "auto", tmp_path)[1] == "hit"


def test_tokenizer_cache_for_the_router(tiny: Path, tmp_path: Path, caplog) -> None:
    from router.text import load_model_info

    assert load_cache.load_tokenizer(tmp_path, tiny) is None
    fresh = load_model_info(str(tiny), load_cache_dir=None)
    info = load_model_info(str(tiny), load_cache_dir=str(tmp_path))  # a miss: writes it
    assert load_cache.load_tokenizer(tmp_path, tiny) is not None
    cached = load_model_info(str(tiny), load_cache_dir=str(tmp_path))
    for got in (info, cached):
        assert (got.max_model_len, got.stop_token_ids, got.name) == \
            (fresh.max_model_len, fresh.stop_token_ids, fresh.name)
        assert got.tokenizer.encode(PROMPTS[1]) == fresh.tokenizer.encode(PROMPTS[1])
    (file,) = tmp_path.glob("tokenizer-*.json")
    _corrupt(file, 0.5)
    with caplog.at_level(logging.WARNING, logger="baton.load_cache"):
        assert load_cache.load_tokenizer(tmp_path, tiny) is None
    assert "rebuilding" in caplog.text


@pytest.mark.slow
def test_default_model_cached_greedy_is_fresh_greedy(tmp_path: Path) -> None:
    """The default model (SmolLM2 Q4_1, auto = int4): a cache hit generates what a fresh
    load does."""
    want, _ = _greedy_default(None)
    assert _greedy_default(tmp_path)[1] == "miss"
    got, outcome = _greedy_default(tmp_path)
    assert outcome == "hit" and got == want


def _greedy_default(cache_dir: Path | None) -> tuple[list, str]:
    engine = LLMEngine(engine_config(device="cpu", quantization="auto", num_blocks=64,
                                     load_cache_dir=cache_dir and str(cache_dir)))
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in ("What is the capital of France?", "Count to five.")]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    return [o.token_ids for o in outs], engine.runner.startup["load cache"]


def test_eviction_keeps_the_most_recently_used(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    import baton.model.load_cache as model_cache

    monkeypatch.setattr(model_cache, "KEEP_MODEL_BYTES", 1)  # the newest file only
    load_with_cache(tiny, "float32", "cpu", "none", tmp_path)
    load_with_cache(tiny, "float32", "cpu", "auto", tmp_path)
    assert len(list(tmp_path.glob("model-*.pt"))) == 1
    assert load_with_cache(tiny, "float32", "cpu", "auto", tmp_path)[1] == "hit"
    assert load_with_cache(tiny, "float32", "cpu", "none", tmp_path)[1] == "miss"


def test_eviction_counts_bytes_so_small_files_keep_a_large_one(tmp_path: Path) -> None:
    """The budget is bytes: small newer files do not push out an older large one that fits
    (the suite's tiny checkpoints once evicted the default model's 540 MB files every run)."""
    import os
    import time

    from baton.load_cache import evict

    for i, (name, size) in enumerate([("big", 600), ("a", 10), ("b", 10), ("c", 10),
                                      ("d", 10), ("e", 500)]):
        f = tmp_path / f"model-{name}.pt"
        f.write_bytes(b"x" * size)
        os.utime(f, (time.time() - 100 + i, time.time() - 100 + i))
    evict(tmp_path, "model-*.pt", keep_bytes=1200)
    assert sorted(f.name for f in tmp_path.glob("model-*.pt")) == [
        "model-a.pt", "model-b.pt", "model-big.pt", "model-c.pt", "model-d.pt", "model-e.pt"]
    evict(tmp_path, "model-*.pt", keep_bytes=600)  # e (500) and d, c, b, a fit; big does not
    assert not (tmp_path / "model-big.pt").exists() and (tmp_path / "model-a.pt").exists()
    evict(tmp_path, "model-*.pt", keep_bytes=1)  # the newest stays whatever its size
    assert [f.name for f in tmp_path.glob("model-*.pt")] == ["model-e.pt"]


def test_engines_that_miss_together_parse_once(tiny: Path, tmp_path: Path) -> None:
    """Two loads of one model that miss at once: the second waits on the first's lock and
    reads the file it wrote (a fleet starting parses the model once, not once an engine)."""
    import threading

    from baton.load_cache import miss_lock

    results = []
    probe = tmp_path / "probe.pt"
    with miss_lock(probe):  # the lock is exclusive: a second holder waits for the first
        waiter = threading.Thread(target=lambda: results.append(_locked_after(probe)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()
    waiter.join(10)
    assert results == [True]
    outcomes = []
    threads = [threading.Thread(target=lambda: outcomes.append(
        load_with_cache(tiny, "float32", "cpu", "none", tmp_path)[1])) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(outcomes) == ["hit", "miss"]


def _locked_after(file: Path) -> bool:
    from baton.load_cache import miss_lock

    with miss_lock(file):
        return True


def _tiny_hf_folder(folder: Path, tiny_gguf: Path) -> Path:
    """A random 2-layer Llama as an HF folder (config.json, safetensors, tokenizer.json)."""
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    tok = load_model(tiny_gguf, device="cpu").tokenizer
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    h, f, vocab = 64, 128, tok.vocab_size
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": f,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": vocab, "max_position_embeddings": 256, "tie_word_embeddings": False}))
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g) * 0.2,
         "lm_head.weight": torch.randn(vocab, h, generator=g) * 0.2,
         "model.norm.weight": torch.ones(h)}
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (32, h), "self_attn.v_proj": (32, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h),
              "mlp.down_proj": (h, f)}
    for i in range(2):
        w[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(h)
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.2
    save_file(w, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_hf_folder_cached_load_is_the_fresh_load(tiny: Path, tmp_path: Path,
                                                  quantization: str) -> None:
    folder = _tiny_hf_folder(tmp_path / "hf", tiny)
    fresh = load_model(folder, device="cpu", quantization=quantization)
    assert load_with_cache(folder, "float32", "cpu", quantization, tmp_path / "c")[1] == "miss"
    cached, outcome = load_with_cache(folder, "float32", "cpu", quantization, tmp_path / "c")
    assert outcome == "hit" and cached.config == fresh.config
    want, got = _tensors(fresh.model), _tensors(cached.model)
    assert want.keys() == got.keys() and all(torch.equal(got[k], t) for k, t in want.items())
    want_ids, _ = _greedy(folder, quantization, None)
    assert _greedy(folder, quantization, tmp_path / "c") == (want_ids, "hit")


def test_a_copy_of_the_same_file_hits_and_names_itself(tiny: Path, tmp_path: Path) -> None:
    """Another checkout's copy of the same file (same name, size, mtime, bytes) shares the cache
    file; the loaded model names the file it was asked for."""
    import shutil

    load_with_cache(tiny, "float32", "cpu", "auto", tmp_path / "c")
    (tmp_path / "elsewhere").mkdir()
    copy = Path(shutil.copy2(tiny, tmp_path / "elsewhere" / tiny.name))
    for asked in (copy, copy.parent):  # a folder holding just that file: the same files
        loaded, outcome = load_with_cache(asked, "float32", "cpu", "auto", tmp_path / "c")
        assert outcome == "hit" and loaded.path == str(copy)
