// C entry points for tests (tests/test_ffi_cpu.py, through ctypes): the pieces of the CPU operator that a test can
// compare with gcmoe_jax.reference exhaustively, where the operator tests reach only the values their data produce.

#include <cstdint>
#include <vector>

#include "common.h"
#include "moe_cpu.h"
#include "mx.h"
#include "sha256.h"

// out[65536]: silu(g) for every bf16 bit pattern g (reference.silu_table()).
GCMOE_EXPORT void gcmoe_test_silu_table(float* out) {
  gcmoe::ScopedMoeFloatEnv fenv;
  for (uint32_t g = 0; g < (1u << 16); ++g) out[g] = gcmoe::SiluTable(static_cast<uint16_t>(g));
}

// reference.mxfp8 of rows [m, k] of bf16 bits: ints [m, k] (512 v, 0 for NaN), exps [m, k/32], nans [m, k/32].
GCMOE_EXPORT void gcmoe_test_mxfp8(const uint16_t* x, int64_t m, int64_t k, int32_t* ints, int32_t* exps,
                                   uint8_t* nans) {
  gcmoe::ScopedMoeFloatEnv fenv;
  std::vector<float> v(k);
  std::vector<int16_t> hi(k), lo(k);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) v[i] = gcmoe::Bf16ToFloat(x[r * k + i]);
    gcmoe::QuantizeMxfp8Row(v.data(), k, hi.data(), lo.data(), exps + r * (k / gcmoe::kBlock),
                            nans + r * (k / gcmoe::kBlock));
    for (int64_t i = 0; i < k; ++i) ints[r * k + i] = 64 * hi[i] + lo[i];
  }
}

// out[32] = SHA-256 of data[n] (the runtime's graph-cache keys; tests compare it with hashlib).
GCMOE_EXPORT void gcmoe_test_sha256(const void* data, int64_t n, uint8_t* out) {
  const gcmoe::Digest d = gcmoe::Sha256().Update(data, static_cast<size_t>(n)).Finish();
  for (int i = 0; i < 32; ++i) out[i] = d[i];
}
