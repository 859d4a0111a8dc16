// Probe for issue 6 (docs/kernels_v2.md "FP16 wgmma on two digit planes"): what would a wide pass cost per K32
// block with FP16 `wgmma` on two digit planes, the decoded weights as the register A operand and the 3-instruction
// exact epilogue?
//
// The current wide passes (int8 mma.sync, three digit planes) spend ~280 SASS instructions per warp per (16 weight
// rows x 64 tokens x K32 block), 6 of them per (row, token, block) in the epilogue, and issue the MMAs and their B
// fragment loads themselves. Here a warpgroup of 4 warps takes 64 weight rows (M) and T tokens (N = 2 T columns:
// column 2 t + p holds digit plane p of token t, 512 x = d0 + 512 d1, both exact in FP16) per K32 block:
//   1. the weights' E2M1 codes (a word per (row, block, lane % 4): the lane's 8 codes in a shuffled nibble order,
//      a format change) decode by prmt into the FP16 A fragments (2 w, exact), ~6 instructions per register;
//   2. two wgmma m64nNk16 (K 0-15, 16-31) from zero: the exact integer plane sums S0, S1 of every (row, token);
//   3. per (row, token): f32(D) = fma(S1, 512, S0) (exact operands, one rounding: cvt.rn of D), the bits of 2**n
//      (one integer add of pre-shifted exponents) and acc = fma(f32(D), 2**n, acc): the semantics' fast path.
// Blocks go in pairs on two accumulator sets: block q's epilogue issues while block q + 1's wgmma runs. Two
// warpgroups per CTA (128 rows, as role 2's items), one CTA per SM (T = 64) or one and two (T = 32, 16).
//
// The probe computes from NB K32 blocks resident in SMEM, cycled: no global streaming (the large-B passes are
// issue-bound, docs/kernels_v2.md "Large batches"), and checks every output bit against the host's sequential
// float emulation of the same block sequence (fmaf, as the semantics' fast path). `mode` 1 drops the epilogue (the
// decode + wgmma cost alone), for the split of the time.
//
// Build and run (H100/H200):
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas -v -o wgmma_planes \
//     docs/probes/wgmma_planes.cu && ./wgmma_planes
// (ptxas must print no C7514/C7515 "wgmma ... serialized" line. The wgmma wrappers are generated text: one asm
// statement per K32 block, both k16 steps, so that the eight A registers are live together.)
#include <cuda_runtime.h>

#include "wgmma_common.cuh"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int ROWS = 128;  // weight rows per CTA: two warpgroups of 64
constexpr int NB = 8;      // K32 blocks resident in SMEM
constexpr int THREADS = 256;

__device__ __forceinline__ void wgmma_block_n32(float* d, const uint32_t a[8], uint64_t desc0, uint64_t desc1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %24, p, 1, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%20, %21, %22, %23}, %25, 1, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]), "l"(desc0),
        "l"(desc1));
}

__device__ __forceinline__ void wgmma_block_n64(float* d, const uint32_t a[8], uint64_t desc0, uint64_t desc1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %40, p, 1, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%36, %37, %38, %39}, %41, 1, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]), "l"(desc0),
        "l"(desc1));
}

__device__ __forceinline__ void wgmma_block_n128(float* d, const uint32_t a[8], uint64_t desc0, uint64_t desc1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %72, p, 1, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%68, %69, %70, %71}, %73, 1, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]), "l"(desc0),
        "l"(desc1));
}

// The lane's word of a (row, K32 block) holds its 8 E2M1 codes (sign, e1, e0, m) in a shuffled nibble order
// (`pack_word`): after a shift by `s`, nibble 1 holds the code of the fragment register's even K and nibble 3 that of
// its odd K. One prmt looks up both magnitudes' FP16 high bytes (2 w = 0, 1, 2, 3, 4, 6, 8, 12: 0x00, 0x3C, 0x40,
// 0x42, 0x44, 0x46, 0x48, 0x4A; the low bytes are zero, and selector nibbles 0 and 2 are zero, i.e. table byte 0x00)
// and an integer multiply moves the two sign bits (7, 15) to the halves' (15, 31).
template <int S>
__device__ __forceinline__ uint32_t dec2(uint32_t w) {
  const uint32_t x = S > 0 ? w >> S : w << -S;
  const uint32_t mag = __byte_perm(0x42403C00u, 0x4A484644u, x & 0x7070);
  return mag | (((x & 0x8080) * 0x10100u) & 0x80008000u);
}

template <int T>
struct Smem {
  static constexpr int N = 2 * T;
  static constexpr int A_BYTES = NB * ROWS * 16;           // [block][row][lane % 4] words
  static constexpr int B_BLOCK = 4 * (N / 8) * 128;         // [k8 group 0..3][n8 group][8 n][8 k] halves
  static constexpr int B_BYTES = NB * B_BLOCK;
  static constexpr int EX_BYTES = NB * T * 4;  // [block][lane % 4][j] token scale bits (t = 4 j + lane % 4)
  static constexpr int EW_BYTES = NB * ROWS * 4;            // [block][row] weight exponent bits
  static constexpr int TOTAL = A_BYTES + B_BYTES + EX_BYTES + EW_BYTES;
};

// mode 0: the full block; mode 1: no epilogue (one add per block keeps the sums live).
template <int T, int MODE>
__global__ void __launch_bounds__(THREADS) planes(const uint32_t* ga, const uint16_t* gb, const int32_t* gex,
                                                  const int32_t* gew, float* out, int nblk, uint32_t lbo,
                                                  uint32_t sbo) {
  using S = Smem<T>;
  constexpr int N = S::N;
  constexpr int R = N / 2;  // accumulator registers per thread and set
  extern __shared__ __align__(1024) uint8_t smem[];
  uint32_t* sa = reinterpret_cast<uint32_t*>(smem);
  uint8_t* sb = smem + S::A_BYTES;
  int32_t* sex = reinterpret_cast<int32_t*>(smem + S::A_BYTES + S::B_BYTES);
  int32_t* sew = reinterpret_cast<int32_t*>(smem + S::A_BYTES + S::B_BYTES + S::EX_BYTES);
  for (int i = threadIdx.x; i < S::A_BYTES / 4; i += THREADS) sa[i] = ga[i];
  for (int i = threadIdx.x; i < S::B_BYTES / 2; i += THREADS) reinterpret_cast<uint16_t*>(sb)[i] = gb[i];
  for (int i = threadIdx.x; i < S::EX_BYTES / 4; i += THREADS) sex[i] = gex[i];
  for (int i = threadIdx.x; i < S::EW_BYTES / 4; i += THREADS) sew[i] = gew[i];
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic-proxy stores, read by the async proxy
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = 16 * warp + g;  // rows row0 and row0 + 8 (warp 4..7: the second warpgroup's 64)
  const uint32_t sb_addr = static_cast<uint32_t>(__cvta_generic_to_shared(sb));

  float acc[2 * (T / 4)];  // (row h, token 4 j + t4) at 2 j + h
#pragma unroll
  for (int i = 0; i < 2 * (T / 4); ++i) acc[i] = 0.f;
  float d[2][R];

  auto issue = [&](float* dd, int q) {
    const int b = q % NB;
    const uint32_t w0 = sa[(b * ROWS + row0) * 4 + t4], w1 = sa[(b * ROWS + row0 + 8) * 4 + t4];
    // wgmma's A fragment: {row g, K 2t4..+1}, {row g + 8, ..}, {row g, K 2t4 + 8..}, {row g + 8, ..} per k16 step.
    const uint32_t a[8] = {dec2<-4>(w0), dec2<-4>(w1), dec2<0>(w0), dec2<0>(w1),
                           dec2<12>(w0), dec2<12>(w1), dec2<16>(w0), dec2<16>(w1)};
    const uint32_t base = sb_addr + b * S::B_BLOCK;
    pin<R>(dd);
    fence();
    if constexpr (N == 32) {
      wgmma_block_n32(dd, a, desc(base, lbo, sbo), desc(base + 2 * (N / 8) * 128, lbo, sbo));
    } else if constexpr (N == 64) {
      wgmma_block_n64(dd, a, desc(base, lbo, sbo), desc(base + 2 * (N / 8) * 128, lbo, sbo));
    } else {
      wgmma_block_n128(dd, a, desc(base, lbo, sbo), desc(base + 2 * (N / 8) * 128, lbo, sbo));
    }
    commit();
  };
  auto epilogue = [&](const float* dd, int q) {
    const int b = q % NB;
    if constexpr (MODE == 1) {
      acc[0] += dd[0] + dd[R - 1];
    } else {
      const int32_t ew0 = sew[b * ROWS + row0], ew1 = sew[b * ROWS + row0 + 8];
      const int4* ex4 = reinterpret_cast<const int4*>(sex + (b * 4 + t4) * (T / 4));
#pragma unroll
      for (int j4 = 0; j4 < T / 16; ++j4) {
        const int4 e = ex4[j4];
        const int32_t ex[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int j = 4 * j4 + u;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // d[4 j + 2 h + p]: row row0 + 8 h, column 8 j + 2 t4 + p = token 4 j + t4, plane p.
            const float fd = fmaf(dd[4 * j + 2 * h + 1], 512.f, dd[4 * j + 2 * h]);
            const float sc = __int_as_float(ex[u] + (h ? ew1 : ew0));
            acc[2 * j + h] = fmaf(fd, sc, acc[2 * j + h]);
          }
        }
      }
    }
  };

  // Pairs of blocks: block q's epilogue runs while block q + 1's wgmma does; nothing is in flight across the loop's
  // back edge (with block q + 2's wgmma carried over it, ptxas serialized every wgmma: C7514).
  for (int q = 0; q < nblk; q += 2) {
    issue(d[0], q);
    issue(d[1], q + 1);
    wait<1>();
    pin<R>(d[0]);
    epilogue(d[0], q);
    wait<0>();
    pin<R>(d[1]);
    epilogue(d[1], q + 1);
  }

  float* o = out + static_cast<int64_t>(blockIdx.x) * ROWS * T;
#pragma unroll
  for (int j = 0; j < T / 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) o[(row0 + 8 * h) * T + 4 * j + t4] = acc[2 * j + h];
  }
}

// ---- host ----------------------------------------------------------------------------------------------------

const int kE2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // 2 w per code

uint16_t f16_of_int(int v) {  // |v| <= 2048: exact
  if (v == 0) return 0;
  uint16_t s = v < 0 ? 0x8000 : 0;
  int m = std::abs(v), e = 0;
  while ((m >> e) > 1) ++e;  // 2**e <= m < 2**(e + 1)
  const int frac = (m << (10 - e)) & 0x3FF;
  return s | static_cast<uint16_t>(((e + 15) << 10) | frac);
}

int e4m3_times_512(uint8_t code) {  // 512 v for an E4M3 code (not NaN): an integer
  const int s = code >> 7, e = (code >> 3) & 0xF, m = code & 7;
  const int v = e == 0 ? m : (8 + m) << (e - 1);  // 512 v = (8 + m) 2**(e - 7) * 512 / 8 ... in units of 2**-9
  return s ? -v : v;
}

struct Problem {
  int T;
  std::vector<uint8_t> codes;    // [NB][ROWS][32] E2M1 codes
  std::vector<int> x512;         // [NB][T][32] 512 x
  std::vector<int> ex, ew;       // [NB][T], [NB][ROWS]: exponents with n = ex + ew (the fast path's range)
};

Problem make(int T, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p{T, std::vector<uint8_t>(NB * ROWS * 32), std::vector<int>(NB * T * 32), std::vector<int>(NB * T),
            std::vector<int>(NB * ROWS)};
  for (auto& c : p.codes) c = rng() % 16;
  for (auto& v : p.x512) {
    uint8_t c;
    do c = rng() & 0xFF; while ((c & 0x7F) == 0x7F);  // no NaN
    v = e4m3_times_512(c);
  }
  for (auto& e : p.ex) e = static_cast<int>(rng() % 9) - 14;  // n = ex + ew in [-24, 0]: acc stays normal
  for (auto& e : p.ew) e = static_cast<int>(rng() % 7) - 3;
  return p;
}

// Host emulation: acc = fma(f32(D), 2**n, acc) over the blocks q = 0 .. nblk - 1 (block q % NB), in order.
std::vector<float> emulate(const Problem& p, int nblk) {
  const int T = p.T;
  std::vector<float> out(ROWS * T);
  for (int r = 0; r < ROWS; ++r) {
    for (int t = 0; t < T; ++t) {
      float acc = 0.f;
      for (int q = 0; q < nblk; ++q) {
        const int b = q % NB;
        int64_t d = 0;
        for (int k = 0; k < 32; ++k)
          d += static_cast<int64_t>(p.x512[(b * T + t) * 32 + k]) * kE2M1[p.codes[(b * ROWS + r) * 32 + k]];
        const float fd = static_cast<float>(d);  // RN: |D| < 2**27
        acc = std::fmaf(fd, std::ldexp(1.f, p.ex[b * T + t] + p.ew[b * ROWS + r]), acc);
      }
      out[r * T + t] = acc;
    }
  }
  return out;
}

template <int T, int MODE>
double run(const Problem& p, int nblk, int grid, uint32_t lbo, uint32_t sbo, std::vector<float>* result) {
  using S = Smem<T>;
  constexpr int N = 2 * T;
  // Device images of the SMEM layouts.
  std::vector<uint32_t> a(S::A_BYTES / 4);
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < ROWS; ++r)
      for (int l = 0; l < 4; ++l) {
        // lane t4 = l: nibbles 0, 2: K 2 l, 2 l + 1; 1, 3: K 2 l + 8, + 9; 4, 6: K 16 + 2 l, + 1; 5, 7: K 24 + 2 l, + 1
        // (`dec2`'s shifts -4, 0, 12, 16 bring each pair to nibbles 1 and 3).
        uint32_t w = 0;
        const int ks[8] = {2 * l, 2 * l + 8, 2 * l + 1, 2 * l + 9, 16 + 2 * l, 24 + 2 * l, 17 + 2 * l, 25 + 2 * l};
        for (int i = 0; i < 8; ++i) w |= static_cast<uint32_t>(p.codes[(b * ROWS + r) * 32 + ks[i]]) << (4 * i);
        a[(b * ROWS + r) * 4 + l] = w;
      }
  std::vector<uint16_t> bimg(S::B_BYTES / 2);
  for (int b = 0; b < NB; ++b)
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < 32; ++k) {
        const int v = p.x512[(b * T + t) * 32 + k];
        const int d1 = static_cast<int>(std::floor((v + 256) / 512.0)), d0 = v - 512 * d1;
        for (int pl = 0; pl < 2; ++pl) {
          const int n = 2 * t + pl;
          const int idx = ((k / 8) * (N / 8) + n / 8) * 64 + (n % 8) * 8 + k % 8;  // halves within the block
          bimg[b * (S::B_BLOCK / 2) + idx] = f16_of_int(pl ? d1 : d0);
        }
      }
  std::vector<int32_t> eximg(S::EX_BYTES / 4), ewimg(S::EW_BYTES / 4);
  for (int b = 0; b < NB; ++b) {
    for (int t = 0; t < T; ++t) eximg[(b * 4 + t % 4) * (T / 4) + t / 4] = (p.ex[b * T + t] + 127) << 23;
    for (int r = 0; r < ROWS; ++r) ewimg[b * ROWS + r] = p.ew[b * ROWS + r] << 23;
  }
  uint32_t* da = upload(a);
  uint16_t* db = upload(bimg);
  int32_t* dex = upload(eximg);
  int32_t* dew = upload(ewimg);
  float* dout;
  CHECK(cudaMalloc(&dout, static_cast<size_t>(grid) * ROWS * T * 4));
  auto k = planes<T, MODE>;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S::TOTAL));
  const float ms = timed([&](int n) { k<<<grid, THREADS, S::TOTAL>>>(da, db, dex, dew, dout, n, lbo, sbo); }, 2, nblk);
  if (result) {
    result->resize(static_cast<size_t>(grid) * ROWS * T);
    CHECK(cudaMemcpy(result->data(), dout, result->size() * 4, cudaMemcpyDeviceToHost));
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dex);
  cudaFree(dew);
  cudaFree(dout);
  return ms;
}

template <int T>
void probe(int sms, int per_sm, int nblk_check, int nblk_time) {
  const Problem p = make(T, 1234 + T);
  // Which of the descriptor's two byte offsets is the K step (no-swizzle K-major: the leading one, 2048 here, on
  // the H200): try that order, the other only if it is not exact.
  const uint32_t kstep = (T / 4) * 128, nstep = 128;  // core matrices adjacent in K / in N (bytes)
  const uint32_t orders[2][2] = {{kstep, nstep}, {nstep, kstep}};
  const std::vector<float> want = emulate(p, nblk_check);
  int exact_order = -1;
  for (int o = 0; o < 2 && exact_order < 0; ++o) {  // (a wrong order may fault: try it only if needed)
    std::vector<float> got;
    run<T, 0>(p, nblk_check, sms * per_sm, orders[o][0], orders[o][1], &got);
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (std::memcmp(&got[i], &want[i % want.size()], 4) != 0) ++bad;
    std::printf("T=%d lbo=%u sbo=%u: %zu of %zu outputs differ from the host emulation (%d blocks)\n", T,
                orders[o][0], orders[o][1], bad, got.size(), nblk_check);
    if (bad == 0) exact_order = o;
  }
  if (exact_order < 0) {
    std::printf("T=%d: no descriptor order is exact; timing skipped\n", T);
    return;
  }
  const uint32_t lbo = orders[exact_order][0], sbo = orders[exact_order][1];
  for (int mode = 0; mode < 2; ++mode) {
    const double ms = mode == 0 ? run<T, 0>(p, nblk_time, sms * per_sm, lbo, sbo, nullptr)
                                : run<T, 1>(p, nblk_time, sms * per_sm, lbo, sbo, nullptr);
    const double triples = static_cast<double>(sms) * per_sm * ROWS * T * nblk_time;
    const double per_sm_ns = triples / sms / (ms * 1e6);
    // GLM5.2 at B = 256: 2048 assignments x (4096 x 192 + 6144 x 64) (row, block) = 2.42 G triples on 128 SMs.
    const double glm256_us = 2048.0 * (4096.0 * 192 + 6144.0 * 64) / (128 * per_sm_ns) / 1e3;
    std::printf("T=%d %d CTA/SM %s: %.3f ms for %d blocks: %.2f (row, token, block) per ns per SM; "
                "GLM5.2 B=256's 2.42 G triples on 128 SMs: %.0f us\n",
                T, per_sm, mode == 0 ? "full" : "no epilogue", ms, nblk_time, per_sm_ns, glm256_us);
  }
}

template <int T>
int report() {
  const void* k = reinterpret_cast<const void*>(planes<T, 0>);
  cudaFuncAttributes fa;
  CHECK(cudaFuncGetAttributes(&fa, k));
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem<T>::TOTAL));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, THREADS, Smem<T>::TOTAL));
  std::printf("T=%d: %d registers, %zu B local, %d B SMEM, %d CTA/SM\n", T, fa.numRegs, fa.localSizeBytes,
              Smem<T>::TOTAL, per_sm);
  return per_sm;
}

}  // namespace

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs\n", prop.name, sms);
  report<64>();
  report<32>();
  report<16>();
  probe<64>(sms, 1, 64, 1 << 15);
  probe<32>(sms, 1, 64, 1 << 15);
  if (report<32>() >= 2) probe<32>(sms, 2, 64, 1 << 15);
  probe<16>(sms, 1, 64, 1 << 15);
  if (report<16>() >= 2) probe<16>(sms, 2, 64, 1 << 15);
  return 0;
}
