// Scheduler::process_outputs: sampled tokens are appended, stops checked, and
// finished sequences reported and released.
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

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
  for (int i = 0; i < n; ++i) {
    const int32_t token = tokens[static_cast<int64_t>(i) * width];
    if (token < 0) throw std::invalid_argument("process_outputs: negative sampled token id " + std::to_string(token));
  }
  PoolGuard guard(*this);
  out.booked = true;
  auto res = acquire_(result_pool_);
  res->num_accepted.resize(n);  // every row's entry is written by book_row_ (no zero fill first)
  std::vector<SequencePtr> chunks;
  const SequencePtr *seqs = out.scheduled_seqs.data();
  // Every running sequence one token longer keeps LCFS order (see running_clean_).
  bool keep_clean = !out.prompt_run && out.running_epoch == running_epoch_;
  for (int i = 0; i < n; ++i) {
    if (i + 2 * kPrefetchAhead < n) prefetch_hot_lines(seqs[i + 2 * kPrefetchAhead].get());
    if (i + kPrefetchAhead < n) prefetch_token_tail(seqs[i + kPrefetchAhead].get());
    book_row_(out, i, tokens, width, *res, chunks);
    keep_clean &= res->num_accepted[i] == 1 && !seqs[i]->is_finished();
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

// One row of process_outputs: its accepted token count, and the sequence's next queue.
inline void Scheduler::book_row_(SchedulerOutputs &out, int i, const int32_t *tokens, int width, ProcessResult &res,
                                 std::vector<SequencePtr> &chunks) {
  const SequencePtr &seq = out.scheduled_seqs[i];
  int32_t &num_accepted = res.num_accepted[i];
  num_accepted = 0;
  const int32_t *row = tokens + static_cast<int64_t>(i) * width;
  seq->inflight_steps -= 1;
  // S29: a step scheduled before a preemption for recompute is void.
  if (seq->epoch != out.epochs[i]) {
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
    // S30: a finished prompt leaves prefill; a chunk goes back to the head of `waiting`.
    register_blocks_(*seq);  // P5: the chunk's full blocks
    if (seq->cache.num_tokens >= seq->get_len()) {
      num_accepted = 1;
      append_token_(*seq, row[0], res);
      finish_prefill_(seq, res);
    } else {
      if (seq->schedule.status != SequenceStatus::WAITING) {
        throw std::logic_error("process_outputs: chunked prefill of " + seq->request_id + " is not WAITING");
      }
      chunks.push_back(seq);
    }
  } else {
    num_accepted = book_decode_(*seq, row, width, out.seqlens_q[i] - 1, res);
  }
  // S42: the committed KV moved the window on; what fell behind it goes back to the pool.
  if (releases_window_ && !seq->is_finished()) release_out_of_window_(*seq);
}

inline void Scheduler::finish_prefill_(const SequencePtr &seq, ProcessResult &res) {
  if (seq->is_finished()) {
    finish_(*seq, res);
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

// S31: the verified drafts (a contiguous prefix), then the sampled token; the
// KV positions of rejected drafts are given back.
inline int Scheduler::book_decode_(Sequence &seq, const int32_t *row, int width, int num_drafts, ProcessResult &res) {
  int accepted = 0;
  // Without speculation no sequence holds drafts: the draft ledger's line stays untouched.
  const bool speculative = cfg_.num_speculative_tokens > 0;
  if (speculative && !seq.draft.accepted_tokens.empty()) seq.draft.accepted_tokens.clear();
  for (int j = 1; j <= num_drafts && j < width && !seq.is_finished(); ++j) {
    if (row[j] < 0) break;
    seq.draft.accepted_tokens.push_back(row[j]);
    append_token_(seq, row[j], res);
    accepted += 1;
  }
  if (speculative) seq.draft.num_accepted += accepted;
  if (!seq.is_finished()) {
    append_token_(seq, row[0], res);
    accepted += 1;
  }
  seq.cache.commit_processed_tokens(accepted);
  if (seq.is_finished()) finish_(seq, res);  // stays in `running` until the next decode branch drops it
  return accepted;
}

// S32: a sequence that stopped reports how many tokens it pushed.
inline void Scheduler::finish_(Sequence &seq, ProcessResult &res) {
  free_info_slot_(seq);
  report_(seq, res.finished);
  res.pushed_tokens_before_finish.emplace_back(seq.request_id, seq.num_pushed_tokens);
  release_(seq);
}

// S32: time to first token is taken when the first output token is appended.
inline void Scheduler::append_token_(Sequence &seq, int32_t token, ProcessResult &res) {
  seq.data.append(token);
  seq.num_pushed_tokens += 1;
  if (seq.get_output_len() == 1) {
    seq.first_token_latency = now_seconds() - seq.arrival_time;
    res.first_token_latencies.emplace_back(seq.request_id, seq.first_token_latency);
  }
  check_stop_(seq);
}

// S31: the stop check after each appended token.
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
