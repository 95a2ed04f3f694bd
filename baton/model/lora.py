"""LoRA adapters (PEFT's folder format) served unmerged beside the base model, several in one
batch.

An adapter is a folder holding `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules) and `adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `lora_B.weight` [out, r] per target). For a token of a request served by adapter
`a`, each targeted projection computes what PEFT computes without merging:

    y = base(x) + scale * B_a (A_a x),   scale = alpha / r   (alpha / sqrt(r) with rslora)

Baton's layers hold fused projections (q|k|v, gate|up): an adapter's q, k and v deltas land in
their rows of the fused output. The base GEMM runs once over the whole batch, as without
adapters; then, per adapter in the step, the rows of its tokens get their delta, computed in
fp32 and added in fp32 on top of whatever produced the base output (the float GEMM in the
exact mode, the block kernels in int8/int4). Rows of the base model get nothing added: their
numbers are those of a step without adapters. Hooks are set on the layers for a step that
has adapter rows only (`LoraSet.begin_step`), so a base-only step runs the plain path.

Targets: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (and Phi-3's fused
qkv_proj, gate_up_proj) of the dense layers. Anything else (embeddings, lm_head, experts,
DoRA, biases, modules_to_save, per-module rank or alpha patterns) is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton.model.config import ModelConfig

logger = logging.getLogger(__name__)

MAX_LORA_RANK = 256  # a larger rank is a fine-tune, not an adapter to batch beside others
MAX_LORA_NAME_CHARS = 128
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module name -> (Baton's fused parameter, which of its parts)
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
TARGETS = (*(p for parts in _FUSED_PARTS.values() for p in parts), "qkv_proj", "gate_up_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])\.weight")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and why."""


@dataclass
class FusedDelta:
    """One adapter's delta on one fused projection of one layer: the parts' A stacked, and
    per part its rows of the output, its columns of `A x` and its B (scale folded in)."""

    a: torch.Tensor  # fp32 [sum of the parts' r, in]
    parts: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    alpha: float
    scale: float
    adapter_id: str  # digest of the config and weights: what enters the block-key seed
    target_modules: tuple[str, ...]
    deltas: dict[tuple[int, str], FusedDelta]  # (layer, fused parameter) -> delta


def check_name(name: str) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME_CHARS \
            or not _NAME.fullmatch(name):
        raise LoraError(f"LoRA adapter name {name!r} must be 1-{MAX_LORA_NAME_CHARS} letters, "
                        "digits or ._:/@+- (starting with a letter or digit)")
    return name


def _fused_rows(config: ModelConfig) -> dict[str, tuple[str, int, int, int]]:
    """PEFT module -> (fused parameter, first output row, rows, input features)."""
    c = config
    q, kv, hidden, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
        c.hidden_size, c.intermediate_size
    return {"q_proj": ("qkv_proj", 0, q, hidden), "k_proj": ("qkv_proj", q, kv, hidden),
            "v_proj": ("qkv_proj", q + kv, kv, hidden),
            "qkv_proj": ("qkv_proj", 0, q + 2 * kv, hidden),
            "o_proj": ("o_proj", 0, hidden, q),
            "gate_proj": ("gate_up_proj", 0, inter, hidden),
            "up_proj": ("gate_up_proj", inter, inter, hidden),
            "gate_up_proj": ("gate_up_proj", 0, 2 * inter, hidden),
            "down_proj": ("down_proj", 0, hidden, inter)}


def _read_config(name: str, folder: Path) -> dict:
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except OSError as e:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {folder / CONFIG_FILE}: "
                        f"{e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {raw.get('peft_type')!r}, only LORA")
    refused = [(key, why) for key, why in (
        ("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"),
        ("modules_to_save", "modules_to_save (fully trained modules)"),
        ("rank_pattern", "a per-module rank_pattern"), ("alpha_pattern", "an alpha_pattern"),
        ("layers_to_transform", "layers_to_transform"))
        if raw.get(key)]
    if raw.get("bias", "none") != "none":
        refused.append(("bias", f"bias={raw['bias']!r} (trained biases)"))
    if refused:
        raise LoraError(f"LoRA adapter {name!r}: {refused[0][1]} is not supported "
                        f"({CONFIG_FILE} field {refused[0][0]!r})")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 0 < r <= MAX_LORA_RANK:
        raise LoraError(f"LoRA adapter {name!r}: rank r={r!r}, expected an integer in "
                        f"[1, {MAX_LORA_RANK}]")
    alpha = raw.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or \
            not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha={alpha!r} is not a number")
    return raw


def read_adapter(name: str, path: str | Path, config: ModelConfig,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """Read and check a PEFT LoRA folder against the model `config`; LoraError naming the
    adapter and the first thing that does not fit (a shape, the rank, a target)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_name(name)
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {folder} is not a folder")
    raw = _read_config(name, folder)
    r, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
    scale = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    weights_path = folder / WEIGHTS_FILE
    try:
        data = weights_path.read_bytes()
        tensors = load_file(str(weights_path))
    except OSError as e:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {weights_path}: "
                        f"{e.strerror or e}") from None
    except SafetensorError as e:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not safetensors: {e}") from None
    pairs = _pair_tensors(name, tensors, config)
    deltas = _fuse(name, pairs, r, scale, config, torch.device(device))
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps({"r": r, "alpha": alpha, "scale": scale}).encode())
    digest.update(data)
    targets = tuple(sorted({module for _, module in pairs}))
    logger.info("LoRA adapter %s from %s: rank %d, alpha %g, scale %g, targets %s, %d layers",
                name, folder, r, alpha, scale, ",".join(targets), len({i for i, _ in pairs}))
    return LoraAdapter(name, str(folder), r, alpha, scale, digest.hexdigest(), targets, deltas)


def _pair_tensors(name: str, tensors: dict[str, torch.Tensor], config: ModelConfig,
                  ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, PEFT module) -> {"A": tensor, "B": tensor}; LoraError on a tensor Baton does not
    serve (another module, a layer the model lacks, an expert, a half pair)."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.fullmatch(key)
        if m is None or m.group(3) not in TARGETS or \
                (m.group(2) == "mlp") != (m.group(3) in _MLP):
            raise LoraError(f"LoRA adapter {name!r}: tensor {key} targets a module adapters are "
                            f"not served on (supported: {', '.join(TARGETS)} of each layer)")
        layer, module = int(m.group(1)), m.group(3)
        if layer >= config.num_layers:
            raise LoraError(f"LoRA adapter {name!r}: tensor {key} is for layer {layer}; the "
                            f"model has {config.num_layers} layers")
        if module in _MLP and config.is_sparse(layer):
            raise LoraError(f"LoRA adapter {name!r}: tensor {key}: layer {layer}'s MLP is a "
                            "mixture of experts; adapters on experts are not supported")
        pairs.setdefault((layer, module), {})[m.group(4)] = tensor
    for (layer, module), pair in pairs.items():
        if len(pair) != 2:
            raise LoraError(f"LoRA adapter {name!r}: layers.{layer}.{module} has lora_"
                            f"{''.join(pair)} but not lora_{'B' if 'A' in pair else 'A'}")
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return pairs


def _fuse(name: str, pairs: dict[tuple[int, str], dict[str, torch.Tensor]], r: int,
          scale: float, config: ModelConfig, device: torch.device,
          ) -> dict[tuple[int, str], FusedDelta]:
    rows = _fused_rows(config)
    what = {"hidden": config.hidden_size, "q": config.num_heads * config.head_dim,
            "inter": config.intermediate_size}
    by_param: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        param, first, num_rows, num_in = rows[module]
        a, b = pair["A"], pair["B"]
        block = "mlp" if module in _MLP else "self_attn"
        prefix = f"LoRA adapter {name!r}: layers.{layer}.{block}.{module}"
        if a.ndim == 2 and b.ndim == 2 and a.shape[1] == num_in and b.shape[0] == num_rows \
                and (a.shape[0], b.shape[1]) != (r, r):
            raise LoraError(f"{prefix} has rank {a.shape[0]} (lora_A {tuple(a.shape)}, lora_B "
                            f"{tuple(b.shape)}); {CONFIG_FILE} says r={r}")
        if tuple(a.shape) != (r, num_in):
            raise LoraError(f"{prefix}.lora_A has shape {tuple(a.shape)}, expected ({r}, "
                            f"{num_in}): rank r={r} and the model's input features {num_in} "
                            f"(hidden size {what['hidden']}, attention width {what['q']}, "
                            f"intermediate size {what['inter']})")
        if tuple(b.shape) != (num_rows, r):
            raise LoraError(f"{prefix}.lora_B has shape {tuple(b.shape)}, expected "
                            f"({num_rows}, {r}): the model's output features {num_rows} and "
                            f"rank r={r}")
        by_param.setdefault((layer, param), []).append((module, a, b))
    deltas = {}
    for (layer, param), parts in by_param.items():
        modules = [m for m, _, _ in parts]
        if param in modules and len(modules) > 1:
            raise LoraError(f"LoRA adapter {name!r}: layers.{layer} targets {param} and its "
                            f"parts {sorted(m for m in modules if m != param)} at once")
        delta = FusedDelta(torch.cat([a for _, a, _ in parts]).to(device, torch.float32))
        for i, (module, _, b) in enumerate(parts):
            _, first, num_rows, _ = rows[module]
            delta.parts.append((first, first + num_rows, i * r, (i + 1) * r,
                                (b.to(torch.float32) * scale).to(device)))
        deltas[(layer, param)] = delta
    return deltas


class LayerLora:
    """The hook a layer calls after each projection while a step has adapter rows."""

    def __init__(self, index: int, step: StepLora) -> None:
        self.index = index
        self.step = step

    def __call__(self, out: torch.Tensor, x: torch.Tensor, param: str) -> torch.Tensor:
        delta = None
        for adapter, rows in self.step.groups:
            fused = adapter.deltas.get((self.index, param))
            if fused is None:
                continue
            xa = x[rows].float() @ fused.a.T
            if delta is None:
                delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
            for first, end, r0, r1, b in fused.parts:
                delta[rows, first:end] += xa[:, r0:r1] @ b.T
        if delta is None:
            return out
        return (out.float() + delta).to(out.dtype)


@dataclass
class StepLora:
    """The current step's tokens of each adapter in it (flat token indices)."""

    groups: list[tuple[LoraAdapter, torch.Tensor]] = field(default_factory=list)


class LoraSet:
    """The adapters loaded on one model, and the per-step hooks that apply them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.adapters: dict[str, LoraAdapter] = {}
        self._step = StepLora()
        self._hooks = [LayerLora(i, self._step) for i in range(len(model.layers))]

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read, check and add an adapter; LoraError when the name is taken or it does not
        fit the model."""
        check_name(name)
        if name in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded (from "
                            f"{self.adapters[name].path}); unload it first")
        adapter = read_adapter(name, path, self.config, self.model.device)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is not loaded (loaded: "
                            f"{sorted(self.adapters) or 'none'})")
        del self.adapters[name]

    def ids(self) -> dict[str, str]:
        """Adapter name -> its id (the digest that keys its KV blocks)."""
        return {name: a.adapter_id for name, a in self.adapters.items()}

    def begin_step(self, row_adapters: Sequence[str], seqlens_q: Sequence[int]) -> bool:
        """Group the flat batch's tokens by their row's adapter ("" = the base) and hook the
        layers; False (nothing hooked) when every row is the base's."""
        by_name: dict[str, list[int]] = {}
        start = 0
        for name, q in zip(row_adapters, seqlens_q, strict=True):
            q = int(q)
            if name:
                by_name.setdefault(name, []).extend(range(start, start + q))
            start += q
        if not by_name:
            return False
        device = self.model.device
        self._step.groups = [(self.adapters[name], torch.tensor(rows, device=device))
                             for name, rows in by_name.items()]
        for layer, hook in zip(self.model.layers, self._hooks, strict=True):
            layer.lora = hook
        return True

    def end_step(self) -> None:
        for layer in self.model.layers:
            layer.lora = None
        self._step.groups = []
