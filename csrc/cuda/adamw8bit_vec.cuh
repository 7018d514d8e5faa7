// zerokern CUDA 8-bit AdamW (issue 23): one lane's 8 elements in and out of global memory, for
// adamw8bit.cu. Each function takes `vec`: the 128-bit (fp32, 16-bit) or 64-bit (codes) access
// when that array's base pointer allows it (zk_adamw8bit_vector_mask), else 8 scalar accesses.
// Device code only; 16-bit values convert with the exact widening and the cvt.rn narrowing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int kQ8Vec = 8;  // elements per lane

struct NoOutQ8 {};  // tag type: param_out absent

// ------------------------------------------------------- loads and stores of one lane's 8 ----

__device__ __forceinline__ float q8_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float q8_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float2 q8_unpack(uint32_t u, const __half*) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return __half22float2(h);
}
__device__ __forceinline__ float2 q8_unpack(uint32_t u, const __nv_bfloat16*) {
  __nv_bfloat162 h;
  memcpy(&h, &u, sizeof(h));
  return __bfloat1622float2(h);
}

__device__ __forceinline__ void q8_load(const float* p, bool vec, float (&x)[kQ8Vec]) {
  if (vec) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) x[j] = p[j];
  }
}

template <typename T>  // __half / __nv_bfloat16: one 128-bit load
__device__ __forceinline__ void q8_load(const T* p, bool vec, float (&x)[kQ8Vec]) {
  if (vec) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const float2 f0 = q8_unpack(u.x, p), f1 = q8_unpack(u.y, p);
    const float2 f2 = q8_unpack(u.z, p), f3 = q8_unpack(u.w, p);
    x[0] = f0.x; x[1] = f0.y; x[2] = f1.x; x[3] = f1.y;
    x[4] = f2.x; x[5] = f2.y; x[6] = f3.x; x[7] = f3.y;
  } else {
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) x[j] = q8_f32(p[j]);
  }
}

__device__ __forceinline__ void q8_load_codes(const uint8_t* p, bool vec, uint32_t (&c)[kQ8Vec]) {
  if (vec) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[j] = (u.x >> (8 * j)) & 0xffu;
      c[j + 4] = (u.y >> (8 * j)) & 0xffu;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) c[j] = p[j];
  }
}

__device__ __forceinline__ void q8_store_codes(uint8_t* p, bool vec, const uint32_t (&c)[kQ8Vec]) {
  if (vec) {
    uint2 u;
    u.x = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
    u.y = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) p[j] = static_cast<uint8_t>(c[j]);
  }
}

__device__ __forceinline__ void q8_store(float* p, bool vec, const float (&x)[kQ8Vec]) {
  if (vec) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) p[j] = x[j];
  }
}

__device__ __forceinline__ uint32_t q8_bits(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}
__device__ __forceinline__ uint32_t q8_bits(__nv_bfloat162 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}
__device__ __forceinline__ __half2 q8_pack(float a, float b, __half*) {
  return __floats2half2_rn(a, b);
}
__device__ __forceinline__ __nv_bfloat162 q8_pack(float a, float b, __nv_bfloat16*) {
  return __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void q8_store1(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void q8_store1(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

template <typename O>  // __half / __nv_bfloat16
__device__ __forceinline__ void q8_store(O* p, bool vec, const float (&x)[kQ8Vec]) {
  if (vec) {
    // __stwb: a plain write-back store, spelled as the intrinsic because nvcc 13 splits this
    // uint4 assignment into four 32-bit stores here (measured in the PTX; not in zk_kernels.cu).
    __stwb(reinterpret_cast<uint4*>(p),
           make_uint4(q8_bits(q8_pack(x[0], x[1], p)), q8_bits(q8_pack(x[2], x[3], p)),
                      q8_bits(q8_pack(x[4], x[5], p)), q8_bits(q8_pack(x[6], x[7], p))));
  } else {
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) q8_store1(p + j, x[j]);
  }
}

__device__ __forceinline__ void q8_store(NoOutQ8*, bool, const float (&)[kQ8Vec]) {}

template <typename O>
__device__ __forceinline__ O* q8_at(O* p, int64_t i) { return p + i; }
__device__ __forceinline__ NoOutQ8* q8_at(NoOutQ8* p, int64_t) { return p; }

}  // namespace
