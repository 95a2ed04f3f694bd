// PrefixCache: the books of automatic prefix caching (P1, P2, P8).
//
//   key chain   key(i) = H(key(i-1), tokens of block i), key(-1) = the seed (the
//               model fingerprint); only full blocks get a key (P1)
//   index       key -> block id; a keyed block also keeps its tokens and its
//               parent's key, and a hit compares both, so a 64-bit collision
//               cannot hand out a block that holds other tokens
//   LRU         keyed blocks whose last owner left: cached-free, least recently
//               freed at the head, evicted first when the plain free list is empty (P2)
//
// A block is exactly one of: plain free (BlockManager's free list, no key),
// cached-free (this LRU, keyed, ref 0) or owned (ref >= 1, keyed or not).
// BlockManager calls push_cached / take_cached / evict_lru; the scheduler calls
// find / insert. Every operation is O(1) but the hash of one block's tokens.
//
// KV events (cache-aware routing): while a listener is attached (event capacity
// > 0) every key that enters or leaves the index is noted; drain_events() hands
// over the net change since the last drain. Past the capacity only an overflow
// flag is kept, and the listener takes a whole snapshot instead. With nobody
// listening the cost is one branch per insert / eviction.
//
// Spill log (P10, a lower tier such as the disk): while its capacity is > 0,
// every block evicted for reuse (not by a reset) is noted with its key, its
// parent's key and its tokens; the engine drains it after each call that can
// allocate and copies those blocks' bytes out before anything rewrites them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace baton {

// splitmix64's finalizer: a bijection that spreads every input bit.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// P1: the key of a block of n tokens after a block keyed `parent`.
inline uint64_t hash_block(uint64_t parent, const int32_t *tokens, int n) {
  constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
  uint64_t h = mix64(parent + kGolden) ^ static_cast<uint64_t>(n);
  int i = 0;
  for (; i + 1 < n; i += 2) {
    const uint64_t w = static_cast<uint32_t>(tokens[i]) | (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = mix64((h ^ w) + kGolden);
  }
  if (i < n) h = mix64((h ^ static_cast<uint32_t>(tokens[i])) + kGolden);
  return h;
}

// One key per full block of tokens[0, n), chained from seed.
inline std::vector<uint64_t> compute_block_keys(const int32_t *tokens, int n, int block_size, uint64_t seed) {
  if (block_size < 1) throw std::invalid_argument("compute_block_keys: block_size=" + std::to_string(block_size) + " must be >= 1");
  std::vector<uint64_t> keys;
  keys.reserve(n / block_size);
  uint64_t parent = seed;
  for (int i = 0; (i + 1) * block_size <= n; ++i) {
    parent = hash_block(parent, tokens + static_cast<size_t>(i) * block_size, block_size);
    keys.push_back(parent);
  }
  return keys;
}

// A sequence's side of the cache (kept on Sequence, cold).
struct SeqPrefixState {
  uint64_t seed{0};            // key(-1) of its chain: the engine's, or its tenant's (P1)
  std::vector<uint64_t> keys;  // the chain over its full committed blocks, as far as computed
  int num_registered{0};       // block_table[0, this) already went through PrefixCache::insert
  int num_cached_tokens{0};    // prompt tokens its last admission took from the cache
  bool kv_pending{false};      // allocate_prompted: the pulled KV has not landed; key nothing
  bool chain_end{false};       // a block holds image tokens (their ids do not say which image), or the
                               // sequence skips the cache (echo): no key from it on
};

class PrefixCache {
 public:
  PrefixCache(int num_blocks, int block_size, uint64_t seed)
      : block_size_(block_size), seed_(seed), meta_(num_blocks), tokens_(static_cast<size_t>(num_blocks) * block_size) {}

  uint64_t seed() const { return seed_; }
  int num_cached() const { return lru_size_; }
  bool is_keyed(int id) const { return meta_[id].keyed; }
  bool is_cached(int id) const { return meta_[id].cached; }
  uint64_t key_of(int id) const { return meta_[id].key; }
  const std::unordered_map<uint64_t, int> &index() const { return index_; }

  // The block that holds exactly `tokens` after a block keyed `parent`, or -1.
  int find(uint64_t key, uint64_t parent, const int32_t *tokens) const {
    auto it = index_.find(key);
    if (it == index_.end()) return -1;
    const Meta &m = meta_[it->second];
    if (m.parent != parent) return -1;
    const int32_t *held = tokens_.data() + static_cast<size_t>(it->second) * block_size_;
    for (int j = 0; j < block_size_; ++j) {
      if (held[j] != tokens[j]) return -1;
    }
    return it->second;
  }

  // P5: an owned block just filled. False when another block holds the key
  // already (two sequences computed the same prefix): this one stays unkeyed.
  bool insert(uint64_t key, uint64_t parent, const int32_t *tokens, int id) {
    if (meta_[id].keyed) throw std::logic_error("PrefixCache.insert: block " + std::to_string(id) + " is keyed already");
    if (!index_.emplace(key, id).second) return false;
    Meta &m = meta_[id];
    m.key = key;
    m.parent = parent;
    m.keyed = true;
    std::copy(tokens, tokens + block_size_, tokens_.data() + static_cast<size_t>(id) * block_size_);
    note_(key);
    return true;
  }

  // P2: a keyed block lost its last owner: the most recently used end.
  void push_cached(int id) {
    Meta &m = meta_[id];
    m.cached = true;
    m.prev = tail_;
    m.next = 0;
    if (tail_) meta_[tail_].next = id; else head_ = id;
    tail_ = id;
    ++lru_size_;
  }

  // P3: a hit on a cached-free block: it leaves the LRU, keeping its key.
  void take_cached(int id) {
    if (!meta_[id].cached) throw std::logic_error("PrefixCache.take_cached: block " + std::to_string(id) + " is not cached-free");
    unlink_(id);
  }

  // P2, P8: the least recently used cached-free block loses its key; returns its id.
  // `spill`: evicted for reuse (P10 notes it), not dropped by a reset.
  int evict_lru(bool spill = true) {
    if (lru_size_ == 0) throw std::logic_error("PrefixCache.evict_lru: no cached-free block");
    int id = head_;
    unlink_(id);
    index_.erase(meta_[id].key);
    meta_[id].keyed = false;
    note_(meta_[id].key);
    if (spill) note_spill_(id);
    return id;
  }

  // P10: 0 stops the spill log (and empties it); past `capacity` entries between two
  // drains an eviction is only counted in num_spills_dropped.
  void set_spill_capacity(int capacity) {
    if (capacity < 0) throw std::invalid_argument("set_spill_capacity: capacity=" + std::to_string(capacity) + " must be >= 0");
    spill_capacity_ = capacity;
    spills_.clear();
    spill_tokens_.clear();
  }

  // P10: the blocks evicted for reuse since the last drain (their ids may be handed out
  // already, but nothing has written them yet), with their tokens [n, block_size].
  void drain_spills(std::vector<uint64_t> &keys, std::vector<uint64_t> &parents, std::vector<int32_t> &ids,
                    std::vector<int32_t> &tokens) {
    for (const Spill &s : spills_) {
      keys.push_back(s.key);
      parents.push_back(s.parent);
      ids.push_back(s.id);
    }
    tokens.swap(spill_tokens_);
    spills_.clear();
    spill_tokens_.clear();
  }
  int64_t num_spills_dropped{0};

  // 0 stops recording; any capacity starts a fresh log (the listener snapshots now).
  void set_event_capacity(int capacity) {
    if (capacity < 0) throw std::invalid_argument("set_event_capacity: capacity=" + std::to_string(capacity) + " must be >= 0");
    event_capacity_ = capacity;
    touched_.clear();
    overflowed_ = false;
  }
  int event_capacity() const { return event_capacity_; }

  // The net change since the last drain: keys now held that were touched, keys
  // touched and no longer held (a key stored and evicted in between is in
  // neither). False (and nothing) when the log overflowed: snapshot instead.
  bool drain_events(std::vector<uint64_t> &stored, std::vector<uint64_t> &removed) {
    const bool ok = !overflowed_;
    if (ok) {
      std::sort(touched_.begin(), touched_.end());
      touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
      for (uint64_t key : touched_) (index_.count(key) ? stored : removed).push_back(key);
    }
    touched_.clear();
    overflowed_ = false;
    return ok;
  }

  // Debug walk of the LRU, least recently used first (O(N)).
  std::vector<int> cached_list() const {
    std::vector<int> ids;
    for (int id = head_; id != 0; id = meta_[id].next) ids.push_back(id);
    return ids;
  }

  int64_t query_tokens{0};  // prompt tokens looked up at admissions
  int64_t hit_tokens{0};    // of which found in the cache

 private:
  struct Meta {
    uint64_t key{0};
    uint64_t parent{0};
    int prev{0};
    int next{0};
    bool keyed{false};
    bool cached{false};
  };

  void unlink_(int id) {
    Meta &m = meta_[id];
    if (m.prev) meta_[m.prev].next = m.next; else head_ = m.next;
    if (m.next) meta_[m.next].prev = m.prev; else tail_ = m.prev;
    m.prev = m.next = 0;
    m.cached = false;
    --lru_size_;
  }

  const int block_size_;
  const uint64_t seed_;
  std::vector<Meta> meta_;
  std::vector<int32_t> tokens_;  // [num_blocks, block_size]: what each keyed block holds
  std::unordered_map<uint64_t, int> index_;
  int head_{0}, tail_{0}, lru_size_{0};

  void note_(uint64_t key) {
    if (event_capacity_ == 0) return;
    if (static_cast<int>(touched_.size()) >= event_capacity_) {
      overflowed_ = true;
      return;
    }
    touched_.push_back(key);
  }

  int event_capacity_{0};  // 0: nobody listens, nothing is recorded

  struct Spill {
    uint64_t key;
    uint64_t parent;
    int32_t id;
  };
  void note_spill_(int id) {
    if (spill_capacity_ == 0) return;
    if (static_cast<int>(spills_.size()) >= spill_capacity_) {
      ++num_spills_dropped;
      return;
    }
    spills_.push_back(Spill{meta_[id].key, meta_[id].parent, id});
    const int32_t *held = tokens_.data() + static_cast<size_t>(id) * block_size_;
    spill_tokens_.insert(spill_tokens_.end(), held, held + block_size_);
  }
  int spill_capacity_{0};  // 0: no lower tier, nothing is noted
  std::vector<Spill> spills_;
  std::vector<int32_t> spill_tokens_;  // [spills_.size(), block_size]
  std::vector<uint64_t> touched_;  // keys stored or evicted since the last drain, repeats allowed
  bool overflowed_{false};
};

}  // namespace baton
