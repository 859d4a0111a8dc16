// What every backend of the operator shares: the attribute flags and the problem sizes.

#ifndef GCMOE_JAX_CSRC_MOE_H_
#define GCMOE_JAX_CSRC_MOE_H_

#include <cstdint>

namespace gcmoe {

// Bits of the `flags` attribute; mirrored by gcmoe_jax.ffi.Flag (tests/test_ffi_cpu.py checks that they agree
// through gcmoe_ffi_build_info()).
enum MoeFlags : int64_t {
  kMoeHasShared = 1,  // the shared-expert buffers hold a shared expert
  kMoeHasClamp = 2,   // the SwiGLU clamp attribute applies
  kMoeSyncCheck = 4,  // CUDA: synchronise after the call and report a device fault at once (GCMOE_SYNC_CHECK)
};

// Sizes, all static (attributes), except `tokens` (the leading dimension of x).
struct MoeDims {
  int64_t tokens;               // T
  int64_t hidden;               // H, multiple of 128
  int64_t intermediate;         // I, multiple of 128
  int64_t experts;              // E
  int64_t top_k;                // k
  int64_t shared_intermediate;  // Is, multiple of 128 (0 without a shared expert)
  int64_t shared_group;         // K-group of the shared scales, 32 or 128 (0 without a shared expert)
};

// The attributes of one call site, as the FFI binding receives them.
struct MoeAttrs {
  int64_t hidden, intermediate, experts, top_k, shared_intermediate, shared_group;
  float clamp;
  int64_t flags;

  bool has_shared() const { return (flags & kMoeHasShared) != 0; }
  bool has_clamp() const { return (flags & kMoeHasClamp) != 0; }
};

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_MOE_H_
