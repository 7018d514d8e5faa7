// Host emulation of csrc/cuda/adamw8bit.cu's kernel for tests/kernels/test_adamw8bit_cuda_host.py:
// the very functions the kernel calls (adamw8bit_math.cuh, compiled here as plain C++ with
// -ffp-contract=off) in the kernel's layout: 16 lanes x 8 elements per 128-element block, each
// lane's running absmax, the 4-step butterfly of __shfl_xor_sync (offsets 8, 4, 2, 1), lane 0
// writing the block's absmax. What it cannot show: the device intrinsics themselves, the vector
// loads and the 16-bit cast-back (the `gpu` tests run those).
#include <cstdint>

#include "cuda/adamw8bit_math.cuh"

extern "C" void zk_q8_emulate(float* master, uint8_t* m_q, float* m_absmax, uint8_t* v_q,
                              float* v_absmax, const float* grad, int64_t n, const double* hp,
                              double t, float gs, const float* code_s, const float* code_u,
                              const float* mid_s, const float* mid_u) {
  constexpr int kLanes = 16, kVec = 8;
  const ZkQ8Scalars s = zk_q8_scalars(hp[0], hp[1], hp[2], hp[3], hp[4], t, gs);
  for (int64_t b = 0; b < n / ZK_Q8_BLOCK; ++b) {
    float m[kLanes][kVec], v[kLanes][kVec], mmax[kLanes], vmax[kLanes];
    const float am = m_absmax[b], av = v_absmax[b];
    for (int lane = 0; lane < kLanes; ++lane) {
      mmax[lane] = 0.f;
      vmax[lane] = 0.f;
      for (int j = 0; j < kVec; ++j) {
        const int64_t i = b * ZK_Q8_BLOCK + lane * kVec + j;
        m[lane][j] = zk_q8_mul(code_s[m_q[i]], am);
        v[lane][j] = zk_q8_mul(code_u[v_q[i]], av);
        master[i] = zk_q8_update(master[i], grad[i], m[lane][j], v[lane][j], s);
        mmax[lane] = zk_q8_max(mmax[lane], zk_q8_abs(m[lane][j]));
        vmax[lane] = zk_q8_max(vmax[lane], zk_q8_abs(v[lane][j]));
      }
    }
    for (int off = kLanes / 2; off > 0; off >>= 1) {  // __shfl_xor_sync, all lanes at once
      float mm[kLanes], vv[kLanes];
      for (int lane = 0; lane < kLanes; ++lane) {
        mm[lane] = zk_q8_max(mmax[lane], mmax[lane ^ off]);
        vv[lane] = zk_q8_max(vmax[lane], vmax[lane ^ off]);
      }
      for (int lane = 0; lane < kLanes; ++lane) {
        mmax[lane] = mm[lane];
        vmax[lane] = vv[lane];
      }
    }
    for (int lane = 0; lane < kLanes; ++lane) {
      const float sm = zk_q8_safe(mmax[lane]), sv = zk_q8_safe(vmax[lane]);
      for (int j = 0; j < kVec; ++j) {
        const int64_t i = b * ZK_Q8_BLOCK + lane * kVec + j;
        m_q[i] = zk_q8_nearest(mid_s, zk_q8_div(m[lane][j], sm));
        v_q[i] = zk_q8_nearest(mid_u, zk_q8_div(v[lane][j], sv));
      }
    }
    m_absmax[b] = mmax[0];
    v_absmax[b] = vmax[0];
  }
}
