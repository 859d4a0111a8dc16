// XLA FFI binding of the CUDA operator: target "gcmoe_moe_v1" on platform "CUDA".
//
// Two stages: instantiate (symbol GcmoeMoeCudaInstantiate: once per call site and executable, attributes only) creates
// the MoeCudaState that will own the workspace, green contexts and graphs; execute (symbol GcmoeMoeCudaExecute) runs
// on XLA's stream. The state type is registered from Python (GcmoeMoeCudaStateTypeId / GcmoeMoeCudaStateTypeInfo)
// before the target. Until issue 5 lands, execute checks its buffers and returns UNIMPLEMENTED.
//
// Compiled by nvcc (CMakeLists.txt) so that device code can join this file; it has none yet.

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "common.h"
#include "moe.h"
#include "moe_checks.h"
#include "xla/ffi/api/ffi.h"

namespace gcmoe {

// Per call site, shared by every local GPU of the process (XLA instantiates once per executable, not per device):
// per-device resources will live in a map keyed by the device ordinal, behind a mutex.
struct MoeCudaState {
  static ffi::TypeId id;
  MoeAttrs attrs;
};

ffi::TypeId MoeCudaState::id = {};

namespace {

ffi::ErrorOr<std::unique_ptr<MoeCudaState>> MoeCudaInstantiate(int64_t h, int64_t i, int64_t e, int64_t k, int64_t is,
                                                               int64_t group, float clamp, int64_t flags) {
  const MoeAttrs attrs{h, i, e, k, is, group, clamp, flags};
  ffi::Error error = CheckMoeAttrs(attrs);
  if (error.failure()) return ffi::Unexpected<ffi::Error>(std::move(error));
  auto state = std::make_unique<MoeCudaState>();
  state->attrs = attrs;
  return ffi::ErrorOr<std::unique_ptr<MoeCudaState>>(std::move(state));
}

ffi::Error MoeCudaExecute(CUstream stream, int32_t device_ordinal, MoeCudaState* state, ffi::AnyBuffer x,
                          ffi::AnyBuffer w13, ffi::AnyBuffer w13_scale, ffi::AnyBuffer w2, ffi::AnyBuffer w2_scale,
                          ffi::AnyBuffer ids, ffi::AnyBuffer weights, ffi::AnyBuffer s13, ffi::AnyBuffer s13_scale,
                          ffi::AnyBuffer s2, ffi::AnyBuffer s2_scale, ffi::Result<ffi::AnyBuffer> y) {
  (void)stream;
  (void)device_ordinal;
  if (state == nullptr) return ffi::Error::Internal(std::string(kMoeOp) + ": the instantiate stage left no state");
  int64_t t = 0;
  GCMOE_RETURN_IF_ERROR(CheckMoeCall(
      state->attrs, MoeBuffers{x, w13, w13_scale, w2, w2_scale, ids, weights, s13, s13_scale, s2, s2_scale, *y}, &t));
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string(kMoeOp) + ": the CUDA runtime is not implemented yet (issue 5)");
}

}  // namespace
}  // namespace gcmoe

GCMOE_EXPORT XLA_FFI_Error* GcmoeMoeCudaInstantiate(XLA_FFI_CallFrame* call_frame);
GCMOE_EXPORT XLA_FFI_Error* GcmoeMoeCudaExecute(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GcmoeMoeCudaInstantiate, gcmoe::MoeCudaInstantiate,
                              xla::ffi::Ffi::BindInstantiate()
                                  .Attr<int64_t>("H")       // H      int64
                                  .Attr<int64_t>("I")       // I      int64
                                  .Attr<int64_t>("E")       // E      int64
                                  .Attr<int64_t>("k")       // k      int64
                                  .Attr<int64_t>("Is")      // Is     int64 (0: no shared expert)
                                  .Attr<int64_t>("group")   // group  int64 (32, 128; 0: no shared expert)
                                  .Attr<float>("clamp")     // clamp  float32 (read when flags has kMoeHasClamp)
                                  .Attr<int64_t>("flags"));  // flags  int64 (MoeFlags bits)

XLA_FFI_DEFINE_HANDLER_SYMBOL(GcmoeMoeCudaExecute, gcmoe::MoeCudaExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>()          // XLA's stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                     // int32 device ordinal
                                  .Ctx<xla::ffi::State<gcmoe::MoeCudaState>>()        // from instantiate
                                  .Arg<xla::ffi::AnyBuffer>()  // x          [T, H] bfloat16
                                  .Arg<xla::ffi::AnyBuffer>()  // w13        [E, H/128, 2I, 64] int8 (E2M1 pairs)
                                  .Arg<xla::ffi::AnyBuffer>()  // w13_scale  [E, 2I, H/128] int32 (UE8M0 x4)
                                  .Arg<xla::ffi::AnyBuffer>()  // w2         [E, I/128, H, 64] int8
                                  .Arg<xla::ffi::AnyBuffer>()  // w2_scale   [E, H, I/128] int32
                                  .Arg<xla::ffi::AnyBuffer>()  // ids        [T, k] int32 (< 0: padding)
                                  .Arg<xla::ffi::AnyBuffer>()  // weights    [T, k] float32
                                  .Arg<xla::ffi::AnyBuffer>()  // s13        [H/128, 2Is, 128] int8 (E4M3) or [0, 0, 0]
                                  .Arg<xla::ffi::AnyBuffer>()  // s13_scale  [2Is, ceil(H/(4g))] int32 or [0, 0]
                                  .Arg<xla::ffi::AnyBuffer>()  // s2         [Is/128, H, 128] int8 (E4M3) or [0, 0, 0]
                                  .Arg<xla::ffi::AnyBuffer>()  // s2_scale   [H, ceil(Is/(4g))] int32 or [0, 0]
                                  .Ret<xla::ffi::AnyBuffer>(),  // y         [T, H] bfloat16
                              {xla::ffi::Traits::kCmdBufferCompatible});

// The state type of the instantiate stage, for jax.ffi.register_ffi_type(..., platform="CUDA").
GCMOE_EXPORT XLA_FFI_TypeId* GcmoeMoeCudaStateTypeId() { return &gcmoe::MoeCudaState::id; }

GCMOE_EXPORT const XLA_FFI_TypeInfo* GcmoeMoeCudaStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = xla::ffi::MakeTypeInfo<gcmoe::MoeCudaState>();
  return &info;
}
