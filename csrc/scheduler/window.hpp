// Sliding-window attention in block accounting: blocks that no query still to
// come can see go back to the pool while their sequence runs. (S42, P9)
//
//   position:  0 ....... 15 16 ...... 31 32 ...... 47 48 ..  n-1 | n (next query)
//   table:     [   0     ] [    0     ] [  blk 9   ] [ blk 4  ]
//              released     released     window W reaches n + 1 - W, in block 2
//
// The next query of a sequence is at position num_tokens (the first token
// without KV) and sees [num_tokens + 1 - W, num_tokens]; later queries see
// later positions only, and num_tokens never goes back while the sequence
// keeps its KV (rejected drafts return positions past the committed ones,
// recompute clears the whole table). A released block's entry becomes the
// null block 0, so the table keeps its positional layout (slot = table[pos /
// block_size]) and the model's rows keep their widths.
//
// Member definitions of Scheduler; include scheduler.hpp, not this file.
#pragma once

#include "scheduler.hpp"

namespace baton {

// S42: how many leading blocks hold only positions before the window of the
// query at num_tokens; the block of the newest KV token always stays (with a
// window of 1 token that block is outside the window too, but a COMPLETION
// admission must pull at least one block, P7).
inline int Scheduler::num_out_of_window_blocks_(int num_tokens) const {
  if (cfg_.sliding_window <= 0 || num_tokens <= 0) return 0;
  const int bs = cfg_.block_size;
  const int first_visible = num_tokens + 1 - cfg_.sliding_window;
  if (first_visible < bs) return 0;
  return std::min(first_visible / bs, (num_tokens - 1) / bs);
}

// S42: called after a booked step (the KV it wrote is committed). The blocks
// are freed at once, not parked (S8): a step still in flight queries positions
// at or after num_tokens as well, so it cannot read them either, and any other
// sequence can reuse them only in a step scheduled after this one.
inline void Scheduler::release_out_of_window_(Sequence &seq) {
  auto &table = seq.cache.block_table;
  const int bs = cfg_.block_size;
  const int n = std::min(num_out_of_window_blocks_(seq.cache.num_tokens), static_cast<int>(table.size()));
  const int from = seq.cache.swa_valid_start / bs;
  if (n <= from) return;
  // P9: keyed first, so a released block that holds a full prefix stays a cache hit.
  register_blocks_(seq);
  for (int i = n - 1; i >= from; --i) {  // deeper first, as free_blocks_ (P2)
    if (table[i] == 0) throw std::logic_error("release_out_of_window_: " + seq.request_id + " has a null block in its window");
    block_manager_->free_nolock(table[i]);
    table[i] = 0;
  }
  seq.cache.swa_valid_start = n * bs;
  seq.cache.table_version += 1;  // not an append: the runner's row cache refills the row
}

}  // namespace baton
