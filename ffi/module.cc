// The nanobind module jax_ep._C: FFI handler capsules and the communication runtime.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "handlers/handlers.h"
#include "jax_ep_source_hash.h"  // generated: ffi/source_hash.cmake
#include "kernels/buffer_layout.h"
#include "runtime/diagnostics.h"
#include "runtime/host_times.h"
#include "runtime/runtime.h"
#include "transport/copy_engine.h"

namespace nb = nanobind;

namespace {

// Every FFI target, with a count of its execute-stage invocations (a diagnostic: it tells
// how often XLA ran each custom call, see handler_calls()).
struct Target {
  const char* name;
  XLA_FFI_Handler* handler;
};

constexpr Target kTargets[] = {
    {"jax_ep_layout", JaxEpLayout},
    {"jax_ep_dispatch", JaxEpDispatch},
    {"jax_ep_cached_dispatch", JaxEpCachedDispatch},
    {"jax_ep_combine", JaxEpCombine},
    {"jax_ep_ll_dispatch_send", JaxEpLLDispatchSend},
    {"jax_ep_ll_dispatch_receive", JaxEpLLDispatchReceive},
    {"jax_ep_ll_combine_send", JaxEpLLCombineSend},
    {"jax_ep_ll_combine_receive", JaxEpLLCombineReceive},
    {"jax_ep_ll_dispatch", JaxEpLLDispatch},
    {"jax_ep_ll_combine", JaxEpLLCombine},
    {"jax_ep_node_send", JaxEpNodeSend},
    {"jax_ep_node_return", JaxEpNodeReturn},
    {"jax_ep_quantize_fp8", JaxEpQuantizeFp8},
    {"jax_ep_batched_matmul", JaxEpBatchedMatmul},
    {"jax_ep_grouped_matmul", JaxEpGroupedMatmul},
};
constexpr int kNumTargets = sizeof(kTargets) / sizeof(kTargets[0]);
std::atomic<unsigned long long> g_calls[kNumTargets];

// Host time of each handler execution (what XLA's thread spends enqueueing a call: validation,
// launches, copy-engine transfers): a path whose host time per call exceeds its GPU time
// cannot keep the GPU busy (see handler_host_times()).
jax_ep::HostTimeRing g_host_times[kNumTargets];

// Diagnostic (runtime.initialize(log_calls=True)): one stderr line per handler execution with
// what tells two executions apart (XLA's run id, the stream, the first operand's address, the
// host thread).
std::atomic<bool> g_log_calls{false};
bool log_calls() { return g_log_calls.load(std::memory_order_relaxed); }

void log_call(const char* name, unsigned long long n, XLA_FFI_CallFrame* frame) {
  const XLA_FFI_Api* api = frame->api;
  void* stream = nullptr;
  long long run_id = -1;
  XLA_FFI_Stream_Get_Args stream_args{XLA_FFI_Stream_Get_Args_STRUCT_SIZE, nullptr, frame->ctx,
                                      nullptr};
  if (api->XLA_FFI_Stream_Get(&stream_args) == nullptr) stream = stream_args.stream;
  constexpr size_t kRunIdEnd = offsetof(XLA_FFI_Api, XLA_FFI_RunId_Get) + sizeof(void*);
  if (api->struct_size >= kRunIdEnd && api->XLA_FFI_RunId_Get != nullptr) {
    XLA_FFI_RunId_Get_Args run_args{XLA_FFI_RunId_Get_Args_STRUCT_SIZE, nullptr, frame->ctx, 0};
    if (api->XLA_FFI_RunId_Get(&run_args) == nullptr) run_id = run_args.run_id;
  }
  const void* first = nullptr;
  if (frame->args.size > 0 && frame->args.types[0] == XLA_FFI_ArgType_BUFFER)
    first = static_cast<XLA_FFI_Buffer*>(frame->args.args[0])->data;
  std::fprintf(stderr, "jax_ep handler %s #%llu run_id %lld stream %p arg0 %p thread %zx\n",
               name, n, run_id, stream, first,
               std::hash<std::thread::id>{}(std::this_thread::get_id()));
}

template <int I>
XLA_FFI_Error* counted(XLA_FFI_CallFrame* frame) {
  // Metadata queries (at registration) and other stages are not executions.
  if (frame->extension_start != nullptr || frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
    return kTargets[I].handler(frame);
  const unsigned long long n = g_calls[I].fetch_add(1, std::memory_order_relaxed) + 1;
  if (log_calls()) log_call(kTargets[I].name, n, frame);
  jax_ep::ScopedHostTimer timer(g_host_times[I]);
  return kTargets[I].handler(frame);
}

template <int... Is>
void add_targets(nb::dict& targets, std::integer_sequence<int, Is...>) {
  ((targets[kTargets[Is].name] = nb::capsule(reinterpret_cast<void*>(&counted<Is>))), ...);
}

nb::dict ffi_targets() {
  nb::dict targets;
  add_targets(targets, std::make_integer_sequence<int, kNumTargets>{});
  return targets;
}

nb::dict handler_calls() {
  nb::dict calls;
  for (int i = 0; i < kNumTargets; ++i) calls[kTargets[i].name] = g_calls[i].load();
  return calls;
}

// {target: [ns of its recent executions]} for the targets executed since the last reset.
nb::dict handler_host_times(bool reset) {
  nb::dict out;
  for (int i = 0; i < kNumTargets; ++i) {
    if (g_host_times[i].count() > 0) {
      nb::list values;
      for (unsigned ns : g_host_times[i].recent()) values.append(ns);
      out[kTargets[i].name] = values;
    }
    if (reset) g_host_times[i].reset();
  }
  return out;
}

// Runs a device read that synchronises (without the GIL) and returns its values as a list.
nb::list synchronised_list(std::vector<unsigned long long> (*read)()) {
  std::vector<unsigned long long> values;
  {
    nb::gil_scoped_release release;
    values = read();
  }
  nb::list out;
  for (unsigned long long v : values) out.append(v);
  return out;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_ep native extension: typed XLA FFI handlers and the NVSHMEM runtime";
  m.def("ffi_targets", &ffi_targets, "{target name: PyCapsule} of every FFI handler");
  m.def("handler_host_times", &handler_host_times, nb::arg("reset") = false,
        "{target: [host ns of each recent execution]} (the last 4096 per target); reset=True "
        "starts afresh after reading");
  m.def("handler_calls", &handler_calls,
        "{target name: executions of its FFI handler in this process} (diagnostic)");
  m.def("cuda_architectures", [] { return std::string(JAX_EP_CUDA_ARCHS); });
  m.def("source_hash", [] { return std::string(JAX_EP_SOURCE_HASH); },
        "SHA-256 of the sources it was built from (ffi/source_hash.cmake)");
  m.def("create_unique_id", [] {
    std::string id = jax_ep::create_unique_id();
    return nb::bytes(id.data(), id.size());
  });
  m.def("unique_id_size", &jax_ep::unique_id_size);
  m.def(
      "initialize",
      [](int rank, int num_ranks, int local_device, size_t buffer_bytes, nb::bytes unique_id,
         bool single_host, size_t low_latency_bytes, std::vector<int> node_of) {
        jax_ep::InitOptions options;
        options.node_of = std::move(node_of);
        options.rank = rank;
        options.num_ranks = num_ranks;
        options.local_device = local_device;
        options.buffer_bytes = buffer_bytes;
        options.low_latency_bytes = low_latency_bytes;
        options.unique_id = std::string(unique_id.c_str(), unique_id.size());
        options.single_host = single_host;
        nb::gil_scoped_release release;  // NVSHMEM's bootstrap blocks until every PE joins
        jax_ep::initialize(options);
      },
      nb::arg("rank"), nb::arg("num_ranks"), nb::arg("local_device"), nb::arg("buffer_bytes"),
      nb::arg("unique_id"), nb::arg("single_host") = true, nb::arg("low_latency_bytes") = 0,
      nb::arg("node_of") = std::vector<int>());
  m.def(
      "set_diagnostics",
      [](double fault_exit_s, bool log) {
        jax_ep::set_fault_exit_s(fault_exit_s);
        g_log_calls.store(log);
      },
      nb::arg("fault_exit_s"), nb::arg("log_calls"),
      "The watchdog's grace after a kernel timeout before it ends the process (0: never), and "
      "whether every handler execution is logged to stderr");
  m.def("finalize", [] {
    nb::gil_scoped_release release;
    jax_ep::finalize();  // synchronises this process's GPU (its device made current) first
    // the cached graphs' nodes name this initialisation's peers and flags
    jax_ep::release_copy_engine_graphs();
  });
  m.def("is_initialized", &jax_ep::is_initialized);
  // (descriptor, base, size) of the XLA allocation holding a JAX array's device pointer; the
  // descriptor is -1 when the allocation cannot be exported.
  m.def("export_xla_window", [](uint64_t ptr) {
    uint64_t base = 0, size = 0;
    const int fd = jax_ep::export_xla_window(ptr, &base, &size);
    return nb::make_tuple(fd, base, size);
  });
  m.def("open_xla_windows", &jax_ep::open_xla_windows);
  m.def("buffer_bytes", [] {
    const jax_ep::Transport* t = jax_ep::transport();
    return t ? t->bytes : size_t(0);
  });
  m.def("low_latency_buffer_bytes", [] {
    const jax_ep::Transport* t = jax_ep::transport();
    return t ? t->ll_bytes : size_t(0);
  });
  m.def("rank", [] {
    const jax_ep::Transport* t = jax_ep::transport();
    return t ? t->rank : -1;
  });
  m.def("num_ranks", [] {
    const jax_ep::Transport* t = jax_ep::transport();
    return t ? t->num_ranks : 0;
  });
  m.def("whole_lines", [] {
    const jax_ep::Transport* t = jax_ep::transport();
    return t ? t->whole_lines : false;
  }, "Whether the low-latency calls read record lines as they land (every two GPUs of this "
     "node joined by NVLink, or one GPU); else they wait for the senders' arrival");
  m.def("nvshmem_version", &jax_ep::nvshmem_version);
  m.def(
      "limits",
      [] {
        nb::dict out;
        out["max_ranks"] = jax_ep::kMaxRanks;
        out["max_sources"] = jax_ep::kMaxSources;
        out["max_copy_ranks"] = jax_ep::kMaxCopyRanks;
        out["low_latency_max_topk"] = jax_ep::kLLMaxTopk;
        return out;
      },
      "The CUDA kernels' size limits: ranks; ranks (rank_major) or top-k (expert_major) of the "
      "push dispatches and of every combine; ranks of the copy-engine paths; low-latency top-k");
  m.def(
      "copy_engine_host_times",
      [](bool reset) {
        nb::dict out;
        for (const auto& t : jax_ep::copy_engine_host_times(reset)) {
          nb::list ns;
          for (unsigned v : t.ns) ns.append(v);
          out[t.kind] = nb::make_tuple(t.calls, ns);
        }
        return out;
      },
      nb::arg("reset") = false,
      "{kind: (host calls, [ns of the last few thousand])} of the copy-engine paths' host calls "
      "(guard, fork, join, graph launch / update / build) since the last reset");
  m.def("low_latency_calls", [] { return synchronised_list(jax_ep::read_low_latency_calls); },
        "Calls started by this PE's low-latency dispatch and combine sends (synchronises)");
  m.def("profile_reset", [] {
    nb::gil_scoped_release release;
    jax_ep::reset_profile();
  }, "Clears the communication kernels' phase timestamps and has the kernels stamp them until "
     "the next profile_read (synchronises the device)");
  m.def("profile_read", [] { return synchronised_list(jax_ep::read_profile); },
        "Phase timestamps [kernel slot][enter, waited, first end, last end] in ns since "
        "profile_reset; stamping stops (synchronises)");
  m.def("required_buffer_bytes", &jax_ep::required_buffer_bytes, nb::arg("num_ranks"),
        nb::arg("num_tokens"), nb::arg("hidden"), nb::arg("elem_bytes"), nb::arg("num_topk"),
        nb::arg("num_experts"), nb::arg("capacity"), nb::arg("expert_major"), nb::arg("fp8"),
        nb::arg("copy_engine") = false, nb::arg("push_combine") = false,
        "Symmetric-buffer bytes that a dispatch + combine of these shapes needs");
  m.def(
      "node_exchange_bytes",
      [](int num_nodes, int num_tokens, int num_topk, size_t row_bytes, size_t scale_row_bytes,
         bool returning) {
        return jax_ep::plan_node_exchange(num_nodes, num_tokens, num_topk, row_bytes,
                                          scale_row_bytes, returning)
            .end;
      },
      nb::arg("num_nodes"), nb::arg("num_tokens"), nb::arg("num_topk"), nb::arg("row_bytes"),
      nb::arg("scale_row_bytes") = 0, nb::arg("returning") = false,
      "Symmetric-buffer bytes of a node exchange (the network stage across nodes)");
  m.def("required_low_latency_bytes", &jax_ep::required_low_latency_bytes,
        nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("num_experts"), nb::arg("num_topk"),
        nb::arg("num_ranks"), nb::arg("elem_bytes"), nb::arg("across_nodes") = false,
        "Low-latency buffer bytes that a low-latency dispatch + combine of these shapes needs");
  m.def(
      "low_latency_sections",
      [](size_t buffer_bytes, bool combine, uint64_t call, int num_ranks, int num_experts,
         int max_tokens, int num_topk, size_t row_bytes, size_t scale_bytes, bool staged) {
        const jax_ep::LLAreas areas = jax_ep::ll_areas(buffer_bytes);
        size_t words_bytes, bytes, begin, end;
        if (combine) {
          const auto plan =
              jax_ep::plan_ll_combine(num_ranks, max_tokens, num_topk, row_bytes, staged);
          words_bytes = plan.words_bytes, bytes = plan.bytes;
          begin = areas.combine_begin, end = areas.combine_end;
        } else {
          const auto plan = jax_ep::plan_ll_dispatch(num_ranks, num_experts, max_tokens,
                                                     num_topk, row_bytes, scale_bytes);
          words_bytes = plan.words_bytes, bytes = plan.bytes;
          begin = areas.dispatch_begin, end = areas.dispatch_end;
        }
        const jax_ep::LLSections at = jax_ep::ll_sections(call, begin, end, words_bytes, bytes);
        return nb::make_tuple(at.words, words_bytes, at.data, bytes - words_bytes, begin, end);
      },
      nb::arg("buffer_bytes"), nb::arg("combine"), nb::arg("call"), nb::arg("num_ranks"),
      nb::arg("num_experts"), nb::arg("max_tokens"), nb::arg("num_topk"), nb::arg("row_bytes"),
      nb::arg("scale_bytes") = 0, nb::arg("staged") = false,
      "(words offset, words bytes, data offset, data bytes, area begin, area end) of call "
      "`call`'s low-latency region in a buffer of buffer_bytes (the layout's own arithmetic; "
      "staged: a combine whose group spans nodes)");
}
