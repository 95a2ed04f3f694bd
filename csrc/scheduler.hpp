// Scheduler: decides each step's work shape and books its results.
//
// A request's life in one scheduler:
//   1. add_sequence -> `waiting` (arrival order; nothing allocated, S14)
//   2. _schedule_prefill takes the head of `waiting`, allocates its blocks on the
//      first chunk; a chunk goes back to the head of `waiting` when booked, a
//      whole prompt joins `running` (NORMAL) or is handed off with its blocks (PROMPT)
//   3. _schedule_decode runs `running` youngest first and preempts the oldest
//      when no block is free (LCFS); a COMPLETION engine fills `running` from
//      `prompted` (KV pulled from a prompt engine), forks come through it too
//   4. process_outputs appends sampled tokens and checks stop; resources return
//      to the pools only once no booked-but-unread step can touch them (S8)
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_manager.hpp"
#include "config.hpp"
#include "outputs.hpp"
#include "sequence.hpp"

namespace baton {

struct AddOptions {
  std::vector<int32_t> eos_token_ids;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos{false};
  bool schedulable{true};
  std::vector<int> chunk_checkpoints;
  bool structured_output{false};
};

class Scheduler {
 public:
  using AllReduceMin = std::function<int(int)>;

  Scheduler(const SchedulerConfig &cfg, AllReduceMin all_reduce_min)
      : cfg_((cfg.validate(), cfg)),
        cp_align_(cfg.cp_size > 1 ? 2 * cfg.cp_size : 1),
        block_manager_(std::make_unique<BlockManager>(cfg.num_blocks)),
        all_reduce_min_(std::move(all_reduce_min)) {
    if (cfg.num_state_slots > 0) state_manager_ = std::make_unique<BlockManager>(cfg.num_state_slots + 1);
    deferred_blocks_.assign(cfg.num_blocks, 0);
    deferred_states_.assign(cfg.num_state_slots + 1, 0);
  }

  const SchedulerConfig &config() const { return cfg_; }

  // ---- arrivals -------------------------------------------------------------

  int64_t add_sequence(const std::string &request_id, std::vector<int32_t> prompt, int max_tokens,
                       const AddOptions &opts) {
    auto seq = make_sequence_(request_id, std::move(prompt), max_tokens, opts);
    seq->arrival_time = now_seconds();
    // Reserve, don't allocate: admission happens in schedule() (S14).
    seq->data.token_ids.reserve(seq->data.prompt_len + max_tokens);
    seq->cache.block_table.reserve(seq->block_table_capacity());
    registry_[request_id] = seq;
    waiting.push_back(seq);
    return seq->seq_id;
  }

  void set_schedulable(const std::string &request_id, bool schedulable) {
    lookup_(request_id)->schedule.schedulable = schedulable;
  }

  void set_draft_tokens(const std::string &request_id, const std::vector<int32_t> &tokens) {
    auto &seq = lookup_(request_id);
    if (static_cast<int>(tokens.size()) > cfg_.num_speculative_tokens) {
      throw std::invalid_argument("set_draft_tokens: " + std::to_string(tokens.size()) +
                                  " drafts for " + request_id + " exceed num_speculative_tokens=" +
                                  std::to_string(cfg_.num_speculative_tokens));
    }
    seq->draft.draft_tokens = tokens;
  }

  void set_structured_output_status(const std::string &request_id, int status) {
    lookup_(request_id)->structured_output.status = status;
  }

  // Marks a request failed outside the scheduler (vision encoder, grammar);
  // the queues drop it like an abort.
  void fail_sequence(const std::string &request_id, SequenceStatus status) {
    if (!is_finished_status(status)) {
      throw std::invalid_argument("fail_sequence: status " + std::to_string(static_cast<int>(status)) +
                                  " is not a finished status");
    }
    auto seq = lookup_(request_id);
    if (seq->is_finished()) return;
    if (release_detached_(seq)) return;
    seq->schedule.status = status;
    pending_sweep_ = true;
  }

  // S16: a new branch sharing the parent's prefix KV. Blocks and state are
  // pinned, not copied; the possibly half-written tail block is cloned on admission.
  int64_t fork_seq(const std::string &parent_id, const std::string &child_id, const std::string &branch_id) {
    PoolGuard guard(*this);
    auto parent = lookup_(parent_id);
    if (parent->is_finished()) throw std::invalid_argument("fork_seq: parent " + parent_id + " is finished");
    if (parent->inflight_steps > 0) {
      throw std::invalid_argument("fork_seq: parent " + parent_id + " has a step in flight; book it first");
    }
    if (registry_.count(child_id)) throw std::invalid_argument("fork_seq: duplicate request id " + child_id);
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
    int bs = cfg_.block_size;
    int num_kv_blocks = (parent->cache.num_tokens + bs - 1) / bs;
    child->cache.block_table.assign(parent->cache.block_table.begin(),
                                    parent->cache.block_table.begin() + num_kv_blocks);
    child->cache.table_version += 1;
    for (int b : child->cache.block_table) block_manager_->pin_block_nolock(b);
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
    } else {
      child->schedule.status = SequenceStatus::WAITING;
      child->schedule.branch_id = "_" + (branch_id.empty() ? std::string("fork") : branch_id);
      waiting.push_front(child);
    }
    return child->seq_id;
  }

  // ---- COMPLETION engine: KV arrives from a prompt engine ---------------------

  std::pair<AllocStatus, std::vector<int32_t>> allocate_prompted(const std::string &request_id,
                                                                 std::vector<int32_t> prompt,
                                                                 int32_t first_token_id, int max_tokens,
                                                                 const AddOptions &opts) {
    PoolGuard guard(*this);
    auto seq = make_sequence_(request_id, std::move(prompt), max_tokens, opts);
    int prompt_len = seq->data.prompt_len;
    if (prompt_len + 1 > cfg_.max_model_len) return {AllocStatus::NEVER, {}};
    int bs = cfg_.block_size;
    int n = (prompt_len + bs - 1) / bs;  // the blocks the prompt KV lands in
    AllocStatus st = can_allocate_with_state_(n);
    if (st != AllocStatus::OK) return {st, {}};
    seq->arrival_time = now_seconds();
    seq->data.token_ids.reserve(prompt_len + max_tokens);
    seq->data.token_ids.push_back(first_token_id);
    seq->cache.num_tokens = prompt_len;  // KV covers the prompt; the first token is fed next
    seq->cache.block_table.reserve(seq->block_table_capacity());
    block_manager_->allocate_nolock(n, seq->cache.block_table);
    if (state_manager_) seq->cache.state_id = state_manager_->allocate_single_nolock();
    hold_(seq);
    registry_[request_id] = seq;
    allocated_[request_id] = seq;
    return {AllocStatus::OK, std::vector<int32_t>(seq->cache.block_table.begin(), seq->cache.block_table.end())};
  }

  void commit_prompted(const std::string &request_id) {
    auto it = allocated_.find(request_id);
    if (it == allocated_.end()) {
      throw std::out_of_range("commit_prompted: no allocated-but-uncommitted request " + request_id);
    }
    auto seq = it->second;
    allocated_.erase(it);
    check_stop_(*seq);  // the first token may already end it; the decode branch then drops it
    prompted.emplace_back(seq, false);
  }

  bool free_prompted(const std::string &request_id) {
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

  // ---- PROMPT engine: prompts leave with their blocks -------------------------

  void release_handed_off(const std::string &request_id) {
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
  void abort_sequence(const std::string &request_id) {
    auto seq = lookup_(request_id);
    if (seq->is_finished()) return;
    if (release_detached_(seq)) return;
    seq->schedule.status = SequenceStatus::FINISHED_ABORTED;
    pending_sweep_ = true;
  }

  // ---- the step ---------------------------------------------------------------

  std::shared_ptr<SchedulerOutputs> schedule() {
    PoolGuard guard(*this);
    FinishedList swept;
    if (pending_sweep_) sweep_dead_(swept);
    auto out = schedule_();
    for (auto &f : swept) out->finished.push_back(std::move(f));
    if (out->prompt_run) {
      decode_step_ = 0;
      if (out->num_seqs() > 0) outstanding_prompt_steps_ += 1;
    } else {
      decode_step_ += 1;
      if (outstanding_prompt_steps_ == 0 && num_used_info_slots_ != static_cast<int>(running.size())) {
        throw std::logic_error("info slots in use " + std::to_string(num_used_info_slots_) +
                               " != running " + std::to_string(running.size()));
      }
    }
    build_metadata_(*out);
    return out;
  }

  std::shared_ptr<ProcessResult> process_outputs(SchedulerOutputs &out, const int32_t *tokens, int rows, int width) {
    if (out.booked) throw std::invalid_argument("process_outputs: this step was already booked");
    int n = out.num_seqs();
    // S32: exactly one output position per scheduled sequence.
    if (rows != n) {
      throw std::invalid_argument("process_outputs: " + std::to_string(rows) + " sampled rows for " +
                                  std::to_string(n) + " scheduled sequences");
    }
    PoolGuard guard(*this);
    out.booked = true;
    auto res = acquire_(result_pool_);
    res->num_accepted.assign(n, 0);
    std::vector<SequencePtr> chunks;
    for (int i = 0; i < n; ++i) {
      const SequencePtr &seq = out.scheduled_seqs[i];
      const int32_t *row = tokens + static_cast<int64_t>(i) * width;
      seq->inflight_steps -= 1;
      if (seq->epoch != out.epochs[i]) {  // preempted for recompute while in flight: void (S29)
        flush_(*seq);
        continue;
      }
      seq->schedule.finish_inflight_step();
      seq->cache.advance_optimistically(out.seqlens_q[i]);
      if (seq->is_finished()) {  // aborted while in flight
        report_(*seq, res->finished);
        release_(*seq);
        continue;
      }
      if (out.prompt_run) {
        if (seq->cache.num_tokens >= seq->get_len()) {
          res->num_accepted[i] = 1;
          append_token_(*seq, row[0], *res);
          finish_prefill_(seq, *res);
        } else {
          if (seq->schedule.status != SequenceStatus::WAITING) {
            throw std::logic_error("process_outputs: chunked prefill of " + seq->request_id + " is not WAITING");
          }
          chunks.push_back(seq);
        }
      } else {
        res->num_accepted[i] = book_decode_(*seq, row, width, out.seqlens_q[i] - 1, *res);
      }
    }
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

  // ---- queries ------------------------------------------------------------------

  int num_free_blocks() const { return block_manager_->num_free_blocks(); }
  int num_total_blocks() const { return block_manager_->num_total_blocks(); }
  int num_free_state_slots() const { return state_manager_ ? state_manager_->num_free_blocks() : 0; }
  int num_total_state_slots() const { return state_manager_ ? state_manager_->num_total_blocks() : 0; }
  int num_waiting() const { return static_cast<int>(waiting.size()); }
  int num_running() const { return static_cast<int>(running.size()); }
  int num_prompted() const { return static_cast<int>(prompted.size()); }
  int num_handed_off() const { return static_cast<int>(handed_off_.size()); }
  int num_allocated_prompted() const { return static_cast<int>(allocated_.size()); }
  int num_used_info_slots() const { return num_used_info_slots_; }
  bool has_unfinished() const {
    return !waiting.empty() || !running.empty() || !prompted.empty() || !allocated_.empty();
  }
  uint32_t decode_step() const { return decode_step_; }
  int ref_count(int block_id) const { return block_manager_->ref_count(block_id); }

  // S12
  double get_gpu_cache_usage(int n_planned = 0) const {
    int total = num_total_blocks();
    return static_cast<double>(total - num_free_blocks() + n_planned) / total;
  }

  std::vector<std::string> live_request_ids() const {
    std::vector<std::string> ids;
    ids.reserve(registry_.size());
    for (auto &kv : registry_) ids.push_back(kv.first);
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  SequencePtr find(const std::string &request_id) const {
    auto it = registry_.find(request_id);
    return it == registry_.end() ? nullptr : it->second;
  }

  // Debug: every block's ref count equals its owners, the free list holds
  // exactly the unowned blocks, and no sequence sits in two queues.
  void check_invariants() const {
    std::vector<int> owners(cfg_.num_blocks, 0), state_owners(state_manager_ ? cfg_.num_state_slots + 1 : 0, 0);
    for (auto &kv : holding_) {
      const Sequence &s = *kv.second;
      for (int b : s.cache.block_table) owners.at(b) += 1;
      for (int b : s.zombie_blocks) owners.at(b) += 1;
      if (s.cache.state_id >= 0) state_owners.at(s.cache.state_id) += 1;
      for (int st : s.zombie_states) state_owners.at(st) += 1;
    }
    for (int b = 0; b < cfg_.num_blocks; ++b) owners[b] += deferred_blocks_[b];
    if (state_manager_) {
      for (size_t st = 0; st < deferred_states_.size(); ++st) state_owners[st] += deferred_states_[st];
    }
    check_pool_(*block_manager_, owners, "block");
    if (state_manager_) check_pool_(*state_manager_, state_owners, "state slot");
    std::unordered_map<const Sequence *, int> seen;
    for (auto &s : waiting) seen[s.get()] += 1;
    for (auto &s : running) seen[s.get()] += 1;
    for (auto &p : prompted) seen[std::get<0>(p).get()] += 1;
    for (auto &kv : handed_off_) seen[kv.second.get()] += 1;
    for (auto &kv : allocated_) seen[kv.second.get()] += 1;
    for (auto &kv : seen) {
      if (kv.second > 1) throw std::logic_error("sequence " + kv.first->request_id + " sits in two queues");
    }
  }

  std::deque<SequencePtr> waiting;
  std::vector<SequencePtr> running;
  std::deque<std::tuple<SequencePtr, bool>> prompted;

 private:
  // S11: state pool first, then KV pool, for a whole call.
  struct PoolGuard {
    explicit PoolGuard(Scheduler &s) {
      if (s.state_manager_) state_lock = std::unique_lock<std::mutex>(s.state_manager_->mutex());
      kv_lock = std::unique_lock<std::mutex>(s.block_manager_->mutex());
    }
    std::unique_lock<std::mutex> state_lock;
    std::unique_lock<std::mutex> kv_lock;
  };

  // ---- _schedule: step type and voting (S33-S35) ------------------------------

  std::shared_ptr<SchedulerOutputs> schedule_() {
    if (cfg_.engine_type == EngineType::COMPLETION) return schedule_decode_();
    if (cfg_.engine_type == EngineType::PROMPT) return schedule_prefill_();
    bool is_any_point = decode_step_ != 0 && decode_step_ % cfg_.prefill_any_attempt_interval == 0;
    bool is_all_point = decode_step_ % cfg_.prefill_attempt_interval == 0;
    if (!is_any_point && !is_all_point) return schedule_decode_();
    bool want = get_gpu_cache_usage() <= cfg_.watermark && has_prefill_waiting_();
    bool do_prefill = is_any_point ? all_reduce_min_or_self_(want ? 0 : 1) == 0
                                   : all_reduce_min_or_self_(want ? 1 : 0) == 1;
    if (!do_prefill) return schedule_decode_();
    auto outputs = schedule_prefill_();
    // Vote 2: with nobody scheduled, an empty prompt step would reset decode_step
    // and land on the next ALL point again, forever.
    bool any_scheduled = all_reduce_min_or_self_(outputs ? 0 : 1) == 0;
    if (!any_scheduled) return schedule_decode_();
    if (outputs) return outputs;
    auto empty = acquire_(output_pool_);
    empty->prompt_run = true;
    return empty;
  }

  // An object is reused only when the pool holds its last reference: no Python
  // object and no numpy view can see the buffers being refilled.
  template <typename T>
  static std::shared_ptr<T> acquire_(std::vector<std::shared_ptr<T>> &pool) {
    for (auto &p : pool) {
      if (p.use_count() == 1) {
        p->reset();
        return p;
      }
    }
    auto p = std::make_shared<T>();
    if (pool.size() < kPoolSize) pool.push_back(p);
    return p;
  }

  int all_reduce_min_or_self_(int value) { return all_reduce_min_ ? all_reduce_min_(value) : value; }

  bool has_prefill_waiting_() const { return !waiting.empty() && waiting.front()->schedule.schedulable; }

  AllocStatus can_allocate_with_state_(int n) const {
    AllocStatus status = block_manager_->can_allocate_nolock(n);
    if (status == AllocStatus::OK && state_manager_ && state_manager_->can_allocate_nolock(1) == AllocStatus::LATER) {
      status = AllocStatus::LATER;
    }
    return status;
  }

  // ---- _schedule_prefill (S15-S25) --------------------------------------------

  std::shared_ptr<SchedulerOutputs> schedule_prefill_() {
    auto out = acquire_(output_pool_);
    out->prompt_run = true;
    int num_curr_seqs = static_cast<int>(running.size());
    int64_t sum_k_remain = cfg_.prefill_max_sum_seqlen_k > 0 ? cfg_.prefill_max_sum_seqlen_k
                                                             : std::numeric_limits<int64_t>::max();
    int num_batched = 0;
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
      if (fresh) {
        to_allocate = seq->get_num_blocks();
      } else if (prefix_hit) {
        num_reserve_blocks = seq->cache.num_tokens / cfg_.block_size;
        to_allocate = seq->get_num_blocks() - num_reserve_blocks;
      }
      if (fresh || prefix_hit) {
        AllocStatus st = can_allocate_with_state_(to_allocate);
        if (st == AllocStatus::NEVER) {
          ignore_(seq, "ignored", *out);
          continue;
        }
        if (st == AllocStatus::LATER) break;
      }
      const int start = seq->cache.num_tokens;
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
        block_manager_->allocate_nolock(to_allocate, seq->cache.block_table);
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

  void ignore_(const SequencePtr &seq, const char *reason, SchedulerOutputs &out) {
    seq->schedule.status = SequenceStatus::FINISHED_IGNORED;
    seq->finish_reason_override = reason;
    report_(*seq, out.ignored);
    release_(*seq);
    waiting.pop_front();
  }

  int cut_at_checkpoint_(Sequence &seq, int start, int seqlen_q) {
    auto &cps = seq.schedule.chunk_checkpoints;
    while (!cps.empty() && cps.front() <= start) cps.pop_front();
    if (!cps.empty() && start + seqlen_q >= cps.front()) {
      seqlen_q = cps.front() - start;
      cps.pop_front();
    }
    return seqlen_q;
  }

  bool inside_image_pad_(size_t k, const std::vector<int32_t> &t) const {
    return k > 0 && k < t.size() && t[k] == cfg_.image_pad_token_id &&
           (t[k - 1] == cfg_.image_pad_token_id || t[k - 1] == cfg_.image_token_id);
  }

  // The article's _adjust_chunk_size: never cut a run of image pads in two.
  int adjust_chunk_size_(int q_len, int old_k_len, const std::vector<int32_t> &t, bool make_larger) const {
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

  int adjust_for_images_(const Sequence &seq, int start, int seqlen_q, int budget_left, int min_chunk) const {
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
  void admit_prefix_hit_(Sequence &seq, int num_reserve_blocks, int to_allocate, SchedulerOutputs &out) {
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

  void clone_state_(Sequence &seq, SchedulerOutputs &out) {
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

  // ---- _schedule_decode (S26-S28) ---------------------------------------------

  std::shared_ptr<SchedulerOutputs> schedule_decode_() {
    auto out = acquire_(output_pool_);
    out->prompt_run = false;
    bool sorted = drop_finished_running_(*out);
    drop_finished_waiting_(*out);
    if (!prompted.empty()) {
      admit_prompted_(*out);
      sorted = false;
    }
    // Usually sorted already (running keeps the last step's order), and the
    // O(n) check rides along the pass that drops finished sequences.
    if (!sorted) std::sort(running.begin(), running.end(), lcfs_before_);
    size_t l = 0, r = running.size();
    size_t first_scheduled = r;
    const int max_seqs = cfg_.max_num_seqs;
    while (l < r && out->num_seqs() < max_seqs) {
      const SequencePtr &seq = running[r - 1];
      trim_drafts_(*seq);
      // The article asks for one free block before every sequence. Baton asks for
      // the blocks this sequence really needs (often 0): with a full pool the
      // literal rule preempts a lone sequence that needs nothing, a livelock
      // under recompute.
      int need = std::max(0, seq->get_num_blocks() - static_cast<int>(seq->cache.block_table.size()));
      while (block_manager_->can_allocate_nolock(need) != AllocStatus::OK && r - l > 1) {
        preempt_(running[l], *out);
        l += 1;
      }
      if (block_manager_->can_allocate_nolock(need) == AllocStatus::OK) {
        append_slot_(*seq);
        out->add_seq(seq, 1 + seq->draft.get_nextn_len());
        first_scheduled = r - 1;
      } else {
        preempt_(seq, *out);
      }
      r -= 1;
    }
    // The batch is youngest first and running keeps oldest first, so running is
    // the batch reversed: the tail it was taken from. The next step's LCFS order
    // is then usually already in place.
    running.erase(running.begin(), running.begin() + first_scheduled);
    return out;
  }

  // LCFS: longest output at the head is preempted first, the youngest at the
  // tail is served first. Ties go by arrival (seq_id), so the order does not
  // flip with each step's tail-first batch.
  static bool lcfs_before_(const SequencePtr &a, const SequencePtr &b) {
    int la = a->get_output_len(), lb = b->get_output_len();
    return la != lb ? la > lb : a->seq_id < b->seq_id;
  }

  // Returns whether the survivors are in LCFS order already.
  bool drop_finished_running_(SchedulerOutputs &out) {
    size_t kept = 0;
    bool sorted = true;
    for (size_t i = 0; i < running.size(); ++i) {
      SequencePtr &seq = running[i];
      if (seq->is_finished()) {
        report_(*seq, out.finished);
        release_(*seq);
      } else {
        if (kept > 0 && sorted && lcfs_before_(seq, running[kept - 1])) sorted = false;
        if (kept != i) running[kept] = std::move(seq);
        ++kept;
      }
    }
    running.resize(kept);
    return sorted;
  }

  // So that a rank holding only dead requests does not want prefill forever (S7).
  void drop_finished_waiting_(SchedulerOutputs &out) {
    if (!pending_sweep_) return;
    for (auto it = waiting.begin(); it != waiting.end();) {
      if ((*it)->is_finished()) {
        report_(**it, out.finished);
        release_(**it);
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
  }

  void admit_prompted_(SchedulerOutputs &out) {
    while (!prompted.empty() && static_cast<int>(running.size()) < cfg_.max_num_seqs) {
      auto [seq, forked] = prompted.front();
      if (seq->is_finished()) {
        report_(*seq, out.finished);
        release_(*seq);
        prompted.pop_front();
        continue;
      }
      if (forked) {
        if ((state_manager_ && !state_manager_->can_allocate_single_nolock()) ||
            !block_manager_->can_allocate_single_nolock()) {
          break;
        }
        clone_state_(*seq, out);
        int new_block = block_manager_->allocate_single_nolock();
        auto &table = seq->cache.block_table;
        if (seq->cache.num_tokens % cfg_.block_size && !table.empty()) {
          int src = table.back();  // half written: parent and child would both write it
          out.clone_blocks.push_back(src);
          out.clone_blocks.push_back(new_block);
          defer_block_(src, out);
          table.back() = new_block;
          seq->cache.table_version += 1;
        } else {
          table.push_back(new_block);
        }
        hold_(seq);
      }
      seq->schedule.status = SequenceStatus::RUNNING;
      allocate_info_slot_(*seq);
      running.push_back(seq);
      prompted.pop_front();
    }
  }

  // Drafts may not push positions past the model length.
  void trim_drafts_(Sequence &seq) const {
    auto &d = seq.draft.draft_tokens;
    if (d.empty()) return;
    int start = seq.cache.num_tokens + seq.schedule.total_inflight_tokens;
    int room = std::max(0, cfg_.max_model_len - (start + 1));
    if (static_cast<int>(d.size()) > room) d.resize(room);
  }

  // S28: the table grows to cover the step's tokens and shrinks when rejected
  // drafts gave positions back.
  void append_slot_(Sequence &seq) {
    auto &table = seq.cache.block_table;
    int n = seq.get_num_blocks();
    while (static_cast<int>(table.size()) < n) table.push_back(block_manager_->allocate_single_nolock());
    while (static_cast<int>(table.size()) > n) {
      block_manager_->free_nolock(table.back());
      table.pop_back();
      seq.cache.table_version += 1;
    }
  }

  // S27: terminate, or recompute from the head of `waiting`. A grammar matcher
  // cannot be replayed, so structured output is never recomputed.
  void preempt_(const SequencePtr &seq, SchedulerOutputs &out) {
    free_info_slot_(*seq);
    // Freed at once, as the article's free_seq_nolock: only steps scheduled after
    // this one can reuse the blocks, and the device runs steps in order; a step of
    // the victim still in flight is voided when booked.
    if (cfg_.stop_preempted_request || seq->structured_output.status != 0) {
      seq->schedule.status = SequenceStatus::FINISHED_PREEMPTED;
      report_(*seq, out.finished);
      release_(*seq, /*now=*/true);
    } else {
      seq->reset_for_recompute();
      seq->schedule.status = SequenceStatus::WAITING;
      release_(*seq, /*now=*/true);
      waiting.push_front(seq);
    }
  }

  // ---- metadata for the model runner (S36, S38) -------------------------------

  void build_metadata_(SchedulerOutputs &out) {
    out.trim();
    const int n = out.num_seqs();
    const int bs = cfg_.block_size;
    out.epochs.resize(n);
    out.seq_ids.resize(n);
    out.seqlens_k.resize(n);
    // add_seq kept the widths: no sequence's table changes once it is in the batch.
    const int total_q = out.num_tokens_q, max_q = out.max_seqlen_q;
    prepare_block_tables_(out, n, out.max_blocks);
    out.input_ids.resize(total_q);
    out.positions.resize(total_q);
    out.slot_mapping.resize(total_q);
    const int nextn = cfg_.num_speculative_tokens;
    const int runtime_max_model_len = cfg_.max_model_len + 2 * nextn;
    int min_k = std::numeric_limits<int>::max(), max_k = 0;
    int64_t sum_qk = 0;
    int t = 0;
    for (int i = 0; i < n; ++i) {
      Sequence &seq = *out.scheduled_seqs[i];
      const int q = out.seqlens_q[i];
      const int start = seq.cache.num_tokens + seq.schedule.total_inflight_tokens;
      const int k = start + q;
      const int position_end = out.prompt_run ? k : k - q + max_q + nextn;
      if (position_end > runtime_max_model_len) {
        throw std::logic_error("position end " + std::to_string(position_end) + " of " + seq.request_id +
                               " exceeds the model length " + std::to_string(runtime_max_model_len));
      }
      out.epochs[i] = seq.epoch;
      out.seq_ids[i] = seq.seq_id;
      out.seqlens_k[i] = k;
      sum_qk += static_cast<int64_t>(q) * k;
      min_k = std::min(min_k, k);
      max_k = std::max(max_k, k);
      fill_block_row_(out, i, seq);
      const int *table = seq.cache.block_table.data();
      const auto &tok = seq.data.token_ids;
      const int len = static_cast<int>(tok.size());
      for (int j = 0; j < q; ++j, ++t) {
        const int pos = start + j;
        int32_t id;
        if (out.prompt_run || j == 0) {
          id = pos < len ? tok[pos] : -1;  // -1: sampled by a step still in flight
        } else {
          id = seq.draft.draft_tokens[j - 1];
        }
        out.input_ids[t] = id;
        out.positions[t] = pos;
        out.slot_mapping[t] = static_cast<int64_t>(table[pos / bs]) * bs + pos % bs;
      }
      seq.schedule.start_inflight_step(q);
      seq.inflight_steps += 1;
      if (!out.prompt_run) {
        seq.draft.num_drafted += q - 1;
        seq.draft.draft_tokens.clear();  // consumed: now counted as tokens in flight
      }
    }
    out.sum_seqlen_qxk = sum_qk;
    out.max_seqlen_k = max_k;
    out.min_seqlen_k = n ? min_k : 0;
    out.attn_tflops = cfg_.attn_flops_per_qk * static_cast<double>(sum_qk) * 1e-12;
    out.total_tflops = out.attn_tflops + cfg_.flops_per_token * total_q * 1e-12;
  }

  // block_tables is [n, max_blocks]; a reused object keeps its rows when the
  // width is unchanged, so most rows need only their newest block written.
  static void prepare_block_tables_(SchedulerOutputs &out, int n, int max_blocks) {
    if (out.table_stride != max_blocks) {
      out.row_cache.clear();  // every row is rewritten in the new layout
      out.table_stride = max_blocks;
    }
    out.row_cache.resize(n);  // rows past n lose their cache: resize does not keep their contents
    out.block_tables.resize(static_cast<size_t>(n) * max_blocks);
  }

  static void fill_block_row_(SchedulerOutputs &out, int i, const Sequence &seq) {
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

  // ---- booking (S29-S32) ------------------------------------------------------

  void finish_prefill_(const SequencePtr &seq, ProcessResult &res) {
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
    }
  }

  int book_decode_(Sequence &seq, const int32_t *row, int width, int num_drafts, ProcessResult &res) {
    int accepted = 0;
    seq.draft.accepted_tokens.clear();
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

  void append_token_(Sequence &seq, int32_t token, ProcessResult &res) {
    seq.data.token_ids.push_back(token);
    seq.num_pushed_tokens += 1;
    if (seq.get_output_len() == 1) {
      seq.first_token_latency = now_seconds() - seq.arrival_time;
      res.first_token_latencies.emplace_back(seq.request_id, seq.first_token_latency);
    }
    check_stop_(seq);
  }

  void check_stop_(Sequence &seq) const {
    const int32_t token = seq.data.last_token();
    if (!seq.ignore_eos && std::find(seq.eos_token_ids.begin(), seq.eos_token_ids.end(), token) != seq.eos_token_ids.end()) {
      seq.schedule.status = SequenceStatus::FINISHED_STOPPED;
      return;
    }
    if (std::find(seq.stop_token_ids.begin(), seq.stop_token_ids.end(), token) != seq.stop_token_ids.end()) {
      seq.schedule.status = SequenceStatus::FINISHED_STOPPED;
      return;
    }
    if (seq.get_len() > cfg_.max_model_len) {
      seq.schedule.status = SequenceStatus::FINISHED_LENGTH_CAPPED;
      return;
    }
    if (seq.get_output_len() >= seq.max_tokens) seq.schedule.status = SequenceStatus::FINISHED_LENGTH_CAPPED;
  }

  // ---- resources ----------------------------------------------------------------

  // Resources leave the sequence now; the pools get them back once no unbooked
  // step can read them (S8).
  void release_(Sequence &seq, bool now = false) {
    auto &table = seq.cache.block_table;
    if (now) {
      for (int b : table) block_manager_->free_nolock(b);
      table.clear();
      seq.cache.table_version += 1;
      if (seq.cache.state_id >= 0) state_manager_->free_nolock(seq.cache.state_id);
      seq.cache.state_id = -1;
    }
    if (!table.empty()) {
      seq.zombie_blocks.insert(seq.zombie_blocks.end(), table.begin(), table.end());
      table.clear();
      seq.cache.table_version += 1;
    }
    if (seq.cache.state_id >= 0) {
      seq.zombie_states.push_back(seq.cache.state_id);
      seq.cache.state_id = -1;
    }
    free_info_slot_(seq);
    flush_(seq);
  }

  void flush_(Sequence &seq) {
    if (seq.inflight_steps > 0) return;
    for (int b : seq.zombie_blocks) block_manager_->free_nolock(b);
    seq.zombie_blocks.clear();
    for (int s : seq.zombie_states) state_manager_->free_nolock(s);
    seq.zombie_states.clear();
    if (seq.cache.block_table.empty() && seq.cache.state_id < 0) holding_.erase(&seq);
  }

  // The child's reference to a clone source moves to the step that copies it.
  void defer_block_(int src, SchedulerOutputs &out) {
    out.release_blocks_after_step.push_back(src);
    deferred_blocks_[src] += 1;
  }

  void hold_(const SequencePtr &seq) { holding_.emplace(seq.get(), seq); }

  bool release_detached_(const SequencePtr &seq) {
    auto h = handed_off_.find(seq->request_id);
    auto a = allocated_.find(seq->request_id);
    bool handed = h != handed_off_.end() && h->second == seq;
    bool allocated = a != allocated_.end() && a->second == seq;
    if (!handed && !allocated) return false;
    PoolGuard guard(*this);
    if (handed) handed_off_.erase(h);
    if (allocated) allocated_.erase(a);
    seq->schedule.status = SequenceStatus::FINISHED_ABORTED;
    seq->reported = true;
    unregister_(*seq);
    release_(*seq);
    return true;
  }

  void sweep_dead_(FinishedList &finished) {
    for (auto it = waiting.begin(); it != waiting.end();) {
      if ((*it)->is_finished()) {
        report_(**it, finished);
        release_(**it);
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = prompted.begin(); it != prompted.end();) {
      auto &seq = std::get<0>(*it);
      if (seq->is_finished()) {
        report_(*seq, finished);
        release_(*seq);
        it = prompted.erase(it);
      } else {
        ++it;
      }
    }
    pending_sweep_ = false;
  }

  void allocate_info_slot_(Sequence &seq) {
    if (seq.draft.info_slot >= 0) return;
    if (free_info_slots_.empty()) {
      seq.draft.info_slot = next_info_slot_++;
    } else {
      seq.draft.info_slot = free_info_slots_.back();
      free_info_slots_.pop_back();
    }
    num_used_info_slots_ += 1;
  }

  void free_info_slot_(Sequence &seq) {
    if (seq.draft.info_slot < 0) return;
    free_info_slots_.push_back(seq.draft.info_slot);
    seq.draft.info_slot = -1;
    num_used_info_slots_ -= 1;
  }

  void report_(Sequence &seq, FinishedList &dst) {
    if (seq.reported) return;
    seq.reported = true;
    dst.emplace_back(seq.request_id, seq.finish_reason());
    unregister_(seq);
  }

  void unregister_(const Sequence &seq) {
    auto it = registry_.find(seq.request_id);
    if (it != registry_.end() && it->second.get() == &seq) registry_.erase(it);
  }

  const SequencePtr &lookup_(const std::string &request_id) const {
    auto it = registry_.find(request_id);
    if (it == registry_.end()) throw std::out_of_range("unknown request id " + request_id);
    return it->second;
  }

  SequencePtr make_sequence_(const std::string &request_id, std::vector<int32_t> prompt, int max_tokens,
                             const AddOptions &opts) {
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
    seq->data.token_ids = std::move(prompt);
    seq->cache.block_size = cfg_.block_size;
    seq->max_tokens = max_tokens;
    seq->eos_token_ids = opts.eos_token_ids;
    seq->stop_token_ids = opts.stop_token_ids;
    seq->ignore_eos = opts.ignore_eos;
    seq->schedule.schedulable = opts.schedulable;
    seq->structured_output.status = opts.structured_output ? 1 : 0;
    std::vector<int> cps = opts.chunk_checkpoints;
    std::sort(cps.begin(), cps.end());
    seq->schedule.chunk_checkpoints.assign(cps.begin(), cps.end());
    return seq;
  }

  static void check_pool_(const BlockManager &pool, const std::vector<int> &owners, const char *what) {
    std::vector<char> on_free_list(pool.num_blocks(), 0);
    for (int id : pool.free_list()) {
      if (on_free_list[id]) throw std::logic_error(std::string(what) + " " + std::to_string(id) + " listed twice");
      on_free_list[id] = 1;
    }
    for (int id = 1; id < pool.num_blocks(); ++id) {
      int refs = pool.ref_count(id);
      if (refs != owners[id]) {
        throw std::logic_error(std::string(what) + " " + std::to_string(id) + " has ref count " +
                               std::to_string(refs) + " but " + std::to_string(owners[id]) + " owners");
      }
      if ((refs == 0) != (on_free_list[id] != 0)) {
        throw std::logic_error(std::string(what) + " " + std::to_string(id) + " is free xor owned violated");
      }
    }
    if (owners[0] != 0) throw std::logic_error(std::string(what) + " 0 (null) is owned");
  }

  const SchedulerConfig cfg_;
  const int cp_align_;
  std::unique_ptr<BlockManager> block_manager_;
  std::unique_ptr<BlockManager> state_manager_;
  AllReduceMin all_reduce_min_;
  uint32_t decode_step_{0};
  int64_t next_seq_id_{0};
  int outstanding_prompt_steps_{0};
  bool pending_sweep_{false};
  std::unordered_map<std::string, SequencePtr> registry_;  // live request ids
  std::unordered_map<std::string, SequencePtr> handed_off_;
  std::unordered_map<std::string, SequencePtr> allocated_;
  std::unordered_map<const Sequence *, SequencePtr> holding_;  // every sequence holding pool resources
  std::vector<int> deferred_blocks_;  // clone-source refs held by unbooked steps
  std::vector<int> deferred_states_;
  std::vector<int> free_info_slots_;
  int next_info_slot_{0};
  int num_used_info_slots_{0};
  static constexpr size_t kPoolSize = 4;  // two steps in flight, plus what a caller keeps a while
  std::vector<std::shared_ptr<SchedulerOutputs>> output_pool_;
  std::vector<std::shared_ptr<ProcessResult>> result_pool_;
};

}  // namespace baton
