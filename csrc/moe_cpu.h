// The GC-MoE operator on the CPU: a scalar restatement of gcmoe_jax.reference.moe_emulated over the packed Table 10
// layouts, bit for bit (DESIGN §2; the order of operations is fixed by the module doc of gcmoe_jax/reference.py).
//
// Framework-free: the FFI binding (ffi_cpu.cc) checks the buffers and provides the threads.

#ifndef GCMOE_JAX_CSRC_MOE_CPU_H_
#define GCMOE_JAX_CSRC_MOE_CPU_H_

#include <cstdint>
#include <functional>
#include <optional>

#include "moe.h"

namespace gcmoe {

// Pointers into the (checked) buffers; shapes as in ffi_cpu.cc.
struct MoeArgs {
  MoeDims dims;
  bool has_shared = false;
  bool has_clamp = false;
  float clamp = 0.0f;           // as float32; rounded to bf16 inside, as the reference does
  const uint16_t* x = nullptr;  // [T, H] bf16 bits
  const int8_t* w13 = nullptr;  // [E, H/128, 2I, 64]
  const int32_t* w13_scale = nullptr;  // [E, H/128, 2I] (MN-major)
  const int8_t* w2 = nullptr;          // [E, I/128, H, 64]
  const int32_t* w2_scale = nullptr;   // [E, I/128, H]
  const int32_t* ids = nullptr;        // [T, k]
  const float* weights = nullptr;      // [T, k]
  const int8_t* s13 = nullptr;         // [H/128, 2Is, 128]
  const int32_t* s13_scale = nullptr;  // [2Is, ceil(H / (4 group))]
  const int8_t* s2 = nullptr;          // [Is/128, H, 128]
  const int32_t* s2_scale = nullptr;   // [H, ceil(Is / (4 group))]
  uint16_t* y = nullptr;               // [T, H] bf16 bits
};

// Runs fn(i) for every i in [0, n), possibly concurrently, and returns when all have finished. An exception thrown by
// fn is rethrown on the calling thread.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& fn)>;

// The first route (in token-major order) whose expert id is >= E; ids < 0 are padding.
struct BadRoute {
  int64_t token;
  int64_t slot;
  int32_t id;
};
std::optional<BadRoute> FindBadRoute(const MoeArgs& args);

// y = moe_emulated(x, w, ids, weights, clamp). Requires every id < E (FindBadRoute). May throw std::bad_alloc.
void MoeCpu(const MoeArgs& args, const ParallelFor& parallel_for);

// float32 silu(g) for the bf16 bit pattern g (reference.silu_table).
float SiluTable(uint16_t g_bits);

// reference.mxfp8 of one row of K values (exactly bf16, as f32): per element the ints `512 v` split as
// reference._e4m3_split (512 v = 64 hi + lo), per K32 block the scale exponent and whether the block holds a NaN.
void QuantizeMxfp8Row(const float* v, int64_t k, int16_t* hi, int16_t* lo, int32_t* exps, uint8_t* nans);

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_MOE_CPU_H_
