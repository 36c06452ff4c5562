// FP8 (e4m3) block quantisation in registers, shared by every kernel that quantises: one
// float32 scale per 128 consecutive channels, jax_ep.fp8.quantize_fp8's arithmetic with every
// float32 step correctly rounded (finite inputs; a NaN is dropped by fmaxf where XLA's max
// propagates it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace jax_ep {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

// 16 consecutive elements of type T, loaded raw as 16 / (16 / sizeof(T)) int4, as floats.
template <typename T>
__device__ __forceinline__ void unpack16(const int4 (&raw)[sizeof(T)], float (&v)[16]) {
  constexpr int kPer = 16 / sizeof(T);  // elements per int4
#pragma unroll
  for (int c = 0; c < int(sizeof(T)); ++c) {
    const T* e = reinterpret_cast<const T*>(&raw[c]);
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[c * kPer + j] = to_float<T>(e[j]);
  }
}

// Lane q holds channels 16 (q % 8) .. 16 (q % 8) + 15 of a 128-channel block, the block's
// 8 lanes next to each other (lanes 8j .. 8j + 7): returns the block's scale and packs this
// lane's 16 e4m3 bytes. Every lane of the warp calls it (the block's amax goes round by
// shuffles); a lane without channels passes zeros and ignores the results.
__device__ __forceinline__ float quantize16(const float (&v)[16], bool ue8m0, int4* packed) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(v[j]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
  // jax_ep.fp8.quantize_fp8's arithmetic (see there): constants rounded from double to
  // float as NumPy does, products and the reciprocal correctly rounded, no FMA.
  float scale =
      __fmul_rn(fmaxf(amax, static_cast<float>(1e-10)), static_cast<float>(1.0 / 448.0));
  if (ue8m0) {
    int exponent;
    const float mantissa = frexpf(scale, &exponent);
    if (mantissa == 0.5f) exponent -= 1;
    scale = __int_as_float((exponent + 127) << 23);  // 2^exponent, a normal float here
  }
  const float inverse = __fdiv_rn(1.0f, scale);
  unsigned char* bytes = reinterpret_cast<unsigned char*>(packed);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float q = fminf(fmaxf(__fmul_rn(v[j], inverse), -448.0f), 448.0f);
    bytes[j] = __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
  }
  return scale;
}

}  // namespace jax_ep
