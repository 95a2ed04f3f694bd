"""The block kernels (`csrc/kernels/qkernels.cpp`): every path that runs on this machine (AVX-512,
AVX2; `kernel_paths`) equals the portable scalar path bit for bit, all compute exact integer dot
products of the stored codes with the activations' int16 codes, and a row's value depends
neither on the other rows of the batch (which tile shape computed it: AVX2's 8x1, 4x2, 2x4 or
1x8, AVX-512's 1..8 rows x 16 columns) nor on the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.model.quant import (
    BLOCK_KINDS,
    KERNEL_PATH_ENV,
    Blocks,
    QuantizedWeight,
    kernel_path,
    kernels,
)

KINDS = tuple(BLOCK_KINDS)
PATHS = tuple(kernels().kernel_paths())  # scalar first, then what this CPU and OS run


def _case(kind: str, n: int, k: int, m: int, seed: int) -> tuple[Blocks, torch.Tensor]:
    g = np.random.default_rng(seed)
    w = g.standard_normal((n, k)).astype(np.float32) * g.uniform(0.01, 3, (n, 1)).astype(np.float32)
    x = torch.from_numpy(g.standard_normal((m, k)).astype(np.float32) * 4)
    return Blocks.of_float(w, kind), x


def _reference(b: Blocks, x: torch.Tensor) -> torch.Tensor:
    """float64 over the dequantized weights and activations (the kernels' values exactly)."""
    q, d, _ = kernels().quantize_activations(x)
    xq = (q.double().view(x.shape[0], -1, 32) * d.double()[..., None]).view(x.shape)
    return xq @ b.dequantize().double().T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k", "m"), [(1, 32, 1), (37, 96, 5), (130, 544, 16), (64, 1536, 13)])
def test_kernel_equals_scalar_path_and_exact_dot_products(kind: str, n: int, k: int, m: int) -> None:
    b, x = _case(kind, n, k, m, seed=n + k + m)
    w = torch.from_numpy(b.data)
    kind_id = BLOCK_KINDS[kind][0]
    got = kernels().qgemm(x, w, kind_id)
    assert torch.equal(got, kernels().qgemm_scalar(x, w, kind_id))
    want = _reference(b, x)
    # Exact integer sums: only the float products and sums of k / 32 blocks round.
    tol = 1e-5 * (x.abs().max() * b.dequantize().abs().max() * k).item()
    assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("kind", KINDS)
def test_rows_do_not_depend_on_the_batch_or_the_threads(kind: str) -> None:
    b, x = _case(kind, 200, 320, 16, seed=7)
    w = torch.from_numpy(b.data)
    kind_id = BLOCK_KINDS[kind][0]
    full = kernels().qgemm(x, w, kind_id)
    for lo, hi in ((0, 1), (3, 4), (5, 12), (13, 16)):
        assert torch.equal(kernels().qgemm(x[lo:hi].contiguous(), w, kind_id), full[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels().qgemm(x, w, kind_id), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
def test_every_tile_shape_gives_the_same_rows(kind: str) -> None:
    """m = 8 g + 4 a + 2 b + c rows go through 8x1, 4x2, 2x4 and 1x8 tiles (leftover columns
    through the scalar path): each row equals the scalar path and the row computed alone."""
    kind_id = BLOCK_KINDS[kind][0]
    b, x = _case(kind, 203, 96, 32, seed=11)
    w_all = torch.from_numpy(b.data)
    alone = torch.cat([kernels().qgemm_scalar(x[i:i + 1].contiguous(), w_all, kind_id)
                       for i in range(32)])
    for n in (8, 13, 16, 40, 200):
        w = w_all[:n]
        for m in (1, 3, 7, 8, 9, 17, 32):
            for lo in {0, 32 - m}:  # the same rows at other places in other tiles
                xs = x[lo:lo + m].contiguous()
                got = kernels().qgemm(xs, w, kind_id)
                assert torch.equal(got, kernels().qgemm_scalar(xs, w, kind_id)), (n, m, lo)
                assert torch.equal(got, alone[lo:lo + m, :n]), (n, m, lo)


def test_stored_extremes_are_exact() -> None:
    """Q8_0 codes of -128 (a file may store them) stay exact integers."""
    b, x = _case("Q8_0", 8, 64, 3, seed=3)
    data = b.data.copy()
    data.reshape(8, 2, 34)[:, :, 2:] = np.uint8(0x80)  # every code -128
    b = Blocks("Q8_0", data)
    got = kernels().qgemm(x, torch.from_numpy(b.data), BLOCK_KINDS["Q8_0"][0])
    assert torch.equal(got, kernels().qgemm_scalar(x, torch.from_numpy(b.data), 2))
    assert torch.allclose(got.double(), _reference(b, x), rtol=1e-5, atol=1e-4)


def test_q4_0_rewritten_as_q4_1_keeps_its_values() -> None:
    b, x = _case("Q4_0", 33, 128, 4, seed=5)
    as_q41 = b.as_q4_1()
    assert torch.equal(as_q41.dequantize(), b.dequantize())
    y0 = QuantizedWeight.of(b, torch.float32).matmul(x)
    y1 = QuantizedWeight.of(as_q41, torch.float32).matmul(x)
    assert torch.allclose(y0, y1, rtol=1e-5, atol=1e-4)


def test_bad_inputs_are_refused_with_their_sizes() -> None:
    b, x = _case("Q4_1", 8, 64, 2, seed=1)
    w = torch.from_numpy(b.data)
    with pytest.raises(RuntimeError, match="need 40"):
        kernels().qgemm(x, w[:, :20].contiguous(), 1)  # one block a row, two expected
    with pytest.raises(RuntimeError, match="float32"):
        kernels().qgemm(x.double(), w, 1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels().qgemm(x[:, :48].contiguous(), w, 1)
    with pytest.raises(RuntimeError, match="unknown block kind 7"):
        kernels().qgemm(x, w, 7)
    with pytest.raises(ValueError, match="Q4_1 blocks must be uint8"):
        Blocks("Q4_1", b.data[:, :30])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_path_equals_the_scalar_path(kind: str, path: str) -> None:
    """1..9 and 32 rows (every AVX-512 row tile, a full one and a partial one after it, four
    full ones), column counts that leave 1..15 columns of a 16-column tile and of an 8-lane one."""
    kind_id = BLOCK_KINDS[kind][0]
    b, x = _case(kind, 77, 160, 32, seed=17)
    w_all = torch.from_numpy(b.data)
    for n in (1, 3, 15, 16, 17, 31, 45, 77):
        w = w_all[:n]
        for m in (*range(1, 10), 32):
            xs = x[32 - m:].contiguous()
            got = kernels().qgemm_path(xs, w, kind_id, path)
            assert torch.equal(got, kernels().qgemm_scalar(xs, w, kind_id)), (path, n, m)


@pytest.mark.parametrize("path", PATHS)
def test_every_path_keeps_extreme_codes_exact(path: str) -> None:
    """Activation codes +-32767 (an int16 code's high byte at its extremes) and 0 next to them,
    against Q8_0 codes -128 / 127 and Q4 codes 0 / 15: the byte-split sums stay exact."""
    g = np.random.default_rng(23)
    x = torch.from_numpy(g.standard_normal((9, 128)).astype(np.float32))
    x[:, ::3] = 1e3  # the block maximum: code 32767
    x[:, 1::3] = -1e3
    x[0] = 0.0  # an all-zero row: zero scales
    for kind in KINDS:
        b, _ = _case(kind, 21, 128, 1, seed=29)
        data = b.data.copy()
        bb = BLOCK_KINDS[kind][1]
        blocks = data.reshape(21, -1, bb)
        if kind == "Q8_0":
            blocks[::2, :, 2:] = np.uint8(0x80)  # -128
            blocks[1::2, :, 2:] = np.uint8(0x7F)
        else:
            blocks[::2, :, bb - 16:] = np.uint8(0xFF)  # every nibble 15
            blocks[1::2, :, bb - 16:] = np.uint8(0x0F)
        w = torch.from_numpy(data)
        kind_id = BLOCK_KINDS[kind][0]
        got = kernels().qgemm_path(x, w, kind_id, path)
        assert torch.equal(got, kernels().qgemm_scalar(x, w, kind_id)), (kind, path)
        b = Blocks(kind, data)
        tol = 1e-5 * (x.abs().max() * b.dequantize().abs().max() * 128).item()
        assert (got.double() - _reference(b, x)).abs().max().item() <= tol


def test_paths_are_named_and_refused_by_name() -> None:
    assert PATHS[0] == "scalar" and set(PATHS) <= {"scalar", "avx2", "avx512"}
    assert kernels().kernel_path() in PATHS
    b, x = _case("Q4_1", 8, 64, 2, seed=1)
    w = torch.from_numpy(b.data)
    assert torch.equal(kernels().qgemm_path(x, w, 1, "auto"), kernels().qgemm(x, w, 1))
    with pytest.raises(RuntimeError, match="unknown kernel path 'avx9'"):
        kernels().qgemm_path(x, w, 1, "avx9")


@pytest.mark.parametrize("path", PATHS)
def test_a_quantized_weight_multiplies_through_its_path(path: str) -> None:
    """The model's weights take their path at load (avx512: tiled then); every path gives the
    scalar path's bits, for a float32 x and for another dtype's."""
    for kind in KINDS:
        b, x = _case(kind, 45, 96, 9, seed=31)
        q = QuantizedWeight(b.kind, torch.from_numpy(b.data), torch.empty(0), b.shape, path=path)
        assert (q.tiles is not None) == (path == "avx512")
        want = kernels().qgemm_scalar(x, q.blocks, BLOCK_KINDS[kind][0])
        assert torch.equal(q.matmul(x), want)
        assert torch.equal(q.matmul(x.double()), want.double())


def test_the_kernel_path_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    b, _ = _case("Q4_1", 8, 64, 1, seed=2)
    monkeypatch.setenv(KERNEL_PATH_ENV, "scalar")
    assert kernel_path() == "scalar"
    assert QuantizedWeight.of(b, torch.float32).path == "scalar"
    monkeypatch.setenv(KERNEL_PATH_ENV, "auto")
    assert kernel_path() == kernels().kernel_path() == PATHS[-1]
    monkeypatch.setenv(KERNEL_PATH_ENV, "avx9")
    with pytest.raises(ValueError, match="BATON_QKERNELS='avx9'"):
        QuantizedWeight.of(b, torch.float32)


def test_tiles_of_a_partial_tile_are_zero_padded() -> None:
    """pack_tiles: 16 rows a tile, rows past n zero; the tiled product still has n columns."""
    if "avx512" not in PATHS:
        pytest.skip("this CPU (or its OS) does not run the avx512 path")
    for kind in KINDS:
        b, x = _case(kind, 19, 64, 3, seed=37)
        kind_id = BLOCK_KINDS[kind][0]
        tiles = kernels().pack_tiles(torch.from_numpy(b.data), kind_id)
        assert tiles.shape == (2, 2 * 16 * BLOCK_KINDS[kind][1])
        padded = np.concatenate((b.data, np.zeros((13, b.data.shape[1]), np.uint8)))
        assert torch.equal(tiles, kernels().pack_tiles(torch.from_numpy(padded), kind_id))
        got = kernels().qgemm_tiles(x, tiles, kind_id, 19)
        assert torch.equal(got, kernels().qgemm_scalar(x, torch.from_numpy(b.data), kind_id))
        with pytest.raises(RuntimeError, match="2 tiles, 40 rows need 3"):
            kernels().qgemm_tiles(x, tiles, kind_id, 40)
