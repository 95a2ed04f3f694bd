"""A tiny seeded random Llama (written by transformers) and random PEFT LoRA adapters (written by
`peft`, nonzero B: an adapter that changes nothing would prove nothing), shared by the LoRA
tests (tests/model/test_lora.py, tests/router/test_lora_e2e.py) through the session fixture
`lora_folders` (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model.test_families import _write

ADAPTERS = {  # name -> LoraConfig keywords: every target, and a subset with rsLoRA
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"]),
    "beta": dict(r=8, lora_alpha=4, use_rslora=True,
                 target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
}


def write_adapter(base: Path, folder: Path, seed: int, **lora) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # B starts at zero: the adapter would be the base
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)


def write_lora_folders(root: Path) -> dict[str, Path]:
    """base (the tiny Llama), alpha and beta (its adapters), narrow (an adapter of another
    base, hidden size 32 where the tiny Llama's is 64)."""
    _write(root / "base", "LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False)
    for i, (name, lora) in enumerate(ADAPTERS.items()):
        write_adapter(root / "base", root / name, seed=11 + i, **lora)
    _write(root / "narrow_base", "LlamaConfig", "LlamaForCausalLM", hidden_size=32,
           tie_word_embeddings=False)
    write_adapter(root / "narrow_base", root / "narrow", seed=3, r=4, target_modules=["q_proj"])
    return {name: root / name for name in ("base", *ADAPTERS, "narrow")}
