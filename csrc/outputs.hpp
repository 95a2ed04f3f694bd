// SchedulerOutputs: one step's work shape for the model runner (S38), and
// ProcessResult: what booking that step produced (S29-S32).
//
// Each schedule() returns a fresh SchedulerOutputs that owns its buffers; the
// binding hands them to numpy without copying (S39) and documents them as valid
// until the next schedule()/process_outputs() so that a later version may reuse
// them. Only this step's sequences are kept, as shared pointers, so booking
// still finds a sequence that was aborted or preempted meanwhile.
#pragma once

#include <cstdint>
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
  int min_seqlen_k{0};
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

  int num_seqs() const { return static_cast<int>(scheduled_seqs.size()); }
};

struct ProcessResult {
  std::vector<int32_t> num_accepted;
  FinishedList finished;
  std::vector<std::pair<std::string, std::vector<int32_t>>> handed_off;
  std::vector<std::pair<std::string, double>> first_token_latencies;  // TTFT, seconds
  std::vector<std::pair<std::string, int>> pushed_tokens_before_finish;
};

}  // namespace baton
