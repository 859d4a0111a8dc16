// XLA FFI binding of the CUDA operator: targets "gcmoe_moe_v1" and, for GCMOE_SYNC_CHECK=1, "gcmoe_moe_sync_v1" on
// platform "CUDA".
//
// Two stages: instantiate (symbol GcmoeMoeCudaInstantiate: once per call site and executable, attributes only) creates
// the MoeCudaState that will own the workspace, green contexts and graphs; execute (symbol GcmoeMoeCudaExecute,
// command-buffer compatible, or GcmoeMoeCudaExecuteSync, the same handler without that trait) runs on XLA's stream.
// The state type is registered from Python (GcmoeMoeCudaStateTypeId / GcmoeMoeCudaStateTypeInfo) before the targets.
//
// Compiled by nvcc (CMakeLists.txt) so that device code can join this file; it has none yet.

#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <atomic>
#include <map>
#include <mutex>
#include <string_view>
#include <memory>
#include <string>
#include <utility>

#include "common.h"
#include "gc_runtime.h"
#include "moe.h"
#include "moe_checks.h"
#include "xla/ffi/api/ffi.h"

namespace gcmoe {

// Per call site (XLA instantiates once per executable, not per device): the kernel variant, and the Runtime of each
// (device, T) taken from the process-wide graph cache on first use (shared with other call sites of the same key),
// behind a mutex (PJRT runs each local device's call on its own thread).
struct MoeCudaState {
  static ffi::TypeId id;
  static std::atomic<int64_t> live;  // states alive in this process (tests: dropped executables free theirs)
  MoeCudaState() { live.fetch_add(1); }
  ~MoeCudaState() { live.fetch_sub(1); }
  MoeCudaState(const MoeCudaState&) = delete;
  MoeCudaState& operator=(const MoeCudaState&) = delete;
  MoeAttrs attrs;
  std::string variant;
  std::shared_ptr<const VariantSpec> spec;
  std::mutex mutex;
  std::map<std::pair<int32_t, int64_t>, std::shared_ptr<Runtime>> runtimes;
};

ffi::TypeId MoeCudaState::id = {};
std::atomic<int64_t> MoeCudaState::live{0};

namespace {

ffi::ErrorOr<std::unique_ptr<MoeCudaState>> MoeCudaInstantiate(int64_t h, int64_t i, int64_t e, int64_t k, int64_t is,
                                                               int64_t group, float clamp, int64_t flags,
                                                               std::string_view variant) {
  const MoeAttrs attrs{h, i, e, k, is, group, clamp, flags};
  ffi::Error error = CheckMoeAttrs(attrs);
  if (error.failure()) return ffi::Unexpected<ffi::Error>(std::move(error));
  auto state = std::make_unique<MoeCudaState>();
  state->attrs = attrs;
  state->variant = std::string(variant);
  state->spec = FindVariant(state->variant);
  if (state->spec == nullptr) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        std::string(kMoeOp) + ": kernel variant '" + state->variant +
        "' is not registered in this process (gcmoe_jax registers it when it traces gm.moe; a program loaded from a "
        "compilation cache must trace gm.moe once first)"));
  }
  return ffi::ErrorOr<std::unique_ptr<MoeCudaState>>(std::move(state));
}

ffi::Error MoeCudaExecute(CUstream stream, int32_t device_ordinal, MoeCudaState* state, ffi::AnyBuffer x,
                          ffi::AnyBuffer w13, ffi::AnyBuffer w13_scale, ffi::AnyBuffer w2, ffi::AnyBuffer w2_scale,
                          ffi::AnyBuffer ids, ffi::AnyBuffer weights, ffi::AnyBuffer s13, ffi::AnyBuffer s13_scale,
                          ffi::AnyBuffer s2, ffi::AnyBuffer s2_scale, ffi::Result<ffi::AnyBuffer> y) {
  if (state == nullptr) return ffi::Error::Internal(std::string(kMoeOp) + ": the instantiate stage left no state");
  int64_t t = 0;
  GCMOE_RETURN_IF_ERROR(CheckMoeCall(
      state->attrs, MoeBuffers{x, w13, w13_scale, w2, w2_scale, ids, weights, s13, s13_scale, s2, s2_scale, *y}, &t));
  std::string why;
  const CudaDriver* cu = GetCudaDriver(&why);
  if (cu == nullptr) return ffi::Error::Internal(std::string(kMoeOp) + ": " + why);
  Runtime* rt = nullptr;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    auto& slot = state->runtimes[{device_ordinal, t}];
    if (slot == nullptr) {
      // +inf is exactly "no clamp" for the kernels: min(g, inf) = g, clip(u, -inf, inf) = u.
      const float clamp = state->attrs.has_clamp() ? state->attrs.clamp : HUGE_VALF;
      slot = Runtime::Get(*cu, state->spec, stream, t, clamp, &why);
      if (slot == nullptr) return ffi::Error::InvalidArgument(why);
    }
    rt = slot.get();
  }
  auto ptr = [](const ffi::AnyBuffer& b) { return reinterpret_cast<CUdeviceptr>(b.untyped_data()); };
  // Kernel parameter order: gcmoe_jax/kernels/abi.py PARAMS (the workspace pointer is the runtime's own).
  const PointerParams ptrs = {ptr(x),  ptr(ids), ptr(weights), ptr(w13), ptr(w13_scale), ptr(w2),          ptr(w2_scale),
                              ptr(s13), ptr(s13_scale), ptr(s2), ptr(s2_scale), ptr(*y), CUdeviceptr{0}};
  std::string err = rt->Execute(stream, ptrs);
  if (err.empty() && (state->attrs.flags & kMoeSyncCheck) != 0) err = rt->SyncAndCheck(stream);
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kInternal, err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace gcmoe

GCMOE_EXPORT XLA_FFI_Error* GcmoeMoeCudaInstantiate(XLA_FFI_CallFrame* call_frame);
GCMOE_EXPORT XLA_FFI_Error* GcmoeMoeCudaExecute(XLA_FFI_CallFrame* call_frame);
GCMOE_EXPORT XLA_FFI_Error* GcmoeMoeCudaExecuteSync(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GcmoeMoeCudaInstantiate, gcmoe::MoeCudaInstantiate,
                              gcmoe::BindMoeAttrs(xla::ffi::Ffi::BindInstantiate()));

namespace gcmoe {
namespace {
auto BindMoeCudaExecute() {
  return BindMoeBuffers(xla::ffi::Ffi::Bind()
                            .Ctx<xla::ffi::PlatformStream<CUstream>>()  // XLA's stream
                            .Ctx<xla::ffi::DeviceOrdinal>()             // int32 device ordinal
                            .Ctx<xla::ffi::State<MoeCudaState>>());     // from the instantiate stage
}
}  // namespace
}  // namespace gcmoe

XLA_FFI_DEFINE_HANDLER_SYMBOL(GcmoeMoeCudaExecute, gcmoe::MoeCudaExecute, gcmoe::BindMoeCudaExecute(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

// The same handler without kCmdBufferCompatible, for GCMOE_SYNC_CHECK=1 (target gcmoe_moe_sync_v1): XLA keeps such
// a call out of its command buffers and runs the handler at every execution, so a device fault is raised by the call
// that hit it. Inside a command buffer a replay runs without the handler, which alone can read the fault record.
XLA_FFI_DEFINE_HANDLER_SYMBOL(GcmoeMoeCudaExecuteSync, gcmoe::MoeCudaExecute, gcmoe::BindMoeCudaExecute());

// The state type of the instantiate stage, for jax.ffi.register_ffi_type(..., platform="CUDA").
GCMOE_EXPORT XLA_FFI_TypeId* GcmoeMoeCudaStateTypeId() { return &gcmoe::MoeCudaState::id; }

// CUDA call-site states alive in this process (each owns its workspaces, green contexts and graphs).
GCMOE_EXPORT int64_t gcmoe_live_states() { return gcmoe::MoeCudaState::live.load(); }

GCMOE_EXPORT const XLA_FFI_TypeInfo* GcmoeMoeCudaStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = xla::ffi::MakeTypeInfo<gcmoe::MoeCudaState>();
  return &info;
}
