// Scheduler resources: blocks, state slots and info slots leave a sequence at
// once but reach the pools only after the last step that may read them; debug checks. (S7-S12)
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

inline std::vector<std::string> Scheduler::live_request_ids() const {
  std::vector<std::string> ids;
  ids.reserve(registry_.size());
  for (auto &kv : registry_) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Debug: every block's ref count equals its owners, the free list holds
// exactly the unowned blocks, and no sequence sits in two queues.
inline void Scheduler::check_invariants() const {
  std::vector<int> owners(cfg_.num_blocks, 0), state_owners(state_manager_ ? cfg_.num_state_slots + 1 : 0, 0);
  for (auto &kv : holding_) {
    const Sequence &s = *kv.second;
    for (int b : s.cache.block_table) owners.at(b) += b != 0;  // 0: released by the window (S42)
    for (int b : s.zombie_blocks) owners.at(b) += 1;
    if (s.cache.state_id >= 0) state_owners.at(s.cache.state_id) += 1;
    for (int st : s.zombie_states) state_owners.at(st) += 1;
  }
  for (int b = 0; b < cfg_.num_blocks; ++b) owners[b] += deferred_blocks_[b];
  if (state_manager_) {
    for (size_t st = 0; st < deferred_states_.size(); ++st) state_owners[st] += deferred_states_[st];
  }
  check_pool_(*block_manager_, owners, "block");
  check_prefix_cache_();
  if (state_manager_) check_pool_(*state_manager_, state_owners, "state slot");
  if (running_clean_) {  // what lets schedule_decode_ skip its pass over `running`
    for (size_t i = 0; i < running.size(); ++i) {
      if (running[i]->is_finished()) {
        throw std::logic_error("running marked clean holds finished " + running[i]->request_id);
      }
      if (i > 0 && lcfs_before_(running[i], running[i - 1])) {
        throw std::logic_error("running marked clean is out of LCFS order at " + running[i]->request_id);
      }
    }
  }
  std::unordered_map<const Sequence *, int> seen;
  for (auto &s : waiting) seen[s.get()] += 1;
  for (auto &s : running) seen[s.get()] += 1;
  for (auto &p : prompted) seen[std::get<0>(p).get()] += 1;
  for (auto &kv : handed_off_) seen[kv.second.get()] += 1;
  for (auto &kv : allocated_) seen[kv.second.get()] += 1;
  for (auto &kv : seen) {
    if (kv.second > 1) throw std::logic_error("sequence " + kv.first->request_id + " sits in two queues");
    const auto &data = kv.first->data;
    if (data.last_token_id != (data.token_ids.empty() ? -1 : data.token_ids.back())) {
      throw std::logic_error("sequence " + kv.first->request_id + ": last_token_id is not its last token");
    }
    // The inline stop ids agree with the vectors they were built from.
    Sequence copy;
    copy.eos_token_ids = kv.first->eos_token_ids;
    copy.stop_token_ids = kv.first->stop_token_ids;
    copy.ignore_eos = kv.first->ignore_eos;
    copy.build_stop_set();
    const StopSet &a = copy.stop_set, &b = kv.first->stop_set;
    if (a.size != b.size || a.overflow != b.overflow || !std::equal(a.ids, a.ids + a.size, b.ids)) {
      throw std::logic_error("sequence " + kv.first->request_id + ": stop_set disagrees with its stop ids");
    }
  }
}

inline AllocStatus Scheduler::can_allocate_with_state_(int n) const {
  AllocStatus status = block_manager_->can_allocate_nolock(n);
  if (status == AllocStatus::OK && state_manager_ && state_manager_->can_allocate_nolock(1) == AllocStatus::LATER) {
    status = AllocStatus::LATER;
  }
  return status;
}

// Resources leave the sequence now; the pools get them back once no unbooked
// step can read them (S8).
inline void Scheduler::release_(Sequence &seq, bool now) {
  auto &table = seq.cache.block_table;
  register_blocks_(seq);  // P5, P6: what it computed stays reusable
  if (now) {
    free_blocks_(table);
    table.clear();
    seq.cache.table_version += 1;
    if (seq.cache.state_id >= 0) state_manager_->free_nolock(seq.cache.state_id);
    seq.cache.state_id = -1;
  }
  if (!table.empty()) {
    // Null entries (blocks the window released, S42) are nobody's.
    std::copy_if(table.begin(), table.end(), std::back_inserter(seq.zombie_blocks), [](int b) { return b != 0; });
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

inline void Scheduler::flush_(Sequence &seq) {
  if (seq.inflight_steps > 0) return;
  free_blocks_(seq.zombie_blocks);
  seq.zombie_blocks.clear();
  for (int s : seq.zombie_states) state_manager_->free_nolock(s);
  seq.zombie_states.clear();
  if (seq.cache.block_table.empty() && seq.cache.state_id < 0) holding_.erase(&seq);
}

// The child's reference to a clone source moves to the step that copies it.
inline void Scheduler::defer_block_(int src, SchedulerOutputs &out) {
  out.release_blocks_after_step.push_back(src);
  deferred_blocks_[src] += 1;
}

inline bool Scheduler::release_detached_(const SequencePtr &seq) {
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

inline void Scheduler::sweep_dead_(FinishedList &finished) {
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

inline void Scheduler::allocate_info_slot_(Sequence &seq) {
  if (seq.draft.info_slot >= 0) return;
  if (free_info_slots_.empty()) {
    seq.draft.info_slot = next_info_slot_++;
  } else {
    seq.draft.info_slot = free_info_slots_.back();
    free_info_slots_.pop_back();
  }
  num_used_info_slots_ += 1;
}

inline void Scheduler::free_info_slot_(Sequence &seq) {
  if (seq.draft.info_slot < 0) return;
  free_info_slots_.push_back(seq.draft.info_slot);
  seq.draft.info_slot = -1;
  num_used_info_slots_ -= 1;
}

inline void Scheduler::report_(Sequence &seq, FinishedList &dst) {
  if (seq.reported) return;
  seq.reported = true;
  dst.emplace_back(seq.request_id, seq.finish_reason());
  unregister_(seq);
}

inline void Scheduler::unregister_(const Sequence &seq) {
  auto it = registry_.find(seq.request_id);
  if (it != registry_.end() && it->second.get() == &seq) registry_.erase(it);
}

inline const SequencePtr &Scheduler::lookup_(const std::string &request_id) const {
  auto it = registry_.find(request_id);
  if (it == registry_.end()) throw std::out_of_range("unknown request id " + request_id);
  return it->second;
}

inline void Scheduler::check_pool_(const BlockManager &pool, const std::vector<int> &owners, const char *what) {
  std::vector<char> on_free_list(pool.num_blocks(), 0);
  for (int id : pool.free_list()) {
    if (on_free_list[id]) throw std::logic_error(std::string(what) + " " + std::to_string(id) + " listed twice");
    on_free_list[id] = 1;
  }
  for (int id : pool.cached_list()) {  // P2: cached-free blocks are unowned too
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

}  // namespace baton
