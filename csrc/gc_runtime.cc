// The GC-MoE CUDA runtime; see gc_runtime.h.

#include "gc_runtime.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

namespace gcmoe {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

std::map<std::string, std::shared_ptr<const VariantSpec>>& Registry() {
  static auto* r = new std::map<std::string, std::shared_ptr<const VariantSpec>>;
  return *r;
}

std::atomic<int64_t> g_graph_instantiations{0};
std::atomic<int32_t> g_stall_expert{-1};

// Restores the thread's stream-capture mode on scope exit. Setup (allocation, library loads, green contexts) must
// not be refused because XLA is capturing on another stream: relaxed mode permits it for this thread.
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(const CudaDriver& cu) : cu_(cu) {
    mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
    ok_ = cu_.cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
  }
  ~RelaxedCaptureMode() {
    if (ok_) cu_.cuThreadExchangeStreamCaptureMode(&mode_);
  }

 private:
  const CudaDriver& cu_;
  CUstreamCaptureMode mode_;
  bool ok_ = false;
};

// Makes `ctx` current for the scope (the driver calls below act on the current context).
class ScopedContext {
 public:
  ScopedContext(const CudaDriver& cu, CUcontext ctx) : cu_(cu), status_(cu.cuCtxPushCurrent(ctx)) {}
  ~ScopedContext() {
    CUcontext popped;
    if (status_ == CUDA_SUCCESS) cu_.cuCtxPopCurrent(&popped);
  }
  CUresult status() const { return status_; }

 private:
  const CudaDriver& cu_;
  CUresult status_;
};

}  // namespace

#define GCMOE_CU(expr)                                                     \
  do {                                                                     \
    CUresult gcmoe_rc_ = (expr);                                           \
    if (gcmoe_rc_ != CUDA_SUCCESS)                                         \
      return CudaErrorMessage(cu_, gcmoe_rc_, #expr, __FILE__, __LINE__);  \
  } while (0)

void RegisterVariant(const std::string& key, std::shared_ptr<const VariantSpec> spec) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[key] = std::move(spec);
}

std::shared_ptr<const VariantSpec> FindVariant(const std::string& key) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(key);
  return it == Registry().end() ? nullptr : it->second;
}

int64_t GraphInstantiations() { return g_graph_instantiations.load(); }
void SetStallExpert(int32_t e) { g_stall_expert.store(e); }

std::unique_ptr<Runtime> Runtime::Create(const CudaDriver& cu, std::shared_ptr<const VariantSpec> spec,
                                         CUstream stream, int64_t tokens, float clamp, std::string* error) {
  std::unique_ptr<Runtime> rt(new Runtime(cu));
  RelaxedCaptureMode relaxed(cu);
  *error = rt->Init(std::move(spec), stream, tokens, clamp);
  if (!error->empty()) return nullptr;
  return rt;
}

std::string Runtime::Init(std::shared_ptr<const VariantSpec> spec, CUstream stream, int64_t tokens, float clamp) {
  spec_ = std::move(spec);
  const VariantSpec& s = *spec_;
  if (tokens > s.capacity) {
    return "gcmoe_moe: T = " + std::to_string(tokens) + " exceeds the kernel variant's token capacity " +
           std::to_string(s.capacity);
  }
  GCMOE_CU(cu_.cuStreamGetCtx(stream, &primary_));
  ScopedContext current(cu_, primary_);
  GCMOE_CU(current.status());
  GCMOE_CU(cu_.cuCtxGetDevice(&device_));

  // ---- Green contexts: ONE split call; the compute partition is the aligned group (eq. 5), dispatch the rest.
  CUdevResource all{};
  GCMOE_CU(cu_.cuDeviceGetDevResource(device_, &all, CU_DEV_RESOURCE_TYPE_SM));
  partition_.total_sms = all.sm.smCount;
  partition_.alignment = std::max(1u, all.sm.smCoscheduledAlignment);
  const unsigned a = partition_.alignment;
  const unsigned requested = static_cast<unsigned>(std::max<int64_t>(1, s.dispatch_sms));
  if (requested >= partition_.total_sms) {
    return "gcmoe_moe: dispatch SMs (GC_MOE_SM120_DISPATCH_SMS) = " + std::to_string(requested) +
           " leaves no compute partition on a device with " + std::to_string(partition_.total_sms) + " SMs";
  }
  const unsigned compute = (partition_.total_sms - requested) / a * a;
  if (compute < 32 || compute % 2 != 0 || partition_.total_sms - compute < 2) {
    return "gcmoe_moe: the green-context split of " + std::to_string(partition_.total_sms) + " SMs (alignment " +
           std::to_string(a) + ", " + std::to_string(requested) + " dispatch SMs requested) gives S_compute = " +
           std::to_string(compute) + ", S_dispatch = " + std::to_string(partition_.total_sms - compute) +
           "; eq. 5 needs S_compute >= 32 and even, S_dispatch > 1";
  }
  CUdevResource groups[1]{};
  CUdevResource rest{};
  unsigned nb = 1;
  GCMOE_CU(cu_.cuDevSmResourceSplitByCount(groups, &nb, &all, &rest, 0, compute));
  if (nb != 1 || groups[0].sm.smCount < compute) {
    return "gcmoe_moe: cuDevSmResourceSplitByCount gave " + std::to_string(nb) + " group(s) of " +
           std::to_string(groups[0].sm.smCount) + " SMs for a compute partition of " + std::to_string(compute);
  }
  partition_.compute_sms = groups[0].sm.smCount;
  partition_.dispatch_sms = rest.sm.smCount;
  if (s.planned_compute_sms != 0 && s.planned_compute_sms != partition_.compute_sms) {
    return "gcmoe_moe: the driver split the device into " + std::to_string(partition_.compute_sms) +
           " compute SMs, but gcmoe_jax.geometry planned " + std::to_string(s.planned_compute_sms) +
           " (device facts differ from the geometry's: check `python -m gcmoe_jax doctor`)";
  }
  CUdevResourceDesc desc[2];
  GCMOE_CU(cu_.cuDevResourceGenerateDesc(&desc[0], &rest, 1));
  GCMOE_CU(cu_.cuDevResourceGenerateDesc(&desc[1], &groups[0], 1));
  for (int g = 0; g < 2; ++g) {
    GCMOE_CU(cu_.cuGreenCtxCreate(&green_[g], desc[g], device_, CU_GREEN_CTX_DEFAULT_STREAM));
  }
  CUcontext dispatch_ctx, compute_ctx;
  GCMOE_CU(cu_.cuCtxFromGreenCtx(&dispatch_ctx, green_[0]));
  GCMOE_CU(cu_.cuCtxFromGreenCtx(&compute_ctx, green_[1]));
  role_ctx_[0] = dispatch_ctx;
  role_ctx_[1] = compute_ctx;
  role_ctx_[2] = primary_;  // finalize runs after both roles: the whole device is free

  // ---- Cubins and the residency check (eq. 6) at the exact launch configuration.
  const unsigned role_sms[kNumRoles] = {partition_.dispatch_sms, partition_.compute_sms, partition_.total_sms};
  // A grid of 0 in the spec means: role 1 one CTA, role 2 one CTA per compute SM, role 3 one CTA per token.
  const unsigned auto_grid[kNumRoles] = {1u, partition_.compute_sms, static_cast<unsigned>(std::max<int64_t>(1, tokens))};
  for (int r = 0; r < kNumRoles; ++r) {
    RoleSpec& role = launch_[r];
    role = s.role[r];
    role.cubin.clear();
    if (role.grid == 0) role.grid = auto_grid[r];
    GCMOE_CU(cu_.cuLibraryLoadData(&library_[r], s.role[r].cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
    unsigned count = 0;
    GCMOE_CU(cu_.cuLibraryGetKernelCount(&count, library_[r]));
    if (count != 1) {
      return "gcmoe_moe: the role " + std::to_string(r + 1) + " cubin holds " + std::to_string(count) +
             " kernels, expected exactly 1";
    }
    GCMOE_CU(cu_.cuLibraryEnumerateKernels(&kernel_[r], 1, library_[r]));
    CUfunction fn;
    GCMOE_CU(cu_.cuKernelGetFunction(&fn, kernel_[r]));
    if (role.smem > 48 * 1024) {
      GCMOE_CU(cu_.cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, role.smem, kernel_[r],
                                        device_));
    }
    int per_sm = 0;
    GCMOE_CU(cu_.cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, role.block, role.smem));
    const int64_t resident = static_cast<int64_t>(per_sm) * role_sms[r];
    if (role.grid == 0 || role.grid > resident) {
      return "gcmoe_moe: role " + std::to_string(r + 1) + " grid of " + std::to_string(role.grid) +
             " CTAs cannot be resident: " + std::to_string(per_sm) + " CTA(s) per SM at " +
             std::to_string(role.block) + " threads and " + std::to_string(role.smem) + " B dynamic SMEM x " +
             std::to_string(role_sms[r]) + " SMs = " + std::to_string(resident) + " (eq. 6)";
    }
  }

  // ---- Workspace: header (epoch 0, timeout, stall hook), silu table; the rest needs no initial value (epochs).
  GCMOE_CU(cu_.cuMemAlloc(&workspace_, static_cast<size_t>(s.ws_total)));
  GCMOE_CU(cu_.cuMemsetD8(workspace_, 0, static_cast<size_t>(s.ws_total)));
  WorkspaceHeader header{};
  header.timeout_ns = s.timeout_ns;
  header.stall_expert = -1;
  GCMOE_CU(cu_.cuMemcpyHtoD(workspace_, &header, sizeof(header)));
  GCMOE_CU(cu_.cuMemcpyHtoD(workspace_ + s.ws_silu_table, s.silu_table.data(), s.silu_table.size() * sizeof(float)));
  void* host = nullptr;
  GCMOE_CU(cu_.cuMemHostAlloc(&host, sizeof(WorkspaceHeader), CU_MEMHOSTALLOC_PORTABLE));
  host_header_ = static_cast<WorkspaceHeader*>(host);
  std::memset(host_header_, 0, sizeof(WorkspaceHeader));

  // ---- The graph: roles 1 and 2 concurrent roots, role 3 after both, then the header mirror.
  tokens_ = static_cast<int32_t>(tokens);
  clamp_ = clamp;
  for (int p = 0; p < kNumPointerParams; ++p) param_ptrs_[p] = &ptrs_[p];
  param_ptrs_[kNumPointerParams] = &tokens_;
  param_ptrs_[kNumPointerParams + 1] = &clamp_;
  ptrs_[12] = workspace_;
  GCMOE_CU(cu_.cuGraphCreate(&graph_, 0));
  for (int r = 0; r < kNumRoles; ++r) {
    const CUDA_KERNEL_NODE_PARAMS p = NodeParams(r);
    const CUgraphNode* deps = r == 2 ? node_ : nullptr;
    GCMOE_CU(cu_.cuGraphAddKernelNode(&node_[r], graph_, deps, r == 2 ? 2 : 0, &p));
  }
  CUDA_MEMCPY3D copy{};
  copy.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  copy.srcDevice = workspace_;
  copy.dstMemoryType = CU_MEMORYTYPE_HOST;
  copy.dstHost = host_header_;
  copy.WidthInBytes = sizeof(WorkspaceHeader);
  copy.srcPitch = copy.dstPitch = sizeof(WorkspaceHeader);
  copy.Height = 1;
  copy.Depth = 1;
  CUgraphNode mirror;
  GCMOE_CU(cu_.cuGraphAddMemcpyNode(&mirror, graph_, &node_[2], 1, &copy, primary_));
  GCMOE_CU(cu_.cuGraphInstantiate(&exec_, graph_, 0));
  g_graph_instantiations.fetch_add(1);
  return "";
}

Runtime::~Runtime() {
  if (primary_ == nullptr) return;  // Init failed before it owned anything
  ScopedContext current(cu_, primary_);
  if (exec_) cu_.cuGraphExecDestroy(exec_);
  if (graph_) cu_.cuGraphDestroy(graph_);
  for (CUlibrary lib : library_)
    if (lib) cu_.cuLibraryUnload(lib);
  if (workspace_) cu_.cuMemFree(workspace_);
  if (host_header_) cu_.cuMemFreeHost(host_header_);
  for (CUgreenCtx g : green_)
    if (g) cu_.cuGreenCtxDestroy(g);
}

CUDA_KERNEL_NODE_PARAMS Runtime::NodeParams(int r) {
  CUDA_KERNEL_NODE_PARAMS p{};
  p.func = nullptr;  // must be null, or ctx is ignored (research/cuda_details.md §1.4)
  p.kern = kernel_[r];
  p.ctx = role_ctx_[r];
  p.gridDimX = launch_[r].grid;
  p.gridDimY = p.gridDimZ = 1;
  p.blockDimX = launch_[r].block;
  p.blockDimY = p.blockDimZ = 1;
  p.sharedMemBytes = launch_[r].smem;
  p.kernelParams = param_ptrs_;
  return p;
}

std::string Runtime::SetParams(const PointerParams& ptrs, bool exec) {
  for (int p = 0; p < kNumPointerParams; ++p) ptrs_[p] = p == 12 ? workspace_ : ptrs[p];
  for (int r = 0; r < kNumRoles; ++r) {
    const CUDA_KERNEL_NODE_PARAMS p = NodeParams(r);
    if (exec) {
      GCMOE_CU(cu_.cuGraphExecKernelNodeSetParams(exec_, node_[r], &p));
    } else {
      GCMOE_CU(cu_.cuGraphKernelNodeSetParams(node_[r], &p));
    }
  }
  return "";
}

// A fault recorded by an earlier replay (the pinned header mirror is written by the graph's last node, so reading it
// needs no synchronisation; it may lag by the calls still in flight). Clears the fault on host and device.
std::string Runtime::CheckFault(CUstream stream) {
  volatile WorkspaceHeader* h = host_header_;
  if (h->error_flag == 0) return "";
  std::string msg = "gcmoe_moe: a role kernel fault was recorded on device " + std::to_string(device_) + ": role " +
                    std::to_string(h->error_role) + ", block " + std::to_string(h->error_block) + ", epoch " +
                    std::to_string(h->error_epoch) + ", counter " + std::to_string(h->error_counter) +
                    ", observed " + std::to_string(h->error_observed);
  if (h->error_role == 1) {
    msg += " (role 1 read expert id " + std::to_string(static_cast<int32_t>(h->error_counter)) +
           ", outside [0, E): routes.ids must be < E)";
  } else {
    msg += " (a spin-wait exceeded its bound of " + std::to_string(spec_->timeout_ns / 1000000) +
           " ms, GCMOE_WAIT_TIMEOUT_MS; the outputs of that call were set to NaN)";
  }
  h->error_flag = 0;
  const uint32_t zero = 0;
  GCMOE_CU(cu_.cuMemcpyHtoDAsync(workspace_ + offsetof(WorkspaceHeader, error_flag), &zero, sizeof(zero), stream));
  return msg;
}

std::string Runtime::SyncAndCheck(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  GCMOE_CU(cu_.cuStreamGetCaptureInfo(stream, &status, nullptr, nullptr, nullptr, nullptr, nullptr));
  if (status == CU_STREAM_CAPTURE_STATUS_ACTIVE) return "";  // nothing ran yet: the capture is replayed later
  GCMOE_CU(cu_.cuStreamSynchronize(stream));
  return CheckFault(stream);
}

std::string Runtime::Execute(CUstream stream, const PointerParams& ptrs) {
  ScopedContext current(cu_, primary_);  // the synchronous test-hook copy below needs the device's context
  GCMOE_CU(current.status());
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  CUgraph capture_graph = nullptr;
  const CUgraphNode* deps = nullptr;
  const CUgraphEdgeData* edges = nullptr;
  size_t ndeps = 0;
  GCMOE_CU(cu_.cuStreamGetCaptureInfo(stream, &status, nullptr, &capture_graph, &deps, &edges, &ndeps));
  const bool capturing = status == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  if (!capturing) {
    std::string fault = CheckFault(stream);
    if (!fault.empty()) return fault;
    const int32_t stall = g_stall_expert.load();
    if (stall != stall_applied_) {  // test hook: role 1 withholds this expert
      static thread_local int32_t value;
      value = stall;
      GCMOE_CU(cu_.cuMemcpyHtoD(workspace_ + offsetof(WorkspaceHeader, stall_expert), &value, sizeof(value)));
      stall_applied_ = stall;
    }
  }
  if (capturing) {
    // cuGraphLaunch on a capturing stream fails and invalidates XLA's capture: splice the graph in as a child node
    // (its parameters are baked in; XLA re-traces when buffer addresses change).
    std::string err = SetParams(ptrs, /*exec=*/false);
    exec_params_set_ = false;  // ptrs_ now describes the template graph, not the instantiated one
    if (!err.empty()) return err;
    CUgraphNode child;
    GCMOE_CU(cu_.cuGraphAddChildGraphNode(&child, capture_graph, deps, ndeps, graph_));
    GCMOE_CU(cu_.cuStreamUpdateCaptureDependencies(stream, &child, nullptr, 1, CU_STREAM_SET_CAPTURE_DEPENDENCIES));
    return "";
  }
  // Parameter updates cost microseconds per node: skip them when XLA hands back the same buffers (steady state).
  PointerParams want = ptrs;
  want[12] = workspace_;
  if (!exec_params_set_ || want != ptrs_) {
    std::string err = SetParams(ptrs, /*exec=*/true);
    if (!err.empty()) return err;
    exec_params_set_ = true;
  }
  GCMOE_CU(cu_.cuGraphLaunch(exec_, stream));
  return "";
}

#undef GCMOE_CU

}  // namespace gcmoe

// ---- ctypes entry points ------------------------------------------------------------------------------------------

#include "common.h"

namespace {
void CopyError(const std::string& why, char* error, int error_size) {
  if (error == nullptr || error_size <= 0) return;
  const size_t n = std::min(why.size(), static_cast<size_t>(error_size - 1));
  why.copy(error, n);
  error[n] = '\0';
}
}  // namespace

// Registers a kernel variant under `key` (gcmoe_jax/ffi/_cuda.py). `config`: capacity, dispatch_sms, timeout_ns,
// ws_total, ws_silu_table (5 int64); `launch`: (grid, block, dynamic smem) of roles 1, 2, 3 (9 uint32); the three
// cubins; the silu table (65536 float32). Returns 0, or -1 with the reason in `error`.
GCMOE_EXPORT int gcmoe_register_variant(const char* key, const int64_t* config, int num_config,
                                        const uint32_t* launch, const void* cubin1, int64_t size1,
                                        const void* cubin2, int64_t size2, const void* cubin3, int64_t size3,
                                        const float* silu_table, int64_t silu_entries, char* error, int error_size) {
  if ((num_config != 5 && num_config != 6) || silu_entries != 65536) {
    CopyError("gcmoe_register_variant: expected 5 or 6 config values and 65536 silu entries, got " +
                  std::to_string(num_config) + " and " + std::to_string(silu_entries),
              error, error_size);
    return -1;
  }
  auto spec = std::make_shared<gcmoe::VariantSpec>();
  spec->capacity = config[0];
  spec->dispatch_sms = config[1];
  spec->timeout_ns = static_cast<uint64_t>(config[2]);
  spec->ws_total = config[3];
  spec->ws_silu_table = config[4];
  spec->planned_compute_sms = num_config > 5 ? config[5] : 0;
  const void* cubins[3] = {cubin1, cubin2, cubin3};
  const int64_t sizes[3] = {size1, size2, size3};
  for (int r = 0; r < gcmoe::kNumRoles; ++r) {
    auto* bytes = static_cast<const uint8_t*>(cubins[r]);
    spec->role[r].cubin.assign(bytes, bytes + sizes[r]);
    spec->role[r].grid = launch[3 * r];
    spec->role[r].block = launch[3 * r + 1];
    spec->role[r].smem = launch[3 * r + 2];
  }
  spec->silu_table.assign(silu_table, silu_table + silu_entries);
  gcmoe::RegisterVariant(key, std::move(spec));
  return 0;
}

// How many graphs were instantiated in this process (tests: one per shape and device, never per call).
GCMOE_EXPORT int64_t gcmoe_graph_instantiations() { return gcmoe::GraphInstantiations(); }

// Test hook: role 1 of every later call never publishes expert `e` (-1: off), so role 2 times out.
GCMOE_EXPORT void gcmoe_debug_set_stall_expert(int32_t e) { gcmoe::SetStallExpert(e); }
