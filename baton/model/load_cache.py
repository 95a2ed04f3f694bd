"""The load cache's model half: `load_model` through a cache file (see baton/load_cache.py for
the key, the checksums and the writing).

A miss runs the real loader (`baton/model/loader.py`) and writes what it produced: every
parameter and buffer of the model, every quantized weight's blocks and dense copy, as stored
(shared tensors once, e.g. a tied head's dense copy and the embedding), the model config and
the tokenizer's serialized form. A hit maps that file (`torch.load(mmap=True)`: the pages come
from the page cache, shared by the engines of a host), checks it, and rebuilds the model on the
meta device with the mapped tensors as its weights: no GGUF parsing, no dequantization.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from baton.load_cache import (
    KEEP_MODEL_BYTES,
    atomic_write,
    bulk_checksum,
    checksum,
    evict,
    key_digest,
    make_key,
    miss_lock,
    save_tokenizer,
    tokenizer_from_state,
    tokenizer_state,
    touch,
)
from baton.model.config import ModelConfig, resolve_dtype
from baton.model.loader import LoadedModel, default_device, load_model
from baton.model.quant import QuantizedWeight, arrange_tiles, kernels
from baton.model_files import default_model_path

logger = logging.getLogger(__name__)


class CacheMiss(Exception):
    """The cache file cannot be used; the message says why."""


def load_model_cached(path: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32",
                      device: str | torch.device | None = None, quantization: str = "none",
                      cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """`load_model` through the cache in `cache_dir` (None: no cache, the loader itself)."""
    return load_with_cache(path, dtype, device, quantization, cache_dir)[0]


def load_with_cache(path: str | os.PathLike | None, dtype: str | torch.dtype,
                    device: str | torch.device | None, quantization: str,
                    cache_dir: str | os.PathLike | None) -> tuple[LoadedModel, str]:
    """`load_model_cached`, and what the cache did: "off", "hit", "miss" (written), "bad"
    (a file not used, rebuilt)."""
    if cache_dir is None:
        return load_model(path, dtype, device, quantization), "off"
    dtype_name = str(resolve_dtype(dtype)).removeprefix("torch.")
    dev = torch.device(device) if device is not None else default_device()
    try:
        key = make_key(path, kind="model", dtype=dtype_name, quantization=quantization)
    except OSError:  # no such model: the loader says so in its own words
        return load_model(path, dtype, device, quantization), "off"
    file = Path(cache_dir) / f"model-{key_digest(key)}.pt"
    found = _restore(file, key, dev, path)
    if isinstance(found, LoadedModel):
        return found, "hit"
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # save says so below
    with miss_lock(file):
        if found == "miss":  # another engine may have built it while this one waited
            again = _restore(file, key, dev, path)
            if isinstance(again, LoadedModel):
                return again, "hit"
        return _build(file, key, path, dtype, device, quantization, cache_dir), found


def _restore(file: Path, key: dict, dev: torch.device, path) -> LoadedModel | str:
    """The cached model, else "miss" (no file) or "bad" (a file not used)."""
    if not file.exists():
        return "miss"
    t0 = time.perf_counter()
    try:
        loaded = restore(file, key, dev, _read_path(path))
    except CacheMiss as e:
        logger.warning("load cache: %s not used (%s): rebuilding it", file, e)
        return "bad"
    touch(file)
    logger.info("load cache: hit %s (%.2f s)", file, time.perf_counter() - t0)
    return loaded


def _build(file: Path, key: dict, path, dtype, device, quantization: str,
           cache_dir) -> LoadedModel:
    loaded = load_model(path, dtype, device, quantization)
    t0 = time.perf_counter()
    try:
        save(file, key, loaded)
        evict(cache_dir, "model-*.pt", keep_bytes=KEEP_MODEL_BYTES)
        save_tokenizer(cache_dir, path, loaded.tokenizer, loaded.config.max_position)
        logger.info("load cache: wrote %s (%.2f s)", file, time.perf_counter() - t0)
    except OSError as e:
        logger.warning("load cache: cannot write %s: %s", file, e)
    return loaded


# ---------------------------------------------------------------- write


def _entries(model: nn.Module) -> tuple[list[list], dict[str, torch.Tensor]]:
    """Where each tensor goes in the model (a list of JSON-able entries) and the tensors by
    name, each storage once."""
    tensors: dict[str, torch.Tensor] = {}
    names: dict[tuple, str] = {}

    def name_of(t: torch.Tensor) -> str:
        t = t.detach()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                 tuple(t.stride()), t.dtype)
        if ident not in names:
            names[ident] = f"t{len(tensors)}"
            tensors[names[ident]] = t.cpu().contiguous()
        return names[ident]

    def quant_entry(q: QuantizedWeight) -> list:
        return [q.kind, list(q.shape), name_of(q.blocks), name_of(q.dense)]

    entries = []
    for mod_name, mod in model.named_modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                entries.append(["param", mod_name, attr, name_of(p)])
        for attr, b in mod._buffers.items():
            if b is not None:
                entries.append(["buffer", mod_name, attr, name_of(b)])
        for attr, v in vars(mod).items():
            if isinstance(v, QuantizedWeight):
                entries.append(["quant", mod_name, attr, *quant_entry(v)])
            elif isinstance(v, list) and v and all(isinstance(q, QuantizedWeight) for q in v):
                entries.append(["quants", mod_name, attr, [quant_entry(q) for q in v]])  # experts
    return entries, tensors


def _tensor_sum(t: torch.Tensor) -> str:
    return bulk_checksum(t.reshape(-1).view(torch.uint8).numpy())


def save(file: Path, key: dict, loaded: LoadedModel) -> None:
    entries, tensors = _entries(loaded.model)
    config = dataclasses.asdict(loaded.config)
    config["dtype"] = str(loaded.config.dtype).removeprefix("torch.")
    cls = type(loaded.model)
    meta = json.dumps({
        "key": key, "entries": entries, "config": config, "path": loaded.path,
        "quantization": loaded.quantization, "model_class": f"{cls.__module__}:{cls.__qualname__}",
        "tokenizer": tokenizer_state(loaded.tokenizer),
        "sums": {name: _tensor_sum(t) for name, t in tensors.items()},
    }, sort_keys=True)
    doc = {"meta": meta, "meta_sum": checksum(meta.encode()), "tensors": tensors}
    atomic_write(file, lambda f: torch.save(doc, f))


# ---------------------------------------------------------------- read


def _read(file: Path, key: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        doc = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
        meta_text = doc["meta"]
        if checksum(meta_text.encode()) != doc["meta_sum"]:
            raise CacheMiss("its metadata does not match its checksum")
        meta, tensors = json.loads(meta_text), doc["tensors"]
    except CacheMiss:
        raise
    except Exception as e:  # torch.load raises many types on a truncated or garbled file
        raise CacheMiss(f"unreadable: {type(e).__name__}: {e}") from None
    if meta.get("key") != key:
        raise CacheMiss("another key inside it")
    if set(tensors) != set(meta["sums"]):
        raise CacheMiss("its tensors are not the ones its metadata lists")
    for name, t in tensors.items():
        if _tensor_sum(t) != meta["sums"][name]:
            raise CacheMiss(f"tensor {name} does not match its checksum")
    return meta, tensors


def _place(model: nn.Module, entry: list, tensors: dict[str, torch.Tensor],
           device: torch.device) -> None:
    kind, mod_name, attr = entry[:3]
    mod = model.get_submodule(mod_name)
    if kind == "param":
        mod._parameters[attr] = nn.Parameter(tensors[entry[3]].to(device), requires_grad=False)
    elif kind == "buffer":
        mod._buffers[attr] = tensors[entry[3]].to(device)
    elif kind in ("quant", "quants"):
        if attr in mod._parameters:
            delattr(mod, attr)  # a Parameter slot refuses a non-Parameter value

        def quant(qkind: str, shape: list, blocks: str, dense: str) -> QuantizedWeight:
            return QuantizedWeight(qkind, tensors[blocks], tensors[dense], tuple(shape))
        setattr(mod, attr, quant(*entry[3:]) if kind == "quant" else
                [quant(*e) for e in entry[3]])
    else:
        raise CacheMiss(f"unknown entry kind {kind!r}")


def _read_path(path: str | os.PathLike | None) -> str:
    """The file or folder the loader reads for `path` (`LoadedModel.path`): a cache file may
    have been written by a load of the same bytes elsewhere (another checkout's copy)."""
    p = Path(path) if path is not None else Path(default_model_path())
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(p.glob("*.gguf"))
        return str(found[0]) if len(found) == 1 else str(p)
    return str(p)


def restore(file: Path, key: dict, device: torch.device, path: str | None = None) -> LoadedModel:
    """The model in `file` (whose key must be `key`) on `device`; `path` is the `LoadedModel`'s
    (default: the one the file was written from). CacheMiss when it cannot be used."""
    meta, tensors = _read(file, key)
    if path is not None:
        meta["path"] = path
    try:
        config = ModelConfig(**{**meta["config"], "eos_token_ids": tuple(
            meta["config"]["eos_token_ids"])})
        module_name, qualname = meta["model_class"].split(":")
        cls = getattr(importlib.import_module(module_name), qualname)
        with torch.device("meta"):
            model = cls(config)
        if any(e[0] in ("quant", "quants") for e in meta["entries"]):
            kernels()  # the ops QuantizedWeight.matmul calls
        for entry in meta["entries"]:
            _place(model, entry, tensors, device)
        tokenizer = tokenizer_from_state(meta["tokenizer"])
    except CacheMiss:
        raise
    except Exception as e:  # a field the code no longer has, a class moved, a bad value
        raise CacheMiss(f"does not restore: {type(e).__name__}: {e}") from None
    for mod_name, mod in model.named_modules():
        for attr, v in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False),
                        *vars(mod).items()]:
            if isinstance(v, torch.Tensor) and v.is_meta:
                raise CacheMiss(f"{mod_name}.{attr} is not in the cache file")
    model.eval()
    arrange_tiles(model)
    logger.info("loaded %s from the load cache: %d layers, hidden %d, vocab %d, %s on %s, %s",
                meta["path"], config.num_layers, config.hidden_size, config.vocab_size,
                config.dtype, device, meta["quantization"])
    return LoadedModel(model, config, tokenizer, meta["path"], meta["quantization"])
