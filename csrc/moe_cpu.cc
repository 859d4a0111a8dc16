// The CPU operator (see moe_cpu.h). Each step names the reference expression it restates.
//
// Work is organised for reuse of decoded weights, never at the price of a different order of operations: every
// output element is accumulated over its K32 blocks in increasing K, exactly as reference._gemm's scan does, whatever
// the loop nest around it. Tokens are processed in chunks so that the intermediate buffers stay bounded.

#include "moe_cpu.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "mx.h"

namespace gcmoe {
namespace {

constexpr int64_t kTokenChunk = 64;  // tokens per chunk: bounds h to kTokenChunk * k * 2I floats
constexpr int64_t kTileN = 16;       // output rows (N) per GEMM work item

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// reference.mxfp8 of rows [M, K], stored as reference._e4m3_split of the ints `512 v`: hi = 8 v where |v| >= 1 (else
// 0), lo = 512 v where |v| < 1 (else 0), so that 512 v = 64 hi + lo exactly and both halves fit int16 (|hi| <= 3584,
// |lo| < 512). One exponent and one NaN flag per K32 block.
struct Mxfp8Rows {
  int64_t k = 0;
  std::vector<int16_t> hi, lo;  // [M, K]
  std::vector<int32_t> exps;    // [M, K/32]
  std::vector<uint8_t> nans;    // [M, K/32]

  Mxfp8Rows(int64_t m, int64_t k_) : k(k_), hi(m * k_), lo(m * k_), exps(m * k_ / kBlock), nans(m * k_ / kBlock) {}

  // Quantizes row `m` from f32 values that are exactly bf16.
  void Quantize(int64_t m, const float* v) {
    QuantizeMxfp8Row(v, k, &hi[m * k], &lo[m * k], &exps[m * (k / kBlock)], &nans[m * (k / kBlock)]);
  }
};

// Exact dot of one K32 block of int16 halves in int32 (every caller's sum is < 2**31; see reference's module doc).
// The widening multiply-add is what pmaddwd computes, so the compiler vectorizes it.
inline int32_t Dot32(const int16_t* a, const int16_t* b) {
  int32_t s = 0;
  for (int i = 0; i < kBlock; ++i) s += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
  return s;
}

// `p = where(x_nan, nan, p)`, then `acc = acc + p` (reference._gemm's step).
inline float Accumulate(float acc, float p, bool nan) { return acc + (nan ? kNaN : p); }

// reference._routed_block per payload byte: (2 w of the low nibble, 2 w of the high nibble).
struct E2m1PairTable {
  std::array<std::array<int16_t, 2>, 256> values;
  E2m1PairTable() {
    for (int b = 0; b < 256; ++b) values[b] = {kE2m1Times2[b & 0xF], kE2m1Times2[b >> 4]};
  }
};
const E2m1PairTable kE2m1Pairs;

// reference._shared_block + _e4m3_split per E4M3 weight byte: (8 w or 0, 512 w or 0); NaN bytes decode to 0 as XLA's
// float -> int conversion of the reference does.
struct E4m3SplitTable {
  std::array<SplitInt, 256> values;
  E4m3SplitTable() {
    for (int b = 0; b < 256; ++b) values[b] = SplitE4m3Int(DecodeE4m3Int(static_cast<uint8_t>(b)).value);
  }
};
const E4m3SplitTable kE4m3Split;

// Runs the hot loops with AVX2 where the CPU has it, without making AVX2 a requirement of the library. Integer dots
// are exact whatever the vector width, and -ffp-contract=off keeps float expressions unfused in every clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GCMOE_TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GCMOE_TARGET_CLONES
#endif

// The rows of one GEMM: input row in the Mxfp8Rows (`in`) and output row (`out`), per entry.
struct RowList {
  const int64_t* in;
  const int64_t* out;
  int64_t count;
};

// Routed FP8 x FP4 GEMM for output rows [n0, n1) of one expert:
// out[r, n] = sum over K32 blocks b (in order) of f32(D) * 2**(ex + ew - 10), D = sum_i (512 x_i) (2 w_i) exact.
// payload [K/128, N, 64] and scales [K/128, N] (MN-major) are the expert's slices of the Table 10 routed layout.
GCMOE_TARGET_CLONES void RoutedGemmTile(const Mxfp8Rows& x, const RowList& rows, const int8_t* payload,
                                        const int32_t* scales, int64_t n_total, int64_t n0, int64_t n1, float* out,
                                        bool round_bf16, std::vector<float>& acc) {
  const int64_t k = x.k, nblocks = k / kBlock;
  acc.assign(rows.count, 0.0f);
  alignas(64) int16_t w[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nblocks; ++b) {
      // reference._routed_block: bytes (b % 4) * 16 .. + 16 of (K128 block b / 4, row n); element 2i in the low nibble.
      const uint8_t* bytes =
          reinterpret_cast<const uint8_t*>(payload) + ((b / 4) * n_total + n) * (kKTile / 2) + (b % 4) * 16;
      for (int i = 0; i < 16; ++i) std::memcpy(&w[2 * i], kE2m1Pairs.values[bytes[i]].data(), 2 * sizeof(int16_t));
      const uint32_t word = static_cast<uint32_t>(scales[(b / 4) * n_total + n]);
      const int32_t w_exp = static_cast<int32_t>((word >> (8 * (b % 4))) & 0xFF) - kUe8m0Bias;
      for (int64_t r = 0; r < rows.count; ++r) {
        const int64_t xr = rows.in[r];
        // D = sum (512 x_i)(2 w_i) = 64 sum hi_i (2 w_i) + sum lo_i (2 w_i), exactly.
        const int32_t d = 64 * Dot32(&x.hi[xr * k + b * kBlock], w) + Dot32(&x.lo[xr * k + b * kBlock], w);
        const float p = ScaleByPow2(static_cast<float>(d), x.exps[xr * nblocks + b] + w_exp - 10);
        acc[r] = Accumulate(acc[r], p, x.nans[xr * nblocks + b]);
      }
    }
    for (int64_t r = 0; r < rows.count; ++r) {
      out[rows.out[r] * n_total + n] = round_bf16 ? RoundBf16(acc[r]) : acc[r];
    }
  }
}

// Shared FP8 x FP8 GEMM for output rows [n0, n1): four exact int32 dots of the int16 hi/lo halves per block,
// p = ((f32(Shh) 2**-6 + f32(Shl + Slh) 2**-12) + f32(Sll) 2**-18) * 2**(ex + ew).
// payload [K/128, N, 128] E4M3, scales [N, ceil(K / (4 group))] (reference._shared_block).
GCMOE_TARGET_CLONES void SharedGemmTile(const Mxfp8Rows& x, const RowList& rows, const int8_t* payload,
                                        const int32_t* scales, int64_t n_total, int64_t group, int64_t n0, int64_t n1,
                                        float* out, bool round_bf16, std::vector<float>& acc) {
  const int64_t k = x.k, nblocks = k / kBlock;
  const int64_t words = (k + 4 * group - 1) / (4 * group);
  const int64_t per_word = 4 * group / kBlock;  // K32 blocks covered by one scale word
  acc.assign(rows.count, 0.0f);
  alignas(64) int16_t wh[kBlock];
  alignas(64) int16_t wl[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* bytes =
          reinterpret_cast<const uint8_t*>(payload) + ((b / 4) * n_total + n) * kKTile + (b % 4) * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        const SplitInt s = kE4m3Split.values[bytes[i]];
        wh[i] = static_cast<int16_t>(s.hi);
        wl[i] = static_cast<int16_t>(s.lo);
      }
      const uint32_t word = static_cast<uint32_t>(scales[n * words + b / per_word]);
      const int64_t byte_id = (b % per_word) / (group / kBlock);
      const int32_t w_exp = static_cast<int32_t>((word >> (8 * byte_id)) & 0xFF) - kUe8m0Bias;
      for (int64_t r = 0; r < rows.count; ++r) {
        const int64_t xr = rows.in[r];
        const int16_t* xh = &x.hi[xr * k + b * kBlock];
        const int16_t* xl = &x.lo[xr * k + b * kBlock];
        const int32_t shh = Dot32(xh, wh);
        const int32_t sx = Dot32(xh, wl) + Dot32(xl, wh);
        const int32_t sll = Dot32(xl, wl);
        float p = (static_cast<float>(shh) * 0x1p-6f + static_cast<float>(sx) * 0x1p-12f) +
                  static_cast<float>(sll) * 0x1p-18f;
        p = ScaleByPow2(p, x.exps[xr * nblocks + b] + w_exp);
        acc[r] = Accumulate(acc[r], p, x.nans[xr * nblocks + b]);
      }
    }
    for (int64_t r = 0; r < rows.count; ++r) {
      out[rows.out[r] * n_total + n] = round_bf16 ? RoundBf16(acc[r]) : acc[r];
    }
  }
}

// reference._swiglu then the route weight (reference._expert_mlp): h [2I] f32 in the stored gate/up interleave ->
// bf16(w * bf16(silu(min(g, c)) * clip(u, -c, c))) [I] as f32 values.
void SwigluRow(const float* h, int64_t i_dim, bool has_clamp, uint16_t clamp_bits, float weight, float* a) {
  const float c = Bf16ToFloat(clamp_bits);
  const uint16_t neg_clamp_bits = clamp_bits ^ 0x8000u;
  for (int64_t col = 0; col < i_dim; ++col) {
    // formats.gate_up_deinterleave: stored row 16q + i is gate row 8q + i, 16q + 8 + i is up row 8q + i.
    const int64_t gate_row = 16 * (col / 8) + col % 8;
    uint16_t g = FloatToBf16(h[gate_row]);
    uint16_t u = FloatToBf16(h[gate_row + 8]);
    if (has_clamp) {
      // jnp.minimum and jnp.clip propagate NaN.
      const float gf = Bf16ToFloat(g), uf = Bf16ToFloat(u);
      if (!std::isnan(gf) && gf > c) g = clamp_bits;
      if (!std::isnan(uf)) {
        if (uf < -c) u = neg_clamp_bits;
        else if (uf > c) u = clamp_bits;
      }
    }
    const float act = RoundBf16(SiluTable(g) * Bf16ToFloat(u));
    a[col] = RoundBf16(weight * act);
  }
}

struct SiluTableData {
  std::array<float, 1 << 16> values;
  SiluTableData() {
    ScopedMoeFloatEnv ieee(/*flush_subnormals=*/false);
    for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
      const float f = Bf16ToFloat(static_cast<uint16_t>(bits));
      const double v = f;
      float out;
      if (std::isnan(f)) {
        out = f;
      } else if (v == -HUGE_VAL) {
        out = -0.0f;
      } else if (-v > 709.0) {
        out = v < 0 ? -0.0f : f;  // exp(-v) overflows: silu(v) -> -0
      } else {
        // The C library's exp in double, as reference.silu_table's math.exp; one rounding to float.
        out = static_cast<float>(v / (1.0 + std::exp(-v)));
      }
      values[bits] = out;
    }
  }
};

// A GEMM work item: `expert` >= 0 for a routed tile, -1 for a shared-expert tile; output rows [n0, n1).
struct Tile {
  int64_t expert;
  int64_t n0, n1;
};

void AddTiles(std::vector<Tile>& tiles, int64_t expert, int64_t n) {
  for (int64_t n0 = 0; n0 < n; n0 += kTileN) tiles.push_back({expert, n0, std::min(n, n0 + kTileN)});
}

// One chunk of tokens [t0, t0 + tc).
void MoeChunk(const MoeArgs& a, int64_t t0, int64_t tc, const ParallelFor& parallel_for) {
  const MoeDims& d = a.dims;
  const int64_t h_dim = d.hidden, i_dim = d.intermediate, k = d.top_k, e_dim = d.experts;
  const int64_t is_dim = d.shared_intermediate;
  const uint16_t clamp_bits = FloatToBf16(a.clamp);  // reference: c = bf16(clamp)
  const int64_t rows = tc * k;

  // Step 1: xq = mxfp8(x[t]), once per token (reference.moe_emulated repeats x over the k slots; same values).
  Mxfp8Rows xq(tc, h_dim);
  parallel_for(tc, [&](int64_t lt) {
    ScopedMoeFloatEnv fenv;
    std::vector<float> v(h_dim);
    const uint16_t* xr = a.x + (t0 + lt) * h_dim;
    for (int64_t i = 0; i < h_dim; ++i) v[i] = Bf16ToFloat(xr[i]);
    xq.Quantize(lt, v.data());
  });

  // Group the valid routes of the chunk by expert (ids < 0 are padding and dropped), rows in increasing (t, j).
  std::vector<int64_t> start(e_dim + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t id = a.ids[t0 * k + r];
    if (id >= 0) ++start[id + 1];
  }
  for (int64_t e = 0; e < e_dim; ++e) start[e + 1] += start[e];
  std::vector<int64_t> route_row(start[e_dim]), route_token(start[e_dim]);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t id = a.ids[t0 * k + r];
      if (id < 0) continue;
      route_row[fill[id]] = r;
      route_token[fill[id]] = r / k;
      ++fill[id];
    }
  }
  std::vector<int64_t> token_index(tc);
  for (int64_t lt = 0; lt < tc; ++lt) token_index[lt] = lt;

  std::vector<Tile> tiles1, tiles2;
  for (int64_t e = 0; e < e_dim; ++e) {
    if (start[e + 1] == start[e]) continue;
    AddTiles(tiles1, e, 2 * i_dim);
    AddTiles(tiles2, e, h_dim);
  }
  if (a.has_shared) {
    AddTiles(tiles1, -1, 2 * is_dim);
    AddTiles(tiles2, -1, h_dim);
  }

  // Step 2: h = xq . W13^T (routed rows [T*k, 2I]; shared rows [T, 2Is]), f32.
  std::vector<float> h(rows * 2 * i_dim), hs(a.has_shared ? tc * 2 * is_dim : 0);
  const int64_t h128 = h_dim / kKTile, i128 = i_dim / kKTile;
  parallel_for(static_cast<int64_t>(tiles1.size()), [&](int64_t ti) {
    ScopedMoeFloatEnv fenv;
    std::vector<float> acc;
    const Tile& t = tiles1[ti];
    if (t.expert >= 0) {
      const int64_t e = t.expert, n = 2 * i_dim;
      const RowList rl{&route_token[start[e]], &route_row[start[e]], start[e + 1] - start[e]};
      RoutedGemmTile(xq, rl, a.w13 + e * h128 * n * (kKTile / 2), a.w13_scale + e * n * h128, n, t.n0, t.n1,
                     h.data(), /*round_bf16=*/false, acc);
    } else {
      const RowList rl{token_index.data(), token_index.data(), tc};
      SharedGemmTile(xq, rl, a.s13, a.s13_scale, 2 * is_dim, d.shared_group, t.n0, t.n1, hs.data(),
                     /*round_bf16=*/false, acc);
    }
  });

  // Steps 3-4: a = bf16(w * swiglu(h)), aq = mxfp8(a) (the shared expert has weight 1).
  Mxfp8Rows aq(rows, i_dim);
  Mxfp8Rows aqs(a.has_shared ? tc : 0, a.has_shared ? is_dim : 0);
  const int64_t num_routes = start[e_dim];
  parallel_for(num_routes + (a.has_shared ? tc : 0), [&](int64_t item) {
    ScopedMoeFloatEnv fenv;
    if (item < num_routes) {
      const int64_t r = route_row[item];
      std::vector<float> act(i_dim);
      SwigluRow(&h[r * 2 * i_dim], i_dim, a.has_clamp, clamp_bits, a.weights[t0 * k + r], act.data());
      aq.Quantize(r, act.data());
    } else {
      const int64_t lt = item - num_routes;
      std::vector<float> act(is_dim);
      SwigluRow(&hs[lt * 2 * is_dim], is_dim, a.has_clamp, clamp_bits, 1.0f, act.data());
      aqs.Quantize(lt, act.data());
    }
  });

  // Step 5: o = bf16(aq . W2^T) (routed rows [T*k, H]; shared rows [T, H]).
  std::vector<float> o(rows * h_dim), os(a.has_shared ? tc * h_dim : 0);
  parallel_for(static_cast<int64_t>(tiles2.size()), [&](int64_t ti) {
    ScopedMoeFloatEnv fenv;
    std::vector<float> acc;
    const Tile& t = tiles2[ti];
    if (t.expert >= 0) {
      const int64_t e = t.expert;
      const RowList rl{&route_row[start[e]], &route_row[start[e]], start[e + 1] - start[e]};
      RoutedGemmTile(aq, rl, a.w2 + e * i128 * h_dim * (kKTile / 2), a.w2_scale + e * h_dim * i128, h_dim, t.n0,
                     t.n1, o.data(), /*round_bf16=*/true, acc);
    } else {
      const RowList rl{token_index.data(), token_index.data(), tc};
      SharedGemmTile(aqs, rl, a.s2, a.s2_scale, h_dim, d.shared_group, t.n0, t.n1, os.data(), /*round_bf16=*/true,
                     acc);
    }
  });

  // Step 6: acc = 0; acc += o_j for j in 0..k-1 (padding adds +0.0); acc += shared_y; y = bf16(acc).
  parallel_for(tc, [&](int64_t lt) {
    ScopedMoeFloatEnv fenv;
    uint16_t* yr = a.y + (t0 + lt) * h_dim;
    for (int64_t n = 0; n < h_dim; ++n) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = lt * k + j;
        acc = acc + (a.ids[t0 * k + r] >= 0 ? o[r * h_dim + n] : 0.0f);
      }
      if (a.has_shared) acc = acc + os[lt * h_dim + n];
      yr[n] = FloatToBf16(acc);
    }
  });
}

}  // namespace

void QuantizeMxfp8Row(const float* v, int64_t k, int16_t* hi, int16_t* lo, int32_t* exps, uint8_t* nans) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* vb = v + b * kBlock;
    float amax = 0.0f;  // over the finite elements only
    for (int i = 0; i < kBlock; ++i) {
      if (std::isfinite(vb[i])) amax = std::max(amax, std::fabs(vb[i]));
    }
    const int32_t e = ScaleExponentE4m3(amax);  // formats.quantize_mx: q = v * 2**-e, then E4M3
    bool nan = false;
    for (int i = 0; i < kBlock; ++i) {
      const E4m3Int q = DecodeE4m3Int(EncodeE4m3(ScaleByPow2(vb[i], -e)));
      const SplitInt split = SplitE4m3Int(q.value);
      hi[b * kBlock + i] = static_cast<int16_t>(split.hi);
      lo[b * kBlock + i] = static_cast<int16_t>(split.lo);
      nan |= q.nan;
    }
    exps[b] = e;
    nans[b] = nan;
  }
}

float SiluTable(uint16_t g_bits) {
  static const SiluTableData* const table = new SiluTableData();  // built once, never destroyed
  return table->values[g_bits];
}

std::optional<BadRoute> FindBadRoute(const MoeArgs& args) {
  const int64_t t = args.dims.tokens, k = args.dims.top_k;
  for (int64_t i = 0; i < t * k; ++i) {
    if (args.ids[i] >= args.dims.experts) return BadRoute{i / k, i % k, args.ids[i]};
  }
  return std::nullopt;
}

void MoeCpu(const MoeArgs& args, const ParallelFor& parallel_for) {
  {
    ScopedMoeFloatEnv fenv;
    (void)SiluTable(0);  // build the table in the reference's environment before any worker reads it
  }
  for (int64_t t0 = 0; t0 < args.dims.tokens; t0 += kTokenChunk) {
    MoeChunk(args, t0, std::min(kTokenChunk, args.dims.tokens - t0), parallel_for);
  }
}

}  // namespace gcmoe
