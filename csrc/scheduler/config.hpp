// SchedulerConfig: the knobs the article names, checked once at construction.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace baton {

enum class EngineType : int {
  NORMAL = 0,      // prompts and completions
  PROMPT = 1,      // prompts only (prefill engine)
  COMPLETION = 2,  // completions only (decode engine)
};

struct SchedulerConfig {
  EngineType engine_type{EngineType::NORMAL};
  int num_blocks{256};  // including the null block 0
  int block_size{16};
  int max_num_seqs{256};
  int max_num_batched_tokens{2048};
  int max_model_len{2048};
  bool enable_chunked_prefill{true};
  bool stop_preempted_request{false};
  int num_state_slots{0};                // 0: the model needs no per-sequence state pool
  int64_t prefill_max_sum_seqlen_k{0};   // 0: unlimited
  int cp_size{1};
  int lookahead_tokens{0};
  double watermark{0.9};
  int prefill_attempt_interval{70};
  int prefill_any_attempt_interval{100};
  // Baton additions.
  int num_speculative_tokens{0};  // most draft tokens per sequence and step
  int image_token_id{-1};         // -1: no multimodal boundaries to respect
  int image_pad_token_id{-1};
  double flops_per_token{0.0};    // FLOP estimates; 0 leaves them at 0
  double attn_flops_per_qk{0.0};
  bool enable_prefix_caching{false};  // P1-P8; off: no key, no lookup, no cached-free block
  uint64_t prefix_cache_seed{0};      // key(-1) of the chain: the engine's model fingerprint (P1)
  // S40: decode steps after a prompt step before the next attempt point (0: the seed's rule,
  // prompt steps back to back while prompts wait).
  int prefill_min_decode_steps{0};
  // S42: tokens a query sees (itself included) on every attention layer of the model; 0: no
  // window (or one on some layers only), every block stays until its sequence leaves.
  int sliding_window{0};

  void validate() const {
    auto bad = [](const std::string &name, const std::string &value, const std::string &why) {
      throw std::invalid_argument("SchedulerConfig." + name + "=" + value + ": " + why);
    };
    int et = static_cast<int>(engine_type);
    if (et < 0 || et > 2) bad("engine_type", std::to_string(et), "must be NORMAL, PROMPT or COMPLETION");
    if (num_blocks < 2) bad("num_blocks", std::to_string(num_blocks), "must be >= 2 (block 0 is the null block)");
    if (block_size < 1) bad("block_size", std::to_string(block_size), "must be >= 1");
    if (max_num_seqs < 1) bad("max_num_seqs", std::to_string(max_num_seqs), "must be >= 1");
    if (max_num_batched_tokens < 1)
      bad("max_num_batched_tokens", std::to_string(max_num_batched_tokens), "must be >= 1");
    if (max_model_len < 1) bad("max_model_len", std::to_string(max_model_len), "must be >= 1");
    if (num_state_slots < 0) bad("num_state_slots", std::to_string(num_state_slots), "must be >= 0");
    if (prefill_max_sum_seqlen_k < 0)
      bad("prefill_max_sum_seqlen_k", std::to_string(prefill_max_sum_seqlen_k), "must be >= 0");
    if (cp_size < 1) bad("cp_size", std::to_string(cp_size), "must be >= 1");
    if (lookahead_tokens < 0) bad("lookahead_tokens", std::to_string(lookahead_tokens), "must be >= 0");
    if (!(watermark > 0.0 && watermark <= 1.0)) bad("watermark", std::to_string(watermark), "must be in (0, 1]");
    if (prefill_attempt_interval < 1)
      bad("prefill_attempt_interval", std::to_string(prefill_attempt_interval), "must be >= 1");
    if (prefill_any_attempt_interval < 1)
      bad("prefill_any_attempt_interval", std::to_string(prefill_any_attempt_interval), "must be >= 1");
    if (prefill_min_decode_steps < 0)
      bad("prefill_min_decode_steps", std::to_string(prefill_min_decode_steps), "must be >= 0");
    if (sliding_window < 0) bad("sliding_window", std::to_string(sliding_window), "must be >= 0 (0: no window)");
    if (num_speculative_tokens < 0)
      bad("num_speculative_tokens", std::to_string(num_speculative_tokens), "must be >= 0");
    if (enable_prefix_caching && num_state_slots > 0) {
      // A per-sequence state (recurrent, SWA) is not in the KV blocks: a hit could not restore it.
      bad("enable_prefix_caching", "True",
          "prefix caching needs a model without a per-sequence state pool (num_state_slots=" +
              std::to_string(num_state_slots) + ")");
    }
    if (engine_type == EngineType::COMPLETION && !stop_preempted_request) {
      bad("stop_preempted_request", "False",
          "a COMPLETION engine cannot recompute preempted requests (it has no prefill path); "
          "build it with stop_preempted_request=True");
    }
  }
};

}  // namespace baton
