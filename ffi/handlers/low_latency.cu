// Typed-FFI handlers of the low-latency (decode) mode: jax_ep_ll_dispatch_send / _receive,
// jax_ep_ll_combine_send / _receive, and the fused jax_ep_ll_dispatch / jax_ep_ll_combine. They validate shapes, check the low-latency buffer is
// large enough, fill the kernels' argument structs and launch; nothing here waits for the
// device.

#include <algorithm>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "kernels/buffer_layout.h"
#include "kernels/launch.h"
#include "kernels/low_latency.h"
#include "runtime/diagnostics.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

constexpr size_t kMaxStaticSmem = 48 * 1024;  // dynamic shared memory without opting in

int sm_count() {
  static const int value = [] {
    int device = 0, count = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        count < 1)
      return 132;
    return count;
  }();
  return value;
}

int blocks_or_default(int64_t num_blocks) {
  return num_blocks > 0 ? static_cast<int>(num_blocks) : sm_count();
}

size_t element_bytes(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32:
    case ffi::DataType::S32: return 4;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F8E4M3FN: return 1;
    default: return 0;
  }
}

bool float_type(ffi::DataType type, LLElement* out) {
  switch (type) {
    case ffi::DataType::BF16: *out = LLElement::kBF16; return true;
    case ffi::DataType::F16: *out = LLElement::kF16; return true;
    case ffi::DataType::F32: *out = LLElement::kF32; return true;
    default: return false;
  }
}

std::string hint_text() {
  return "pass low_latency_bytes to jax_ep.runtime.initialize() (or set JAX_EP_LL_BUFFER_BYTES); "
         "jax_ep.low_latency_buffer_size_hint(max_tokens_per_rank, hidden, num_experts, "
         "num_topk, num_ranks) gives the size for your shapes";
}

// The peer context on the low-latency buffer and the area of this op. `region` is the bytes
// one parity of this call needs; `combine` picks the combine area.
ffi::Error ll_context(const char* op, ffi::Buffer<ffi::S32> rank, int64_t num_experts,
                      int64_t max_tokens, int64_t num_topk, size_t region, bool combine,
                      const EpGroup& group, const Tuning& tuning, PeerContext* ctx,
                      size_t* begin, size_t* end) {
  const Transport* t = transport();
  if (t == nullptr)
    return invalid(std::string(op) + ": the runtime is not initialised: call "
                   "jax_ep.runtime.initialize() after jax.distributed.initialize()");
  if (rank.element_count() != 1) return invalid(std::string(op) + ": rank must be a scalar");
  GroupPlace place;
  if (auto err = place_in_group(op, group, *t, /*across_nodes=*/true, &place); err.failure())
    return err;
  const int R = place.num_ranks;
  if (num_experts < R || num_experts % R != 0)
    return invalid(std::string(op) + ": num_experts must be a positive multiple of the " +
                   std::to_string(R) + " NVSHMEM PEs");
  if (num_topk < 1 || num_topk > kLLMaxTopk)
    return invalid(std::string(op) + ": num_topk must be in [1, " + std::to_string(kLLMaxTopk) +
                   "]");
  // a pair header holds expert * M + slot in 32 bits, 0xffffffff naming no row
  if (num_experts * max_tokens >= int64_t(UINT32_MAX))
    return invalid(std::string(op) + ": num_experts * max_tokens_per_rank must be below 2^32 - 1");
  const size_t needed = combine ? ll_bytes_for_combine(region) : ll_bytes_for_dispatch(region);
  const LLAreas areas = ll_areas(t->ll_bytes);
  const size_t have = combine ? areas.combine_end - areas.combine_begin
                              : areas.dispatch_end - areas.dispatch_begin;
  if (t->ll_bytes == 0 || 2 * region > have)
    return invalid(std::string(op) + ": this call needs a low-latency buffer of " +
                   std::to_string(needed) + " bytes but the runtime has " +
                   std::to_string(t->ll_bytes) + "; " + hint_text());
  *ctx = PeerContext{t->ll_peers,          place.rank,        place.num_ranks,
                    tuning.timeout_ns(), rank.typed_data(), device_fault_record(),
                    next_profile_row(),  place.base,        place.stride,
                    t->num_ranks,        t->spans_nodes};
  ctx->whole_lines = t->whole_lines;
  *begin = combine ? areas.combine_begin : areas.dispatch_begin;
  *end = combine ? areas.combine_end : areas.dispatch_end;
  return ffi::Error::Success();
}

// Rows of the expert_major layout: every pair a rank can receive (each source sends at most
// M tokens, each to at most min(K, L) of this rank's experts).
int64_t packed_rows(int R, int64_t max_tokens, int64_t num_topk, int L) {
  return int64_t(R) * max_tokens * std::min<int64_t>(num_topk, L);
}

// Ranks of the call's EP group (validated against the job in ll_context).
int group_ranks(const EpGroup& group) {
  return static_cast<int>(std::max<int64_t>(group.num_ranks, 1));
}

// The combine stages partial rows for owners on other nodes (plan_ll_combine's `staged`):
// whether the call's group leaves this PE's node (a bad group is reported by ll_context).
bool group_off_node(const char* op, const EpGroup& group) {
  const Transport* t = transport();
  GroupPlace place;
  return t != nullptr && place_in_group(op, group, *t, true, &place).success() &&
         place.off_node;
}

// ------------------------------------------------------------- split calls, own stream
//
// A split call (dispatch or combine) runs the whole operation (the fused kernel: send and
// receive) on a stream of the extension's own, so that the program's stream goes on with the
// work between the send and its receive while the rows travel; the receive only makes the
// program's stream wait for that kernel. The send's results are the operation's outputs,
// written by that kernel, and the receive returns them (aliased): XLA reads none of them before
// the receive. The send's operands are operands of the receive as well, so XLA keeps them alive
// and unchanged until then. The kernel is enqueued before the work after the send and takes
// few SMs by default (config.LOW_LATENCY_SPLIT_DISPATCH_BLOCKS, ..._COMBINE_BLOCKS), leaving
// that work the others. (A wait of the program's stream until the kernel's first block ran, so
// that the work after it could not take every SM first, cost 3 to 6 µs a call and won on no
// measured row.) Under stream capture the kernel runs on the program's stream instead. Any
// later kernel of ours on the program's stream waits for the split kernels in flight
// (KernelStreams, launch.h).

class SplitCalls {
 public:
  static SplitCalls& get() {
    static SplitCalls* one = new SplitCalls;  // never destroyed: outlives the driver
    return *one;
  }

  // What a receive launches on the program's stream once it has joined its send's kernel.
  using Finish = std::function<cudaError_t(cudaStream_t program)>;

  // Launches a split send's kernel: launch(stream) with its arguments; `out` (its first result
  // row) names it for its receive, which then runs `finish` (if any) on the program's stream.
  template <typename Launch>
  ffi::Error launch(cudaStream_t program, const void* out, const char* op, Launch launch,
                    Finish finish = nullptr) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (auto err = cuda_error(cudaStreamIsCapturing(program, &capture), op); err.failure())
      return err;
    const bool captured = capture != cudaStreamCaptureStatusNone;
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto err = forget(program, captured, out, op); err.failure()) return err;
    if (captured) {
      if (auto err = cuda_error(launch(program), op); err.failure()) return err;
      pending_.push_back(Pending{out, nullptr, std::move(finish)});
      return ffi::Error::Success();
    }
    if (auto err = cuda_error(ready(), op); err.failure()) return err;
    cudaEvent_t inputs = take_event(), done = take_event();
    if (inputs == nullptr || done == nullptr) return invalid(std::string(op) + ": no CUDA event");
    cudaError_t status = cudaEventRecord(inputs, program);
    if (status == cudaSuccess) status = cudaStreamWaitEvent(stream_, inputs, 0);
    events_.push_back(inputs);  // reusable once the wait is enqueued
    if (status == cudaSuccess) status = KernelStreams::get().order(stream_, program);
    if (status == cudaSuccess) status = launch(stream_);
    if (status == cudaSuccess) status = cudaEventRecord(done, stream_);
    if (status != cudaSuccess) {
      events_.push_back(done);
      return cuda_error(status, op);
    }
    pending_.push_back(Pending{out, done, std::move(finish)});
    return ffi::Error::Success();
  }

  // The receive of the send that returned `out`: the program's stream waits for its kernel.
  ffi::Error join(cudaStream_t program, const void* out, const char* op) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (pending_[i].out != out) continue;
      const cudaEvent_t done = pending_[i].done;
      const Finish finish = std::move(pending_[i].finish);
      pending_.erase(pending_.begin() + static_cast<long>(i));
      cudaError_t status = cudaSuccess;
      if (done != nullptr) {  // (else it ran on the program's stream)
        status = cudaStreamWaitEvent(program, done, 0);
        events_.push_back(done);
        if (status == cudaSuccess && !in_flight()) KernelStreams::get().joined(program, stream_);
      }
      if (status == cudaSuccess && finish) status = finish(program);
      return cuda_error(status, op);
    }
    return invalid(std::string(op) + ": its rows are not those of a send in flight: pass the "
                   "result of the send to one receive, unchanged (a pending call that XLA "
                   "copied, or one received already, cannot be received)");
  }

 private:
  struct Pending {
    const void* out;
    cudaEvent_t done;  // nullptr: the kernel ran on the program's stream
    Finish finish;
  };

  // A send whose rows XLA placed where an earlier pending call's were: that one was never
  // received (XLA reused its buffer), so it can no longer be. The program's stream waits for
  // its kernel all the same, so that every split kernel off the pending list is behind it
  // (unless captured: a captured stream cannot wait for work outside its graph). A send whose
  // receive has work of its own (a combine's sum, which raises the protocol's flags) cannot
  // be left: an error, as no later call of its op could proceed.
  ffi::Error forget(cudaStream_t program, bool captured, const void* out, const char* op) {
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (pending_[i].out != out) continue;
      const cudaEvent_t done = pending_[i].done;
      const bool finish = static_cast<bool>(pending_[i].finish);
      pending_.erase(pending_.begin() + static_cast<long>(i));
      cudaError_t status = cudaSuccess;
      if (done != nullptr) {
        events_.push_back(done);
        if (!captured) status = cudaStreamWaitEvent(program, done, 0);
      }
      if (finish)
        return invalid(std::string(op) + ": an earlier split call whose rows were here was "
                       "never received (its receive sums the partial rows and frees the "
                       "buffer for the next calls): pass each send's result to one receive");
      return cuda_error(status, op);
    }
    return ffi::Error::Success();
  }

  bool in_flight() const {
    for (const Pending& p : pending_)
      if (p.done != nullptr) return true;
    return false;
  }

  cudaError_t ready() {
    if (stream_ != nullptr) return cudaSuccess;
    int least = 0, greatest = 0;
    cudaError_t status = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (status == cudaSuccess)
      status = cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest);
    if (status != cudaSuccess) stream_ = nullptr;
    return status;
  }

  cudaEvent_t take_event() {
    if (!events_.empty()) {
      const cudaEvent_t e = events_.back();
      events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) return nullptr;
    return e;
  }

  std::mutex mutex_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // free for reuse
  std::vector<Pending> pending_;
};

// How a fused call's kernel is launched on the program's stream. Its launch waits for every
// kernel of ours on other streams so far (KernelStreams), the split kernels in flight among
// them: those of its own op take call numbers from the same counter, and one of the other op
// would otherwise run beside it, each grid waiting for a peer's (a peer whose fused grid took
// every SM first starves its own split kernel of SMs, while here the split kernel holds the
// SMs the fused grid waits for, and neither ends; both grids launched cooperatively did not
// prevent it on two GPUs). So nothing of ours runs beside it (kAlone), except in a captured
// program, which cannot wait for work outside its graph (kBesideOwn: cooperative).
ffi::Error fused_placement(cudaStream_t program, LLPlacement& placement) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t status = cudaStreamIsCapturing(program, &capture);
  placement = status == cudaSuccess && capture == cudaStreamCaptureStatusNone
                  ? LLPlacement::kAlone
                  : LLPlacement::kBesideOwn;
  return cuda_error(status, "low-latency call");
}

ffi::Error make_dispatch_send(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                              ffi::Buffer<ffi::S32> slots_in, ffi::Buffer<ffi::S32> rank,
                              ffi::ResultBuffer<ffi::S32> send_slot,
                              ffi::ResultBuffer<ffi::S32> call,
                              ffi::ResultBuffer<ffi::S32> num_dropped, int64_t num_experts,
                              int64_t max_tokens, bool use_fp8, bool ue8m0, bool cached,
                              const EpGroup& group, const Tuning& tuning,
                              LLDispatchSendArgs& a) {
  const char* op = "low_latency_dispatch (send)";
  auto x_dims = x.dimensions();
  auto idx_dims = topk_idx.dimensions();
  if (x_dims.size() != 2 || idx_dims.size() != 2 || idx_dims[0] != x_dims[0])
    return invalid(std::string(op) + ": x must be [T, D] and topk_idx [T, K]");
  const int T = static_cast<int>(x_dims[0]), D = static_cast<int>(x_dims[1]);
  const int K = static_cast<int>(idx_dims[1]);
  if (max_tokens < 1 || T > max_tokens)
    return invalid(std::string(op) + ": " + std::to_string(T) +
                   " tokens exceed max_tokens_per_rank=" + std::to_string(max_tokens));
  if (send_slot->element_count() != size_t(T) * K || call->element_count() != 2 ||
      num_dropped->element_count() != 1)
    return invalid(std::string(op) + ": result shapes do not match [T, K], [2], []");
  if (cached && slots_in.element_count() != size_t(T) * K)
    return invalid(std::string(op) + ": a cached dispatch needs the handle's send_slot [T, K]");
  a = LLDispatchSendArgs{};
  a.use_fp8 = use_fp8 != 0;
  a.ue8m0 = ue8m0 != 0;
  a.cached = cached != 0;
  if (a.use_fp8 && a.cached) return invalid(std::string(op) + ": cached dispatches send raw rows");
  if (a.use_fp8) {
    if (!float_type(x.element_type(), &a.x_type))
      return invalid(std::string(op) + ": FP8 dispatch quantises bf16, f16 or f32 rows");
    if (D % 128 != 0)
      return invalid(std::string(op) + ": FP8 dispatch needs hidden divisible by 128");
    a.row_bytes = size_t(D);
    a.scale_bytes = sizeof(float) * size_t(D / 128);
  } else {
    const size_t elem = element_bytes(x.element_type());
    if (elem == 0) return invalid(std::string(op) + ": unsupported dtype of x");
    a.x_type = LLElement::kRaw;
    a.row_bytes = size_t(D) * elem;
    a.scale_bytes = 0;
  }
  const int R = group_ranks(group);
  a.plan = plan_ll_dispatch(R, static_cast<int>(num_experts), static_cast<int>(max_tokens), K,
                            a.row_bytes, a.scale_bytes);
  if (auto err = ll_context(op, rank, num_experts, max_tokens, K, a.plan.bytes, false, group,
                            tuning,
                            &a.ctx, &a.area_begin, &a.area_end);
      err.failure())
    return err;
  const int E = static_cast<int>(num_experts);
  a.num_tokens = T;
  a.num_topk = K;
  a.num_experts = E;
  a.max_tokens = static_cast<int>(max_tokens);
  a.num_blocks = blocks_or_default(tuning.num_blocks);
  if (!ll_plan_dispatch_stages(&a))
    return invalid(std::string(op) + ": " + std::to_string(T * K) + " (token, k) pairs and a " +
                   std::to_string(a.plan.payload_bytes) + "-byte row need more than " +
                   std::to_string(kLLMaxSendSmem) + " bytes of shared memory");
  a.hidden = D;
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  a.slots_in = a.cached ? slots_in.typed_data() : nullptr;
  a.send_slot = send_slot->typed_data();
  a.call_out = call->typed_data();
  a.num_dropped = num_dropped->typed_data();
  return ffi::Error::Success();
}


// `call`: the device [2] int32 call number of the matching send.
ffi::Error make_dispatch_receive(const int32_t* call, ffi::Buffer<ffi::S32> rank,
                                 ffi::Result<ffi::AnyBuffer> out_x,
                                 ffi::ResultBuffer<ffi::F32> out_scales,
                                 ffi::ResultBuffer<ffi::S32> recv_count,
                                 ffi::ResultBuffer<ffi::S32> src_rank,
                                 ffi::ResultBuffer<ffi::S32> src_token,
                                 ffi::ResultBuffer<ffi::S32> src_k,
                                 ffi::ResultBuffer<ffi::S32> pair_row, int64_t num_experts,
                                 int64_t max_tokens, int64_t num_tokens, int64_t num_topk,
                                 bool records, const EpGroup& group, const Tuning& tuning,
                                 LLDispatchReceiveArgs& a) {
  const char* op = "low_latency_dispatch (receive)";
  auto dims = out_x->dimensions();
  const int R = group_ranks(group);
  if (max_tokens < 1 || num_experts < R || num_experts % R != 0)
    return invalid(std::string(op) + ": bad num_experts / max_tokens_per_rank");
  const int L = static_cast<int>(num_experts / R), RM = R * static_cast<int>(max_tokens);
  if (sizeof(int32_t) * (size_t(num_experts) + 1) > kMaxStaticSmem)
    return invalid(std::string(op) + ": at most " +
                   std::to_string(kMaxStaticSmem / sizeof(int32_t) - 1) + " experts");
  // x [P, D]: the expert_major layout, every group packed (P rows hold every pair a rank can
  // receive); records: x [R*M, D], each record once, the handle's rows packed; else
  // [L, R*M, D] blocks
  const bool packed = records || dims.size() == 2;
  const int64_t P = packed_rows(R, max_tokens, num_topk, L);
  if (records ? dims.size() != 2 || dims[0] != RM
      : packed ? dims[0] != P
               : dims.size() != 3 || dims[0] != L || dims[1] != RM)
    return invalid(std::string(op) + ": x must be [L, R*M, D] = [" + std::to_string(L) + ", " +
                   std::to_string(RM) + ", D], expert_major [R*M*min(K, L), D] = [" +
                   std::to_string(P) + ", D] or records [R*M, D]; the EP axis must span "
                   "every NVSHMEM PE");
  const size_t elem = element_bytes(out_x->element_type());
  if (elem == 0) return invalid(std::string(op) + ": unsupported dtype of x");
  const int D = static_cast<int>(dims[dims.size() - 1]);
  const size_t rows = records ? size_t(RM) : packed ? size_t(P) : size_t(L) * RM;
  const size_t handle_rows = packed ? size_t(P) : size_t(L) * RM;
  a = LLDispatchReceiveArgs{};
  a.num_rows = packed ? static_cast<int>(P) : 0;
  a.records = records;
  a.row_bytes = size_t(D) * elem;
  const bool fp8 = out_scales->element_count() != 0;
  if (fp8 && (out_x->element_type() != ffi::DataType::F8E4M3FN || D % 128 != 0 ||
              out_scales->element_count() != rows * (D / 128)))
    return invalid(std::string(op) + ": FP8 results must be e4m3 rows of H and float32 rows "
                   "of H / 128");
  a.scale_bytes = fp8 ? sizeof(float) * size_t(D / 128) : 0;
  const bool want_src = src_rank->element_count() != 0;
  if (recv_count->element_count() != size_t(L) ||
      (want_src && (src_rank->element_count() != handle_rows ||
                    src_token->element_count() != handle_rows ||
                    src_k->element_count() != handle_rows ||
                    pair_row->element_count() != size_t(R) * num_tokens * num_topk)))
    return invalid(std::string(op) + ": recv_count must be [L], src_* one per row (packed "
                   "rows for records) and pair_row [R, T, K] (or empty)");
  if (records && !want_src)
    return invalid(std::string(op) + ": a records dispatch returns the handle's rows");
  if (num_tokens < 0 || num_tokens > max_tokens)
    return invalid(std::string(op) + ": num_tokens must be in [0, max_tokens_per_rank]");
  a.plan = plan_ll_dispatch(R, static_cast<int>(num_experts), static_cast<int>(max_tokens),
                            static_cast<int>(num_topk), a.row_bytes, a.scale_bytes);
  if (auto err = ll_context(op, rank, num_experts, max_tokens, num_topk, a.plan.bytes, false,
                            group, tuning, &a.ctx, &a.area_begin, &a.area_end);
      err.failure())
    return err;
  a.num_experts = static_cast<int>(num_experts);
  a.max_tokens = static_cast<int>(max_tokens);
  a.num_tokens = static_cast<int>(num_tokens);
  a.num_topk = static_cast<int>(num_topk);
  a.num_blocks = blocks_or_default(tuning.num_blocks);
  a.call = call;
  a.out_x = out_x->untyped_data();
  a.out_scales = fp8 ? out_scales->typed_data() : nullptr;
  a.recv_count = recv_count->typed_data();
  a.src_rank = want_src ? src_rank->typed_data() : nullptr;
  a.src_token = want_src ? src_token->typed_data() : nullptr;
  a.src_k = want_src ? src_k->typed_data() : nullptr;
  a.pair_row = want_src ? pair_row->typed_data() : nullptr;
  return ffi::Error::Success();
}

// A split receive: its operands are the send's results (aliased to its own) and the send's
// operands (kept alive for the kernel); the program's stream waits for the kernel of the send
// whose rows are operand `rows`.
ffi::Error join_receive(cudaStream_t stream, ffi::RemainingArgs operands,
                        ffi::RemainingRets results, const char* op, const char* pending,
                        size_t rows) {
  if (operands.size() <= rows || results.size() <= rows)
    return invalid(std::string(op) + ": takes the pending " + pending + " of a send");
  auto out = operands.get<ffi::AnyBuffer>(rows);
  if (out.has_error()) return invalid(std::string(op) + ": the pending rows are missing");
  return SplitCalls::get().join(stream, out.value().untyped_data(), op);
}

ffi::Error dispatch_receive_impl(cudaStream_t stream, ffi::RemainingArgs operands,
                                 ffi::RemainingRets results) {
  return join_receive(stream, operands, results, "low_latency_dispatch (receive)", "dispatch",
                      3);  // out_x
}

// Send and receive in one kernel, the same operands and results either way: on the program's
// stream (the fused and cached dispatches: XLA cannot put anything between the halves, so
// fused calls never count against the two calls in flight) or, kSplit, on the extension's
// stream for a split send (SplitCalls), whose receive returns these results.
template <bool kSplit>
ffi::Error dispatch_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                         ffi::Buffer<ffi::S32> slots_in, ffi::Buffer<ffi::S32> rank,
                         ffi::ResultBuffer<ffi::S32> send_slot, ffi::ResultBuffer<ffi::S32> call,
                         ffi::ResultBuffer<ffi::S32> num_dropped, ffi::Result<ffi::AnyBuffer> out_x,
                         ffi::ResultBuffer<ffi::F32> out_scales,
                         ffi::ResultBuffer<ffi::S32> recv_count,
                         ffi::ResultBuffer<ffi::S32> src_rank, ffi::ResultBuffer<ffi::S32> src_token,
                         ffi::ResultBuffer<ffi::S32> src_k,
                         ffi::ResultBuffer<ffi::S32> pair_row, int64_t num_experts,
                         int64_t max_tokens, bool use_fp8, bool ue8m0, bool cached,
                         bool records, EpGroup group, Tuning tuning) {
  LLDispatchSendArgs send;
  if (auto err = make_dispatch_send(x, topk_idx, slots_in, rank, send_slot, call, num_dropped,
                                    num_experts, max_tokens, use_fp8, ue8m0, cached, group,
                                    tuning,
                                    send);
      err.failure())
    return err;
  LLDispatchReceiveArgs receive;
  if (auto err = make_dispatch_receive(send.call_out, rank, out_x, out_scales, recv_count,
                                       src_rank, src_token, src_k, pair_row, num_experts,
                                       max_tokens, send.num_tokens, send.num_topk, records,
                                       group, tuning, receive);
      err.failure())
    return err;
  if (receive.row_bytes != send.row_bytes || receive.scale_bytes != send.scale_bytes)
    return invalid("low_latency_dispatch: the result rows do not match the sent rows");
  receive.ctx.profile = send.ctx.profile;  // one call, one profile row
  if (kSplit) {
    if (receive.src_rank == nullptr)
      return invalid("low_latency_dispatch (send): a split dispatch returns the handle's arrays");
    return SplitCalls::get().launch(
        stream, receive.out_x, "low_latency_dispatch (send)", [&](cudaStream_t on) {
          return launch_ll_dispatch(send, receive, on, LLPlacement::kBesideWork);
        });
  }
  LLPlacement placement = LLPlacement::kAlone;
  if (auto err = fused_placement(stream, placement); err.failure()) return err;
  return cuda_error(launch_ll_dispatch(send, receive, stream, placement), "low_latency_dispatch");
}

// The weights [T, K] are this rank's, as owner: the send publishes them for the expert ranks.
// topk_idx and send_slot (the handle's) give T and K and tie the call to its handle; the rows
// of each pair here come from the handle's pair_row.
ffi::Error make_combine_send(ffi::AnyBuffer y,
                             ffi::Buffer<ffi::S32> recv_count, ffi::Buffer<ffi::S32> pair_row,
                             ffi::Buffer<ffi::S32> topk_idx,
                             ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::F32> weights,
                             ffi::Buffer<ffi::S32> rank, ffi::ResultBuffer<ffi::S32> call,
                             int64_t num_experts, int64_t max_tokens, const EpGroup& group,
                             const Tuning& tuning,
                             LLCombineSendArgs& a) {
  const char* op = "low_latency_combine (send)";
  auto dims = y.dimensions();
  auto idx_dims = topk_idx.dimensions();
  const int R = group_ranks(group);
  if (max_tokens < 1 || num_experts < R || num_experts % R != 0)
    return invalid(std::string(op) + ": bad num_experts / max_tokens_per_rank");
  const int L = static_cast<int>(num_experts / R), RM = R * static_cast<int>(max_tokens);
  if (idx_dims.size() != 2)
    return invalid(std::string(op) + ": topk_idx must be [T, K]");
  const int T = static_cast<int>(idx_dims[0]), K = static_cast<int>(idx_dims[1]);
  const bool packed = dims.size() == 2;  // expert_major
  const int64_t P = packed_rows(R, max_tokens, K, L);
  if (packed ? dims[0] != P : dims.size() != 3 || dims[0] != L || dims[1] != RM)
    return invalid(std::string(op) + ": y must be [L, R*M, H] = [" + std::to_string(L) + ", " +
                   std::to_string(RM) + ", H] or, expert_major, [R*M*min(K, L), H] = [" +
                   std::to_string(P) + ", H]; the EP axis must span every NVSHMEM PE");
  const int64_t H = dims[dims.size() - 1];
  if (T > max_tokens) return invalid(std::string(op) + ": more tokens than max_tokens_per_rank");
  if (send_slot.element_count() != size_t(T) * K || weights.element_count() != size_t(T) * K)
    return invalid(std::string(op) + ": send_slot and topk_weights must be [T, K]");
  LLElement dtype;
  if (!float_type(y.element_type(), &dtype))
    return invalid(std::string(op) + ": y must be bf16, f16 or f32");
  if (recv_count.element_count() != size_t(L) ||
      pair_row.element_count() != size_t(R) * T * K || call->element_count() != 2)
    return invalid(std::string(op) + ": the handle's recv_count / pair_row do not match [L] / "
                   "[R, T, K]");
  a = LLCombineSendArgs{};
  a.num_rows = packed ? static_cast<int>(P) : 0;
  a.row_bytes = size_t(H) * element_bytes(y.element_type());
  a.plan = plan_ll_combine(R, static_cast<int>(max_tokens), K, a.row_bytes,
                           group_off_node(op, group));
  if (auto err = ll_context(op, rank, num_experts, max_tokens, K, a.plan.bytes, true, group,
                            tuning,
                            &a.ctx, &a.area_begin, &a.area_end);
      err.failure())
    return err;
  a.num_local_experts = L;
  a.rows_per_expert = RM;
  a.max_tokens = static_cast<int>(max_tokens);
  a.num_topk = K;
  a.num_experts = static_cast<int>(num_experts);
  a.num_tokens = T;
  a.dtype = dtype;
  a.hidden = static_cast<int>(H);
  a.num_blocks = blocks_or_default(tuning.num_blocks);
  a.y = y.untyped_data();
  a.recv_count = recv_count.typed_data();
  a.pair_row = pair_row.typed_data();
  a.weights = weights.typed_data();
  a.call_out = call->typed_data();
  return ffi::Error::Success();
}

ffi::Error make_combine_receive(const int32_t* call, ffi::Buffer<ffi::S32> topk_idx,
                                ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::S32> rank,
                                ffi::Result<ffi::AnyBuffer> out, int64_t num_experts,
                                int64_t max_tokens, const EpGroup& group, const Tuning& tuning,
                                LLCombineReceiveArgs& a) {
  const char* op = "low_latency_combine (receive)";
  auto idx_dims = topk_idx.dimensions();
  auto dims = out->dimensions();
  if (idx_dims.size() != 2 || dims.size() != 2 || dims[0] != idx_dims[0])
    return invalid(std::string(op) + ": topk_idx must be [T, K] and the result [T, H]");
  // The kernel sums the records tagged with this call and reads neither array: the handle's
  // topk_idx and send_slot give T and K here and tie the call to its handle.
  const int T = static_cast<int>(idx_dims[0]), K = static_cast<int>(idx_dims[1]);
  if (send_slot.element_count() != size_t(T) * K)
    return invalid(std::string(op) + ": send_slot must be [T, K]");
  if (max_tokens < 1 || T > max_tokens)
    return invalid(std::string(op) + ": more tokens than max_tokens_per_rank");
  a = LLCombineReceiveArgs{};
  if (!float_type(out->element_type(), &a.dtype))
    return invalid(std::string(op) + ": the result must be bf16, f16 or f32");
  const size_t row_bytes = size_t(dims[1]) * element_bytes(out->element_type());
  a.plan = plan_ll_combine(group_ranks(group), static_cast<int>(max_tokens), K, row_bytes,
                           group_off_node(op, group));
  if (auto err = ll_context(op, rank, num_experts, max_tokens, K, a.plan.bytes, true, group,
                            tuning,
                            &a.ctx, &a.area_begin, &a.area_end);
      err.failure())
    return err;
  a.num_tokens = T;
  a.num_topk = K;
  a.num_experts = static_cast<int>(num_experts);
  a.hidden = static_cast<int>(dims[1]);
  a.num_blocks = blocks_or_default(tuning.num_blocks);
  a.call = call;
  a.out = out->untyped_data();
  return ffi::Error::Success();
}

// Send and receive in one kernel (the fused combine), or, kSplit, a split send's kernel on the
// extension's stream (SplitCalls) and its sum on every SM on the program's stream at the
// receive, which returns these results.
template <bool kSplit>
ffi::Error combine_impl(cudaStream_t stream, ffi::AnyBuffer y,
                        ffi::Buffer<ffi::S32> recv_count, ffi::Buffer<ffi::S32> pair_row,
                        ffi::Buffer<ffi::S32> topk_idx,
                        ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::F32> weights,
                        ffi::Buffer<ffi::S32> rank, ffi::ResultBuffer<ffi::S32> call,
                        ffi::Result<ffi::AnyBuffer> out, int64_t num_experts, int64_t max_tokens,
                        EpGroup group, Tuning tuning) {
  if (out->element_type() != y.element_type())
    return invalid("low_latency_combine: the result must have y's dtype");
  LLCombineSendArgs send;
  if (auto err = make_combine_send(y, recv_count, pair_row, topk_idx,
                                   send_slot, weights, rank, call, num_experts, max_tokens,
                                   group, tuning, send);
      err.failure())
    return err;
  LLCombineReceiveArgs receive;
  if (auto err = make_combine_receive(send.call_out, topk_idx, send_slot, rank, out, num_experts,
                                      max_tokens, group, tuning, receive);
      err.failure())
    return err;
  if (receive.plan.bytes != send.plan.bytes || receive.hidden != send.hidden)
    return invalid("low_latency_combine: the result does not match y");
  receive.ctx.profile = send.ctx.profile;  // one call, one profile row
  if (kSplit) {
    LLCombineReceiveArgs sum = receive;
    sum.num_blocks = sm_count();  // after the work: every SM
    return SplitCalls::get().launch(
        stream, receive.out, "low_latency_combine (send)",
        [&](cudaStream_t on) {
          return launch_ll_combine_send(send, receive.num_blocks, on, LLPlacement::kBesideWork);
        },
        [sum](cudaStream_t program) { return launch_ll_combine_receive(sum, program); });
  }
  LLPlacement placement = LLPlacement::kAlone;
  if (auto err = fused_placement(stream, placement); err.failure()) return err;
  return cuda_error(launch_ll_combine(send, receive, stream, placement), "low_latency_combine");
}

// The split combine's receive: operands (call, out, then the send's operands kept alive),
// results aliased to the first two; the program's stream waits for the send's kernel.
ffi::Error combine_receive_impl(cudaStream_t stream, ffi::RemainingArgs operands,
                                ffi::RemainingRets results) {
  return join_receive(stream, operands, results, "low_latency_combine (receive)", "combine",
                      1);  // out
}

}  // namespace
}  // namespace jax_ep

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

// The fused dispatch's and the split send's operands, results and attributes (the same call).
auto dispatch_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()           // x
      .Arg<ffi::Buffer<ffi::S32>>()    // topk_idx
      .Arg<ffi::Buffer<ffi::S32>>()    // slots_in (cached)
      .Arg<ffi::Buffer<ffi::S32>>()    // rank
      .Ret<ffi::Buffer<ffi::S32>>()    // send_slot
      .Ret<ffi::Buffer<ffi::S32>>()    // call
      .Ret<ffi::Buffer<ffi::S32>>()    // num_dropped
      .Ret<ffi::AnyBuffer>()           // x
      .Ret<ffi::Buffer<ffi::F32>>()    // scales
      .Ret<ffi::Buffer<ffi::S32>>()    // recv_count
      .Ret<ffi::Buffer<ffi::S32>>()    // src_rank
      .Ret<ffi::Buffer<ffi::S32>>()    // src_token
      .Ret<ffi::Buffer<ffi::S32>>()    // src_k
      .Ret<ffi::Buffer<ffi::S32>>()    // pair_row
      .Attr<int64_t>("num_experts")
      .Attr<int64_t>("max_tokens")
      .Attr<bool>("use_fp8")
      .Attr<bool>("ue8m0")
      .Attr<bool>("cached")
      .Attr<bool>("records")
      .Attr<EpGroup>("group")
      .Attr<Tuning>("tuning");
}

// The fused combine's and the split send's operands, results and attributes (the same call).
auto combine_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()           // y
      .Arg<ffi::Buffer<ffi::S32>>()    // recv_count
      .Arg<ffi::Buffer<ffi::S32>>()    // pair_row
      .Arg<ffi::Buffer<ffi::S32>>()    // topk_idx
      .Arg<ffi::Buffer<ffi::S32>>()    // send_slot
      .Arg<ffi::Buffer<ffi::F32>>()    // weights
      .Arg<ffi::Buffer<ffi::S32>>()    // rank
      .Ret<ffi::Buffer<ffi::S32>>()    // call
      .Ret<ffi::AnyBuffer>()           // out
      .Attr<int64_t>("num_experts")
      .Attr<int64_t>("max_tokens")
      .Attr<EpGroup>("group")
      .Attr<Tuning>("tuning");
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLDispatchSend, jax_ep::dispatch_impl<true>,
                              jax_ep::dispatch_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLDispatchReceive, jax_ep::dispatch_receive_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLCombineSend, jax_ep::combine_impl<true>,
                              jax_ep::combine_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLCombineReceive, jax_ep::combine_receive_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLDispatch, jax_ep::dispatch_impl<false>,
                              jax_ep::dispatch_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLCombine, jax_ep::combine_impl<false>,
                              jax_ep::combine_binding());
