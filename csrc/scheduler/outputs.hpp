// SchedulerOutputs: one step's work shape for the model runner (S38), and
// ProcessResult: what booking that step produced (S29-S32).
//
// The scheduler keeps a few of each and reuses one only once nobody else holds
// it (no Python object, no numpy view over its buffers): a reused object keeps
// its buffers' capacity, and its shared pointers usually already point at the
// same sequences, so refilling it costs no allocation and no refcount traffic.
// The binding hands the buffers to numpy without copying (S39) and documents
// them as valid until the next schedule()/process_outputs(). This step's
// sequences are kept as shared pointers, so booking still finds a sequence that
// was aborted or preempted meanwhile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "sequence.hpp"

namespace baton {

using FinishedList = std::vector<std::pair<std::string, std::string>>;

struct SchedulerOutputs {
  std::vector<SequencePtr> scheduled_seqs;
  std::vector<int> epochs;  // each sequence's epoch when scheduled: a recompute in between voids it
  bool prompt_run{false};
  int num_batched_tokens{0};
  FinishedList finished;  // finished while scheduling: preempted, aborted, stopped meanwhile
  FinishedList ignored;   // never scheduled: prompt too long, can never fit, dead at the head

  // Per sequence, in scheduled order.
  std::vector<int64_t> seq_ids;
  std::vector<int32_t> seqlens_q;
  std::vector<int32_t> seqlens_k;
  std::vector<int32_t> block_tables;  // [n, max_blocks], padded with the null block 0
  int max_blocks{0};
  // Per token.
  std::vector<int32_t> input_ids;  // -1 where the token is still in flight (sampled on device)
  std::vector<int32_t> positions;
  std::vector<int64_t> slot_mapping;

  int64_t sum_seqlen_qxk{0};
  int max_seqlen_q{0};
  int max_seqlen_k{0};
  int min_seqlen_k{std::numeric_limits<int>::max()};
  double attn_tflops{0.0};
  double total_tflops{0.0};

  std::vector<int32_t> clone_states;  // flat (src, dst) pairs
  std::vector<int32_t> clone_blocks;  // flat (src, dst) pairs; dst == 0: release src only
  std::vector<int32_t> zero_states;

  // Clone sources a forked sequence gives back; the copy reads them during this
  // step, so the pool gets them only when the step is booked.
  std::vector<int> release_blocks_after_step;
  std::vector<int> release_states_after_step;
  bool booked{false};
  uint64_t running_epoch{~uint64_t{0}};  // Scheduler::running_epoch_ when this decode step was built

  // What each row of block_tables held when this object was last filled, so a
  // reuse only writes the blocks appended since (see Scheduler::fill_block_row_).
  struct RowCache {
    int64_t seq_id{-1};
    uint32_t table_version{0};
    int32_t len{0};
    int32_t last_block{0};  // the row's block len - 1: a decode row's slot without reading the table
  };
  std::vector<RowCache> row_cache;
  std::vector<int32_t> stale_rows;  // scratch of emit_plain_rows_: rows whose table row needs writing
  int table_stride{0};  // the row width block_tables and row_cache were filled with
  int num_scheduled{0};
  int num_tokens_q{0};  // sum of seqlens_q
  // A decode step writes its rows while scheduling (Scheduler::emit_decode_row_);
  // build_metadata_ then only returns max_end_base.
  bool rows_built{false};
  int max_end_base{0};  // the largest k - q of a decode step's rows (S38)

  int num_seqs() const { return num_scheduled; }

  // Slot i keeps its old pointer until overwritten: assigning the same sequence
  // again (the usual case in decode) touches no reference count.
  void add_seq(const SequencePtr &seq, int seqlen_q) {
    if (num_scheduled < static_cast<int>(scheduled_seqs.size())) {
      // Copy-assigning a shared_ptr is two atomic operations even when it
      // already holds this sequence: ~15 us a step at 1024 running.
      SequencePtr &slot = scheduled_seqs[num_scheduled];
      if (slot.get() != seq.get()) slot = seq;
    } else {
      scheduled_seqs.push_back(seq);
    }
    seqlens_q.push_back(seqlen_q);
    num_scheduled += 1;
    num_tokens_q += seqlen_q;
    max_seqlen_q = std::max(max_seqlen_q, seqlen_q);
    max_blocks = std::max(max_blocks, static_cast<int>(seq->cache.block_table.size()));
  }

  // Everything but the buffers, the sequence slots and the row cache. The
  // per-sequence and per-token arrays keep their size as well: the next fill
  // overwrites every element, and shrinking them here would make it zero-fill
  // them all first.
  void reset() {
    prompt_run = false;
    num_batched_tokens = 0;
    finished.clear();
    ignored.clear();
    seqlens_q.clear();
    max_blocks = 0;
    sum_seqlen_qxk = 0;
    max_seqlen_q = max_seqlen_k = 0;
    min_seqlen_k = std::numeric_limits<int>::max();  // 0 once finished with no sequence
    attn_tflops = total_tflops = 0.0;
    clone_states.clear();
    clone_blocks.clear();
    zero_states.clear();
    release_blocks_after_step.clear();
    release_states_after_step.clear();
    booked = false;
    running_epoch = ~uint64_t{0};
    num_scheduled = 0;
    num_tokens_q = 0;
    rows_built = false;
    max_end_base = 0;
  }

  // Drops the slots this step did not refill.
  void trim() { scheduled_seqs.resize(num_scheduled); }
};

struct ProcessResult {
  std::vector<int32_t> num_accepted;

  // num_accepted keeps its size: process_outputs resizes it and writes every
  // entry, and clearing it here would make that resize zero-fill it first.
  void reset() {
    finished.clear();
    handed_off.clear();
    first_token_latencies.clear();
    pushed_tokens_before_finish.clear();
  }

  FinishedList finished;
  std::vector<std::pair<std::string, std::vector<int32_t>>> handed_off;
  std::vector<std::pair<std::string, double>> first_token_latencies;  // TTFT, seconds
  std::vector<std::pair<std::string, int>> pushed_tokens_before_finish;
};

}  // namespace baton
