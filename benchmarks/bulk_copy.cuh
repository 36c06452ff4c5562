// The standalone probes' Hopper bulk copies (the TMA's cp.async.bulk) between global and
// shared memory, and the shared-memory barriers that track them. One thread issues a copy of a whole row; the
// hardware moves it, so a few threads per SM keep many kilobytes in flight (plain stores need
// every lane of many warps for that).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JAX_EP_BULK_COPY 1
#else
#define JAX_EP_BULK_COPY 0
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Declared in every compilation pass; the instructions exist only where JAX_EP_BULK_COPY (the
// callers check it too, and use plain copies below sm_90).
#if JAX_EP_BULK_COPY
#define JAX_EP_BULK_ASM(...) asm volatile(__VA_ARGS__)
#else
#define JAX_EP_BULK_ASM(...) __trap()
#endif

__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  JAX_EP_BULK_ASM("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  // the barrier must be visible to the copy engine (the async proxy) before its first use
  JAX_EP_BULK_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}

// Loads `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` into
// shared `dst`; `bar` completes the current phase when they have landed.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  JAX_EP_BULK_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   shared_address(bar)),
               "r"(bytes)
               : "memory");
  JAX_EP_BULK_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
#if !JAX_EP_BULK_COPY
  done = 1;
  __trap();
#endif
  while (!done)
    JAX_EP_BULK_ASM(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(phase)
        : "memory");
}

// Stores `bytes` from shared `src` to global `dst` (local or a peer's, mapped over NVLink).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  JAX_EP_BULK_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  JAX_EP_BULK_ASM("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N committed store groups still read their shared source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  JAX_EP_BULK_ASM("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until every committed store group has completed its writes.
__device__ __forceinline__ void bulk_wait_all() {
  JAX_EP_BULK_ASM("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace jax_ep
