// Sequence: one request's ledgers (S1-S6).
//
// Four books, read and written by the scheduler every step:
//   SequenceData           committed tokens (drafts are kept apart, S1)
//   KvCacheState           how many tokens own KV, and where (S2)
//   SequenceScheduleState  queue status, chunking, tokens in flight (S3)
//   DraftState / StructuredOutputState  speculative and grammar state (S4)
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "prefix_cache.hpp"

namespace baton {

// Order matters: is_finished() is one comparison (S6), so running states stay first.
enum class SequenceStatus : int {
  WAITING = 0,
  RUNNING,
  SWAPPED,
  FINISHED_STOPPED,
  FINISHED_LENGTH_CAPPED,
  FINISHED_ABORTED,
  FINISHED_IGNORED,
  FINISHED_PREEMPTED,
  FINISHED_SO_FAILED,
  FINISHED_VE_FAILED,
};

inline bool is_finished_status(SequenceStatus s) { return s >= SequenceStatus::FINISHED_STOPPED; }

inline const char *finish_reason_of(SequenceStatus s) {
  switch (s) {
    case SequenceStatus::FINISHED_STOPPED: return "stop";
    case SequenceStatus::FINISHED_LENGTH_CAPPED: return "length";
    case SequenceStatus::FINISHED_ABORTED: return "abort";
    case SequenceStatus::FINISHED_IGNORED: return "ignored";
    case SequenceStatus::FINISHED_PREEMPTED: return "insufficient_system_resource";
    case SequenceStatus::FINISHED_SO_FAILED: return "structured_output_failed";
    case SequenceStatus::FINISHED_VE_FAILED: return "vision_encoder_failed";
    default: return "";
  }
}

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

struct SequenceData {
  std::vector<int32_t> token_ids;  // grown through assign() and append() only
  int prompt_len{0};
  // token_ids.back() beside the length, in the sequence's hot lines: a decode row
  // feeds the newest token without reading the token array.
  int32_t last_token_id{-1};

  void assign(std::vector<int32_t> ids) {
    token_ids = std::move(ids);
    last_token_id = token_ids.empty() ? -1 : token_ids.back();
  }
  void append(int32_t token) {
    token_ids.push_back(token);
    last_token_id = token;
  }
  int get_len() const { return static_cast<int>(token_ids.size()); }
  int get_prompt_len() const { return prompt_len; }
  int get_output_len() const { return get_len() - prompt_len; }
  int32_t last_token() const { return last_token_id; }

  // Room for the prompt and up to kOutputReserve outputs; longer outputs grow
  // the array geometrically (a few reallocations in a sequence's life). Not
  // the whole max_tokens: allocations that large are page-aligned mappings of
  // one size, so in a batch of equal lengths every sequence's newest token
  // sits at the same page offset and all of them share a few cache sets
  // (measured: twice the decode step's cache misses at 1024 running).
  static constexpr int kOutputReserve = 256;
  void reserve_outputs(int max_tokens) {
    token_ids.reserve(static_cast<size_t>(prompt_len) + std::min(max_tokens, kOutputReserve));
  }
};

// The blocks that hold num_tokens tokens: ceil(num_tokens / block_size).
inline int num_blocks_for(int num_tokens, int block_size) { return (num_tokens + block_size - 1) / block_size; }

struct KvCacheState {
  // Cold head, hot tail: Sequence ends its cold first line with this struct's head.
  int hit_tokens{0};
  // S42: tokens [0, swa_valid_start) lie outside every window still to come: their blocks
  // went back to the pool and their table entries are the null block 0 (a multiple of block_size).
  int swa_valid_start{0};
  int state_id{-1};
  int last_copy_state_token_idx{0};
  int previous_num_tokens{0};
  int num_tokens{0};
  uint32_t table_version{0};  // bumped by every edit that is not an append (row cache key)
  int block_size{0};
  std::vector<int> block_table;

  // Booked before the sampled tokens are known, so the next step's block count
  // already covers them (S2).
  void advance_optimistically(int q) {
    previous_num_tokens = num_tokens;
    num_tokens += q;
  }
  // Drafts that were rejected give their KV positions back.
  void commit_processed_tokens(int accepted) { num_tokens = previous_num_tokens + accepted; }
};

struct SequenceScheduleState {
  // Hot fields first: the decode path reads them for every sequence every step.
  SequenceStatus status{SequenceStatus::WAITING};
  bool schedulable{false};
  int total_inflight_tokens{0};
  int last_inflight_tokens{0};
  int chunked_rest_len{0};
  std::string branch_id{"default"};
  std::deque<int> chunk_checkpoints;

  // A two-beat pipeline: at most one step in flight besides the one being booked.
  void start_inflight_step(int n) {
    total_inflight_tokens += n;
    last_inflight_tokens = n;
  }
  void finish_inflight_step() {
    if (total_inflight_tokens == last_inflight_tokens) {
      total_inflight_tokens = 0;
      last_inflight_tokens = 0;
    } else {
      total_inflight_tokens = last_inflight_tokens;
    }
  }
};

struct DraftState {
  // Cold: a decode step reads the vectors only when speculation is configured.
  int info_slot{-1};                     // one per running sequence (S36)
  int64_t num_drafted{0};
  int64_t num_accepted{0};
  std::vector<int32_t> draft_tokens;     // proposed for the next decode step, not committed
  std::vector<int32_t> accepted_tokens;  // accepted on the last step

  int get_nextn_len() const { return static_cast<int>(draft_tokens.size()); }
};

struct StructuredOutputState {
  int status{0};  // non-zero: a grammar matcher holds state, so never recompute (S27)
};

// The stop ids of one sequence inline (eos unless ignored, then stop ids), so
// the per-token check reads no vector; more than fit: the vectors decide.
struct StopSet {
  static constexpr int kInline = 3;
  // Unused entries hold a value no sampled token has (process_outputs refuses
  // negative ones), so the check is three compares without a loop.
  static constexpr int32_t kNoToken = std::numeric_limits<int32_t>::min();
  int32_t ids[kInline]{kNoToken, kNoToken, kNoToken};
  uint8_t size{0};
  bool overflow{false};

  // Whether token is one of the inline ids; decides alone unless overflow.
  bool matches_inline(int32_t token) const { return (ids[0] == token) | (ids[1] == token) | (ids[2] == token); }
};

// alignas(64): a decode step touches two whole cache lines of each running
// sequence, [64, 192), and no other line of the object (with speculation off:
// the draft ledger is read only when num_speculative_tokens > 0). The first
// line holds cold fields and ends with the cache ledger's cold head, so the hot
// lines start with its counters and block table; the schedule ledger's cold
// tail (chunking, branch id, checkpoints) starts the third line. At 1024
// running sequences the step's working set then fits one core's L2, where three
// hot lines did not. Offsets are checked below.
struct alignas(64) Sequence {
  // Line 0: cold.
  std::string request_id;
  double arrival_time{0.0};  // metrics (S32)
  StructuredOutputState structured_output;
  bool ignore_eos{false};
  bool reported{false};  // finish reason already handed to the caller
  KvCacheState cache;    // cold head [48, 64), hot tail [64, 104)
  // Lines 1-2: hot.
  int64_t seq_id{0};
  SequenceData data;
  // Bookkeeping that is Baton's own, not the article's:
  int epoch{0};          // bumped by reset_for_recompute; a step booked under an old epoch is void
  int inflight_steps{0};  // scheduled steps not yet booked: resources may not return before 0 (S8)
  int max_tokens{0};      // stopping criteria
  int num_pushed_tokens{0};
  StopSet stop_set;  // eos_token_ids and stop_token_ids as the check reads them
  SequenceScheduleState schedule;  // hot head; chunking, branch id and checkpoints start the cold rest
  // Cold.
  DraftState draft;
  std::vector<int32_t> eos_token_ids;
  std::vector<int32_t> stop_token_ids;
  double first_token_latency{-1.0};  // metrics (S32)
  std::vector<int> zombie_blocks;  // released, waiting for inflight_steps == 0
  std::vector<int> zombie_states;
  const char *finish_reason_override{nullptr};
  SeqPrefixState prefix;  // prefix caching (P1-P8); untouched when it is off

  // Fills stop_set from eos_token_ids, stop_token_ids and ignore_eos (set once, on arrival).
  void build_stop_set() {
    stop_set = StopSet{};
    auto add = [&](const std::vector<int32_t> &v) {
      for (int32_t id : v) {
        if (stop_set.size < StopSet::kInline) {
          stop_set.ids[stop_set.size++] = id;
        } else {
          stop_set.overflow = true;
        }
      }
    };
    if (!ignore_eos) add(eos_token_ids);
    add(stop_token_ids);
  }
  // Whether a sampled token stops this sequence (S31).
  bool stops_at(int32_t token) const {
    if (__builtin_expect(stop_set.overflow, 0)) {
      for (int32_t id : stop_token_ids) if (id == token) return true;
      if (ignore_eos) return false;
      for (int32_t id : eos_token_ids) if (id == token) return true;
      return false;
    }
    return stop_set.matches_inline(token);
  }

  bool is_finished() const { return is_finished_status(schedule.status); }
  int get_len() const { return data.get_len(); }
  int get_output_len() const { return data.get_output_len(); }

  // S5: ceil((L + I + D) / P), and the block-table capacity reserved on
  // arrival, one spare for drafts and alignment.
  int get_num_blocks() const {
    return num_blocks_for(data.get_len() + schedule.total_inflight_tokens + draft.get_nextn_len(), cache.block_size);
  }
  int block_table_capacity() const { return num_blocks_for(data.get_prompt_len() + max_tokens, cache.block_size) + 1; }

  const char *finish_reason() const {
    return finish_reason_override ? finish_reason_override : finish_reason_of(schedule.status);
  }

  // Preempted by recompute: every committed token becomes prompt again.
  void reset_for_recompute() {
    cache.previous_num_tokens = 0;
    cache.num_tokens = 0;
    cache.hit_tokens = 0;
    cache.swa_valid_start = 0;
    cache.last_copy_state_token_idx = 0;
    schedule.chunked_rest_len = 0;
    schedule.total_inflight_tokens = 0;
    schedule.last_inflight_tokens = 0;
    draft.draft_tokens.clear();
    draft.accepted_tokens.clear();
    epoch += 1;
  }
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
static_assert(offsetof(Sequence, cache) + offsetof(KvCacheState, previous_num_tokens) == 64, "hot lines start at 64");
static_assert(offsetof(Sequence, schedule) + offsetof(SequenceScheduleState, chunked_rest_len) == 192,
              "hot lines end at 192");
#pragma GCC diagnostic pop

using SequencePtr = std::shared_ptr<Sequence>;

// The per-sequence passes walk sequences scattered over the heap: above a few
// hundred running sequences each one is a cache miss the core waits for. These
// ask for a sequence a few iterations ahead of its use, in two stages where
// the token array is needed, since its address sits in the hot lines.
constexpr int kPrefetchAhead = 8;  // iterations; measured with bench/scheduler_bench.py

inline void prefetch_hot_lines(const Sequence *seq) {
  const char *p = reinterpret_cast<const char *>(seq);
  __builtin_prefetch(p + 64, 1);
  __builtin_prefetch(p + 128, 1);
}
inline void prefetch_token_tail(const Sequence *seq) {
  const auto &ids = seq->data.token_ids;
  __builtin_prefetch(ids.data() + ids.size(), 1);  // the next token's slot; the last token is in its line or the one before
}

}  // namespace baton
