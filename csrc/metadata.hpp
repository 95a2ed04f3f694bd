// The model runner's arrays for one step: per sequence and per token, and the
// block tables, refilled incrementally when a step output is reused. (S36, S38, S39)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

// One pass over the batch; add_seq already kept the widths (no sequence's
// table changes once it is in the batch). Returns the row whose position end
// is the largest (S38 checks only that one), -1 for an empty batch.
inline int Scheduler::build_metadata_(SchedulerOutputs &out) {
  out.trim();
  const int n = out.num_seqs();
  size_metadata_(out, n, out.num_tokens_q);
  prepare_block_tables_(out, n, out.max_blocks);
  int worst = -1, worst_end = std::numeric_limits<int>::min();
  const SequencePtr *seqs = out.scheduled_seqs.data();
  const int32_t *seqlens_q = out.seqlens_q.data();
  if (!out.prompt_run && out.num_tokens_q == n) return build_decode_rows_(out, n);
  for (int i = 0, t = 0; i < n; ++i) {
    Sequence &seq = *seqs[i];
    const int q = seqlens_q[i];
    emit_seq_(out, i, t, seq, q);
    fill_block_row_(out, i, seq);
    // A prompt step ends at k, a decode step at k - q + max_seqlen_q + nextn.
    const int end = out.prompt_run ? out.seqlens_k[i] : out.seqlens_k[i] - q;
    if (end > worst_end) {
      worst_end = end;
      worst = i;
    }
    t += q;
  }
  return worst;
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

// build_metadata_ for the usual decode step: one token per row, no drafts.
// The arrays and running extremes live in locals, so nothing is reloaded per row.
inline int Scheduler::build_decode_rows_(SchedulerOutputs &out, int n) {
  const SequencePtr *seqs = out.scheduled_seqs.data();
  int *epochs = out.epochs.data();
  int64_t *seq_ids = out.seq_ids.data();
  int32_t *seqlens_k = out.seqlens_k.data();
  int32_t *input_ids = out.input_ids.data();
  int32_t *positions = out.positions.data();
  int64_t *slots = out.slot_mapping.data();
  int64_t sum_qxk = 0;
  int min_k = out.min_seqlen_k, max_k = out.max_seqlen_k, worst = -1;
  for (int i = 0; i < n; ++i) {
    if (i + 2 * kPrefetchAhead < n) prefetch_hot_lines(seqs[i + 2 * kPrefetchAhead].get());
    if (i + kPrefetchAhead < n) prefetch_tails(seqs[i + kPrefetchAhead].get());
    Sequence &seq = *seqs[i];
    const int pos = seq.cache.num_tokens + seq.schedule.total_inflight_tokens;
    const int k = pos + 1;
    epochs[i] = seq.epoch;
    seq_ids[i] = seq.seq_id;
    seqlens_k[i] = k;
    sum_qxk += k;
    min_k = std::min(min_k, k);
    if (k > max_k) {
      max_k = k;
      worst = i;  // the first row of the largest k - q
    }
    const auto &tok = seq.data.token_ids;
    input_ids[i] = pos < static_cast<int>(tok.size()) ? tok[pos] : -1;
    positions[i] = pos;
    slots[i] = slot_of_(seq.cache.block_table.data(), pos);
    seq.schedule.start_inflight_step(1);
    seq.inflight_steps += 1;
    fill_block_row_(out, i, seq);
  }
  out.sum_seqlen_qxk += sum_qxk;
  out.min_seqlen_k = min_k;
  out.max_seqlen_k = max_k;
  return n > 0 && worst < 0 ? 0 : worst;
}

// After all rows: the position-end check (S38) and the FLOP estimates. Only the
// worst row can fail; when it does, the first failing row is reported.
inline void Scheduler::finish_metadata_(SchedulerOutputs &out, int worst) {
  const int n = out.num_seqs();
  const int nextn = cfg_.num_speculative_tokens;
  const int runtime_max_model_len = cfg_.max_model_len + 2 * nextn;
  auto position_end = [&](int i) {
    const int k = out.seqlens_k[i], q = out.seqlens_q[i];
    return out.prompt_run ? k : k - q + out.max_seqlen_q + nextn;
  };
  if (worst >= 0 && position_end(worst) > runtime_max_model_len) {
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
}

}  // namespace baton
