// The GC-MoE CUDA runtime (paper §4.1-4.2, §5.2-5.3): green contexts, the role graph, replay in XLA's stream.
//
// One Runtime per (call site, device). At first use (outside any stream capture) it allocates the workspace, splits
// the device into a dispatch and a compute green context with ONE split call, loads the three role cubins with
// cuLibraryLoadData, checks that every role's grid is resident (eq. 6, occupancy API at the exact block size and
// dynamic SMEM), and builds a 3-node graph: role 1 (dispatch partition) and role 2 (compute partition) as concurrent
// roots synchronised through epoch-tagged flags in the workspace, role 3 (finalize, primary context) after both, and
// a memcpy node that mirrors the workspace header into pinned host memory so faults are reported without a sync.
// Each call updates the kernel parameters of the instantiated graph (no re-instantiation) and launches it into XLA's
// stream, or, when that stream is capturing (XLA command buffers), splices the graph in as a child node.

#ifndef GCMOE_JAX_CSRC_GC_RUNTIME_H_
#define GCMOE_JAX_CSRC_GC_RUNTIME_H_

#include <cuda.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_driver.h"

namespace gcmoe {

inline constexpr int kNumRoles = 3;
inline constexpr int kNumPointerParams = 13;  // gcmoe_jax/kernels/abi.py PARAMS

// Header fields of the workspace (gcmoe_jax/kernels/abi.py HEADER); tests check that the two agree.
struct WorkspaceHeader {
  uint32_t epoch;
  uint32_t error_flag;
  uint64_t timeout_ns;
  uint32_t error_role;
  uint32_t error_block;
  uint32_t error_epoch;
  uint32_t error_counter;
  uint32_t error_observed;
  int32_t stall_expert;
  uint8_t pad[256 - 40];
};
static_assert(sizeof(WorkspaceHeader) == 256, "abi.HEADER_BYTES");

struct RoleSpec {
  std::vector<uint8_t> cubin;
  unsigned grid = 0, block = 0, smem = 0;
};

// Everything static about one kernel variant, registered from Python (gcmoe_register_variant) before lowering.
struct VariantSpec {
  int64_t capacity = 0;      // token capacity of the cubins
  int64_t dispatch_sms = 0;  // requested dispatch SMs (eq. 5); the compute group is the aligned rest
  uint64_t timeout_ns = 0;   // bound of every spin-wait
  int64_t ws_total = 0, ws_silu_table = 0;
  int64_t planned_compute_sms = 0;  // the split gcmoe_jax.geometry planned (eq. 5); 0: not checked
  std::array<RoleSpec, kNumRoles> role;
  std::vector<float> silu_table;  // 65536 entries
};

// Registry of variants, by key (the `variant` attribute of the call).
void RegisterVariant(const std::string& key, std::shared_ptr<const VariantSpec> spec);
std::shared_ptr<const VariantSpec> FindVariant(const std::string& key);

// Per-call device pointers, in kernel parameter order (abi.PARAMS[:13]).
using PointerParams = std::array<CUdeviceptr, kNumPointerParams>;

struct Partition {
  unsigned total_sms = 0, dispatch_sms = 0, compute_sms = 0, alignment = 0;
};

class Runtime {
 public:
  // Builds everything for `tokens` on the current context's device; returns "" or the reason it cannot run.
  static std::unique_ptr<Runtime> Create(const CudaDriver& cu, std::shared_ptr<const VariantSpec> spec, CUstream stream,
                                         int64_t tokens, float clamp, std::string* error);
  ~Runtime();

  // Runs one call on `stream` (launch or splice into the capture). Returns "" or an error message; a fault recorded
  // by an earlier replay is returned here (and cleared) before anything is launched.
  std::string Execute(CUstream stream, const PointerParams& ptrs);

  // GCMOE_SYNC_CHECK: waits for the stream, then reports a fault of this call at once.
  std::string SyncAndCheck(CUstream stream);


 private:
  Runtime(const CudaDriver& cu) : cu_(cu) {}
  std::string Init(std::shared_ptr<const VariantSpec> spec, CUstream stream, int64_t tokens, float clamp);
  std::string CheckFault(CUstream stream);
  std::string SetParams(const PointerParams& ptrs, bool exec);
  CUDA_KERNEL_NODE_PARAMS NodeParams(int role);  // role r's kernel node: kernel, green context, launch, params

  const CudaDriver& cu_;
  std::shared_ptr<const VariantSpec> spec_;
  CUcontext primary_ = nullptr;
  CUdevice device_ = 0;
  Partition partition_;
  std::array<RoleSpec, kNumRoles> launch_;  // the launch triples in use (auto grids resolved; no cubin bytes)
  CUgreenCtx green_[2] = {nullptr, nullptr};  // dispatch, compute
  CUcontext role_ctx_[kNumRoles] = {nullptr, nullptr, nullptr};
  CUlibrary library_[kNumRoles] = {nullptr, nullptr, nullptr};
  CUkernel kernel_[kNumRoles] = {nullptr, nullptr, nullptr};
  CUdeviceptr workspace_ = 0;
  WorkspaceHeader* host_header_ = nullptr;  // pinned mirror, written by the graph's memcpy node
  CUgraph graph_ = nullptr;
  CUgraphExec exec_ = nullptr;
  CUgraphNode node_[kNumRoles] = {nullptr, nullptr, nullptr};
  // Kernel parameter storage (the graph reads it when params are set): 13 pointers, tokens, clamp.
  PointerParams ptrs_{};
  int32_t tokens_ = 0;
  float clamp_ = 0.0f;
  void* param_ptrs_[kNumPointerParams + 2] = {};
  int32_t stall_applied_ = -1;
  bool exec_params_set_ = false;  // the instantiated graph's nodes hold ptrs_
};

// Test hooks and counters, reachable through ctypes.
int64_t GraphInstantiations();
void SetStallExpert(int32_t e);

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_GC_RUNTIME_H_
