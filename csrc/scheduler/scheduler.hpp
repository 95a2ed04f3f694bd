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
#include <iterator>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <optional>
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
  // Prompt logprobs (echo) need every prompt position's logits: no prefix-cache hit, no
  // key (its blocks are not cached either).
  bool skip_prefix_cache{false};
  // P1: key(-1) of this sequence's block-key chain; none = the engine's prefix_cache_seed.
  // A tenant's cache salt gives its own seed, so its blocks match no other tenant's.
  std::optional<uint64_t> key_seed;
};

class Scheduler {
 public:
  using AllReduceMin = std::function<int(int)>;

  Scheduler(const SchedulerConfig &cfg, AllReduceMin all_reduce_min)
      : cfg_((cfg.validate(), cfg)),
        cp_align_(cfg.cp_size > 1 ? 2 * cfg.cp_size : 1),
        bs_shift_((cfg.block_size & (cfg.block_size - 1)) == 0 ? __builtin_ctz(cfg.block_size) : -1),
        releases_window_(cfg.sliding_window > 0 && cfg.engine_type != EngineType::PROMPT),
        block_manager_(std::make_unique<BlockManager>(cfg.num_blocks)),
        all_reduce_min_(std::move(all_reduce_min)) {
    if (cfg.num_state_slots > 0) state_manager_ = std::make_unique<BlockManager>(cfg.num_state_slots + 1);
    deferred_blocks_.assign(cfg.num_blocks, 0);
    deferred_states_.assign(cfg.num_state_slots + 1, 0);
    if (cfg.enable_prefix_caching) {
      prefix_ = std::make_unique<PrefixCache>(cfg.num_blocks, cfg.block_size, cfg.prefix_cache_seed);
      block_manager_->attach_prefix_cache(prefix_.get());
    }
  }

  const SchedulerConfig &config() const { return cfg_; }

  // ---- arrivals -------------------------------------------------------------

  int64_t add_sequence(const std::string &request_id, std::vector<int32_t> prompt, int max_tokens,
                       const AddOptions &opts);

  void set_schedulable(const std::string &request_id, bool schedulable) {
    lookup_(request_id)->schedule.schedulable = schedulable;
  }

  void set_draft_tokens(const std::string &request_id, const std::vector<int32_t> &tokens);

  void set_structured_output_status(const std::string &request_id, int status) {
    lookup_(request_id)->structured_output.status = status;
  }

  void fail_sequence(const std::string &request_id, SequenceStatus status);
  int64_t fork_seq(const std::string &parent_id, const std::string &child_id, const std::string &branch_id,
                   int32_t last_token_id = -1);

  // ---- COMPLETION engine: KV arrives from a prompt engine ---------------------

  // Status, the prompt's block ids, and how many of them (the first) are local prefix-cache hits.
  std::tuple<AllocStatus, std::vector<int32_t>, int> allocate_prompted(const std::string &request_id,
                                                                       std::vector<int32_t> prompt,
                                                                       int32_t first_token_id, int max_tokens,
                                                                       const AddOptions &opts,
                                                                       const std::vector<uint64_t> &block_keys = {});
  void commit_prompted(const std::string &request_id);
  bool free_prompted(const std::string &request_id);

  // ---- PROMPT engine: prompts leave with their blocks -------------------------

  void release_handed_off(const std::string &request_id);
  void abort_sequence(const std::string &request_id);

  // ---- the step ---------------------------------------------------------------

  std::shared_ptr<SchedulerOutputs> schedule();
  std::shared_ptr<ProcessResult> process_outputs(SchedulerOutputs &out, const int32_t *tokens, int rows, int width);

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
  // S27 preemptions since start, terminated or recomputed (an operator's figure).
  int64_t num_preemptions() const { return num_preemptions_; }
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

  std::vector<std::string> live_request_ids() const;

  SequencePtr find(const std::string &request_id) const {
    auto it = registry_.find(request_id);
    return it == registry_.end() ? nullptr : it->second;
  }

  void check_invariants() const;

  // ---- prefix caching (P1-P8, prefix.hpp) ---------------------------------------

  bool reset_prefix_cache(bool spill = false);
  int num_cached_prompt_tokens(const std::string &request_id) const {
    return lookup_(request_id)->prefix.num_cached_tokens;
  }
  std::vector<uint64_t> block_keys(const std::string &request_id) const;
  int num_cached_blocks() const { return prefix_ ? prefix_->num_cached() : 0; }
  int64_t prefix_query_tokens() const { return prefix_ ? prefix_->query_tokens : 0; }
  int64_t prefix_hit_tokens() const { return prefix_ ? prefix_->hit_tokens : 0; }
  // KV events for cache-aware routing (prefix_cache.hpp); all no-ops with caching off.
  void set_kv_event_capacity(int capacity);
  bool drain_kv_events(std::vector<uint64_t> &stored, std::vector<uint64_t> &removed);
  std::vector<uint64_t> prefix_cache_keys() const;
  // P10: a lower tier (the disk) below the pool, all no-ops with caching off.
  void set_spill_capacity(int capacity);
  void drain_spills(std::vector<uint64_t> &keys, std::vector<uint64_t> &parents, std::vector<int32_t> &ids,
                    std::vector<int32_t> &tokens);
  int64_t num_spills_dropped() const { return prefix_ ? prefix_->num_spills_dropped : 0; }
  int num_held_prefix_blocks(const std::vector<uint64_t> &keys) const;
  std::vector<int32_t> adopt_blocks(const std::vector<int32_t> &tokens, uint64_t seed, int first_block, int reserve);

  // S13: the three queues.
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

  std::shared_ptr<SchedulerOutputs> schedule_();

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

  // S37: one rank (no callback) votes with itself.
  int all_reduce_min_or_self_(int value) { return all_reduce_min_ ? all_reduce_min_(value) : value; }

  bool has_prefill_waiting_() const { return !waiting.empty() && waiting.front()->schedule.schedulable; }

  AllocStatus can_allocate_with_state_(int n) const;

  // ---- _schedule_prefill (S15-S25) --------------------------------------------

  std::shared_ptr<SchedulerOutputs> schedule_prefill_();
  void ignore_(const SequencePtr &seq, const char *reason, SchedulerOutputs &out);
  int cut_at_checkpoint_(Sequence &seq, int start, int seqlen_q);
  bool inside_image_pad_(size_t k, const std::vector<int32_t> &t) const;
  int adjust_chunk_size_(int q_len, int old_k_len, const std::vector<int32_t> &t, bool make_larger) const;
  int adjust_for_images_(const Sequence &seq, int start, int seqlen_q, int budget_left, int min_chunk) const;
  void admit_prefix_hit_(Sequence &seq, int num_reserve_blocks, int to_allocate, SchedulerOutputs &out);
  void clone_state_(Sequence &seq, SchedulerOutputs &out);

  // The KV slot of a token position: its block's id times the block size plus
  // its offset in the block (by shifts when block_size is a power of two).
  int64_t slot_in_block_(int block_id, int pos) const {
    const int bs = cfg_.block_size;
    if (bs_shift_ >= 0) return (static_cast<int64_t>(block_id) << bs_shift_) | (pos & (bs - 1));
    return static_cast<int64_t>(block_id) * bs + pos % bs;
  }
  int64_t slot_of_(const int *table, int pos) const {
    return slot_in_block_(table[bs_shift_ >= 0 ? pos >> bs_shift_ : pos / cfg_.block_size], pos);
  }

  // ---- _schedule_decode (S26-S28) ---------------------------------------------

  std::shared_ptr<SchedulerOutputs> schedule_decode_();
  static bool lcfs_before_(const SequencePtr &a, const SequencePtr &b);
  bool drop_finished_running_(SchedulerOutputs &out);
  void drop_finished_waiting_(SchedulerOutputs &out);
  void admit_prompted_(SchedulerOutputs &out);
  void trim_drafts_(Sequence &seq) const;
  void append_slot_(Sequence &seq, int num_blocks);
  void preempt_(const SequencePtr &seq, SchedulerOutputs &out);

  // ---- metadata for the model runner (S36, S38) -------------------------------

  int build_metadata_(SchedulerOutputs &out);
  void size_metadata_(SchedulerOutputs &out, int n, int num_tokens);
  void emit_seq_(SchedulerOutputs &out, int i, int t, Sequence &seq, int q);
  void finish_metadata_(SchedulerOutputs &out, int max_end_base);
  void decode_extremes_(SchedulerOutputs &out, const int32_t *seqlens_q, const int32_t *seqlens_k, int n);
  struct DecodeRows;
  DecodeRows begin_decode_rows_(SchedulerOutputs &out, int max_rows);
  void emit_decode_row_(DecodeRows &rows, const SequencePtr &seq, int q);
  size_t emit_plain_rows_(DecodeRows &rows, const SequencePtr *run, size_t l, size_t r, int max_rows);
  template <bool kSpeculative>
  size_t emit_plain_rows_loop_(DecodeRows &rows, const SequencePtr *run, size_t l, size_t r, size_t limit);
  void grow_decode_tokens_(DecodeRows &rows, int num_tokens);
  void end_decode_rows_(DecodeRows &rows);
  static void prepare_block_tables_(SchedulerOutputs &out, int n, int max_blocks);
  static void fill_block_row_(SchedulerOutputs &out, int i, const Sequence &seq);

  // ---- booking (S29-S32) ------------------------------------------------------

  void finish_prefill_(const SequencePtr &seq, ProcessResult &res);
  int book_decode_(Sequence &seq, const int32_t *row, int width, int num_drafts, ProcessResult &res);
  void finish_(Sequence &seq, ProcessResult &res);
  void book_row_(SchedulerOutputs &out, int i, const int32_t *tokens, int width, ProcessResult &res,
                 std::vector<SequencePtr> &chunks);
  void append_token_(Sequence &seq, int32_t token, ProcessResult &res);
  void check_stop_(Sequence &seq) const;

  // ---- resources ----------------------------------------------------------------

  void release_(Sequence &seq, bool now = false);
  void flush_(Sequence &seq);
  // S42: the sliding window's release of blocks no query still to come can see.
  int num_out_of_window_blocks_(int num_tokens) const;
  void release_out_of_window_(Sequence &seq);
  void defer_block_(int src, SchedulerOutputs &out);

  void hold_(const SequencePtr &seq) { holding_.emplace(seq.get(), seq); }

  bool release_detached_(const SequencePtr &seq);
  void sweep_dead_(FinishedList &finished);
  void allocate_info_slot_(Sequence &seq);
  void free_info_slot_(Sequence &seq);
  void report_(Sequence &seq, FinishedList &dst);
  void unregister_(const Sequence &seq);
  const SequencePtr &lookup_(const std::string &request_id) const;
  SequencePtr make_sequence_(const std::string &request_id, std::vector<int32_t> prompt, int max_tokens,
                             const AddOptions &opts);
  static void check_pool_(const BlockManager &pool, const std::vector<int> &owners, const char *what);

  // ---- prefix caching (prefix.hpp) ------------------------------------------------

  int num_keyable_blocks_(Sequence &seq, int max_blocks);
  int match_prefix_(Sequence &seq, int &num_cached_hits);
  void admit_hits_(Sequence &seq, int num_hits, int num_query_tokens);
  void register_blocks_(Sequence &seq);
  void free_blocks_(const std::vector<int> &blocks);
  bool has_image_token_(const int32_t *tokens, int n) const;
  void check_prefix_cache_() const;
  std::unique_ptr<PrefixCache> prefix_;  // null: caching off
  std::vector<int> prefix_hits_;         // scratch: the last match's block ids
  const SchedulerConfig cfg_;
  const int cp_align_;
  const int bs_shift_;  // log2(block_size) when it is a power of two (the usual case), else -1
  // S42: a window on every layer and sequences that stay here to decode (a PROMPT engine's
  // prompts leave whole: the hand-off leases every block of the prompt).
  const bool releases_window_;
  std::unique_ptr<BlockManager> block_manager_;
  std::unique_ptr<BlockManager> state_manager_;
  AllReduceMin all_reduce_min_;
  uint32_t decode_step_{0};
  bool after_prompt_step_{false};  // S40: a prompt step has run (the gap applies after one)
  int decode_stride_hint_{0};  // the last decode step's block_tables width: the next one's usually
  int64_t next_seq_id_{0};
  int outstanding_prompt_steps_{0};
  bool pending_sweep_{false};
  // `running` holds no finished sequence and is in LCFS order, so the next decode
  // step may skip the pass that checks both. Set by a decode step that preempted
  // nothing; kept by a booking in which every sequence of `running` took exactly
  // one token and none finished; cleared by anything else (abort, fail, drafts, a
  // membership change). check_invariants verifies it whenever it is set.
  bool running_clean_{false};
  uint64_t running_epoch_{0};  // bumped by every change of running's membership
  std::unordered_map<std::string, SequencePtr> registry_;  // live request ids
  std::unordered_map<std::string, SequencePtr> handed_off_;
  std::unordered_map<std::string, SequencePtr> allocated_;
  std::unordered_map<const Sequence *, SequencePtr> holding_;  // every sequence holding pool resources
  std::vector<int> deferred_blocks_;  // clone-source refs held by unbooked steps
  std::vector<int> deferred_states_;
  std::vector<int> free_info_slots_;
  int next_info_slot_{0};
  int num_used_info_slots_{0};
  int64_t num_preemptions_{0};
  static constexpr size_t kPoolSize = 4;  // two steps in flight, plus what a caller keeps a while
  std::vector<std::shared_ptr<SchedulerOutputs>> output_pool_;
  std::vector<std::shared_ptr<ProcessResult>> result_pool_;
};

}  // namespace baton

// Member definitions, one file per responsibility.
#include "arrivals.hpp"
#include "voting.hpp"
#include "prefill.hpp"
#include "metadata.hpp"  // before decode.hpp, which writes its rows with DecodeRows
#include "decode.hpp"
#include "booking.hpp"
#include "resources.hpp"
#include "prefix.hpp"
#include "window.hpp"
