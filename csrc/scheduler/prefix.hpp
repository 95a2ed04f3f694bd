// Scheduler's automatic prefix caching: the lookup at admission, keys as
// blocks fill, the reset and the debug checks. (P1-P8)
//
//   admission (schedule_prefill_, allocate_prompted): match_prefix_ walks the
//     prompt's key chain while the index holds a block with the same tokens;
//     admit_hits_ pins those blocks as the head of the block table (P3)
//   booking, table growth, release: register_blocks_ keys every full block
//     whose KV a booked step wrote (P5); the cursor makes it O(new blocks)
//   freeing: BlockManager sends keyed blocks to the LRU instead (P2, P6)
//   lower tier (P10): evictions for reuse are logged for the engine to spill;
//     adopt_blocks keys blocks the engine fills from the tier, cached-free, so
//     that the admission's own walk (P3) hits them
//
// A decode block is keyed when its sequence next grows its table or leaves:
// the decode rows stay untouched, and in a loop that schedules a step before
// booking the last one that is one block behind.
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

// Image pad ids do not say which image they stand for: a block holding one has
// no key, and neither has any block after it.
inline bool Scheduler::has_image_token_(const int32_t *tokens, int n) const {
  if (cfg_.image_token_id < 0 && cfg_.image_pad_token_id < 0) return false;
  for (int j = 0; j < n; ++j) {
    if (tokens[j] == cfg_.image_token_id || tokens[j] == cfg_.image_pad_token_id) return true;
  }
  return false;
}

// Extends the sequence's key chain over its first max_blocks full blocks (all
// committed); returns how many of them have a key.
inline int Scheduler::num_keyable_blocks_(Sequence &seq, int max_blocks) {
  auto &ps = seq.prefix;
  const int bs = cfg_.block_size;
  const int32_t *tokens = seq.data.token_ids.data();
  max_blocks = std::min(max_blocks, seq.get_len() / bs);
  while (static_cast<int>(ps.keys.size()) < max_blocks && !ps.chain_end) {
    const size_t i = ps.keys.size();
    const int32_t *block = tokens + i * bs;
    if (has_image_token_(block, bs)) {
      ps.chain_end = true;
      break;
    }
    ps.keys.push_back(hash_block(i ? ps.keys[i - 1] : ps.seed, block, bs));
  }
  return std::min(static_cast<int>(ps.keys.size()), max_blocks);
}

// P3: the longest run of the sequence's full blocks held in the cache, at most
// all but the block of its last token (its logits give the next token). Fills
// prefix_hits_; no side effect on the pool.
inline int Scheduler::match_prefix_(Sequence &seq, int &num_cached_hits) {
  prefix_hits_.clear();
  num_cached_hits = 0;
  const int bs = cfg_.block_size;
  const int max_hits = (seq.get_len() - 1) / bs;
  const int32_t *tokens = seq.data.token_ids.data();
  const auto &keys = seq.prefix.keys;
  for (int i = 0; i < max_hits; ++i) {
    if (num_keyable_blocks_(seq, i + 1) <= i) break;
    const int id = prefix_->find(keys[i], i ? keys[i - 1] : seq.prefix.seed, tokens + static_cast<size_t>(i) * bs);
    if (id < 0) break;
    prefix_hits_.push_back(id);
    if (block_manager_->ref_count(id) == 0) num_cached_hits += 1;
  }
  return static_cast<int>(prefix_hits_.size());
}

// P3: the first num_hits blocks of prefix_hits_ head the (empty) block table,
// pinned; the KV covers them. Pin before allocating the rest, which may evict.
inline void Scheduler::admit_hits_(Sequence &seq, int num_hits, int num_query_tokens) {
  auto &table = seq.cache.block_table;
  if (!table.empty()) throw std::logic_error("admit_hits_: " + seq.request_id + " already holds blocks");
  for (int i = 0; i < num_hits; ++i) {
    block_manager_->pin_hit_nolock(prefix_hits_[i]);
    table.push_back(prefix_hits_[i]);
  }
  const int num_hit_tokens = num_hits * cfg_.block_size;
  seq.cache.num_tokens = num_hit_tokens;
  seq.cache.hit_tokens = num_hit_tokens;
  seq.prefix.num_registered = num_hits;
  seq.prefix.num_cached_tokens = num_hit_tokens;
  prefix_->query_tokens += num_query_tokens;
  prefix_->hit_tokens += num_hit_tokens;
}

// P5: every full block whose KV a booked step wrote gets its key (tokens past
// the committed ones and the blocks of an uncommitted pull never do).
inline void Scheduler::register_blocks_(Sequence &seq) {
  if (!prefix_ || seq.prefix.kv_pending) return;
  auto &ps = seq.prefix;
  const auto &table = seq.cache.block_table;
  int limit = std::min(seq.cache.num_tokens, seq.get_len()) / cfg_.block_size;
  limit = std::min(limit, static_cast<int>(table.size()));
  if (ps.num_registered >= limit) return;
  limit = num_keyable_blocks_(seq, limit);
  const int bs = cfg_.block_size;
  const int32_t *tokens = seq.data.token_ids.data();
  for (int i = ps.num_registered; i < limit; ++i) {
    // Keyed already: a block shared with a fork that registered it first. Null: outside the
    // window, never held here (a COMPLETION admission, P9).
    if (table[i] == 0 || prefix_->is_keyed(table[i])) continue;
    prefix_->insert(ps.keys[i], i ? ps.keys[i - 1] : ps.seed, tokens + static_cast<size_t>(i) * bs, table[i]);
  }
  ps.num_registered = std::max(ps.num_registered, limit);
}

// With caching on, a table is freed last block first, so that its deeper
// blocks leave the LRU before the prefix they extend.
inline void Scheduler::free_blocks_(const std::vector<int> &blocks) {
  // A null entry is a block the window released already (S42).
  if (prefix_) {
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
      if (*it != 0) block_manager_->free_nolock(*it);
    }
  } else {
    for (int b : blocks) {
      if (b != 0) block_manager_->free_nolock(b);
    }
  }
}

// P8: refused while a pull may still be landing in an allocate_prompted allocation.
inline bool Scheduler::reset_prefix_cache(bool spill) {
  PoolGuard guard(*this);
  if (!allocated_.empty()) return false;
  if (prefix_) block_manager_->reset_prefix_cache_nolock(spill);
  return true;
}

inline void Scheduler::set_kv_event_capacity(int capacity) {
  PoolGuard guard(*this);
  if (prefix_) prefix_->set_event_capacity(capacity);
}

inline bool Scheduler::drain_kv_events(std::vector<uint64_t> &stored, std::vector<uint64_t> &removed) {
  PoolGuard guard(*this);
  return prefix_ ? prefix_->drain_events(stored, removed) : true;
}

// Every key the index holds (owned and cached-free blocks): a listener's snapshot.
inline std::vector<uint64_t> Scheduler::prefix_cache_keys() const {
  std::vector<uint64_t> keys;
  if (!prefix_) return keys;
  keys.reserve(prefix_->index().size());
  for (const auto &entry : prefix_->index()) keys.push_back(entry.first);
  return keys;
}

inline void Scheduler::set_spill_capacity(int capacity) {
  PoolGuard guard(*this);
  if (prefix_) prefix_->set_spill_capacity(capacity);
}

inline void Scheduler::drain_spills(std::vector<uint64_t> &keys, std::vector<uint64_t> &parents,
                                    std::vector<int32_t> &ids, std::vector<int32_t> &tokens) {
  PoolGuard guard(*this);
  if (prefix_) prefix_->drain_spills(keys, parents, ids, tokens);
}

// P10: how many of `keys` (a prompt's chain), from the first, the index holds: what a
// lower tier need not load. Keys only (the admission compares the tokens).
inline int Scheduler::num_held_prefix_blocks(const std::vector<uint64_t> &keys) const {
  if (!prefix_) return 0;
  int n = 0;
  while (n < static_cast<int>(keys.size()) && prefix_->index().count(keys[n])) ++n;
  return n;
}

// P10: blocks [first_block, n) of `tokens` (n full blocks, chained from `seed`) enter
// the cache cached-free and keyed, for the engine to fill with a lower tier's bytes
// before the next step; returns their ids, -1 for a block left out. The run before
// first_block must be held (else nothing: a hit could not reach them); room is made
// by the usual eviction (P2, spilled) but never out of that run, and `reserve`
// blocks stay free for the rest of the prompt. LRU order afterwards: the adopted
// blocks, deepest first, then the held run (its root most recent).
inline std::vector<int32_t> Scheduler::adopt_blocks(const std::vector<int32_t> &tokens, uint64_t seed, int first_block,
                                                    int reserve) {
  PoolGuard guard(*this);
  const int bs = cfg_.block_size;
  const int n = static_cast<int>(tokens.size()) / bs;
  std::vector<int32_t> ids(std::max(0, n - first_block), -1);
  if (!prefix_ || first_block < 0 || first_block >= n) return ids;
  const auto keys = compute_block_keys(tokens.data(), n * bs, bs, seed);
  std::vector<int> held, adopted;
  for (int i = 0; i < n; ++i) {
    const uint64_t parent = i ? keys[i - 1] : seed;
    const int32_t *block = tokens.data() + static_cast<size_t>(i) * bs;
    const int id = prefix_->find(keys[i], parent, block);
    if (id >= 0) {
      if (prefix_->is_cached(id)) {
        prefix_->take_cached(id);  // out of the LRU for this call: not evicted below
        held.push_back(id);
      }
      continue;
    }
    if (i < first_block || block_manager_->num_free_blocks() <= reserve) break;
    const int fresh = block_manager_->allocate_single_nolock();
    if (!prefix_->insert(keys[i], parent, block, fresh)) {  // another block holds the key
      block_manager_->free_nolock(fresh);
      break;
    }
    ids[i - first_block] = fresh;
    adopted.push_back(fresh);
  }
  for (auto it = adopted.rbegin(); it != adopted.rend(); ++it) block_manager_->free_nolock(*it);
  for (auto it = held.rbegin(); it != held.rend(); ++it) prefix_->push_cached(*it);
  return ids;
}

// The keys of the prompt's full blocks (chained from its own seed, P1), up to the first
// that holds an image token.
inline std::vector<uint64_t> Scheduler::block_keys(const std::string &request_id) const {
  const auto &seq = lookup_(request_id);
  const int bs = cfg_.block_size;
  const int32_t *tokens = seq->data.token_ids.data();
  auto keys = compute_block_keys(tokens, seq->data.prompt_len, bs, seq->prefix.seed);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (has_image_token_(tokens + i * bs, bs)) {
      keys.resize(i);
      break;
    }
  }
  return keys;
}

// P2: free + cached-free + owned == total; a plain free block has no key; every
// key maps to a keyed, owned or cached-free block that holds it.
inline void Scheduler::check_prefix_cache_() const {
  if (!prefix_) return;
  const int n = cfg_.num_blocks;
  auto fail = [](const std::string &what) { throw std::logic_error("prefix cache: " + what); };
  const auto free_ids = block_manager_->free_list();
  for (int id : free_ids) {
    if (prefix_->is_keyed(id)) fail("plain free block " + std::to_string(id) + " has a key");
  }
  const auto cached = prefix_->cached_list();
  if (static_cast<int>(cached.size()) != prefix_->num_cached()) fail("LRU length disagrees with its count");
  for (int id : cached) {
    if (!prefix_->is_keyed(id) || !prefix_->is_cached(id) || block_manager_->ref_count(id) != 0) {
      fail("cached-free block " + std::to_string(id) + " is unkeyed or owned");
    }
  }
  int owned = 0, keyed = 0;
  for (int id = 1; id < n; ++id) {
    if (block_manager_->ref_count(id) > 0) owned += 1;
    if (prefix_->is_keyed(id)) keyed += 1;
    if (prefix_->is_cached(id) && block_manager_->ref_count(id) > 0) fail("owned block " + std::to_string(id) + " in the LRU");
  }
  if (static_cast<int>(free_ids.size() + cached.size()) + owned != n - 1) {
    fail("free " + std::to_string(free_ids.size()) + " + cached " + std::to_string(cached.size()) + " + owned " +
         std::to_string(owned) + " != " + std::to_string(n - 1));
  }
  if (static_cast<int>(prefix_->index().size()) != keyed) fail("index size differs from the keyed blocks");
  for (const auto &[key, id] : prefix_->index()) {
    if (id <= 0 || id >= n || !prefix_->is_keyed(id) || prefix_->key_of(id) != key) {
      fail("a key maps to block " + std::to_string(id) + ", which does not hold it");
    }
    if (block_manager_->ref_count(id) == 0 && !prefix_->is_cached(id)) fail("a key maps to free block " + std::to_string(id));
  }
}

}  // namespace baton
