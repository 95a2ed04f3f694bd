"""The names of the runtime's modes (torch-free: configs check them without loading torch)."""

from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Weight-only quantization modes (baton/model/quant.py); auto picks one from the file.
QUANTIZATIONS = ("none", "int8", "int4")
QUANTIZATION_REQUESTS = (*QUANTIZATIONS, "auto")
# The KV pool's element type, independent of the weights' (auto = the compute dtype).
KV_CACHE_DTYPES = ("auto", *DTYPES)


def check_dtype_name(dtype: str) -> str:
    """The canonical dtype name; ValueError naming the choices otherwise."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return name


def check_quantization(quantization: str) -> None:
    """ValueError unless `quantization` is a mode or auto."""
    if quantization not in QUANTIZATION_REQUESTS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_REQUESTS)}, "
                         f"got {quantization!r}")


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The canonical KV cache dtype name (auto or a dtype); ValueError naming the choices."""
    name = DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected one of "
                         f"{list(KV_CACHE_DTYPES)}")
    return name

