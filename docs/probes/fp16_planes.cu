// Probe kernels for docs/probes/fp16_planes.py (issue 6: two FP16 digit planes instead of three int8 ones).
//
// exact_hmma: warp w computes block w's 16 x 8 product of a 16 x 32 A tile (row-major) and a 32 x 8 B tile
// (column-major), both FP16 holding integers, with two chained mma.sync m16n8k16 (FP32 accumulate from 0): the
// Python driver compares every output with the exact int64 product.
// rate_hmma / rate_imma: each warp issues `iters` rounds of 8 independent MMAs (m16n8k16 f16 -> f32, m16n8k32 s8 ->
// s32) and stores one value per lane so nothing is dead; the driver times them to compare the two instructions'
// issue rates on this GPU.
//
// Build: nvcc -arch=sm_90a -cubin -O3 -o fp16_planes.cubin fp16_planes.cu
#include <cstdint>

namespace {

__device__ __forceinline__ void hmma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}

__device__ __forceinline__ void imma(int d[4], const uint32_t a[4], const uint32_t b[2], const int c[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]), "r"(c[2]),
        "r"(c[3]));
}

__device__ __forceinline__ uint32_t pair(const uint16_t* p) {  // two consecutive halves as one f16x2 register
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 16);
}

}  // namespace

// a: [blocks][16][32] halves (row-major), b: [blocks][8][32] halves (column n holds K 0..31), d: [blocks][16][8].
extern "C" __global__ void exact_hmma(const uint16_t* a, const uint16_t* b, float* d, int blocks) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  if (warp >= blocks) return;
  const uint16_t* A = a + static_cast<int64_t>(warp) * 16 * 32;
  const uint16_t* B = b + static_cast<int64_t>(warp) * 8 * 32;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < 32; k0 += 16) {
    // PTX ISA, m16n8k16 .f16: a0 (row g, k 2t4..+1), a1 (row g + 8), a2 (row g, k 2t4 + 8..), a3 (row g + 8, ...);
    // b0 (k 2t4..+1, column g), b1 (k 2t4 + 8..); c0, c1 (row g, columns 2t4, 2t4 + 1), c2, c3 (row g + 8).
    const uint32_t af[4] = {pair(A + g * 32 + k0 + 2 * t4), pair(A + (g + 8) * 32 + k0 + 2 * t4),
                            pair(A + g * 32 + k0 + 2 * t4 + 8), pair(A + (g + 8) * 32 + k0 + 2 * t4 + 8)};
    const uint32_t bf[2] = {pair(B + g * 32 + k0 + 2 * t4), pair(B + g * 32 + k0 + 2 * t4 + 8)};
    float out[4];
    hmma(out, af, bf, acc);
    for (int i = 0; i < 4; ++i) acc[i] = out[i];
  }
  float* D = d + static_cast<int64_t>(warp) * 16 * 8;
  D[g * 8 + 2 * t4] = acc[0];
  D[g * 8 + 2 * t4 + 1] = acc[1];
  D[(g + 8) * 8 + 2 * t4] = acc[2];
  D[(g + 8) * 8 + 2 * t4 + 1] = acc[3];
}

// One loop for both rates: T is the accumulator type, Mma the instruction, `one` a register of ones of its inputs.
template <typename T, void (*Mma)(T*, const uint32_t*, const uint32_t*, const T*)>
__device__ void rate(int iters, float* out, uint32_t one) {
  const uint32_t a[4] = {one ^ threadIdx.x, one, one, one};
  const uint32_t b[2] = {one, one ^ (threadIdx.x & 1)};
  T acc[8][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j) Mma(acc[j], a, b, acc[j]);
  }
  T s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = static_cast<float>(s);
}

extern "C" __global__ void rate_hmma(int iters, float* out) { rate<float, hmma>(iters, out, 0x3c003c00u); }
extern "C" __global__ void rate_imma(int iters, float* out) { rate<int, imma>(iters, out, 0x01010101u); }
