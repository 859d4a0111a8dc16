// Attribute and buffer checks of the gcmoe_moe call, shared by the CPU and CUDA bindings.
//
// The operand list (one line per binding in ffi_cpu.cc / ffi_cuda.cc):
//   x [T, H] bf16, w13 [E, H/128, 2I, 64] s8, w13_scale [E, H/128, 2I] s32, w2 [E, I/128, H, 64] s8,
//   w2_scale [E, I/128, H] s32, ids [T, k] s32, weights [T, k] f32,
//   s13 [H/128, 2Is, 128] s8, s13_scale [2Is, ceil(H/(4g))] s32, s2 [Is/128, H, 128] s8, s2_scale [H, ceil(Is/(4g))]
//   s32 (all four [0, 0, 0] / [0, 0] without a shared expert) -> y [T, H] bf16.

#ifndef GCMOE_JAX_CSRC_MOE_CHECKS_H_
#define GCMOE_JAX_CSRC_MOE_CHECKS_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common.h"
#include "moe.h"
#include "xla/ffi/api/ffi.h"

namespace gcmoe {

inline constexpr char kMoeOp[] = "gcmoe_moe";
inline constexpr int64_t kMoeKTile = 128;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Checks the attributes that shape every buffer (gcmoe_jax.ffi sets them from ExpertWeights.config).
inline ffi::Error CheckMoeAttrs(const MoeAttrs& a) {
  const char* op = kMoeOp;
  GCMOE_RETURN_IF_ERROR(
      CheckAttr(op, a.hidden > 0 && a.hidden % kMoeKTile == 0, "H", "to be a positive multiple of 128", a.hidden));
  GCMOE_RETURN_IF_ERROR(CheckAttr(op, a.intermediate > 0 && a.intermediate % kMoeKTile == 0, "I",
                                  "to be a positive multiple of 128", a.intermediate));
  GCMOE_RETURN_IF_ERROR(CheckAttr(op, a.experts > 0, "E", "to be positive", a.experts));
  GCMOE_RETURN_IF_ERROR(CheckAttr(op, a.top_k > 0, "k", "to be positive", a.top_k));
  GCMOE_RETURN_IF_ERROR(CheckAttr(op, (a.flags & ~int64_t{kMoeHasShared | kMoeHasClamp | kMoeSyncCheck}) == 0,
                                  "flags", "to hold only the bits 1 (shared), 2 (clamp) and 4 (sync check)", a.flags));
  if (a.has_shared()) {
    GCMOE_RETURN_IF_ERROR(CheckAttr(op, a.shared_intermediate > 0 && a.shared_intermediate % kMoeKTile == 0, "Is",
                                    "to be a positive multiple of 128 with a shared expert", a.shared_intermediate));
    GCMOE_RETURN_IF_ERROR(
        CheckAttr(op, a.shared_group == 32 || a.shared_group == 128, "group", "to be 32 or 128", a.shared_group));
  } else {
    GCMOE_RETURN_IF_ERROR(
        CheckAttr(op, a.shared_intermediate == 0, "Is", "to be 0 without a shared expert", a.shared_intermediate));
    GCMOE_RETURN_IF_ERROR(
        CheckAttr(op, a.shared_group == 0, "group", "to be 0 without a shared expert", a.shared_group));
  }
  if (a.has_clamp()) {
    GCMOE_RETURN_IF_ERROR(
        CheckAttr(op, std::isfinite(a.clamp) && a.clamp > 0.0f, "clamp", "to be finite and positive", a.clamp));
  }
  return ffi::Error::Success();
}

// The buffers of one call, in operand order.
struct MoeBuffers {
  const ffi::AnyBuffer& x;
  const ffi::AnyBuffer& w13;
  const ffi::AnyBuffer& w13_scale;
  const ffi::AnyBuffer& w2;
  const ffi::AnyBuffer& w2_scale;
  const ffi::AnyBuffer& ids;
  const ffi::AnyBuffer& weights;
  const ffi::AnyBuffer& s13;
  const ffi::AnyBuffer& s13_scale;
  const ffi::AnyBuffer& s2;
  const ffi::AnyBuffer& s2_scale;
  const ffi::AnyBuffer& y;
};

// Checks the attributes, then every buffer's dtype and shape against them; sets `*tokens` to T.
inline ffi::Error CheckMoeCall(const MoeAttrs& a, const MoeBuffers& b, int64_t* tokens) {
  GCMOE_RETURN_IF_ERROR(CheckMoeAttrs(a));
  const char* op = kMoeOp;
  const int64_t h = a.hidden, i = a.intermediate, e = a.experts, k = a.top_k;
  const int64_t is = a.shared_intermediate, g = a.shared_group;
  if (b.x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x: expected [T, " + std::to_string(h) +
                                       "] bfloat16, got " + ShapeString(b.x.dimensions()) + " " +
                                       DtypeName(b.x.element_type()));
  }
  const int64_t t = b.x.dimensions()[0];
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "x", b.x, ffi::DataType::BF16, {t, h}));
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "w13", b.w13, ffi::DataType::S8, {e, h / kMoeKTile, 2 * i, kMoeKTile / 2}));
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "w13_scale", b.w13_scale, ffi::DataType::S32, {e, h / kMoeKTile, 2 * i}));
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "w2", b.w2, ffi::DataType::S8, {e, i / kMoeKTile, h, kMoeKTile / 2}));
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "w2_scale", b.w2_scale, ffi::DataType::S32, {e, i / kMoeKTile, h}));
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "ids", b.ids, ffi::DataType::S32, {t, k}));
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "weights", b.weights, ffi::DataType::F32, {t, k}));
  if (a.has_shared()) {
    GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "s13", b.s13, ffi::DataType::S8, {h / kMoeKTile, 2 * is, kMoeKTile}));
    GCMOE_RETURN_IF_ERROR(
        CheckBuffer(op, "s13_scale", b.s13_scale, ffi::DataType::S32, {2 * is, CeilDiv(h, 4 * g)}));
    GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "s2", b.s2, ffi::DataType::S8, {is / kMoeKTile, h, kMoeKTile}));
    GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "s2_scale", b.s2_scale, ffi::DataType::S32, {h, CeilDiv(is, 4 * g)}));
  } else {
    // Without a shared expert the four operands are empty placeholders (gcmoe_jax.ffi builds them).
    GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "s13", b.s13, ffi::DataType::S8, {0, 0, 0}));
    GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "s13_scale", b.s13_scale, ffi::DataType::S32, {0, 0}));
    GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "s2", b.s2, ffi::DataType::S8, {0, 0, 0}));
    GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "s2_scale", b.s2_scale, ffi::DataType::S32, {0, 0}));
  }
  GCMOE_RETURN_IF_ERROR(CheckBuffer(op, "y (result)", b.y, ffi::DataType::BF16, {t, h}));
  *tokens = t;
  return ffi::Error::Success();
}

// The buffers of gcmoe_moe, in the order gcmoe_jax/ffi/_moe.py passes them: one list for the CPU handler and the
// CUDA execute stage, so the two cannot drift.
template <typename Binding>
auto BindMoeBuffers(Binding&& b) {
  using xla::ffi::AnyBuffer;
  return std::forward<Binding>(b)
      .template Arg<AnyBuffer>()   // x          [T, H] bfloat16
      .template Arg<AnyBuffer>()   // w13        [E, H/128, 2I, 64] int8 (E2M1 pairs)
      .template Arg<AnyBuffer>()   // w13_scale  [E, H/128, 2I] int32 (UE8M0 x4, MN-major)
      .template Arg<AnyBuffer>()   // w2         [E, I/128, H, 64] int8
      .template Arg<AnyBuffer>()   // w2_scale   [E, I/128, H] int32
      .template Arg<AnyBuffer>()   // ids        [T, k] int32 (< 0: padding)
      .template Arg<AnyBuffer>()   // weights    [T, k] float32
      .template Arg<AnyBuffer>()   // s13        [H/128, 2Is, 128] int8 (E4M3) or [0, 0, 0]
      .template Arg<AnyBuffer>()   // s13_scale  [2Is, ceil(H/(4g))] int32 or [0, 0]
      .template Arg<AnyBuffer>()   // s2         [Is/128, H, 128] int8 (E4M3) or [0, 0, 0]
      .template Arg<AnyBuffer>()   // s2_scale   [H, ceil(Is/(4g))] int32 or [0, 0]
      .template Ret<AnyBuffer>();  // y          [T, H] bfloat16
}

// The attributes of gcmoe_moe (MoeAttrs, then the kernel variant key): one list for the CPU handler and the CUDA
// instantiate stage.
template <typename Binding>
auto BindMoeAttrs(Binding&& b) {
  return std::forward<Binding>(b)
      .template Attr<int64_t>("H")
      .template Attr<int64_t>("I")
      .template Attr<int64_t>("E")
      .template Attr<int64_t>("k")
      .template Attr<int64_t>("Is")      // 0: no shared expert
      .template Attr<int64_t>("group")   // 32, 128; 0: no shared expert
      .template Attr<float>("clamp")     // read when flags has kMoeHasClamp
      .template Attr<int64_t>("flags")   // MoeFlags bits
      .template Attr<std::string_view>("variant");  // the CUDA kernel variant key
}

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_MOE_CHECKS_H_
