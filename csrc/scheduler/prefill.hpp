// Scheduler::_schedule_prefill: prompts from the head of `waiting`, chunked to
// the token budget, checkpoints and image boundaries. (S15-S25)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

inline std::shared_ptr<SchedulerOutputs> Scheduler::schedule_prefill_() {
  auto out = acquire_(output_pool_);
  out->prompt_run = true;
  // S19 counts every sequence that holds an info slot: the running ones and the prompts a
  // step not booked yet admitted (they join `running` at booking). Counting `running` alone
  // let two prefill steps scheduled back to back admit past max_num_seqs.
  int num_curr_seqs = num_used_info_slots_;
  int64_t sum_k_remain = cfg_.prefill_max_sum_seqlen_k > 0 ? cfg_.prefill_max_sum_seqlen_k
                                                           : std::numeric_limits<int64_t>::max();
  int num_batched = 0;
  // S17: the longest prompt admitted.
  const int prompt_limit = cfg_.enable_chunked_prefill ? cfg_.max_model_len
                                                       : std::min(cfg_.max_model_len, cfg_.max_num_batched_tokens);
  const int min_chunk = std::max(cfg_.lookahead_tokens, 1);
  while (!waiting.empty()) {
    SequencePtr seq = waiting.front();
    if (seq->is_finished()) {
      report_(*seq, out->ignored);
      release_(*seq);
      waiting.pop_front();
      continue;
    }
    if (!seq->schedule.schedulable) break;  // head-of-line blocking keeps arrival order (S15)
    if (seq->get_len() > prompt_limit) {
      ignore_(seq, "prompt_length_exceeded", *out);
      continue;
    }
    // S19, in order: sequence count, sum of K, then (below) the token budget.
    if (num_curr_seqs + 1 > cfg_.max_num_seqs) break;
    if (sum_k_remain < seq->get_len()) break;
    const bool fresh = seq->cache.block_table.empty();
    const bool prefix_hit = !fresh && !seq->schedule.branch_id.empty() && seq->schedule.branch_id[0] == '_';
    int num_reserve_blocks = 0;
    int to_allocate = 0;
    int num_hits = 0, num_cached_hits = 0;  // P3: automatic prefix-cache hits of a fresh admission
    if (fresh) {
      to_allocate = seq->get_num_blocks();
      if (prefix_) num_hits = match_prefix_(*seq, num_cached_hits);
    } else if (prefix_hit) {
      num_reserve_blocks = seq->cache.num_tokens / cfg_.block_size;
      to_allocate = seq->get_num_blocks() - num_reserve_blocks;
    }
    if (fresh || prefix_hit) {
      AllocStatus st = can_allocate_with_state_(to_allocate);
      // P4: owned hits cost nothing, cached-free hits leave what allocation may evict.
      if (st != AllocStatus::NEVER && num_hits > 0) {
        st = can_allocate_with_state_(to_allocate - num_hits + num_cached_hits);
      }
      if (st == AllocStatus::NEVER) {
        ignore_(seq, "ignored", *out);
        continue;
      }
      if (st == AllocStatus::LATER) break;
    }
    const int start = fresh ? num_hits * cfg_.block_size : seq->cache.num_tokens;
    const int rest = seq->get_len() - start;
    int seqlen_q = rest;
    const int budget_left = cfg_.max_num_batched_tokens - num_batched;
    const int aligned_left = budget_left / cp_align_ * cp_align_;
    if (seqlen_q > aligned_left) {
      if (!cfg_.enable_chunked_prefill) break;
      seqlen_q = aligned_left;  // S20
    }
    seqlen_q = cut_at_checkpoint_(*seq, start, seqlen_q);  // S21
    if (seqlen_q < rest) seqlen_q = adjust_for_images_(*seq, start, seqlen_q, budget_left, min_chunk);  // S22
    if (seqlen_q < min_chunk) break;  // S23
    // S24: side effects only from here on.
    num_batched += (seqlen_q + cp_align_ - 1) / cp_align_ * cp_align_;
    if (fresh) {
      // A fork without KV to share: its blocks are its own from now on.
      if (!seq->schedule.branch_id.empty() && seq->schedule.branch_id[0] == '_') seq->schedule.branch_id.erase(0, 1);
      if (prefix_) admit_hits_(*seq, num_hits, seq->get_len());
      block_manager_->allocate_nolock(to_allocate - num_hits, seq->cache.block_table);
      if (state_manager_) seq->cache.state_id = state_manager_->allocate_single_nolock();
      hold_(seq);
    } else if (prefix_hit) {
      admit_prefix_hit_(*seq, num_reserve_blocks, to_allocate, *out);
    }
    sum_k_remain -= seq->get_len();
    const bool is_chunked = seqlen_q < rest;
    if (!is_chunked) {
      num_curr_seqs += 1;
      seq->schedule.status = SequenceStatus::RUNNING;
      allocate_info_slot_(*seq);
    }
    out->add_seq(seq, seqlen_q);
    seq->schedule.chunked_rest_len = is_chunked ? rest - seqlen_q : 0;
    waiting.pop_front();
    if (is_chunked && cfg_.engine_type == EngineType::NORMAL) break;  // one chunk per step
  }
  out->num_batched_tokens = num_batched;
  if (cfg_.engine_type != EngineType::NORMAL || out->num_seqs() > 0 || !out->ignored.empty()) return out;
  return nullptr;
}

inline void Scheduler::ignore_(const SequencePtr &seq, const char *reason, SchedulerOutputs &out) {
  seq->schedule.status = SequenceStatus::FINISHED_IGNORED;
  seq->finish_reason_override = reason;
  report_(*seq, out.ignored);
  release_(*seq);
  waiting.pop_front();
}

inline int Scheduler::cut_at_checkpoint_(Sequence &seq, int start, int seqlen_q) {
  auto &cps = seq.schedule.chunk_checkpoints;
  while (!cps.empty() && cps.front() <= start) cps.pop_front();
  if (!cps.empty() && start + seqlen_q >= cps.front()) {
    seqlen_q = cps.front() - start;
    cps.pop_front();
  }
  return seqlen_q;
}

inline bool Scheduler::inside_image_pad_(size_t k, const std::vector<int32_t> &t) const {
  return k > 0 && k < t.size() && t[k] == cfg_.image_pad_token_id &&
         (t[k - 1] == cfg_.image_pad_token_id || t[k - 1] == cfg_.image_token_id);
}

// The article's _adjust_chunk_size: never cut a run of image pads in two.
inline int Scheduler::adjust_chunk_size_(int q_len, int old_k_len, const std::vector<int32_t> &t,
                                         bool make_larger) const {
  size_t k = static_cast<size_t>(old_k_len + q_len);
  if (k >= t.size() || !inside_image_pad_(k, t)) return q_len;
  if (make_larger) {
    while (k < t.size() && t[k] == cfg_.image_pad_token_id) ++k;
  } else {
    while (k > static_cast<size_t>(old_k_len) && t[k - 1] == cfg_.image_pad_token_id) --k;
    if (k > static_cast<size_t>(old_k_len) && t[k - 1] == cfg_.image_token_id) --k;
  }
  return static_cast<int>(k) - old_k_len;
}

inline int Scheduler::adjust_for_images_(const Sequence &seq, int start, int seqlen_q, int budget_left,
                                         int min_chunk) const {
  if (cfg_.image_pad_token_id < 0) return seqlen_q;
  const auto &t = seq.data.token_ids;
  int smaller = adjust_chunk_size_(seqlen_q, start, t, false);
  if (smaller >= min_chunk) return smaller;
  // Moving back left too little: run past the images if the budget allows.
  int larger = adjust_chunk_size_(seqlen_q, start, t, true);
  int charged = (larger + cp_align_ - 1) / cp_align_ * cp_align_;
  return charged <= budget_left ? larger : smaller;
}

// S18: blocks fully written by the prefix stay shared; the half-written tail
// is copied to a private block.
inline void Scheduler::admit_prefix_hit_(Sequence &seq, int num_reserve_blocks, int to_allocate,
                                         SchedulerOutputs &out) {
  if (num_reserve_blocks > static_cast<int>(seq.cache.block_table.size())) {
    throw std::logic_error("prefix hit of " + seq.request_id + ": block table shorter than its KV");
  }
  seq.schedule.branch_id.erase(0, 1);
  clone_state_(seq, out);
  std::vector<int> new_blocks;
  block_manager_->allocate_nolock(to_allocate, new_blocks);
  auto &table = seq.cache.block_table;
  size_t keep = static_cast<size_t>(num_reserve_blocks);
  if (seq.cache.num_tokens % cfg_.block_size && !new_blocks.empty()) {
    int src = table[keep];
    out.clone_blocks.push_back(src);
    out.clone_blocks.push_back(new_blocks.front());
    defer_block_(src, out);
    keep += 1;
  }
  for (size_t i = keep; i < table.size(); ++i) block_manager_->free_nolock(table[i]);
  table.resize(num_reserve_blocks);
  seq.cache.table_version += 1;
  table.insert(table.end(), new_blocks.begin(), new_blocks.end());
}

inline void Scheduler::clone_state_(Sequence &seq, SchedulerOutputs &out) {
  if (!state_manager_) return;
  int dst = state_manager_->allocate_single_nolock();
  if (seq.cache.state_id >= 0) {
    out.clone_states.push_back(seq.cache.state_id);
    out.clone_states.push_back(dst);
    out.release_states_after_step.push_back(seq.cache.state_id);
    deferred_states_[seq.cache.state_id] += 1;
  } else {
    out.zero_states.push_back(dst);
  }
  seq.cache.state_id = dst;
}

}  // namespace baton
