// baton._scheduler: the compiled scheduler, bound without per-sequence Python objects.
//
// Array lifetime (S39): every numpy array handed out by SchedulerOutputs and
// ProcessResult is a view over a C++ buffer of that object, with the object as
// its base. Treat the views as valid until the next schedule() or
// process_outputs(); copy (np.array(x)) anything kept longer.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "scheduler.hpp"

namespace py = pybind11;
using namespace baton;

namespace {

template <typename T>
py::array view_1d(const std::vector<T> &v, const py::object &owner) {
  return py::array_t<T>({static_cast<py::ssize_t>(v.size())}, {static_cast<py::ssize_t>(sizeof(T))}, v.data(),
                        owner);
}

template <typename T>
py::array view_2d(const std::vector<T> &v, py::ssize_t rows, py::ssize_t cols, const py::object &owner) {
  return py::array_t<T>({rows, cols}, {static_cast<py::ssize_t>(cols * sizeof(T)), static_cast<py::ssize_t>(sizeof(T))},
                        v.data(), owner);
}

py::list finished_list(const FinishedList &items) {
  py::list out;
  for (const auto &[rid, reason] : items) out.append(py::make_tuple(rid, reason));
  return out;
}

AddOptions make_options(std::vector<int32_t> eos, std::vector<int32_t> stop, bool ignore_eos, bool schedulable,
                        std::vector<int> checkpoints, bool structured_output,
                        bool skip_prefix_cache, std::optional<uint64_t> key_seed) {
  AddOptions o;
  o.eos_token_ids = std::move(eos);
  o.stop_token_ids = std::move(stop);
  o.ignore_eos = ignore_eos;
  o.schedulable = schedulable;
  o.chunk_checkpoints = std::move(checkpoints);
  o.structured_output = structured_output;
  o.skip_prefix_cache = skip_prefix_cache;
  o.key_seed = key_seed;
  return o;
}

std::vector<int32_t> to_tokens(const py::handle &obj, const char *what) {
  auto arr = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!arr) throw std::invalid_argument(std::string(what) + " must be a sequence of ints");
  if (arr.ndim() != 1) throw std::invalid_argument(std::string(what) + " must be one-dimensional");
  std::vector<int32_t> out(arr.size());
  const int64_t *p = arr.data();
  for (py::ssize_t i = 0; i < arr.size(); ++i) {
    if (p[i] < 0 || p[i] > INT32_MAX) {
      throw std::invalid_argument(std::string(what) + "[" + std::to_string(i) + "]=" + std::to_string(p[i]) +
                                  " is not a valid token id");
    }
    out[i] = static_cast<int32_t>(p[i]);
  }
  return out;
}

std::vector<uint64_t> to_keys(const py::handle &obj) {
  auto arr = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!arr) throw std::invalid_argument("block_keys must be a sequence of uint64");
  if (arr.ndim() != 1) throw std::invalid_argument("block_keys must be one-dimensional");
  return std::vector<uint64_t>(arr.data(), arr.data() + arr.size());
}

py::array_t<uint64_t> keys_array(const std::vector<uint64_t> &keys) {
  py::array_t<uint64_t> arr(static_cast<py::ssize_t>(keys.size()));
  std::copy(keys.begin(), keys.end(), arr.mutable_data());
  return arr;
}

struct ResultHandle {
  std::shared_ptr<ProcessResult> res;
};

}  // namespace

PYBIND11_MODULE(_scheduler, m) {
  m.doc() = "Baton compiled scheduler (C++17). Arrays are views valid until the next schedule()/process_outputs().";

  // std::out_of_range -> KeyError, std::invalid_argument -> ValueError (pybind11 defaults);
  // logic_error (a broken invariant) -> RuntimeError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::out_of_range &e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const std::invalid_argument &e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::logic_error &e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::enum_<EngineType>(m, "EngineType")
      .value("NORMAL", EngineType::NORMAL)
      .value("PROMPT", EngineType::PROMPT)
      .value("COMPLETION", EngineType::COMPLETION);
  py::enum_<AllocStatus>(m, "AllocStatus")
      .value("OK", AllocStatus::OK)
      .value("LATER", AllocStatus::LATER)
      .value("NEVER", AllocStatus::NEVER);

  py::class_<BlockManager>(m, "BlockManager")
      .def(py::init<int>(), py::arg("num_blocks"))
      .def("num_free_blocks", &BlockManager::num_free_blocks)
      .def("num_total_blocks", &BlockManager::num_total_blocks)
      .def("ref_count", &BlockManager::ref_count, py::arg("block_id"))
      .def("can_allocate", [](BlockManager &b, int n) {
        std::lock_guard<std::mutex> g(b.mutex());
        if (n < 0) throw std::invalid_argument("can_allocate: negative block count " + std::to_string(n));
        return static_cast<int>(b.can_allocate_nolock(n));
      }, py::arg("num_blocks"))
      .def("allocate", [](BlockManager &b) {
        std::lock_guard<std::mutex> g(b.mutex());
        return b.allocate_single_nolock();
      })
      .def("free", [](BlockManager &b, int id) {
        std::lock_guard<std::mutex> g(b.mutex());
        b.free_nolock(id);
      }, py::arg("block_id"))
      .def("pin_block", [](BlockManager &b, int id) {
        std::lock_guard<std::mutex> g(b.mutex());
        b.pin_block_nolock(id);
      }, py::arg("block_id"))
      .def("free_list", &BlockManager::free_list)
      .def("reset", &BlockManager::reset);

  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init<>())
      .def_readwrite("engine_type", &SchedulerConfig::engine_type)
      .def_readwrite("num_blocks", &SchedulerConfig::num_blocks)
      .def_readwrite("block_size", &SchedulerConfig::block_size)
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &SchedulerConfig::max_model_len)
      .def_readwrite("enable_chunked_prefill", &SchedulerConfig::enable_chunked_prefill)
      .def_readwrite("stop_preempted_request", &SchedulerConfig::stop_preempted_request)
      .def_readwrite("num_state_slots", &SchedulerConfig::num_state_slots)
      .def_readwrite("prefill_max_sum_seqlen_k", &SchedulerConfig::prefill_max_sum_seqlen_k)
      .def_readwrite("cp_size", &SchedulerConfig::cp_size)
      .def_readwrite("lookahead_tokens", &SchedulerConfig::lookahead_tokens)
      .def_readwrite("watermark", &SchedulerConfig::watermark)
      .def_readwrite("prefill_attempt_interval", &SchedulerConfig::prefill_attempt_interval)
      .def_readwrite("prefill_any_attempt_interval", &SchedulerConfig::prefill_any_attempt_interval)
      .def_readwrite("prefill_min_decode_steps", &SchedulerConfig::prefill_min_decode_steps)
      .def_readwrite("sliding_window", &SchedulerConfig::sliding_window)
      .def_readwrite("num_speculative_tokens", &SchedulerConfig::num_speculative_tokens)
      .def_readwrite("image_token_id", &SchedulerConfig::image_token_id)
      .def_readwrite("image_pad_token_id", &SchedulerConfig::image_pad_token_id)
      .def_readwrite("flops_per_token", &SchedulerConfig::flops_per_token)
      .def_readwrite("attn_flops_per_qk", &SchedulerConfig::attn_flops_per_qk)
      .def_readwrite("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readwrite("prefix_cache_seed", &SchedulerConfig::prefix_cache_seed)
      .def("validate", &SchedulerConfig::validate);

  m.def("compute_block_keys",
        [](py::handle tokens, int block_size, uint64_t seed) {
          auto ids = to_tokens(tokens, "token_ids");
          return keys_array(compute_block_keys(ids.data(), static_cast<int>(ids.size()), block_size, seed));
        },
        py::arg("token_ids"), py::arg("block_size"), py::arg("seed"),
        "P1: one uint64 key per full block, key(i) = H(key(i-1), tokens of block i), key(-1) = seed.");

  py::class_<SchedulerOutputs, std::shared_ptr<SchedulerOutputs>>(m, "SchedulerOutputs")
      .def_readonly("prompt_run", &SchedulerOutputs::prompt_run)
      .def_readonly("num_batched_tokens", &SchedulerOutputs::num_batched_tokens)
      .def_readonly("sum_seqlen_qxk", &SchedulerOutputs::sum_seqlen_qxk)
      .def_readonly("max_seqlen_q", &SchedulerOutputs::max_seqlen_q)
      .def_readonly("max_seqlen_k", &SchedulerOutputs::max_seqlen_k)
      .def_readonly("min_seqlen_k", &SchedulerOutputs::min_seqlen_k)
      .def_readonly("attn_tflops", &SchedulerOutputs::attn_tflops)
      .def_readonly("total_tflops", &SchedulerOutputs::total_tflops)
      .def_readonly("booked", &SchedulerOutputs::booked)
      .def_property_readonly("num_seqs", &SchedulerOutputs::num_seqs)
      .def("__len__", &SchedulerOutputs::num_seqs)
      .def_property_readonly("request_ids", [](const SchedulerOutputs &o) {
        py::list ids(o.num_seqs());
        for (int i = 0; i < o.num_seqs(); ++i) ids[i] = py::str(o.scheduled_seqs[i]->request_id);
        return ids;
      })
      .def_property_readonly("seq_ids", [](py::object self) {
        return view_1d(self.cast<SchedulerOutputs &>().seq_ids, self);
      })
      .def_property_readonly("seqlens_q", [](py::object self) {
        return view_1d(self.cast<SchedulerOutputs &>().seqlens_q, self);
      })
      .def_property_readonly("seqlens_k", [](py::object self) {
        return view_1d(self.cast<SchedulerOutputs &>().seqlens_k, self);
      })
      .def_property_readonly("block_tables", [](py::object self) {
        auto &o = self.cast<SchedulerOutputs &>();
        return view_2d(o.block_tables, o.num_seqs(), o.max_blocks, self);
      })
      .def_property_readonly("input_ids", [](py::object self) {
        return view_1d(self.cast<SchedulerOutputs &>().input_ids, self);
      })
      .def_property_readonly("positions", [](py::object self) {
        return view_1d(self.cast<SchedulerOutputs &>().positions, self);
      })
      .def_property_readonly("slot_mapping", [](py::object self) {
        return view_1d(self.cast<SchedulerOutputs &>().slot_mapping, self);
      })
      .def_property_readonly("clone_blocks", [](py::object self) {
        auto &o = self.cast<SchedulerOutputs &>();
        return view_2d(o.clone_blocks, static_cast<py::ssize_t>(o.clone_blocks.size() / 2), 2, self);
      })
      .def_property_readonly("clone_states", [](py::object self) {
        auto &o = self.cast<SchedulerOutputs &>();
        return view_2d(o.clone_states, static_cast<py::ssize_t>(o.clone_states.size() / 2), 2, self);
      })
      .def_property_readonly("zero_states", [](py::object self) {
        return view_1d(self.cast<SchedulerOutputs &>().zero_states, self);
      })
      .def_property_readonly("finished", [](const SchedulerOutputs &o) { return finished_list(o.finished); })
      .def_property_readonly("ignored", [](const SchedulerOutputs &o) { return finished_list(o.ignored); });

  py::class_<ProcessResult, std::shared_ptr<ProcessResult>>(m, "ProcessResult")
      .def_property_readonly("num_accepted", [](py::object self) {
        return view_1d(self.cast<ProcessResult &>().num_accepted, self);
      })
      .def_property_readonly("finished", [](const ProcessResult &r) { return finished_list(r.finished); })
      .def_property_readonly("handed_off", [](const ProcessResult &r) {
        py::list out;
        for (const auto &[rid, blocks] : r.handed_off) {
          py::array_t<int32_t> arr(static_cast<py::ssize_t>(blocks.size()));
          std::copy(blocks.begin(), blocks.end(), arr.mutable_data());
          out.append(py::make_tuple(rid, arr));
        }
        return out;
      })
      .def_readonly("first_token_latencies", &ProcessResult::first_token_latencies)
      .def_readonly("pushed_tokens_before_finish", &ProcessResult::pushed_tokens_before_finish);

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init([](const SchedulerConfig &cfg, py::object all_reduce_min) {
             Scheduler::AllReduceMin fn;
             if (!all_reduce_min.is_none()) {
               if (!PyCallable_Check(all_reduce_min.ptr())) {
                 throw std::invalid_argument("all_reduce_min must be a callable int -> int or None");
               }
               fn = [all_reduce_min](int v) { return all_reduce_min(v).cast<int>(); };
             }
             return std::make_unique<Scheduler>(cfg, std::move(fn));
           }),
           py::arg("config"), py::arg("all_reduce_min") = py::none())
      .def("add_sequence",
           [](Scheduler &s, const std::string &rid, py::handle prompt, int max_tokens, py::handle eos,
              py::handle stop, bool ignore_eos, bool schedulable, std::vector<int> checkpoints, bool so,
              bool skip_cache, std::optional<uint64_t> key_seed) {
             return s.add_sequence(rid, to_tokens(prompt, "prompt_token_ids"), max_tokens,
                                   make_options(to_tokens(eos, "eos_token_ids"), to_tokens(stop, "stop_token_ids"),
                                                ignore_eos, schedulable, std::move(checkpoints), so, skip_cache,
                                                key_seed));
           },
           py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("max_tokens"), py::kw_only(),
           py::arg("eos_token_ids") = py::tuple(), py::arg("stop_token_ids") = py::tuple(),
           py::arg("ignore_eos") = false, py::arg("schedulable") = true,
           py::arg("chunk_checkpoints") = std::vector<int>{}, py::arg("structured_output") = false,
           py::arg("skip_prefix_cache") = false, py::arg("key_seed") = py::none())
      .def("allocate_prompted",
           [](Scheduler &s, const std::string &rid, py::handle prompt, int32_t first, int max_tokens, py::handle eos,
              py::handle stop, bool ignore_eos, bool schedulable, std::vector<int> checkpoints, bool so,
              py::handle keys, std::optional<uint64_t> key_seed) {
             if (first < 0) throw std::invalid_argument("first_token_id=" + std::to_string(first) + " is negative");
             auto [st, blocks, num_cached] = s.allocate_prompted(
                 rid, to_tokens(prompt, "prompt_token_ids"), first, max_tokens,
                 make_options(to_tokens(eos, "eos_token_ids"), to_tokens(stop, "stop_token_ids"), ignore_eos,
                              schedulable, std::move(checkpoints), so, false, key_seed),
                 to_keys(keys));
             py::array_t<int32_t> arr(static_cast<py::ssize_t>(blocks.size()));
             std::copy(blocks.begin(), blocks.end(), arr.mutable_data());
             auto seq = st == AllocStatus::OK ? s.find(rid) : nullptr;
             return py::make_tuple(static_cast<int>(st), arr, seq ? seq->seq_id : -1, num_cached);
           },
           py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("first_token_id"), py::arg("max_tokens"),
           py::kw_only(), py::arg("eos_token_ids") = py::tuple(), py::arg("stop_token_ids") = py::tuple(),
           py::arg("ignore_eos") = false, py::arg("schedulable") = true,
           py::arg("chunk_checkpoints") = std::vector<int>{}, py::arg("structured_output") = false,
           py::arg("block_keys") = py::tuple(), py::arg("key_seed") = py::none())
      .def("commit_prompted", &Scheduler::commit_prompted, py::arg("request_id"))
      .def("free_prompted", &Scheduler::free_prompted, py::arg("request_id"))
      .def("release_handed_off", &Scheduler::release_handed_off, py::arg("request_id"))
      .def("abort_sequence", &Scheduler::abort_sequence, py::arg("request_id"))
      .def("fail_sequence", [](Scheduler &s, const std::string &rid, int status) {
        s.fail_sequence(rid, static_cast<SequenceStatus>(status));
      }, py::arg("request_id"), py::arg("status"))
      .def("set_schedulable", &Scheduler::set_schedulable, py::arg("request_id"), py::arg("schedulable") = true)
      .def("set_draft_tokens", [](Scheduler &s, const std::string &rid, py::handle tokens) {
        s.set_draft_tokens(rid, to_tokens(tokens, "draft_token_ids"));
      }, py::arg("request_id"), py::arg("draft_token_ids"))
      .def("set_structured_output_status", &Scheduler::set_structured_output_status, py::arg("request_id"),
           py::arg("status"))
      .def("fork_seq", &Scheduler::fork_seq, py::arg("parent_request_id"), py::arg("child_request_id"),
           py::arg("branch_id") = "", py::arg("last_token_id") = -1)
      .def("schedule", &Scheduler::schedule)
      .def("process_outputs",
           [](Scheduler &s, SchedulerOutputs &out, py::handle sampled) {
             auto arr = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(sampled);
             if (!arr) throw std::invalid_argument("sampled_token_ids must be an int32 array");
             if (arr.ndim() != 1 && arr.ndim() != 2) {
               throw std::invalid_argument("sampled_token_ids must be [n] or [n, 1+k], got ndim=" +
                                           std::to_string(arr.ndim()));
             }
             int rows = static_cast<int>(arr.shape(0));
             int width = arr.ndim() == 2 ? static_cast<int>(arr.shape(1)) : 1;
             if (width < 1) throw std::invalid_argument("sampled_token_ids has no columns");
             return s.process_outputs(out, arr.data(), rows, width);
           },
           py::arg("outputs"), py::arg("sampled_token_ids"))
      .def("num_free_blocks", &Scheduler::num_free_blocks)
      .def("num_total_blocks", &Scheduler::num_total_blocks)
      .def("num_free_state_slots", &Scheduler::num_free_state_slots)
      .def("num_total_state_slots", &Scheduler::num_total_state_slots)
      .def("num_waiting", &Scheduler::num_waiting)
      .def("num_running", &Scheduler::num_running)
      .def("num_prompted", &Scheduler::num_prompted)
      .def("num_handed_off", &Scheduler::num_handed_off)
      .def("num_preemptions", &Scheduler::num_preemptions)
      .def("num_allocated_prompted", &Scheduler::num_allocated_prompted)
      .def("num_used_info_slots", &Scheduler::num_used_info_slots)
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def("decode_step", &Scheduler::decode_step)
      .def("ref_count", &Scheduler::ref_count, py::arg("block_id"))
      .def("get_gpu_cache_usage", &Scheduler::get_gpu_cache_usage, py::arg("n_planned") = 0)
      .def("check_invariants", &Scheduler::check_invariants)
      .def("reset_prefix_cache", &Scheduler::reset_prefix_cache, py::arg("spill") = false)
      .def("num_cached_prompt_tokens", &Scheduler::num_cached_prompt_tokens, py::arg("request_id"))
      .def("block_keys", [](const Scheduler &s, const std::string &rid) { return keys_array(s.block_keys(rid)); },
           py::arg("request_id"))
      .def("num_cached_blocks", &Scheduler::num_cached_blocks)
      .def("set_kv_event_capacity", &Scheduler::set_kv_event_capacity, py::arg("capacity"))
      .def("drain_kv_events", [](Scheduler &s) {
        std::vector<uint64_t> stored, removed;
        bool ok = s.drain_kv_events(stored, removed);
        return py::make_tuple(ok, keys_array(stored), keys_array(removed));
      })
      .def("prefix_cache_keys", [](const Scheduler &s) { return keys_array(s.prefix_cache_keys()); })
      .def("set_spill_capacity", &Scheduler::set_spill_capacity, py::arg("capacity"))
      .def("drain_spills", [](Scheduler &s) {
        std::vector<uint64_t> keys, parents;
        std::vector<int32_t> ids, tokens;
        s.drain_spills(keys, parents, ids, tokens);
        const auto n = static_cast<py::ssize_t>(ids.size());
        const auto bs = static_cast<py::ssize_t>(s.config().block_size);
        py::array_t<int32_t> id_arr(n), tok_arr({n, bs});
        std::copy(ids.begin(), ids.end(), id_arr.mutable_data());
        std::copy(tokens.begin(), tokens.end(), tok_arr.mutable_data());
        return py::make_tuple(keys_array(keys), keys_array(parents), id_arr, tok_arr);
      })
      .def("num_spills_dropped", &Scheduler::num_spills_dropped)
      .def("num_held_prefix_blocks", [](const Scheduler &s, py::handle keys) {
        return s.num_held_prefix_blocks(to_keys(keys));
      }, py::arg("block_keys"))
      .def("adopt_blocks", [](Scheduler &s, py::handle tokens, uint64_t seed, int first_block, int reserve) {
        auto ids = s.adopt_blocks(to_tokens(tokens, "token_ids"), seed, first_block, reserve);
        py::array_t<int32_t> arr(static_cast<py::ssize_t>(ids.size()));
        std::copy(ids.begin(), ids.end(), arr.mutable_data());
        return arr;
      }, py::arg("token_ids"), py::arg("seed"), py::arg("first_block"), py::arg("reserve") = 0)
      .def("prefix_cache_stats", [](const Scheduler &s) {
        py::dict d;
        d["query_tokens"] = s.prefix_query_tokens();
        d["hit_tokens"] = s.prefix_hit_tokens();
        return d;
      })
      .def("waiting_ids", [](const Scheduler &s) {
        std::vector<std::string> ids;
        for (auto &q : s.waiting) ids.push_back(q->request_id);
        return ids;
      })
      .def("running_ids", [](const Scheduler &s) {
        std::vector<std::string> ids;
        for (auto &q : s.running) ids.push_back(q->request_id);
        return ids;
      })
      .def("prompted_ids", [](const Scheduler &s) {
        std::vector<std::string> ids;
        for (auto &p : s.prompted) ids.push_back(std::get<0>(p)->request_id);
        return ids;
      })
      .def("live_request_ids", &Scheduler::live_request_ids)
      .def("sequence_info", [](const Scheduler &s, const std::string &rid) {
        auto seq = s.find(rid);
        if (!seq) throw std::out_of_range("unknown request id " + rid);
        py::dict d;
        d["seq_id"] = seq->seq_id;
        d["status"] = static_cast<int>(seq->schedule.status);
        d["token_ids"] = seq->data.token_ids;
        d["prompt_len"] = seq->data.prompt_len;
        d["output_len"] = seq->get_output_len();
        d["num_tokens"] = seq->cache.num_tokens;
        d["block_table"] = seq->cache.block_table;
        d["swa_valid_start"] = seq->cache.swa_valid_start;
        d["block_table_capacity"] = seq->cache.block_table.capacity();
        d["state_id"] = seq->cache.state_id;
        d["num_blocks_needed"] = seq->get_num_blocks();
        d["chunked_rest_len"] = seq->schedule.chunked_rest_len;
        d["total_inflight_tokens"] = seq->schedule.total_inflight_tokens;
        d["branch_id"] = seq->schedule.branch_id;
        d["info_slot"] = seq->draft.info_slot;
        d["accepted_tokens"] = seq->draft.accepted_tokens;
        d["first_token_latency"] = seq->first_token_latency;
        d["arrival_time"] = seq->arrival_time;
        d["schedulable"] = seq->schedule.schedulable;
        return d;
      }, py::arg("request_id"));
}
