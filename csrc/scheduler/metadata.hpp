// The model runner's arrays for one step: per sequence and per token, and the
// block tables, refilled incrementally when a step output is reused. (S36, S38, S39)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

// One pass over the batch; add_seq already kept the widths (no sequence's
// table changes once it is in the batch). Returns the largest position-end
// base over the rows (S38 checks only it, see finish_metadata_), INT_MIN for
// an empty batch.
inline int Scheduler::build_metadata_(SchedulerOutputs &out) {
  if (out.rows_built) return out.max_end_base;
  out.trim();
  const int n = out.num_seqs();
  size_metadata_(out, n, out.num_tokens_q);
  prepare_block_tables_(out, n, out.max_blocks);
  int max_end_base = std::numeric_limits<int>::min();
  const SequencePtr *seqs = out.scheduled_seqs.data();
  const int32_t *seqlens_q = out.seqlens_q.data();
  for (int i = 0, t = 0; i < n; ++i) {
    Sequence &seq = *seqs[i];
    const int q = seqlens_q[i];
    emit_seq_(out, i, t, seq, q);
    fill_block_row_(out, i, seq);
    max_end_base = std::max(max_end_base, out.prompt_run ? out.seqlens_k[i] : out.seqlens_k[i] - q);
    t += q;
  }
  return max_end_base;
}

// Sizes only move the vectors' ends: a reused output of the same shape pays nothing.
inline void Scheduler::size_metadata_(SchedulerOutputs &out, int n, int num_tokens) {
  out.epochs.resize(n);
  out.seq_ids.resize(n);
  out.seqlens_k.resize(n);
  out.input_ids.resize(num_tokens);
  out.positions.resize(num_tokens);
  out.slot_mapping.resize(num_tokens);
}

// Row i and tokens [t, t + q) of the arrays; also starts the sequence's step in flight.
inline void Scheduler::emit_seq_(SchedulerOutputs &out, int i, int t, Sequence &seq, int q) {
  const int start = seq.cache.num_tokens + seq.schedule.total_inflight_tokens;
  const int k = start + q;
  out.epochs[i] = seq.epoch;
  out.seq_ids[i] = seq.seq_id;
  out.seqlens_k[i] = k;
  out.sum_seqlen_qxk += static_cast<int64_t>(q) * k;
  out.min_seqlen_k = std::min(out.min_seqlen_k, k);
  out.max_seqlen_k = std::max(out.max_seqlen_k, k);
  const int *table = seq.cache.block_table.data();
  const int32_t *tok = seq.data.token_ids.data();
  const int len = seq.data.get_len();
  int32_t *input_ids = out.input_ids.data() + t;
  int32_t *positions = out.positions.data() + t;
  int64_t *slots = out.slot_mapping.data() + t;
  // Token 0 (a prompt step: every token) is committed, or -1: sampled by a step still in flight.
  const int num_committed = out.prompt_run ? q : 1;
  for (int j = 0; j < num_committed; ++j) {
    const int pos = start + j;
    input_ids[j] = pos < len ? tok[pos] : -1;
    positions[j] = pos;
    slots[j] = slot_of_(table, pos);
  }
  for (int j = num_committed; j < q; ++j) {  // drafts
    const int pos = start + j;
    input_ids[j] = seq.draft.draft_tokens[j - 1];
    positions[j] = pos;
    slots[j] = slot_of_(table, pos);
  }
  seq.schedule.start_inflight_step(q);
  seq.inflight_steps += 1;
  if (!out.prompt_run && q > 1) {
    seq.draft.num_drafted += q - 1;
    seq.draft.draft_tokens.clear();  // consumed: now counted as tokens in flight
  }
}

// A decode step's rows, written while schedule_decode_ picks the sequences:
// each sequence's hot lines are read once a step instead of once per pass.
// Emitting at pick time is exact: a sequence's table no longer changes once
// it is picked, and preemption only takes sequences not yet picked.
// Everything the rows need sits in this struct, a local of schedule_decode_
// that the compiler keeps in registers: no field is reloaded per row.
struct Scheduler::DecodeRows {
  SchedulerOutputs &out;
  SequencePtr *seqs;
  int32_t *seqlens_q;
  int *epochs;
  int64_t *seq_ids;
  int32_t *seqlens_k;
  int32_t *input_ids;
  int32_t *positions;
  int64_t *slots;
  int32_t *block_tables;
  SchedulerOutputs::RowCache *row_cache;
  int token_capacity;
  // block_tables is written with last step's width, which is this step's but
  // when the longest table grew or left; then end_decode_rows_ lays it out again.
  int stride;
  int bs_shift;  // as Scheduler::bs_shift_
  int block_size;
  int i, t, max_blocks;
  int num_stale;  // emit_plain_rows_loop_'s entries in out.stale_rows
};

// Every array sized for max_rows one-token rows; end_decode_rows_ trims them.
inline Scheduler::DecodeRows Scheduler::begin_decode_rows_(SchedulerOutputs &out, int max_rows) {
  if (static_cast<int>(out.scheduled_seqs.size()) < max_rows) out.scheduled_seqs.resize(max_rows);
  out.seqlens_q.resize(max_rows);
  size_metadata_(out, max_rows, max_rows);
  prepare_block_tables_(out, max_rows, decode_stride_hint_);
  return DecodeRows{out, out.scheduled_seqs.data(), out.seqlens_q.data(), out.epochs.data(), out.seq_ids.data(),
                    out.seqlens_k.data(), out.input_ids.data(), out.positions.data(), out.slot_mapping.data(),
                    out.block_tables.data(), out.row_cache.data(), max_rows, decode_stride_hint_, bs_shift_,
                    cfg_.block_size, 0, 0, 0, 0};
}

// Row i and tokens [t, t + q): the committed token (-1 while a step still in
// flight samples it) and q - 1 drafts; also starts the sequence's step in flight.
__attribute__((always_inline)) inline void Scheduler::emit_decode_row_(DecodeRows &rows, const SequencePtr &seq,
                                                                        int q) {
  Sequence &sq = *seq;
  const int i = rows.i, t = rows.t;
  // Assigning the same sequence again (the usual case) touches no reference count.
  if (rows.seqs[i].get() != &sq) rows.seqs[i] = seq;
  const int *table = sq.cache.block_table.data();
  const int num_blocks = static_cast<int>(sq.cache.block_table.size());
  rows.max_blocks = std::max(rows.max_blocks, num_blocks);
  const int pos = sq.cache.num_tokens + sq.schedule.total_inflight_tokens;
  rows.seqlens_q[i] = q;
  rows.epochs[i] = sq.epoch;
  rows.seq_ids[i] = sq.seq_id;
  rows.seqlens_k[i] = pos + q;
  if (__builtin_expect(t + q > rows.token_capacity, 0)) grow_decode_tokens_(rows, t + q);
  const auto &tok = sq.data.token_ids;
  rows.input_ids[t] = pos < static_cast<int>(tok.size()) ? tok[pos] : -1;
  rows.positions[t] = pos;
  rows.slots[t] = slot_of_(table, pos);
  sq.schedule.start_inflight_step(q);
  sq.inflight_steps += 1;
  if (__builtin_expect(q > 1, 0)) {
    for (int j = 1; j < q; ++j) {
      rows.input_ids[t + j] = sq.draft.draft_tokens[j - 1];
      rows.positions[t + j] = pos + j;
      rows.slots[t + j] = slot_of_(table, pos + j);
    }
    sq.draft.num_drafted += q - 1;
    sq.draft.draft_tokens.clear();  // consumed: now counted as tokens in flight
  }
  // fill_block_row_, with the usual case (the row holds all but at most the
  // newest block) as plain stores instead of library calls.
  if (num_blocks <= rows.stride) {
    auto &rc = rows.row_cache[i];
    int32_t *row = rows.block_tables + static_cast<size_t>(i) * rows.stride;
    if (rc.seq_id == sq.seq_id && rc.table_version == sq.cache.table_version && rc.len <= num_blocks) {
      if (num_blocks - rc.len == 1) {
        row[rc.len] = table[rc.len];
      } else if (num_blocks > rc.len) {
        std::copy(table + rc.len, table + num_blocks, row + rc.len);
      }
    } else {
      std::copy(table, table + num_blocks, row);
      std::fill(row + num_blocks, row + rows.stride, 0);
      rc.seq_id = sq.seq_id;
      rc.table_version = sq.cache.table_version;
    }
    rc.len = num_blocks;
    rc.last_block = num_blocks > 0 ? table[num_blocks - 1] : 0;
  }
  rows.i = i + 1;
  rows.t = t + q;
}

// seqlens_q and seqlens_k of n one-token rows from their positions.
inline void plain_row_lengths(int32_t *seqlens_q, int32_t *seqlens_k, const int32_t *positions, size_t n) {
  for (size_t j = 0; j < n; ++j) {
    seqlens_q[j] = 1;
    seqlens_k[j] = positions[j] + 1;
  }
}

// schedule_decode_'s usual rows, youngest first from run[r - 1] down to
// run[l]: one token, no drafts, no block to add. Stops at the first row that
// is not, or after max_rows rows in all; returns the new r.
__attribute__((noinline)) inline size_t Scheduler::emit_plain_rows_(DecodeRows &rows, const SequencePtr *run,
                                                                      size_t l, size_t r, int max_rows) {
  if (rows.bs_shift < 0) return r;  // block sizes that are no power of two take emit_decode_row_
  const int i0 = rows.i, t0 = rows.t;
  const size_t limit = std::min({r - l, static_cast<size_t>(max_rows - i0), static_cast<size_t>(rows.token_capacity - t0)});
  auto &stale = rows.out.stale_rows;
  if (stale.size() < limit) stale.resize(limit);
  // Without speculation no sequence holds drafts: the draft ledger's line stays untouched.
  const size_t n = cfg_.num_speculative_tokens > 0 ? emit_plain_rows_loop_<true>(rows, run, l, r, limit)
                                                   : emit_plain_rows_loop_<false>(rows, run, l, r, limit);
  // What the loop left out, over contiguous arrays: the batch's shared pointers
  // (assigning the same sequence again, the usual case, touches no reference
  // count), seqlens_q and seqlens_k, and the table rows that gained a block or
  // are new to this output.
  SequencePtr *seqs = rows.seqs + i0;
  for (size_t j = 0; j < n; ++j) {
    if (seqs[j].get() != run[r - 1 - j].get()) seqs[j] = run[r - 1 - j];
  }
  plain_row_lengths(rows.seqlens_q + i0, rows.seqlens_k + i0, rows.positions + t0, n);
  for (int k = 0, num_stale = rows.num_stale; k < num_stale; ++k) {
    const int i = i0 + stale[k];
    fill_block_row_(rows.out, i, *rows.seqs[i]);  // writes only the blocks the row lacks
  }
  rows.num_stale = 0;
  rows.i = i0 + static_cast<int>(n);
  rows.t = t0 + static_cast<int>(n);
  return r - n;
}

// emit_plain_rows_'s loop: only what differs per row is written here, and no
// call, so what it needs stays in registers. Returns the number of rows.
template <bool kSpeculative>
inline size_t Scheduler::emit_plain_rows_loop_(DecodeRows &rows, const SequencePtr *run, size_t l, size_t r,
                                               size_t limit) {
  const int shift = rows.bs_shift, stride = rows.stride;
  const int i0 = rows.i, t0 = rows.t;
  int *__restrict epochs = rows.epochs + i0;
  int64_t *__restrict seq_ids = rows.seq_ids + i0;
  int32_t *__restrict input_ids = rows.input_ids + t0;
  int32_t *__restrict positions = rows.positions + t0;
  int64_t *__restrict slots = rows.slots + t0;
  const SchedulerOutputs::RowCache *row_cache = rows.row_cache + i0;
  int32_t *__restrict stale = rows.out.stale_rows.data();
  int num_stale = 0;
  int max_blocks = rows.max_blocks;
  size_t j = 0;
  for (; j < limit; ++j) {
    const size_t at = r - 1 - j;
    if (at >= l + 2 * kPrefetchAhead) prefetch_hot_lines(run[at - 2 * kPrefetchAhead].get());
    Sequence &sq = *run[at];
    if (kSpeculative && !sq.draft.draft_tokens.empty()) break;
    const int len = static_cast<int>(sq.data.token_ids.size());
    const int inflight = sq.schedule.total_inflight_tokens;
    const int num_blocks = static_cast<int>(sq.cache.block_table.size());
    if (num_blocks_for(len + inflight, rows.block_size) != num_blocks) break;  // needs a block (or gives one back)
    max_blocks = std::max(max_blocks, num_blocks);
    const int pos = sq.cache.num_tokens + inflight;
    epochs[j] = sq.epoch;
    seq_ids[j] = sq.seq_id;
    // The newest token (the usual case, in the hot lines), an older one, or -1: in flight.
    input_ids[j] = pos >= len ? -1 : pos == len - 1 ? sq.data.last_token_id : sq.data.token_ids.data()[pos];
    positions[j] = pos;
    sq.schedule.start_inflight_step(1);
    sq.inflight_steps += 1;
    // The usual row already holds this sequence's whole table (only one step in
    // sixteen adds a block): its newest block, where pos usually lies, is in the
    // row cache, so neither the table nor the row's line is touched.
    const auto &rc = row_cache[j];
    const bool row_whole =
        rc.seq_id == sq.seq_id && rc.table_version == sq.cache.table_version && rc.len == num_blocks;
    if (__builtin_expect(row_whole && (pos >> shift) == num_blocks - 1, 1)) {
      slots[j] = slot_in_block_(rc.last_block, pos);
      continue;
    }
    slots[j] = slot_of_(sq.cache.block_table.data(), pos);
    // Wider than the row: end_decode_rows_ lays the tables out again.
    if (!row_whole && num_blocks <= stride) stale[num_stale++] = static_cast<int32_t>(j);
  }
  rows.max_blocks = max_blocks;
  rows.num_stale = num_stale;
  return j;
}

// Drafts make a step longer than one token a row.
__attribute__((always_inline)) inline void Scheduler::grow_decode_tokens_(DecodeRows &rows, int num_tokens) {
  SchedulerOutputs &out = rows.out;
  const int capacity = std::max(num_tokens, 2 * rows.token_capacity);
  out.input_ids.resize(capacity);
  out.positions.resize(capacity);
  out.slot_mapping.resize(capacity);
  rows.input_ids = out.input_ids.data();
  rows.positions = out.positions.data();
  rows.slots = out.slot_mapping.data();
  rows.token_capacity = capacity;
}

inline void Scheduler::end_decode_rows_(DecodeRows &rows) {
  SchedulerOutputs &out = rows.out;
  const int n = rows.i;
  out.num_scheduled = n;
  out.num_tokens_q = rows.t;
  out.max_blocks = rows.max_blocks;
  out.trim();
  out.seqlens_q.resize(n);
  size_metadata_(out, n, rows.t);
  decode_extremes_(out, rows.seqlens_q, rows.seqlens_k, n);
  prepare_block_tables_(out, n, rows.max_blocks);
  if (rows.max_blocks != rows.stride) {
    for (int i = 0; i < n; ++i) fill_block_row_(out, i, *out.scheduled_seqs[i]);
  }
  decode_stride_hint_ = rows.max_blocks;
  out.rows_built = true;
}

// The extremes over a decode step's finished arrays, not in the row loop:
// fewer live values there (S38 needs only the largest k - q, not its row).
inline void Scheduler::decode_extremes_(SchedulerOutputs &out,
                                                                         const int32_t *seqlens_q,
                                                                         const int32_t *seqlens_k, int n) {
  int64_t sum_qxk = 0;
  int max_q = 0, min_k = out.min_seqlen_k, max_k = out.max_seqlen_k;
  int max_end_base = std::numeric_limits<int>::min();
  if (out.num_tokens_q == n && n > 0) {  // every q is 1: sums and extremes of k alone
    for (int i = 0; i < n; ++i) {
      const int k = seqlens_k[i];
      sum_qxk += k;
      min_k = std::min(min_k, k);
      max_k = std::max(max_k, k);
    }
    out.sum_seqlen_qxk += sum_qxk;
    out.max_seqlen_q = 1;
    out.min_seqlen_k = min_k;
    out.max_seqlen_k = max_k;
    out.max_end_base = max_k - 1;
    return;
  }
  for (int i = 0; i < n; ++i) {
    const int q = seqlens_q[i], k = seqlens_k[i];
    sum_qxk += static_cast<int64_t>(q) * k;
    max_q = std::max(max_q, q);
    min_k = std::min(min_k, k);
    max_k = std::max(max_k, k);
    max_end_base = std::max(max_end_base, k - q);
  }
  out.sum_seqlen_qxk += sum_qxk;
  out.max_seqlen_q = max_q;
  out.min_seqlen_k = min_k;
  out.max_seqlen_k = max_k;
  out.max_end_base = max_end_base;
}

// After all rows: the position-end check (S38) and the FLOP estimates. A row's
// position end is k (prompt) or k - q + max_seqlen_q + nextn (decode): only the
// largest base can fail; when it does, the first failing row is reported.
inline void Scheduler::finish_metadata_(SchedulerOutputs &out, int max_end_base) {
  const int n = out.num_seqs();
  const int nextn = cfg_.num_speculative_tokens;
  const int runtime_max_model_len = cfg_.max_model_len + 2 * nextn;
  auto end_of = [&](int base) { return out.prompt_run ? base : base + out.max_seqlen_q + nextn; };
  auto position_end = [&](int i) {
    const int k = out.seqlens_k[i], q = out.seqlens_q[i];
    return end_of(out.prompt_run ? k : k - q);
  };
  if (n > 0 && end_of(max_end_base) > runtime_max_model_len) {
    for (int i = 0; i < n; ++i) {
      if (position_end(i) > runtime_max_model_len) {
        throw std::logic_error("position end " + std::to_string(position_end(i)) + " of " +
                               out.scheduled_seqs[i]->request_id + " exceeds the model length " +
                               std::to_string(runtime_max_model_len));
      }
    }
  }
  if (n == 0) out.min_seqlen_k = 0;
  out.attn_tflops = cfg_.attn_flops_per_qk * static_cast<double>(out.sum_seqlen_qxk) * 1e-12;
  out.total_tflops = out.attn_tflops + cfg_.flops_per_token * out.num_tokens_q * 1e-12;
}

// block_tables is [n, max_blocks]; a reused object keeps its rows when the
// width is unchanged, so most rows need only their newest block written.
inline void Scheduler::prepare_block_tables_(SchedulerOutputs &out, int n, int max_blocks) {
  if (out.table_stride != max_blocks) {
    out.row_cache.clear();  // every row is rewritten in the new layout
    out.table_stride = max_blocks;
  }
  out.row_cache.resize(n);  // rows past n lose their cache: resize does not keep their contents
  out.block_tables.resize(static_cast<size_t>(n) * max_blocks);
}

inline void Scheduler::fill_block_row_(SchedulerOutputs &out, int i, const Sequence &seq) {
  const int stride = out.table_stride;
  int32_t *row = out.block_tables.data() + static_cast<size_t>(i) * stride;
  const auto &table = seq.cache.block_table;
  const int len = static_cast<int>(table.size());
  auto &rc = out.row_cache[i];
  int from = 0;
  if (rc.seq_id == seq.seq_id && rc.table_version == seq.cache.table_version && rc.len <= len) {
    from = rc.len;  // [0, from) still holds this table's prefix, [len, stride) is still 0
  } else {
    std::fill(row + len, row + stride, 0);
    rc.seq_id = seq.seq_id;
    rc.table_version = seq.cache.table_version;
  }
  std::copy(table.begin() + from, table.end(), row + from);
  rc.len = len;
  rc.last_block = len > 0 ? table[len - 1] : 0;
}

}  // namespace baton
