"""Decode rows: each decoding sequence's K/V of every layer, kept dense across steps.

Attention over the paged pool needs each sequence's K/V as one dense run per layer. Gathering
every sequence's blocks of every layer again at every step costs a copy of the whole batch's
K/V per step (at batch 32 x 1000 tokens of SmolLM2, 1.5 GB read and written for one token each),
so the rows persist: a sequence keeps its row from step to step and each layer appends only the
new token (`LlamaLayer` writes it into the pool and the row alike). Blocks are gathered only for a
sequence that is new to decoding, or whose row no longer holds exactly the tokens before this
step's (recomputed, or skipped by a step). A speculative step's verified drafts run as a chunk
over the pool: the row keeps the tokens before the chunk (`truncate`), and the next decode step
appends the kept drafts' K/V from the pool instead of gathering the whole row again (a whole
row of 256 tokens made the next step of SmolLM2 cost ~2x a plain one).

Rows live in groups by length class (up to 512 tokens, 2048, 8192, ...): a dense workspace pads
every row to its longest member, so one 1500-token prompt among chat turns of 100 tokens would
make every chat row's attention 15 times longer (measured: a 6-sequence decode step on one thread
went from ~90 to ~185 ms). Within a group the padding is at most the class ratio; attention runs
once per non-empty group. A sequence moves up a class (its row gathered again) when it outgrows
its group.

A group's layout is `[num_layers, 2, rows, num_kv_heads, capacity, head_dim]`: per layer and head
a sequence's keys are contiguous, the layout transformers' own cache has, which the CPU attention
kernel reads fastest. Its active rows are always 0..n-1 (a freed row is filled by moving the last
one into it), so attention runs on views of the first n rows, in row order; `rows` maps the batch
order onto them (a step that verifies drafts keeps those sequences' rows among them, which the
eager path attends over and drops). Memory: 46 KB per token-row for SmolLM2 in fp32.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

_CAPACITY_STEP = 256  # tokens: the capacity grows in these steps, a quarter more than needed
_LENGTH_CLASSES = (512, 2048, 8192, 32768, 131072, 1 << 62)  # group limits, tokens
_LIMITS = np.asarray(_LENGTH_CLASSES, dtype=np.int64)


class DecodeRows:
    """The length-class groups of decode rows over one KV pool."""

    def __init__(self) -> None:
        self.groups = [RowGroup(limit) for limit in _LENGTH_CLASSES]
        self._pool_key: tuple | None = None
        self._class: dict[int, int] = {}  # seq id -> group index, this step's batch

    @property
    def num_gathered(self) -> int:
        return sum(g.num_gathered for g in self.groups)

    @property
    def num_appended(self) -> int:
        return sum(g.num_appended for g in self.groups)

    def reset(self) -> None:
        self._class = {}
        for g in self.groups:
            g.reset()

    def forget(self, seq_ids) -> None:
        for g in self.groups:
            g.forget(seq_ids)

    def truncate(self, seq_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """These sequences' K/V from `num_tokens` on is being written by a chunk of verified
        drafts: their rows keep the tokens before it (see `RowGroup.truncate`)."""
        for g in self.groups:
            g.truncate(seq_ids, num_tokens)

    def prepare(self, seq_ids: np.ndarray, seqlens_k: np.ndarray, tables: torch.Tensor,
                kv_cache: torch.Tensor, block_size: int, keep: np.ndarray | None = None,
                ) -> list[tuple[RowGroup, np.ndarray, torch.Tensor]]:
        """Rows for every sequence of a decode batch: (group, the batch entries it serves, their
        rows), one per non-empty group; see `RowGroup.prepare`. Every group is visited, so a
        sequence that left the batch (or moved up a class) loses its old row, except those in
        `keep` (sequences of the same step that verify drafts: they decode again next step)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if key != self._pool_key:  # another pool: nothing here describes it
            self._pool_key = key
            self.groups = [RowGroup(limit) for limit in _LENGTH_CLASSES]
            self._class = {}
        ids = [int(s) for s in seq_ids]
        cls = np.searchsorted(_LIMITS, seqlens_k)  # the first class whose limit is >= k
        for i, s in enumerate(ids):  # never move down: a row only grows
            cls[i] = max(cls[i], self._class.get(s, 0))
        kept = {} if keep is None else \
            {int(s): self._class[int(s)] for s in keep if int(s) in self._class}
        self._class = {**kept, **dict(zip(ids, cls.tolist(), strict=True))}
        out = []
        for c, group in enumerate(self.groups):
            index = np.flatnonzero(cls == c)
            if len(index) == 0 and group.num_rows == 0:
                continue  # nothing to serve, nothing to release
            sub = tables if len(index) == len(seq_ids) else tables[torch.as_tensor(index, device=tables.device)]
            rows = group.prepare(seq_ids[index], seqlens_k[index], sub, kv_cache, block_size,
                                 kept)
            if len(index):
                out.append((group, index, rows))
        return out


class RowGroup:
    """Row bookkeeping (seq id -> row, tokens each row holds) and the workspace of one length
    class: sequences of at most `limit` tokens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.ws: torch.Tensor | None = None
        self._row_of: dict[int, int] = {}
        self._seq_of: list[int] = []  # row -> seq id, rows 0..n-1 active
        self._held = np.zeros(0, dtype=np.int64)  # tokens each row holds, -1 = unknown
        self.num_gathered = 0  # rows filled from the pool (tests and metrics)
        self.num_appended = 0  # rows that got only their newest tokens from the pool

    @property
    def num_rows(self) -> int:
        return len(self._seq_of)

    def reset(self) -> None:
        self._row_of.clear()
        self._seq_of.clear()
        self._held[:] = -1

    def forget(self, seq_ids) -> None:
        """These sequences' K/V is being rewritten (a prefill chunk): their rows are stale."""
        for s in seq_ids:
            row = self._row_of.get(int(s))
            if row is not None:
                self._held[row] = -1

    def truncate(self, seq_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Rows keep at most `num_tokens` tokens: the pool's K/V from there on is being
        rewritten (verified drafts); the tokens before it stay the row's."""
        for s, k in zip(seq_ids.tolist(), num_tokens.tolist(), strict=True):
            row = self._row_of.get(s)
            if row is not None:
                self._held[row] = min(int(self._held[row]), k)

    def prepare(self, seq_ids: np.ndarray, seqlens_k: np.ndarray, tables: torch.Tensor,
                kv_cache: torch.Tensor, block_size: int, keep=()) -> torch.Tensor:
        """Make rows hold tokens [0, k - 1) of each sequence (k = its context after this step;
        the layers write token k - 1): a row holding fewer of them gets the rest from the pool
        (a row's tokens always match the pool's: a chunk that rewrites them forgets or
        truncates it). Sequences not in this batch nor in `keep` lose their rows. Returns the
        row of each batch entry, int64 [n]: a permutation of 0..n-1 unless kept rows lie among
        them."""
        ids = [int(s) for s in seq_ids]
        keep = set(ids).union(keep)
        for s in [s for s in self._seq_of if s not in keep]:
            self._release(s)
        n = len(ids)
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=kv_cache.device)
        self._ensure(len(self._seq_of) + sum(s not in self._row_of for s in ids),
                     int(seqlens_k.max()), kv_cache)
        rows = np.empty(n, dtype=np.int64)
        for i, s in enumerate(ids):
            row = self._row_of.get(s)
            if row is None:
                row = len(self._seq_of)
                self._seq_of.append(s)
                self._row_of[s] = row
                self._held[row] = -1
            rows[i] = row
            need = int(seqlens_k[i]) - 1
            held = int(self._held[row])
            if 0 < held < need:
                self._append(row, tables[i], held, need, kv_cache, block_size)
            elif held != need:
                self._gather(row, tables[i], need, kv_cache, block_size)
        return torch.as_tensor(rows, device=kv_cache.device)

    def commit(self, rows: torch.Tensor, seqlens_k: np.ndarray) -> None:
        """Every layer wrote this step's token: the rows hold k tokens now."""
        self._held[rows.cpu().numpy()] = seqlens_k

    def _release(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id)
        last = len(self._seq_of) - 1
        if row != last:  # keep rows dense: the last row moves into the hole
            moved = self._seq_of[last]
            held = int(self._held[last])
            if held > 0:
                self.ws[:, :, row, :, :held] = self.ws[:, :, last, :, :held]
            self._held[row] = held
            self._seq_of[row] = moved
            self._row_of[moved] = row
        self._seq_of.pop()
        self._held[last] = -1

    def _ensure(self, n: int, max_len: int, kv_cache: torch.Tensor) -> None:
        num_layers, _, _, num_kv_heads, head_dim = kv_cache.shape[1:]
        rows = 0 if self.ws is None else self.ws.shape[2]
        cap = 0 if self.ws is None else self.ws.shape[4]
        if n <= rows and max_len <= cap:
            return
        new_rows = max(n, rows)
        new_cap = cap if max_len <= cap else min(
            -(-(max_len * 5 // 4) // _CAPACITY_STEP) * _CAPACITY_STEP, self.limit)
        # Zeros, not empty: attention reads every row up to its group's longest and masks the
        # tail with an additive -inf, which only works over finite keys. Memory a freed tensor
        # left behind can hold inf or NaN (masks are full of -inf), and q . inf - inf is NaN:
        # a short row beside a long one then decoded token 0 forever (a flaky engine test).
        ws = torch.zeros((num_layers, 2, new_rows, num_kv_heads, new_cap, head_dim),
                         dtype=kv_cache.dtype, device=kv_cache.device)
        active = len(self._seq_of)
        if self.ws is not None and active:
            ws[:, :, :active, :, :cap] = self.ws[:, :, :active]
        held = np.full(new_rows, -1, dtype=np.int64)
        held[:len(self._held)] = self._held
        self.ws, self._held = ws, held
        logger.debug("decode rows: %d x %d tokens (%.0f MiB)", new_rows, new_cap,
                     ws.numel() * ws.element_size() / 2**20)

    def _gather(self, row: int, table: torch.Tensor, num_tokens: int, kv_cache: torch.Tensor,
                block_size: int) -> None:
        nb = -(-num_tokens // block_size)
        # A sliding window's released blocks lead the table as the null block (S42): they are
        # not read; the row's tokens there stay as they were (finite), hidden by the window.
        first = int((table[:nb] == 0).sum()) if nb else 0
        assert first < nb or not nb, "a decode row whose every block is released"
        assert not bool((table[first:nb] == 0).any()), "a null block inside the window"
        if nb:
            blocks = kv_cache.index_select(0, table[first:nb])  # [nb - first, L, 2, B, Hkv, D]
            src = blocks.permute(1, 2, 4, 0, 3, 5).flatten(3, 4)  # [L, 2, Hkv, (nb - first) B, D]
            start = first * block_size
            self.ws[:, :, row, :, start:num_tokens] = src[:, :, :, :num_tokens - start]
        self._held[row] = num_tokens
        self.num_gathered += 1

    def _append(self, row: int, table: torch.Tensor, held: int, num_tokens: int,
                kv_cache: torch.Tensor, block_size: int) -> None:
        """Tokens [held, num_tokens) of the row from the pool (the ones before are the row's)."""
        pos = torch.arange(held, num_tokens, device=kv_cache.device)
        blocks = table[pos // block_size]
        assert bool((blocks > 0).all()), "a released block after a decode row's tokens"
        # Advanced indices on dims 0 and 3 around slices: [T, L, 2, Hkv, D].
        src = kv_cache[blocks, :, :, pos % block_size]
        self.ws[:, :, row, :, held:num_tokens] = src.permute(1, 2, 3, 0, 4)
        self._held[row] = num_tokens
        self.num_appended += 1
