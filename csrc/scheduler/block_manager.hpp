// BlockManager: a ref-counted pool of fixed-size KV blocks (S9, S10).
//
// Pool layout (num_blocks = N):
//
//   id:      0      1      2      3     ...    N-1
//          +------+------+------+------+-----+------+
//          | null | blk  | blk  | blk  | ... | blk  |
//          +------+------+------+------+-----+------+
//   free list (doubly linked through next/prev, 0 terminates):
//          head -> 3 <-> 7 <-> 1 <-> ... <-> tail
//
// Block 0 is never handed out: block tables pad with it, and clone pairs use
// dst == 0 for "release only". A block is either on the free list (ref 0) or
// owned (ref >= 1); pin_block adds an owner without touching the list, which is
// how a forked sequence shares its parent's prefix. Every operation is O(1).
//
// With prefix caching (P2) a third state: a keyed block whose last owner left
// is cached-free (PrefixCache's LRU), not on the free list. It counts as free
// (num_free_blocks, can_allocate), and allocate evicts the least recently used
// one only when the plain free list is empty.
//
// The same class doubles as the per-sequence state-slot pool (S11): a "block"
// there is one whole sequence state.
#pragma once

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "prefix_cache.hpp"

namespace baton {

enum class AllocStatus : int { OK = 0, LATER = 1, NEVER = 2 };

class BlockManager {
 public:
  explicit BlockManager(int num_blocks) : blocks_(num_blocks) {
    if (num_blocks < 2) {
      throw std::invalid_argument("BlockManager needs at least 2 blocks (block 0 is the null block), got " +
                                  std::to_string(num_blocks));
    }
    link_all_();
  }

  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  int num_total_blocks() const { return num_blocks() - 1; }
  // Plain free and cached-free: both can be handed out.
  int num_free_blocks() const { return size_ + num_cached_(); }
  int num_plain_free_blocks() const { return size_; }
  int ref_count(int id) const { return blocks_.at(id).ref_count; }

  // Every *_nolock call relies on the caller holding mutex() (the scheduler's
  // guard locks the state pool first, then this one).
  std::mutex &mutex() { return mutex_; }

  AllocStatus can_allocate_nolock(int n) const {
    // >= because block 0 is never usable: n == num_blocks can never be met.
    if (n >= num_blocks()) return AllocStatus::NEVER;
    if (num_free_blocks() >= n) return AllocStatus::OK;
    return AllocStatus::LATER;
  }
  bool can_allocate_single_nolock() const { return num_free_blocks() > 0; }

  // Prefix caching on: keyed blocks go to `cache` when freed (not owned here).
  void attach_prefix_cache(PrefixCache *cache) { prefix_ = cache; }

  int allocate_single_nolock() {
    int id;
    if (size_ > 0) {
      id = head_;
      erase_(id);
    } else if (num_cached_() > 0) {
      id = prefix_->evict_lru();  // P2: the plain free list first, then the LRU
    } else {
      throw std::runtime_error("BlockManager: allocate from an empty pool");
    }
    blocks_[id].ref_count = 1;
    return id;
  }

  void allocate_nolock(int n, std::vector<int> &out) {
    if (n > num_free_blocks()) {
      throw std::runtime_error("BlockManager: allocate " + std::to_string(n) + " with only " +
                               std::to_string(num_free_blocks()) + " free");
    }
    for (int i = 0; i < n; ++i) out.push_back(allocate_single_nolock());
  }

  void pin_block_nolock(int id) {
    check_owned_(id, "pin");
    blocks_[id].ref_count += 1;
  }

  // P3: one more owner of a prefix-cache hit, owned or cached-free.
  void pin_hit_nolock(int id) {
    if (id <= 0 || id >= num_blocks()) throw std::out_of_range("BlockManager.pin_hit: bad block id " + std::to_string(id));
    if (blocks_[id].ref_count == 0) prefix_->take_cached(id);
    blocks_[id].ref_count += 1;
  }

  void free_nolock(int id) {
    check_owned_(id, "free");
    if (--blocks_[id].ref_count == 0) {
      if (prefix_ && prefix_->is_keyed(id)) {
        prefix_->push_cached(id);  // P2, P6: keeps its key
      } else {
        push_back_(id);
      }
    }
  }

  // P8: every cached-free block loses its key and becomes plain free; `spill`: each
  // is noted for a lower tier to keep (P10: an engine closing).
  void reset_prefix_cache_nolock(bool spill = false) {
    while (num_cached_() > 0) push_back_(prefix_->evict_lru(spill));
  }

  // Refuses while any block is in use: clearing a pool that still has owners
  // would hand the same block to two sequences.
  void reset() {
    std::lock_guard<std::mutex> g(mutex_);
    if (num_free_blocks() != num_total_blocks()) {
      throw std::runtime_error("BlockManager.reset: " + std::to_string(num_total_blocks() - num_free_blocks()) +
                               " blocks still in use");
    }
    while (num_cached_() > 0) prefix_->evict_lru(false);
    link_all_();
  }

  // Debug walk of the free list (O(N)); used by invariant checks only.
  std::vector<int> free_list() const {
    std::vector<int> ids;
    for (int id = head_; id != 0; id = blocks_[id].next) ids.push_back(id);
    return ids;
  }
  std::vector<int> cached_list() const { return prefix_ ? prefix_->cached_list() : std::vector<int>{}; }

 private:
  struct Block {
    int ref_count{0};
    int next{0};
    int prev{0};
  };

  int num_cached_() const { return prefix_ ? prefix_->num_cached() : 0; }

  void link_all_() {
    int n = num_blocks();
    for (int i = 1; i < n; ++i) {
      blocks_[i] = Block{0, i + 1 < n ? i + 1 : 0, i - 1};
    }
    head_ = 1;
    tail_ = n - 1;
    size_ = n - 1;
  }

  void check_owned_(int id, const char *what) const {
    if (id <= 0 || id >= num_blocks()) {
      throw std::out_of_range(std::string("BlockManager.") + what + ": bad block id " + std::to_string(id));
    }
    if (blocks_[id].ref_count <= 0) {
      throw std::runtime_error(std::string("BlockManager.") + what + ": block " + std::to_string(id) +
                               " is not allocated");
    }
  }

  void erase_(int id) {
    Block &b = blocks_[id];
    if (b.prev) blocks_[b.prev].next = b.next; else head_ = b.next;
    if (b.next) blocks_[b.next].prev = b.prev; else tail_ = b.prev;
    b.next = b.prev = 0;
    --size_;
  }

  void push_back_(int id) {
    Block &b = blocks_[id];
    b.prev = tail_;
    b.next = 0;
    if (tail_) blocks_[tail_].next = id; else head_ = id;
    tail_ = id;
    ++size_;
  }

  std::vector<Block> blocks_;
  int head_{0}, tail_{0}, size_{0};
  PrefixCache *prefix_{nullptr};
  std::mutex mutex_;
};

}  // namespace baton
