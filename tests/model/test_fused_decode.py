"""The fused decode attention (`baton/model/backends/cpu_fused.py`) against the eager path it
replaces in the quantized modes: the op against the eager formulas, and int4 decode steps with
the op against the same steps without it (same weights, same batches)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from baton.model.backends import cpu_fused
from baton.model.llama import apply_rope

from .reference import BLOCK_SIZE, held_out_tokens

# The eager formulas the op replaces, one sequence at a time: its benchmark's baseline.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from decode_attention_bench import HKV, HQ, D, eager  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_fused.AVAILABLE, reason="baton._decode_ops not built")
LAYERS = 4


def rotated(qkv, cos, sin):
    """The projection with its query and key heads rotated: what a step with prefills hands
    the op (RoPE done by the eager path)."""
    n = qkv.shape[0]
    qk = apply_rope(qkv[:, :(HQ + HKV) * D].view(n, HQ + HKV, D), cos[:, None], sin[:, None])
    return torch.cat((qk.flatten(1), qkv[:, (HQ + HKV) * D:]), dim=1)


@pytest.mark.parametrize("threads", [1, 2])
def test_op_matches_the_eager_formulas(threads: int) -> None:
    g = torch.Generator().manual_seed(threads)
    ws = torch.randn(LAYERS, 2, 5, HKV, 300, D, generator=g)
    qkv = torch.randn(4, (HQ + 2 * HKV) * D, generator=g)
    cos, sin = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)
    rows, positions = torch.tensor([3, 0, 4, 1]), torch.tensor([10, 299, 0, 64])
    want_ws = ws.clone()
    want = eager(qkv, cos, sin, want_ws, 2, rows, positions)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_fused.decode_attention(qkv, cos, sin, ws, 2, rows, positions, HQ, HKV)
        # Already rotated (a step with prefills): the same values, bit for bit.
        again = cpu_fused.decode_attention(rotated(qkv, cos, sin), None, None, ws.clone(), 2, rows,
                                           positions, HQ, HKV)
        alone = cpu_fused.decode_attention(qkv[1:2], cos[1:2], sin[1:2], ws.clone(), 2,
                                           rows[1:2], positions[1:2], HQ, HKV)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ws, want_ws)  # the rotated key and the value at their places
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Rotating inside the op equals rotating first; a row's output does not depend on the batch.
    assert torch.equal(again, got)
    assert torch.equal(alone, got[1:2])


@pytest.mark.parametrize("d", [32, 48, 128])  # 32 and 128: the AVX2 loop's other sizes; 48: portable
def test_op_at_other_head_sizes(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    ws = torch.randn(1, 2, 2, 2, 40, d, generator=g)
    qkv = torch.randn(2, (4 + 2 * 2) * d, generator=g)
    rows, positions = torch.tensor([1, 0]), torch.tensor([37, 2])
    got = cpu_fused.decode_attention(qkv, None, None, ws, 0, rows, positions, 4, 2)
    for i in range(2):
        r, p = int(rows[i]), int(positions[i])
        q = qkv[i, :4 * d].view(2, 2, d)  # [kv head, group, d]
        assert torch.equal(ws[0, 0, r, :, p], qkv[i, 4 * d:6 * d].view(2, d))
        keys, vals = ws[0, 0, r, :, :p + 1], ws[0, 1, r, :, :p + 1]
        want = ((q @ keys.transpose(-1, -2)) * d ** -0.5).softmax(-1) @ vals
        torch.testing.assert_close(got[i], want.reshape(-1), rtol=1e-5, atol=1e-5)


def test_op_checks_what_it_is_given() -> None:
    ws = torch.zeros(LAYERS, 2, 2, HKV, 16, D)
    qkv = torch.zeros(1, (HQ + 2 * HKV) * D)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_fused.decode_attention(qkv, None, None, ws, 0, torch.tensor([2]), torch.tensor([0]),
                                   HQ, HKV)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_fused.decode_attention(qkv, None, None, ws, 0, torch.tensor([0]), torch.tensor([16]),
                                   HQ, HKV)
    with pytest.raises(RuntimeError, match="layer"):
        cpu_fused.decode_attention(qkv, None, None, ws, LAYERS, torch.tensor([0]),
                                   torch.tensor([0]), HQ, HKV)


@pytest.mark.parametrize("threads", [1, 2])
def test_norm_and_silu_ops_match_the_eager_formulas(threads: int) -> None:
    from baton.model.llama import rms_norm

    g = torch.Generator().manual_seed(7)
    x, r = torch.randn(19, 576, generator=g) * 3, torch.randn(19, 576, generator=g)
    w = torch.randn(576, generator=g)
    gate_up = torch.randn(19, 2 * 1536, generator=g) * 4
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -90.0, 90.0, -1e-30])  # exp's clamps
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s, h = cpu_fused.rms_norm(x, w, 1e-5, residual=r)
        same, alone = cpu_fused.rms_norm(s[3:4].contiguous(), w, 1e-5)
        act = cpu_fused.silu_mul(gate_up)
        act_alone = cpu_fused.silu_mul(gate_up[5:6].contiguous())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(h, rms_norm(x + r, w, 1e-5), rtol=1e-6, atol=1e-6)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-5)
    # A row's values do not depend on the other rows.
    assert torch.equal(alone, h[3:4]) and same is not None and torch.equal(act_alone, act[5:6])
    with pytest.raises(RuntimeError, match="residual"):
        cpu_fused.rms_norm(x, w, 1e-5, residual=r[:3].contiguous())
    with pytest.raises(RuntimeError, match="weight"):
        cpu_fused.rms_norm(x, w[:100].contiguous(), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        cpu_fused.silu_mul(gate_up[:, :7].contiguous())


def _decode_logits(runner, prompts: list[list[int]], steps: int, late: list[int]) -> torch.Tensor:
    """Teacher-forced decode: prefill each prompt, then feed the held-out text one token a step
    as an engine does (seq ids kept, so the dense rows persist); `late` joins with its whole
    prompt at the middle step, beside the others' decode tokens. Logits of every decode token."""
    seqs = [{"id": i, "tokens": p, "blocks": [], "done": 0} for i, p in enumerate(prompts)]
    free = list(range(runner.num_blocks - 1, 0, -1))
    out = []

    def step(batch: list[tuple[dict, int]]) -> torch.Tensor:
        ids, pos, slots, q, k, sid = [], [], [], [], [], []
        for s, num in batch:
            start, end = s["done"], s["done"] + num
            while len(s["blocks"]) * BLOCK_SIZE < end:
                s["blocks"].append(free.pop())
            ids += s["tokens"][start:end]
            pos += range(start, end)
            slots += [s["blocks"][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, end)]
            q.append(num)
            k.append(end)
            sid.append(s["id"])
            s["done"] = end
        tables = np.zeros((len(batch), max(len(s["blocks"]) for s, _ in batch)), np.int64)
        for i, (s, _) in enumerate(batch):
            tables[i, :len(s["blocks"])] = s["blocks"]
        return runner.forward(ids, pos, slots, q, k, tables, seq_ids=sid)

    first = len(prompts[0]) - steps
    step([(s, first) for s in seqs if s["id"] not in late])
    for t in range(steps):
        batch = [(s, 1) for s in seqs if s["id"] not in late or s["done"]]
        if t == steps // 2:
            batch += [(s, first + t) for s in seqs if s["id"] in late]
        logits = step(batch)
        out.append(logits[[i for i, (_, num) in enumerate(batch) if num == 1]])
    return torch.cat(out)


@pytest.mark.slow
def test_decode_steps_with_the_op_match_the_eager_path() -> None:
    """On the exact mode's fp32 weights (the op forced on), so that nothing but attention
    differs: a quantized mode rounds activations for its int kernels, which turns the op's
    last-bit differences into visible ones."""
    from baton.model.backends import CPUBackend
    from baton.model.runner import ModelRunner

    from .reference import baton_model

    text = held_out_tokens(4 * 64)
    prompts = [text[i * 64:(i + 1) * 64] for i in range(4)]
    got, want = [], []
    for fused, out in ((True, got), (False, want)):
        runner = ModelRunner(baton_model(), BLOCK_SIZE, num_blocks=32,
                             backend=CPUBackend(fused_decode=fused))
        assert runner.backend.fused_decode == fused
        out.append(_decode_logits(runner, prompts, steps=16, late=[3]))
    got, want = got[0], want[0]
    # Three sequences decode every step; the late one from the step after its prompt's.
    assert got.shape == want.shape and got.shape[0] == 3 * 16 + 7
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_quantized_modes_take_the_op_and_the_exact_mode_does_not() -> None:
    from baton.model.backends import get_backend

    assert get_backend("cpu", exact=False).fused_decode
    assert not get_backend("cpu").fused_decode
