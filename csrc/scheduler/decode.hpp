// Scheduler::_schedule_decode: every running sequence youngest first, LCFS
// preemption when blocks run out, admission from `prompted`. (S26-S28)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

inline std::shared_ptr<SchedulerOutputs> Scheduler::schedule_decode_() {
  auto out = acquire_(output_pool_);
  out->prompt_run = false;
  // The pass over every running sequence is skipped when nothing since the last
  // decode step can have finished one or changed their order (running_clean_).
  bool sorted = running_clean_ || drop_finished_running_(*out);
  running_clean_ = false;
  drop_finished_waiting_(*out);
  if (!prompted.empty()) {
    const size_t before = running.size();
    admit_prompted_(*out);
    if (running.size() != before) running_epoch_ += 1;
    sorted = false;
  }
  // Usually sorted already (running keeps the last step's order), and the
  // O(n) check rides along the pass that drops finished sequences.
  if (!sorted) std::sort(running.begin(), running.end(), lcfs_before_);
  size_t l = 0, r = running.size();
  size_t first_scheduled = r;
  bool preempted = false;
  const int max_seqs = cfg_.max_num_seqs;
  DecodeRows rows = begin_decode_rows_(*out, static_cast<int>(r));
  const SequencePtr *run = running.data();  // preempt_ never moves `running`
  while (l < r && rows.i < max_seqs) {
    const size_t before = r;
    r = emit_plain_rows_(rows, run, l, r, max_seqs);
    if (r != before) first_scheduled = r;
    if (l >= r || rows.i >= max_seqs) break;
    // A row that needs a block or carries drafts.
    const SequencePtr &seq = run[r - 1];
    if (r - l > kPrefetchAhead) prefetch_hot_lines(run[r - 1 - kPrefetchAhead].get());
    Sequence &sq = *seq;
    trim_drafts_(sq);
    // The article asks for one free block before every sequence. Baton asks for
    // the blocks this sequence really needs (often 0): with a full pool the
    // literal rule preempts a lone sequence that needs nothing, a livelock
    // under recompute.
    const int nextn = sq.draft.get_nextn_len();
    const int num_blocks = sq.get_num_blocks();
    const int need = num_blocks - static_cast<int>(sq.cache.block_table.size());
    if (__builtin_expect(need != 0, 0)) {
      if (need > 0) {
        while (block_manager_->can_allocate_nolock(need) != AllocStatus::OK && r - l > 1) {
          preempt_(run[l], *out);
          preempted = true;
          l += 1;
        }
        if (block_manager_->can_allocate_nolock(need) != AllocStatus::OK) {
          preempt_(seq, *out);
          preempted = true;
          r -= 1;
          continue;
        }
      }
      append_slot_(sq, num_blocks);
    }
    emit_decode_row_(rows, seq, 1 + nextn);
    first_scheduled = r - 1;
    r -= 1;
  }
  end_decode_rows_(rows);
  // The batch is youngest first and running keeps oldest first, so running is
  // the batch reversed: the tail it was taken from. The next step's LCFS order
  // is then usually already in place. [0, l) were preempted from the head and
  // [r, first_scheduled) is a lone sequence that preempted itself; [l, r) stays:
  // sequences a batch full at max_num_seqs left out (none while admission keeps
  // running within the info slots, S26), still running.
  const size_t kept_head = r > l ? r - l : 0;
  running.erase(running.begin() + std::max(l, r), running.begin() + first_scheduled);
  running.erase(running.begin(), running.begin() + l);
  if (first_scheduled != kept_head) running_epoch_ += 1;
  // What is left is the batch, finished-free and in order, behind any sequence
  // it left out; one left out did not grow, so the order may not hold next step.
  running_clean_ = !preempted && kept_head == 0;
  out->running_epoch = running_epoch_;
  return out;
}

// LCFS: longest output at the head is preempted first, the youngest at the
// tail is served first. Ties go by arrival (seq_id), so the order does not
// flip with each step's tail-first batch.
inline bool Scheduler::lcfs_before_(const SequencePtr &a, const SequencePtr &b) {
  int la = a->get_output_len(), lb = b->get_output_len();
  return la != lb ? la > lb : a->seq_id < b->seq_id;
}

// Returns whether the survivors are in LCFS order already (lcfs_before_ on
// each neighbour pair, with the previous survivor's key carried along).
inline bool Scheduler::drop_finished_running_(SchedulerOutputs &out) {
  const size_t n = running.size();
  SequencePtr *run = running.data();
  size_t kept = 0;
  bool sorted = true;
  int prev_len = 0;
  int64_t prev_id = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) prefetch_hot_lines(run[i + kPrefetchAhead].get());
    Sequence &seq = *run[i];
    if (seq.is_finished()) {
      report_(seq, out.finished);
      release_(seq);
      continue;
    }
    const int len = seq.get_output_len();
    if (kept > 0 && (len != prev_len ? len > prev_len : seq.seq_id < prev_id)) sorted = false;
    prev_len = len;
    prev_id = seq.seq_id;
    if (kept != i) run[kept] = std::move(run[i]);
    ++kept;
  }
  if (kept != n) {
    running.resize(kept);
    running_epoch_ += 1;
  }
  return sorted;
}

// So that a rank holding only dead requests does not want prefill forever (S7).
inline void Scheduler::drop_finished_waiting_(SchedulerOutputs &out) {
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

// The room under max_num_seqs is counted in info slots (S26), as S19 counts it: a prompt
// that a prefill step still in flight admitted holds one and joins `running` only when that
// step is booked. Counting `running` let a decode step scheduled beside that prefill step
// admit past max_num_seqs, and the batch, full at max_num_seqs, then left the oldest
// sequence out of `running` for good (a fork stranded with its slot and blocks).
inline void Scheduler::admit_prompted_(SchedulerOutputs &out) {
  while (!prompted.empty() && num_used_info_slots_ < cfg_.max_num_seqs) {
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
inline void Scheduler::trim_drafts_(Sequence &seq) const {
  auto &d = seq.draft.draft_tokens;
  if (d.empty()) return;
  int start = seq.cache.num_tokens + seq.schedule.total_inflight_tokens;
  int room = std::max(0, cfg_.max_model_len - (start + 1));
  if (static_cast<int>(d.size()) > room) d.resize(room);
}

// S28: the table grows to cover the step's tokens and shrinks when rejected
// drafts gave positions back.
inline void Scheduler::append_slot_(Sequence &seq, int n) {
  auto &table = seq.cache.block_table;
  if (prefix_ && static_cast<int>(table.size()) < n) register_blocks_(seq);  // P5: the blocks decode filled
  while (static_cast<int>(table.size()) < n) table.push_back(block_manager_->allocate_single_nolock());
  while (static_cast<int>(table.size()) > n) {
    block_manager_->free_nolock(table.back());
    table.pop_back();
    seq.cache.table_version += 1;
  }
}

// S27: terminate, or recompute from the head of `waiting`. A grammar matcher
// cannot be replayed, so structured output is never recomputed.
inline void Scheduler::preempt_(const SequencePtr &seq, SchedulerOutputs &out) {
  ++num_preemptions_;
  register_blocks_(*seq);  // P6: before reset_for_recompute forgets the KV
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

}  // namespace baton
