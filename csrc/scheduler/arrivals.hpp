// Scheduler arrivals and departures outside the step: add, fork, abort, and the
// two disaggregated hand-overs (COMPLETION: KV arrives; PROMPT: prompts leave with their blocks). (S7, S14, S16, S30)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

inline int64_t Scheduler::add_sequence(const std::string &request_id, std::vector<int32_t> prompt, int max_tokens,
                                       const AddOptions &opts) {
  auto seq = make_sequence_(request_id, std::move(prompt), max_tokens, opts);
  seq->arrival_time = now_seconds();
  // Reserve, don't allocate: admission happens in schedule() (S14).
  seq->data.reserve_outputs(max_tokens);
  seq->cache.block_table.reserve(seq->block_table_capacity());
  registry_[request_id] = seq;
  waiting.push_back(seq);
  return seq->seq_id;
}

inline void Scheduler::set_draft_tokens(const std::string &request_id, const std::vector<int32_t> &tokens) {
  auto &seq = lookup_(request_id);
  if (static_cast<int>(tokens.size()) > cfg_.num_speculative_tokens) {
    throw std::invalid_argument("set_draft_tokens: " + std::to_string(tokens.size()) +
                                " drafts for " + request_id + " exceed num_speculative_tokens=" +
                                std::to_string(cfg_.num_speculative_tokens));
  }
  seq->draft.draft_tokens = tokens;
  running_clean_ = false;
}

// Marks a request failed outside the scheduler (vision encoder, grammar);
// the queues drop it like an abort.
inline void Scheduler::fail_sequence(const std::string &request_id, SequenceStatus status) {
  if (!is_finished_status(status)) {
    throw std::invalid_argument("fail_sequence: status " + std::to_string(static_cast<int>(status)) +
                                " is not a finished status");
  }
  auto seq = lookup_(request_id);
  if (seq->is_finished()) return;
  if (release_detached_(seq)) return;
  seq->schedule.status = status;
  pending_sweep_ = true;
  running_clean_ = false;
}

// S16: a new branch sharing the parent's prefix KV. Blocks and state are
// pinned, not copied; the possibly half-written tail block is cloned on admission.
// last_token_id >= 0 replaces the child's newest output token, which has no KV
// yet: n > 1 choices share the prompt but each samples its own first token.
inline int64_t Scheduler::fork_seq(const std::string &parent_id, const std::string &child_id,
                                   const std::string &branch_id, int32_t last_token_id) {
  PoolGuard guard(*this);
  auto parent = lookup_(parent_id);
  if (parent->is_finished()) throw std::invalid_argument("fork_seq: parent " + parent_id + " is finished");
  if (parent->inflight_steps > 0) {
    throw std::invalid_argument("fork_seq: parent " + parent_id + " has a step in flight; book it first");
  }
  if (registry_.count(child_id)) throw std::invalid_argument("fork_seq: duplicate request id " + child_id);
  const bool own_last = last_token_id >= 0;
  if (own_last && (parent->get_output_len() < 1 || parent->cache.num_tokens != parent->get_len() - 1)) {
    throw std::invalid_argument("fork_seq: last_token_id for " + child_id + " needs a parent whose only token "
                                "without KV is its newest output; " + parent_id + " has " +
                                std::to_string(parent->get_output_len()) + " outputs, KV for " +
                                std::to_string(parent->cache.num_tokens) + " of " +
                                std::to_string(parent->get_len()) + " tokens");
  }
  auto child = std::make_shared<Sequence>(*parent);
  child->seq_id = next_seq_id_++;
  child->request_id = child_id;
  child->arrival_time = now_seconds();
  child->first_token_latency = -1.0;
  child->num_pushed_tokens = 0;
  child->epoch = 0;
  child->inflight_steps = 0;
  child->zombie_blocks.clear();
  child->zombie_states.clear();
  child->reported = false;
  child->draft = DraftState{};
  child->schedule.chunked_rest_len = 0;
  child->schedule.total_inflight_tokens = 0;
  child->schedule.last_inflight_tokens = 0;
  // Only the blocks that hold KV are shared; the rest are the child's own business.
  int num_kv_blocks = num_blocks_for(parent->cache.num_tokens, cfg_.block_size);
  child->cache.block_table.assign(parent->cache.block_table.begin(),
                                  parent->cache.block_table.begin() + num_kv_blocks);
  child->cache.table_version += 1;
  for (int b : child->cache.block_table) {
    if (b != 0) block_manager_->pin_block_nolock(b);  // 0: released by the parent's window (S42)
  }
  if (parent->cache.state_id >= 0 && num_kv_blocks > 0) {
    state_manager_->pin_block_nolock(parent->cache.state_id);
  } else {
    child->cache.state_id = -1;
  }
  if (!child->cache.block_table.empty() || child->cache.state_id >= 0) hold_(child);
  registry_[child_id] = child;
  bool prompt_done = parent->cache.num_tokens >= parent->get_len() - 1 && parent->get_output_len() > 0;
  if (prompt_done) {
    child->schedule.status = SequenceStatus::WAITING;  // RUNNING once admitted from `prompted`
    child->schedule.branch_id = branch_id.empty() ? "fork" : branch_id;
    prompted.emplace_back(child, true);
    if (own_last) {
      child->data.token_ids.back() = last_token_id;
      child->data.last_token_id = last_token_id;
      check_stop_(*child);  // its own token may end it: admission from `prompted` drops it
    }
  } else {
    child->schedule.status = SequenceStatus::WAITING;
    child->schedule.branch_id = "_" + (branch_id.empty() ? std::string("fork") : branch_id);
    waiting.push_front(child);
  }
  return child->seq_id;
}

// P7: the first num_hits blocks are local prefix-cache hits (pinned; no pull),
// the rest are fresh and take the pull. The last prompt block is always
// pulled, so every admission pulls something. S42, P9: with a sliding window
// the blocks before the window of the first decode query are neither
// allocated nor pulled (null entries), and hits are looked up from the
// window's first block; the count returned covers both kinds of entry that
// need no pull.
inline std::tuple<AllocStatus, std::vector<int32_t>, int> Scheduler::allocate_prompted(
    const std::string &request_id, std::vector<int32_t> prompt, int32_t first_token_id, int max_tokens,
    const AddOptions &opts, const std::vector<uint64_t> &block_keys) {
  PoolGuard guard(*this);
  auto seq = make_sequence_(request_id, std::move(prompt), max_tokens, opts);
  int prompt_len = seq->data.prompt_len;
  int bs = cfg_.block_size;
  if (static_cast<int>(block_keys.size()) > prompt_len / bs) {
    throw std::invalid_argument("allocate_prompted: " + std::to_string(block_keys.size()) + " block keys for " +
                                request_id + ", whose prompt has " + std::to_string(prompt_len / bs) + " full blocks");
  }
  if (prompt_len + 1 > cfg_.max_model_len) return {AllocStatus::NEVER, {}, 0};
  int n = num_blocks_for(prompt_len, bs);  // the blocks the prompt KV lands in
  const int num_out = num_out_of_window_blocks_(prompt_len);  // S42: < n, the last block stays
  AllocStatus st = can_allocate_with_state_(n - num_out);
  int num_hits = 0, num_cached_hits = 0;
  if (prefix_ && st != AllocStatus::NEVER) {
    const int max_hits = std::min(static_cast<int>(block_keys.size()), n - 1);
    const int32_t *tokens = seq->data.token_ids.data();
    prefix_hits_.clear();
    for (int i = num_out; i < max_hits; ++i) {
      const int id = prefix_->find(block_keys[i], i ? block_keys[i - 1] : seq->prefix.seed,
                                   tokens + static_cast<size_t>(i) * bs);
      if (id < 0) break;
      prefix_hits_.push_back(id);
      if (block_manager_->ref_count(id) == 0) num_cached_hits += 1;
    }
    num_hits = static_cast<int>(prefix_hits_.size());
    if (num_hits > 0) st = can_allocate_with_state_(n - num_out - num_hits + num_cached_hits);  // P4
  }
  if (st != AllocStatus::OK) return {st, {}, 0};
  seq->arrival_time = now_seconds();
  seq->data.reserve_outputs(max_tokens);
  seq->data.append(first_token_id);
  auto &table = seq->cache.block_table;
  table.reserve(seq->block_table_capacity());
  if (prefix_) {
    admit_hits_(*seq, num_hits, prompt_len);
    seq->prefix.kv_pending = true;  // nothing is keyed before the pull lands (commit_prompted)
  }
  if (num_out > 0) {
    table.insert(table.begin(), num_out, 0);
    seq->cache.swa_valid_start = num_out * bs;
    seq->prefix.num_registered += num_out;
  }
  seq->cache.num_tokens = prompt_len;  // KV covers the prompt; the first token is fed next
  block_manager_->allocate_nolock(n - num_out - num_hits, table);
  if (state_manager_) seq->cache.state_id = state_manager_->allocate_single_nolock();
  hold_(seq);
  registry_[request_id] = seq;
  allocated_[request_id] = seq;
  return {AllocStatus::OK, std::vector<int32_t>(table.begin(), table.end()), num_out + num_hits};
}

inline void Scheduler::commit_prompted(const std::string &request_id) {
  auto it = allocated_.find(request_id);
  if (it == allocated_.end()) {
    throw std::out_of_range("commit_prompted: no allocated-but-uncommitted request " + request_id);
  }
  auto seq = it->second;
  PoolGuard guard(*this);
  allocated_.erase(it);
  seq->prefix.kv_pending = false;
  register_blocks_(*seq);  // P7: the pulled prompt's full blocks
  check_stop_(*seq);  // the first token may already end it; the decode branch then drops it
  prompted.emplace_back(seq, false);
}

inline bool Scheduler::free_prompted(const std::string &request_id) {
  auto it = allocated_.find(request_id);
  if (it == allocated_.end()) return false;  // idempotent: an abort may have freed it already
  auto seq = it->second;
  PoolGuard guard(*this);
  seq->schedule.status = SequenceStatus::FINISHED_ABORTED;
  seq->reported = true;
  allocated_.erase(it);
  unregister_(*seq);
  release_(*seq);
  return true;
}

inline void Scheduler::release_handed_off(const std::string &request_id) {
  auto it = handed_off_.find(request_id);
  if (it == handed_off_.end()) throw std::out_of_range("release_handed_off: unknown request id " + request_id);
  auto seq = it->second;
  PoolGuard guard(*this);
  handed_off_.erase(it);
  seq->schedule.status = SequenceStatus::FINISHED_STOPPED;
  seq->reported = true;
  unregister_(*seq);
  release_(*seq);
}

// S7: only marks; the queues drop it and its resources return after the last
// step that may read them. Detached sequences (handed off, allocated but not
// committed) sit in no queue, so they are freed here.
inline void Scheduler::abort_sequence(const std::string &request_id) {
  auto seq = lookup_(request_id);
  if (seq->is_finished()) return;
  if (release_detached_(seq)) return;
  seq->schedule.status = SequenceStatus::FINISHED_ABORTED;
  pending_sweep_ = true;
  running_clean_ = false;
}

inline SequencePtr Scheduler::make_sequence_(const std::string &request_id, std::vector<int32_t> prompt,
                                             int max_tokens, const AddOptions &opts) {
  if (registry_.count(request_id)) throw std::invalid_argument("duplicate request id " + request_id);
  if (prompt.empty()) throw std::invalid_argument("empty prompt for request " + request_id);
  if (max_tokens < 1) {
    throw std::invalid_argument("max_tokens=" + std::to_string(max_tokens) + " for request " + request_id +
                                " must be >= 1");
  }
  auto seq = std::make_shared<Sequence>();
  seq->seq_id = next_seq_id_++;
  seq->request_id = request_id;
  seq->data.prompt_len = static_cast<int>(prompt.size());
  seq->data.assign(std::move(prompt));
  seq->cache.block_size = cfg_.block_size;
  seq->max_tokens = max_tokens;
  seq->eos_token_ids = opts.eos_token_ids;
  seq->stop_token_ids = opts.stop_token_ids;
  seq->ignore_eos = opts.ignore_eos;
  seq->build_stop_set();
  seq->schedule.schedulable = opts.schedulable;
  seq->structured_output.status = opts.structured_output ? 1 : 0;
  seq->prefix.chain_end = opts.skip_prefix_cache;
  seq->prefix.seed = opts.key_seed.value_or(cfg_.prefix_cache_seed);
  std::vector<int> cps = opts.chunk_checkpoints;
  std::sort(cps.begin(), cps.end());
  seq->schedule.chunk_checkpoints.assign(cps.begin(), cps.end());
  return seq;
}

}  // namespace baton
