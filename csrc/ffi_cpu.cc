// XLA FFI binding of the CPU operator: target "gcmoe_moe_v1" on platform "cpu", symbol GcmoeMoeCpu.
//
// The handler checks every attribute and buffer before touching data, then every expert id, and never throws
// (common.h). The math is in moe_cpu.cc.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common.h"
#include "moe_checks.h"
#include "moe_cpu.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace gcmoe {
namespace {

ffi::Error MoeCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w13, ffi::AnyBuffer w13_scale,
                      ffi::AnyBuffer w2, ffi::AnyBuffer w2_scale, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                      ffi::AnyBuffer s13, ffi::AnyBuffer s13_scale, ffi::AnyBuffer s2, ffi::AnyBuffer s2_scale,
                      ffi::Result<ffi::AnyBuffer> y, int64_t h, int64_t i, int64_t e, int64_t k, int64_t is,
                      int64_t group, float clamp, int64_t flags, std::string_view variant) {
  (void)variant;  // the CUDA kernel variant; nothing to choose on CPU
  const MoeAttrs attrs{h, i, e, k, is, group, clamp, flags};
  int64_t t = 0;
  GCMOE_RETURN_IF_ERROR(CheckMoeCall(
      attrs, MoeBuffers{x, w13, w13_scale, w2, w2_scale, ids, weights, s13, s13_scale, s2, s2_scale, *y}, &t));
  const bool has_shared = attrs.has_shared();

  MoeArgs args;
  args.dims = MoeDims{t, h, i, e, k, is, group};
  args.has_shared = has_shared;
  args.has_clamp = attrs.has_clamp();
  args.clamp = clamp;
  args.x = static_cast<const uint16_t*>(x.untyped_data());
  args.w13 = static_cast<const int8_t*>(w13.untyped_data());
  args.w13_scale = static_cast<const int32_t*>(w13_scale.untyped_data());
  args.w2 = static_cast<const int8_t*>(w2.untyped_data());
  args.w2_scale = static_cast<const int32_t*>(w2_scale.untyped_data());
  args.ids = static_cast<const int32_t*>(ids.untyped_data());
  args.weights = static_cast<const float*>(weights.untyped_data());
  args.s13 = static_cast<const int8_t*>(s13.untyped_data());
  args.s13_scale = static_cast<const int32_t*>(s13_scale.untyped_data());
  args.s2 = static_cast<const int8_t*>(s2.untyped_data());
  args.s2_scale = static_cast<const int32_t*>(s2_scale.untyped_data());
  args.y = static_cast<uint16_t*>(y->untyped_data());
  if (t == 0) return ffi::Error::Success();

  // Expert ids are data: under jit the Python side cannot see them, so this is where an id >= E is caught.
  if (const auto bad = FindBadRoute(args)) {
    return ffi::Error::InvalidArgument(std::string(kMoeOp) + ": routes.ids: expert id " + std::to_string(bad->id) +
                                       " at token " + std::to_string(bad->token) + ", slot " +
                                       std::to_string(bad->slot) + " is out of range [0, E = " + std::to_string(e) +
                                       ") (ids < 0 are padding)");
  }

  // XLA's intra-op pool is sized to the machine and shared with XLA's own work; use it when it is there.
  const int64_t pool_threads = pool.num_threads();
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const PoolParallelFor parallel_for(pool_threads > 0 ? &pool : nullptr, pool_threads > 0 ? pool_threads : hardware);
  try {
    MoeCpu(args, parallel_for);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(kMoeOp) + ": out of host memory for T = " + std::to_string(t) + " tokens");
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(std::string(kMoeOp) + ": " + ex.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(kMoeOp) + ": unknown C++ exception");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace gcmoe

GCMOE_EXPORT XLA_FFI_Error* GcmoeMoeCpu(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GcmoeMoeCpu, gcmoe::MoeCpuImpl,
                              gcmoe::BindMoeAttrs(gcmoe::BindMoeBuffers(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>())));
