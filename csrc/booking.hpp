// Scheduler::process_outputs: sampled tokens are appended, stops checked, and
// finished sequences reported and released. (S29-S32)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

// The smallest of column 0 of a [n, width] array (0 when there is none
// smaller); O3 vectorizes the one-column case.
__attribute__((optimize("O3"))) inline int32_t min_sampled_token(const int32_t *tokens, int n, int width) {
  int32_t smallest = 0;
  if (width == 1) {
    for (int i = 0; i < n; ++i) smallest = std::min(smallest, tokens[i]);
  } else {
    for (int i = 0; i < n; ++i) smallest = std::min(smallest, tokens[static_cast<int64_t>(i) * width]);
  }
  return smallest;
}

inline std::shared_ptr<ProcessResult> Scheduler::process_outputs(SchedulerOutputs &out, const int32_t *tokens,
                                                                 int rows, int width) {
  if (out.booked) throw std::invalid_argument("process_outputs: this step was already booked");
  int n = out.num_seqs();
  // S32: exactly one output position per scheduled sequence.
  if (rows != n) {
    throw std::invalid_argument("process_outputs: " + std::to_string(rows) + " sampled rows for " +
                                std::to_string(n) + " scheduled sequences");
  }
  // A sampled token is a vocabulary id; only drafts (columns 1+) use -1, for rejected.
  const int32_t min_token = min_sampled_token(tokens, n, width);
  if (min_token < 0) {
    throw std::invalid_argument("process_outputs: negative sampled token id " + std::to_string(min_token));
  }
  PoolGuard guard(*this);
  out.booked = true;
  auto res = acquire_(result_pool_);
  res->num_accepted.resize(n);  // every row's entry is written below (no zero fill first)
  std::vector<SequencePtr> chunks;
  int32_t *num_accepted = res->num_accepted.data();
  const SequencePtr *seqs = out.scheduled_seqs.data();
  // Every running sequence one token longer keeps LCFS order (see running_clean_).
  bool keep_clean = !out.prompt_run && out.running_epoch == running_epoch_;
  if (!out.prompt_run && width == 1) {
    // A decode step is booked last row first. schedule() wrote the rows first
    // to last, so the sequences it touched last are still in cache, and the
    // next schedule() starts with the ones booked last: at 1024 running
    // sequences the cache then zig-zags instead of losing each line just
    // before its reuse. The lists the loop appends to are put back in row
    // order after it.
    for (int hi = n; hi > 0; --hi) {
      hi = book_plain_rows_(out, tokens, num_accepted, hi);
      if (hi == 0) break;
      book_row_(out, hi - 1, tokens, width, *res, chunks, keep_clean);
    }
    std::reverse(res->finished.begin(), res->finished.end());
    std::reverse(res->first_token_latencies.begin(), res->first_token_latencies.end());
    std::reverse(res->pushed_tokens_before_finish.begin(), res->pushed_tokens_before_finish.end());
  } else {
    for (int i = 0; i < n; ++i) {
      if (i + 2 * kPrefetchAhead < n) prefetch_hot_lines(seqs[i + 2 * kPrefetchAhead].get());
      if (i + kPrefetchAhead < n) prefetch_token_tail(seqs[i + kPrefetchAhead].get());
      book_row_(out, i, tokens, width, *res, chunks, keep_clean);
    }
  }
  if (!keep_clean) running_clean_ = false;
  for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) waiting.push_front(*it);
  if (out.prompt_run && n > 0) outstanding_prompt_steps_ -= 1;
  for (int b : out.release_blocks_after_step) {
    deferred_blocks_[b] -= 1;
    block_manager_->free_nolock(b);
  }
  for (int s : out.release_states_after_step) {
    deferred_states_[s] -= 1;
    state_manager_->free_nolock(s);
  }
  return res;
}

// One row of process_outputs, any kind.
inline void Scheduler::book_row_(SchedulerOutputs &out, int i, const int32_t *tokens, int width, ProcessResult &res,
                                 std::vector<SequencePtr> &chunks, bool &keep_clean) {
  const SequencePtr &seq = out.scheduled_seqs[i];
  int32_t *num_accepted = res.num_accepted.data();
  if (!out.prompt_run && width == 1 && out.seqlens_q[i] == 1 && seq->epoch == out.epochs[i]) {
    num_accepted[i] = book_plain_(*seq, tokens[i], res);
    keep_clean &= num_accepted[i] == 1 && !seq->is_finished();
    return;
  }
  keep_clean = false;
  num_accepted[i] = 0;
  const int32_t *row = tokens + static_cast<int64_t>(i) * width;
  seq->inflight_steps -= 1;
  if (seq->epoch != out.epochs[i]) {  // preempted for recompute while in flight: void (S29)
    flush_(*seq);
    return;
  }
  seq->schedule.finish_inflight_step();
  seq->cache.advance_optimistically(out.seqlens_q[i]);
  if (seq->is_finished()) {  // aborted while in flight
    report_(*seq, res.finished);
    release_(*seq);
    return;
  }
  if (out.prompt_run) {
    if (seq->cache.num_tokens >= seq->get_len()) {
      num_accepted[i] = 1;
      append_token_(*seq, row[0], res);
      finish_prefill_(seq, res);
    } else {
      if (seq->schedule.status != SequenceStatus::WAITING) {
        throw std::logic_error("process_outputs: chunked prefill of " + seq->request_id + " is not WAITING");
      }
      chunks.push_back(seq);
    }
  } else {
    num_accepted[i] = book_decode_(*seq, row, width, out.seqlens_q[i] - 1, res);
  }
}

// book_plain_ for the rows where nothing but counters move, last to first from
// row hi - 1: one token, not voided, not aborted, not the first token, no stop,
// no length cap, room in the token array. Stops at the first row that is not,
// before touching it, and returns its index + 1 (0 when every row was booked).
// No call in the loop, so what it needs stays in registers.
__attribute__((noinline)) inline int Scheduler::book_plain_rows_(const SchedulerOutputs &out, const int32_t *tokens,
                                                                 int32_t *num_accepted, int hi) {
  const SequencePtr *seqs = out.scheduled_seqs.data();
  const int32_t *seqlens_q = out.seqlens_q.data();
  const int *epochs = out.epochs.data();
  const int max_model_len = cfg_.max_model_len;
  const bool speculative = cfg_.num_speculative_tokens > 0;
  int i = hi - 1;
  for (; i >= 0; --i) {
    if (i >= 2 * kPrefetchAhead) prefetch_hot_lines(seqs[i - 2 * kPrefetchAhead].get());
    if (i >= kPrefetchAhead) prefetch_token_tail(seqs[i - kPrefetchAhead].get());
    Sequence &seq = *seqs[i];
    const int32_t token = tokens[i];
    const auto &ids = seq.data.token_ids;
    const int len = static_cast<int>(ids.size()) + 1;  // after this token
    const int output_len = len - seq.data.prompt_len;
    if (seqlens_q[i] != 1 || seq.epoch != epochs[i] || seq.is_finished() || ids.size() == ids.capacity() ||
        output_len == 1 || len > max_model_len || output_len >= seq.max_tokens || seq.stop_set.overflow ||
        (speculative && !seq.draft.accepted_tokens.empty())) {
      break;
    }
    if (seq.stop_set.matches_inline(token)) break;
    // book_plain_'s counters: the step leaves the pipeline, its token is committed
    // (advance_optimistically(1) then commit_processed_tokens(1) is the first alone).
    seq.inflight_steps -= 1;
    seq.schedule.finish_inflight_step();
    seq.cache.advance_optimistically(1);
    seq.data.append(token);  // capacity checked above: no allocation
    seq.num_pushed_tokens += 1;
    num_accepted[i] = 1;
  }
  return i + 1;
}

inline void Scheduler::finish_prefill_(const SequencePtr &seq, ProcessResult &res) {
  if (seq->is_finished()) {
    free_info_slot_(*seq);
    report_(*seq, res.finished);
    res.pushed_tokens_before_finish.emplace_back(seq->request_id, seq->num_pushed_tokens);
    release_(*seq);
  } else if (cfg_.engine_type == EngineType::PROMPT) {
    // S30: the prompt leaves with its blocks; the lease decides when they return.
    free_info_slot_(*seq);
    handed_off_[seq->request_id] = seq;
    const auto &table = seq->cache.block_table;
    res.handed_off.emplace_back(seq->request_id, std::vector<int32_t>(table.begin(), table.end()));
  } else {
    running.push_back(seq);
    running_epoch_ += 1;
    running_clean_ = false;
  }
}

inline int Scheduler::book_decode_(Sequence &seq, const int32_t *row, int width, int num_drafts, ProcessResult &res) {
  int accepted = 0;
  if (!seq.draft.accepted_tokens.empty()) seq.draft.accepted_tokens.clear();
  // Verified drafts first (a contiguous prefix), then the sampled token.
  for (int j = 1; j <= num_drafts && j < width && !seq.is_finished(); ++j) {
    if (row[j] < 0) break;
    seq.draft.accepted_tokens.push_back(row[j]);
    append_token_(seq, row[j], res);
    accepted += 1;
  }
  seq.draft.num_accepted += accepted;
  if (!seq.is_finished()) {
    append_token_(seq, row[0], res);
    accepted += 1;
  }
  seq.cache.commit_processed_tokens(accepted);
  if (seq.is_finished()) {
    free_info_slot_(seq);
    report_(seq, res.finished);
    res.pushed_tokens_before_finish.emplace_back(seq.request_id, seq.num_pushed_tokens);
    release_(seq);  // stays in `running` until the next decode branch drops it
  }
  return accepted;
}

// process_outputs for the usual decode row: one token in flight, no drafts,
// not voided; the same steps as the general path, without its loops.
__attribute__((always_inline)) inline int Scheduler::book_plain_(Sequence &seq, int32_t token, ProcessResult &res) {
  seq.inflight_steps -= 1;
  seq.schedule.finish_inflight_step();
  seq.cache.advance_optimistically(1);
  if (seq.is_finished()) {  // aborted while in flight
    report_(seq, res.finished);
    release_(seq);
    return 0;
  }
  // Accepted drafts exist only with speculation configured (see book_decode_).
  if (cfg_.num_speculative_tokens > 0 && !seq.draft.accepted_tokens.empty()) seq.draft.accepted_tokens.clear();
  seq.data.append(token);
  const auto &ids = seq.data.token_ids;
  seq.num_pushed_tokens += 1;
  const int len = static_cast<int>(ids.size());
  const int output_len = len - seq.data.prompt_len;
  if (output_len == 1) {
    seq.first_token_latency = now_seconds() - seq.arrival_time;
    res.first_token_latencies.emplace_back(seq.request_id, seq.first_token_latency);
  }
  if (seq.stops_at(token)) {
    seq.schedule.status = SequenceStatus::FINISHED_STOPPED;
  } else if (len > cfg_.max_model_len || output_len >= seq.max_tokens) {
    seq.schedule.status = SequenceStatus::FINISHED_LENGTH_CAPPED;
  }
  seq.cache.commit_processed_tokens(1);
  if (seq.is_finished()) {
    free_info_slot_(seq);
    report_(seq, res.finished);
    res.pushed_tokens_before_finish.emplace_back(seq.request_id, seq.num_pushed_tokens);
    release_(seq);
  }
  return 1;
}

inline void Scheduler::append_token_(Sequence &seq, int32_t token, ProcessResult &res) {
  seq.data.append(token);
  seq.num_pushed_tokens += 1;
  if (seq.get_output_len() == 1) {
    seq.first_token_latency = now_seconds() - seq.arrival_time;
    res.first_token_latencies.emplace_back(seq.request_id, seq.first_token_latency);
  }
  check_stop_(seq);
}

inline void Scheduler::check_stop_(Sequence &seq) const {
  const int32_t token = seq.data.last_token();
  if (seq.stops_at(token)) {
    seq.schedule.status = SequenceStatus::FINISHED_STOPPED;
    return;
  }
  if (seq.get_len() > cfg_.max_model_len) {
    seq.schedule.status = SequenceStatus::FINISHED_LENGTH_CAPPED;
    return;
  }
  if (seq.get_output_len() >= seq.max_tokens) seq.schedule.status = SequenceStatus::FINISHED_LENGTH_CAPPED;
}

}  // namespace baton
