// MX element and scale codecs, bit-exact with gcmoe_jax/formats.py and gcmoe_jax/reference.py.
//
// Every function here is a scalar restatement of one jax.numpy expression of the reference; the comment above each
// names it. Framework-free (no XLA headers) so that the math can be tested and reused by other handlers.
//
// Floating point: this file must be compiled with -ffp-contract=off and without -ffast-math (see CMakeLists.txt);
// every product of a value with a power of two is then exact, and no multiply-add is fused behind our back.

#ifndef GCMOE_JAX_CSRC_MX_H_
#define GCMOE_JAX_CSRC_MX_H_

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace gcmoe {

inline constexpr int kBlock = 32;       // MX block: 32 elements along K (formats.BLOCK)
inline constexpr int kKTile = 128;      // K extent of one payload block (formats.K_TILE)
inline constexpr int kUe8m0Bias = 127;  // formats.UE8M0_BIAS

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// bf16 -> f32 is exact: the bf16 bits are the high half of the f32 bits.
inline float Bf16ToFloat(uint16_t bits) { return BitsToFloat(static_cast<uint32_t>(bits) << 16); }

// `x.astype(jnp.bfloat16)`: round to nearest even; NaN stays NaN (quieted, sign kept); overflow rounds to +-inf.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Rounds through bf16 and back, for values that the reference keeps as bf16 but combines in f32.
inline float RoundBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// `formats._exp2`: exact 2**e in f32 for integer e, built from the exponent bits with the reference's clips
// (e >= 127 gives 2**127; e < -149 gives 2**-149). Only e in [-138, 127] occurs (`ScaleByPow2`).
inline float Exp2(int32_t e) {
  if (e >= -126) {
    int32_t biased = e + 127;
    biased = biased < 1 ? 1 : (biased > 254 ? 254 : biased);
    return BitsToFloat(static_cast<uint32_t>(biased) << 23);
  }
  int32_t shift = e + 149;
  shift = shift < 0 ? 0 : (shift > 22 ? 22 : shift);
  return BitsToFloat(1u << shift);  // a subnormal power of two
}

// Python's floor division `n // 2` (C++ `/` truncates toward zero).
inline int32_t FloorHalf(int32_t n) { return n >= 0 ? n / 2 : -((-n + 1) / 2); }

// `formats._scale_by_pow2`: v * 2**e as two exact multiplications, (v * 2**(e//2)) * 2**(e - e//2).
inline float ScaleByPow2(float v, int32_t e) {
  int32_t half = FloorHalf(e);
  return (v * Exp2(half)) * Exp2(e - half);
}

// `formats.scale_exponent(amax, 448)`: ceil(log2(amax / 448)) via frexp, 0 for amax == 0, clipped to [-127, 127].
// frexp(448) = 0.875 * 2**9.
inline int32_t ScaleExponentE4m3(float amax) {
  if (!(amax > 0.0f)) return 0;
  int p = 0;
  float m = std::frexp(amax, &p);
  int32_t e = p - 9 + (m > 0.875f ? 1 : 0);
  return e < -kUe8m0Bias ? -kUe8m0Bias : (e > kUe8m0Bias ? kUe8m0Bias : e);
}

// `formats.encode_e4m3` of one value already divided by its block scale: float8_e4m3fn bits, round to nearest
// even, finite values saturated at +-448, NaN and +-Inf -> NaN (0x7F with the sign bit).
inline uint8_t EncodeE4m3(float q) {
  const uint8_t sign = std::signbit(q) ? 0x80 : 0x00;
  if (!std::isfinite(q)) return sign | 0x7F;
  float a = std::fabs(q);
  if (a > 448.0f) a = 448.0f;
  if (a < 0x1p-6f) {
    // Subnormal E4M3 (and the smallest normal): the code is the multiple of 2**-9, rounded to nearest even.
    // a * 512 is exact; nearbyint rounds half to even in the default rounding mode.
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  // Normal: keep 3 of the 23 f32 mantissa bits, round to nearest even; a carry moves into the exponent.
  uint32_t bits = FloatToBits(a);
  bits += 0x7FFFFu + ((bits >> 20) & 1u);
  const int32_t exp = static_cast<int32_t>(bits >> 23) - 127 + 7;
  return sign | static_cast<uint8_t>((exp << 3) | ((bits >> 20) & 7u));
}

// One E4M3 byte as the exact int32 `512 v` (every E4M3 value is a multiple of 2**-9) plus its NaN flag.
struct E4m3Int {
  int32_t value;  // 512 v, 0 for NaN (XLA converts NaN to int 0)
  bool nan;
};

inline E4m3Int DecodeE4m3Int(uint8_t byte) {
  const int32_t exp = (byte >> 3) & 0xF, mant = byte & 7;
  if (exp == 0xF && mant == 7) return {0, true};
  const int32_t mag = exp == 0 ? mant : (8 + mant) << (exp - 1);  // (1 + m/8) 2**(exp-7) * 512
  return {(byte & 0x80) ? -mag : mag, false};
}

// `reference._e4m3_split`: 512 v -> (8 v where |v| >= 1 else 0, 512 v where |v| < 1 else 0). For |v| >= 1 the value
// 512 v is a multiple of 64, so the floor division of the reference is exact.
struct SplitInt {
  int32_t hi, lo;
};

inline SplitInt SplitE4m3Int(int32_t v512) {
  if (v512 >= 512 || v512 <= -512) return {v512 / 64, 0};
  return {0, v512};
}

// E2M1 codes as `2 w` (exact ints): formats._E2M1_VALUES * 2.
inline constexpr std::array<int8_t, 16> kE2m1Times2 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Sets the floating-point environment the operator is defined in (docs/semantics.md: round to nearest even, float32
// subnormals flushed to zero on input and output, as XLA's CPU runtime and the CUDA role kernels (.ftz) do) for the
// lifetime of the object, and restores the caller's afterwards, so the result never depends on the calling thread.
class ScopedMoeFloatEnv {
 public:
  // `flush_subnormals = false` gives plain IEEE 754 (for constants such as the silu table, which the reference
  // computes in float64 without flushing).
  explicit ScopedMoeFloatEnv(bool flush_subnormals = true) {
#if defined(__SSE__) || defined(__x86_64__)
    saved_ = _mm_getcsr();
    const unsigned flush = flush_subnormals ? kFlushToZero | kDenormalsAreZero : 0u;
    _mm_setcsr((saved_ & ~(kRoundingControl | kFlushToZero | kDenormalsAreZero)) | flush);
#elif defined(__aarch64__)
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t fpcr = (saved_ & ~(kRoundingMode | kFlushToZero)) | (flush_subnormals ? kFlushToZero : 0);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~ScopedMoeFloatEnv() {
#if defined(__SSE__) || defined(__x86_64__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedMoeFloatEnv(const ScopedMoeFloatEnv&) = delete;
  ScopedMoeFloatEnv& operator=(const ScopedMoeFloatEnv&) = delete;

 private:
#if defined(__SSE__) || defined(__x86_64__)
  static constexpr unsigned kFlushToZero = 0x8000u;       // MXCSR.FTZ
  static constexpr unsigned kDenormalsAreZero = 0x0040u;  // MXCSR.DAZ
  static constexpr unsigned kRoundingControl = 0x6000u;   // MXCSR.RC, 00 = nearest even
  unsigned saved_ = 0;
#elif defined(__aarch64__)
  static constexpr uint64_t kFlushToZero = uint64_t{1} << 24;  // FPCR.FZ
  static constexpr uint64_t kRoundingMode = uint64_t{3} << 22;  // FPCR.RMode, 00 = nearest even
  uint64_t saved_ = 0;
#endif
};

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_MX_H_
