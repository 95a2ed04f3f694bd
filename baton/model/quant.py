"""Weight-only quantization in GGUF's own block formats, multiplied by baton's kernels
(`csrc/kernels/qkernels.cpp`, torch ops `torch.ops.baton_q.*`), as llama.cpp's CPU backend does:

    int4: every layer weight in Q4_1 (or Q4_0) blocks: 32 4-bit codes, fp16 scale (and offset)
    int8: every layer weight in Q8_0 blocks: 32 int8 codes, fp16 scale
    both: the vocabulary projection in Q8_0 blocks

A layer weight is each of a layer's four fused projections (q|k|v, o, gate|up, down; Phi-3's
fused tensors as stored) of every family, and each expert's gate|up and down of a sparse layer
(one block weight per expert, the router in floats).

A GGUF file's Q4_0 / Q4_1 / Q8_0 tensors are kept as the bytes it stores: nothing is rounded a
second time (their dequantized values are exactly the exact mode's weights). Any other tensor
(F32, F16, Q6_K, ...; every tensor of a safetensors checkpoint) is quantized from its float
values by gguf-py's reference quantizers, the ones that wrote the file. The few-row kernels
quantize the activations per 32 values to int16 codes and a float scale (ggml's q8_1 with 16-bit
codes: its 8-bit ones gave 97.2% teacher-forced top-1 agreement with the exact mode, under the
98% gate) and accumulate exact integer dot products; they run on any x86-64 CPU, through the
fastest path it and its OS allow (`kernel_path`: AVX-512 VNNI over weights tiled at load, AVX2,
or the portable scalar one; every path gives the same bits). Decode rows run through them, prefill rows through `dense`, the same weights
dequantized to the model's dtype, so prefill keeps the float GEMMs' speed; the backend chooses
by the kind of row, never by the step's size (`CPUBackend.linear`), so that a decode token's
numbers do not depend on what else its step holds. Activations, norms, attention and KV stay in the model's dtype.

int8 refuses a file whose layer weights are 4-bit: Q8_0 from those values re-rounds every
weight, at twice int4's bytes. A fused projection (q|k|v, gate|up) takes one block kind: a part
in Q4_0 next to a Q4_1 part is rewritten as Q4_1 (offset -8 d, exact in fp16).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from baton.model.modes import QUANTIZATION_REQUESTS, QUANTIZATIONS, check_quantization  # noqa: F401

logger = logging.getLogger(__name__)

# What a caller may ask for: a mode, or "auto": the file's own layer format where the kernels
# read it as stored (Q4_0 / Q4_1 layers: int4), else none (`resolve_auto`).
REQUESTS = QUANTIZATION_REQUESTS
BLOCK_SIZE = 32  # values per GGUF block
BLOCK_KINDS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}  # kind -> (kernel id, bytes)
_LAYER_KIND = {"int4": ("Q4_1", "Q4_0"), "int8": ("Q8_0",)}  # mode -> block kinds kept as stored
HEAD_KIND = "Q8_0"


def resolve_auto(layer_kinds: set[str], kernels_run: bool) -> str:
    """auto's mode for a checkpoint whose layer weights are stored as `layer_kinds` (GGUF tensor
    type names): int4 when every one is Q4_0 / Q4_1 and the kernels can run (`kernels_run`: a
    CPU and fp32, the dtype of the quantized modes' fused ops), since that mode multiplies
    exactly the blocks the file holds; none for float checkpoints and everywhere else."""
    return "int4" if kernels_run and layer_kinds and layer_kinds <= set(_LAYER_KIND["int4"]) \
        else "none"


_OPS = None
KERNEL_PATH_ENV = "BATON_QKERNELS"  # scalar | avx2 | avx512 | auto: the path new weights take


def kernels():
    """`torch.ops.baton_q`, registered by importing the compiled module."""
    global _OPS
    if _OPS is None:
        try:
            import baton._qkernels  # noqa: F401  (registers the ops)
        except ImportError as e:
            raise RuntimeError(f"baton's quantized kernels are not built ({e}): run `make install`"
                               ) from None
        _OPS = torch.ops.baton_q
    return _OPS


def kernel_path() -> str:
    """The kernel path a `QuantizedWeight` made now multiplies through: $BATON_QKERNELS when it
    names one (auto or unset: the fastest this CPU and OS run)."""
    name = os.environ.get(KERNEL_PATH_ENV, "auto") or "auto"
    if name == "auto":
        return kernels().kernel_path()
    if name not in kernels().kernel_paths():
        raise ValueError(f"{KERNEL_PATH_ENV}={name!r}: this CPU runs the kernel paths "
                         f"{list(kernels().kernel_paths())} (or auto)")
    return name


@dataclass
class Blocks:
    """A 2-D tensor as GGUF blocks: `data` uint8 [N, K / 32 * block bytes], rows in order."""

    kind: str  # a key of BLOCK_KINDS
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise ValueError(f"block kind must be one of {list(BLOCK_KINDS)}, got {self.kind!r}")
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or \
                self.data.shape[1] % BLOCK_KINDS[self.kind][1]:
            raise ValueError(f"{self.kind} blocks must be uint8 [rows, n * "
                             f"{BLOCK_KINDS[self.kind][1]}], got {self.data.dtype} {self.data.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.data.shape
        return n, width // BLOCK_KINDS[self.kind][1] * BLOCK_SIZE

    @staticmethod
    def of_float(w: torch.Tensor | np.ndarray, kind: str) -> Blocks:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        w = np.ascontiguousarray(np.asarray(w, dtype=np.float32))
        if w.ndim != 2 or w.shape[1] % BLOCK_SIZE:
            raise ValueError(f"{kind} needs [rows, k] with k % {BLOCK_SIZE} == 0, got {w.shape}")
        return Blocks(kind, quantize(w, GGMLQuantizationType[kind]).reshape(w.shape[0], -1))

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(self.data, GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(self.shape))

    def rows_permuted(self, perm: np.ndarray) -> Blocks:
        return Blocks(self.kind, self.data[perm])

    def as_q4_1(self) -> Blocks:
        """Q4_0 blocks rewritten as Q4_1 with the same values: d (q - 8) = d q + (-8 d)."""
        if self.kind != "Q4_0":
            raise ValueError(f"only Q4_0 blocks convert to Q4_1, got {self.kind}")
        b = self.data.reshape(-1, 18)
        d = b[:, 0:2].copy().view(np.float16)
        m = (d.astype(np.float32) * -8).astype(np.float16)  # a power of two: exact unless it overflows
        if not np.array_equal(m.astype(np.float32), d.astype(np.float32) * -8):
            raise ValueError("Q4_0 scale too large for a Q4_1 offset (|8 d| > 65504)")
        out = np.concatenate((b[:, 0:2], m.view(np.uint8), b[:, 2:]), axis=1)
        return Blocks("Q4_1", out.reshape(self.data.shape[0], -1))

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        kinds = {p.kind for p in parts}
        if kinds == {"Q4_0", "Q4_1"}:
            parts = [p.as_q4_1() if p.kind == "Q4_0" else p for p in parts]
        elif len(kinds) > 1:
            raise ValueError(f"cannot fuse blocks of kinds {sorted(kinds)}")
        return Blocks(parts[0].kind, np.concatenate([p.data for p in parts]))


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight as GGUF blocks, with its dense copy."""

    kind: str  # a key of BLOCK_KINDS
    blocks: torch.Tensor  # uint8 [N, K / 32 * block bytes]
    dense: torch.Tensor  # [N, K] in the model's dtype: the blocks' values, for many rows
    shape: tuple[int, int]
    path: str = ""  # the kernel path (`kernel_path()` when empty)
    # avx512: the blocks as that path's 16-row tiles (pack_tiles), made at load; `blocks` stays,
    # as the load cache stores it (the file serves every CPU) and the other paths read it.
    tiles: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.path:
            self.path = kernel_path()
        if self.path == "avx512" and self.tiles is None:
            self.tiles = kernels().pack_tiles(self.blocks, BLOCK_KINDS[self.kind][0])

    @staticmethod
    def of(b: Blocks, dtype: torch.dtype, dense: torch.Tensor | None = None) -> QuantizedWeight:
        """`dense`: the blocks' values when the caller holds them already (no second copy)."""
        kernels()  # a missing build fails at load, not at the first step
        return QuantizedWeight(b.kind, torch.from_numpy(np.ascontiguousarray(b.data)),
                               (b.dequantize() if dense is None else dense).to(dtype), b.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` by the block kernel (activations quantized per 32 values), x [M, K]: a row's
        values do not depend on the other rows nor on the threads."""
        if x.dtype == torch.float32 and x.is_contiguous():  # a decode step's usual x: no dispatches
            return self._matmul(x)
        return self._matmul(x.float().contiguous()).to(x.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            return _OPS.qgemm_tiles(x, self.tiles, BLOCK_KINDS[self.kind][0], self.shape[0])
        return _OPS.qgemm_path(x, self.blocks, BLOCK_KINDS[self.kind][0], self.path)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()  # the tiles (avx512) are a second copy of these bytes


_LAYER_WEIGHTS = {  # fused parameter -> the HF tensors it is made of, in row order
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # the untied head, else the tied one


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def _huge_page_bytes(num_bytes: int) -> torch.Tensor:
    """uint8 [num_bytes], 2 MiB aligned, advised to the kernel as huge pages before anything
    touches it (Linux with transparent huge pages on `madvise`; elsewhere plain memory)."""
    raw = torch.empty(num_bytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -(-raw.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(num_bytes // _HUGE_PAGE
                                                                 * _HUGE_PAGE), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no madvise: plain pages, the same bits
            pass
    offset = start - raw.data_ptr()
    return raw[offset:offset + num_bytes]


def arrange_tiles(model: torch.nn.Module) -> None:
    """Move the AVX-512 tiles of every layer's four projections and of the vocabulary
    projection into one buffer, in the order a decode step multiplies them, on huge pages.
    A 1-row decode step streams all of them from memory (96 MB for SmolLM2 in int4): end to
    end, each GEMM's prefetch runs on into the next one's first tiles, and the huge pages spare
    the TLB a miss every 4 KiB (on the 2-core Xeon, one thread: a step's GEMMs 0.79-0.81x the
    time over separate tensors, 0.94-0.97x in one buffer of 4 KiB pages). The same bytes."""
    weights = [getattr(layer, attr, None) for layer in getattr(model, "layers", ())
               for attr in _LAYER_WEIGHTS]
    weights.append(getattr(model, "lm_head", None))
    weights = [w for w in weights if isinstance(w, QuantizedWeight) and w.tiles is not None]
    if not weights:
        return
    sizes = [-(-w.tiles.numel() // 64) * 64 for w in weights]  # each tile run 64-byte aligned
    arena = _huge_page_bytes(sum(sizes))
    offset = 0
    for w, size in zip(weights, sizes, strict=True):
        tiles = arena[offset:offset + w.tiles.numel()].view(w.tiles.shape)
        tiles.copy_(w.tiles)
        w.tiles = tiles
        offset += size


def _replace(module: torch.nn.Module, name: str, weight: QuantizedWeight) -> None:
    delattr(module, name)  # a Parameter slot refuses a non-Parameter value
    setattr(module, name, weight)


def _layer_blocks(name: str, quantization: str, weights: dict[str, torch.Tensor],
                  stored: dict[str, Blocks]) -> Blocks:
    kinds = _LAYER_KIND[quantization]
    b = stored.get(name)
    return b if b is not None and b.kind in kinds else Blocks.of_float(weights[name], kinds[0])


_FUSED_NAMES = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}  # Phi-3's


def _fused_blocks(layer: torch.nn.Module, i: int, attr: str, quantization: str,
                  weights: dict[str, torch.Tensor], stored: dict[str, Blocks],
                  ) -> tuple[Blocks, int, bool]:
    """(blocks, tensors taken as stored, all of it as stored) of `layer.attr`: from its HF parts
    where the checkpoint names them (each part as a GGUF file stores it, else from its floats),
    else from the one fused tensor (Phi-3's qkv_proj, gate_up_proj) or the loaded values (the
    blocks of a row are those of its part: quantizing the fused rows is the same)."""
    names = [f"model.layers.{i}.{p}.weight" for p in _LAYER_WEIGHTS[attr]]
    if all(n in weights or n in stored for n in names):
        blocks = [_layer_blocks(n, quantization, weights, stored) for n in names]
        as_stored = [b is stored.get(n) for b, n in zip(blocks, names, strict=True)]
        return Blocks.cat(blocks), sum(as_stored), all(as_stored)
    b = stored.get(f"model.layers.{i}.{_FUSED_NAMES.get(attr, '?')}.weight")
    if b is not None and b.kind in _LAYER_KIND[quantization]:
        return b, 1, True
    return Blocks.of_float(getattr(layer, attr).data, _LAYER_KIND[quantization][0]), 0, False


def _quantize_experts(moe: torch.nn.Module, quantization: str, dtype: torch.dtype) -> int:
    """A sparse layer's expert weights -> one QuantizedWeight per expert (the router stays in
    floats: a few rows); the bytes they take."""
    kind = _LAYER_KIND[quantization][0]
    nbytes = 0
    for attr in ("gate_up", "down"):
        experts = [QuantizedWeight.of(Blocks.of_float(w, kind), dtype) for w in getattr(moe, attr)]
        nbytes += sum(q.nbytes for q in experts)
        _replace(moe, attr, experts)
    return nbytes


def quantize_model(model: torch.nn.Module, quantization: str,
                   weights: dict[str, torch.Tensor], stored: dict[str, Blocks]) -> None:
    """Replace every layer's projections, its experts (a sparse layer) and the vocabulary
    projection of a loaded `DecoderModel` by block weights. `weights`: the checkpoint's
    HF-named float tensors; `stored`: HF name -> the blocks a GGUF file stores, taken in place
    of quantizing the float values again."""
    if quantization == "none":
        return
    dtype = model.config.dtype
    float_bytes = quant_bytes = 0
    kept = 0
    for i, layer in enumerate(model.layers):
        if getattr(layer, "moe", None) is not None:
            float_bytes += sum(p.numel() * 4 for p in (layer.moe.gate_up, layer.moe.down))
            quant_bytes += _quantize_experts(layer.moe, quantization, dtype)
        for attr in _LAYER_WEIGHTS:
            if not hasattr(layer, attr):
                continue  # a sparse layer has no dense MLP
            blocks, num_stored, is_stored = _fused_blocks(layer, i, attr, quantization, weights,
                                                          stored)
            kept += num_stored
            float_bytes += getattr(layer, attr).numel() * 4
            # All parts as stored: the layer's float weight holds the blocks' values already.
            dense = getattr(layer, attr).data if is_stored else None
            q = QuantizedWeight.of(blocks, dtype, dense)
            quant_bytes += q.nbytes
            _replace(layer, attr, q)
    head_name = HEAD_NAMES[0] if model.lm_head is not None else HEAD_NAMES[1]
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    b = stored.get(head_name)
    is_stored = b is not None and b.kind == HEAD_KIND
    q = QuantizedWeight.of(b if is_stored else Blocks.of_float(weights[head_name], HEAD_KIND), dtype,
                           head.data if is_stored else None)
    _replace(model, "lm_head", q)
    arrange_tiles(model)
    logger.info("quantized %s: layer weights %.0f MiB (fp32 %.0f MiB), %d tensors as stored; "
                "vocabulary projection %s %s; kernel path %s", quantization, quant_bytes / 2**20,
                float_bytes / 2**20, kept, HEAD_KIND, "as stored" if is_stored else "from float",
                q.path)
