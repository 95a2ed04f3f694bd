// Scheduler::schedule and _schedule: which kind of step runs, decided by the
// data-parallel votes, and the bookkeeping around it. (S33-S35)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

inline std::shared_ptr<SchedulerOutputs> Scheduler::schedule() {
  PoolGuard guard(*this);
  FinishedList swept;
  if (pending_sweep_) sweep_dead_(swept);
  auto out = schedule_();
  for (auto &f : swept) out->finished.push_back(std::move(f));
  if (out->prompt_run) {
    decode_step_ = 0;
    after_prompt_step_ = true;
    if (out->num_seqs() > 0) outstanding_prompt_steps_ += 1;
  } else {
    decode_step_ += 1;
    if (outstanding_prompt_steps_ == 0 && num_used_info_slots_ != static_cast<int>(running.size())) {
      throw std::logic_error("info slots in use " + std::to_string(num_used_info_slots_) +
                             " != running " + std::to_string(running.size()));
    }
  }
  finish_metadata_(*out, build_metadata_(*out));
  return out;
}

inline std::shared_ptr<SchedulerOutputs> Scheduler::schedule_() {
  if (cfg_.engine_type == EngineType::COMPLETION) return schedule_decode_();
  if (cfg_.engine_type == EngineType::PROMPT) return schedule_prefill_();
  // S40: after a prompt step (decode_step_ reset to 0) no attempt point comes before
  // prefill_min_decode_steps decode steps, so a burst of prompts alternates with decodes
  // instead of stalling every running stream for the whole burst. A single rank with nothing
  // running has no stream to protect and skips the gap; data-parallel ranks always keep it,
  // since decode_step_ is the state they share and their votes must meet at the same steps.
  bool has_peers = static_cast<bool>(all_reduce_min_);
  if (after_prompt_step_ && decode_step_ < static_cast<uint32_t>(cfg_.prefill_min_decode_steps)
      && (has_peers || !running.empty()))
    return schedule_decode_();
  bool is_any_point = decode_step_ != 0 && decode_step_ % cfg_.prefill_any_attempt_interval == 0;
  bool is_all_point = decode_step_ % cfg_.prefill_attempt_interval == 0;
  if (!is_any_point && !is_all_point) return schedule_decode_();
  // S34: vote 1.
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

}  // namespace baton
