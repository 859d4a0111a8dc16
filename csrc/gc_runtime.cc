// The GC-MoE CUDA runtime; see gc_runtime.h.

#include "gc_runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

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
std::atomic<int64_t> g_live_runtimes{0};
// Test hook: (device ordinal or -1 for every device) << 32 | expert (-1: off), one word so a reader never sees a
// device from one call and an expert from another.
std::atomic<int64_t> g_stall{-1};

// The workspace of the most recently initialised Runtime (debug hook: `gcmoe_debug_read_workspace`).
struct LastWorkspace {
  CUcontext ctx = nullptr;
  CUdeviceptr ptr = 0;
  int64_t bytes = 0;
};
std::mutex g_last_mutex;
LastWorkspace g_last;

// Faults found by the runtimes of this process. When the process drives several devices (one process, several ranks
// of an expert-parallel mesh), a rank that stopped at its call while its peers went on into the step's collectives
// would leave them waiting in XLA's all-to-all for ever. So a fault found at a device's n-th call is reported by the
// next call of every device that has run more than n calls, and by none before: ranks of one SPMD program make
// their calls in step (runs start with a rendezvous of the local devices), so they all stop at the same call, after
// the dispatch exchange and before the combine. A process that drives one device reports at once.
struct FaultBoard {
  std::mutex mu;
  std::map<int, int64_t> calls;     // per device: calls made
  std::map<int, int64_t> reported;  // per device: the generation it last reported
  int64_t generation = 0;           // faults published
  int64_t at_call = 0;              // the publishing device's call count at the newest fault
  int origin = -1;
  std::string message;
};

FaultBoard& Board() {
  static auto* b = new FaultBoard;
  return *b;
}

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

#define GCMOE_CU(expr) GCMOE_CU_OR_RETURN(cu_, expr, #expr)

void RegisterVariant(const std::string& key, std::shared_ptr<VariantSpec> spec) {
  Sha256 sha;
  sha.Add(spec->capacity).Add(spec->dispatch_sms).Add(spec->timeout_ns).Add(spec->ws_total).Add(spec->ws_silu_table);
  sha.Add(spec->planned_compute_sms).Add(spec->ranks).Add(spec->finalize_early_tokens);
  sha.Add(spec->solo_tokens).Add(spec->solo_blocks).Add(spec->solo_all_sms).Add(spec->graph_on_stream);
  for (int32_t d : spec->peer_devices) sha.Add(d);
  for (const TensorMapSpec& m : spec->tensormaps) {
    sha.Add(m.param).Add(m.dtype).Add(m.dim0).Add(m.dim1).Add(m.row_stride).Add(m.box0).Add(m.box1).Add(m.swizzle);
  }
  for (const RoleSpec& r : spec->role) {
    sha.Add(r.grid).Add(r.block).Add(r.smem);
    sha.Add(Sha256().Update(r.cubin.data(), r.cubin.size()).Finish());
  }
  sha.Add(Sha256().Update(spec->silu_table.data(), spec->silu_table.size() * sizeof(float)).Finish());
  spec->digest = sha.Finish();
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[key] = std::move(spec);
}

std::shared_ptr<const VariantSpec> FindVariant(const std::string& key) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(key);
  return it == Registry().end() ? nullptr : it->second;
}

int64_t GraphInstantiations() { return g_graph_instantiations.load(); }
int64_t LiveRuntimes() { return g_live_runtimes.load(); }
void SetStallExpert(int32_t e, int32_t device) {
  g_stall.store(static_cast<int64_t>(static_cast<uint64_t>(static_cast<uint32_t>(device)) << 32 |
                                     static_cast<uint32_t>(e)));
}

namespace {

// The expert the stall hook withholds on `device` (-1: none).
int32_t StallExpertFor(int device) {
  const int64_t v = g_stall.load();
  const int32_t target = static_cast<int32_t>(v >> 32), e = static_cast<int32_t>(v & 0xffffffff);
  return target < 0 || target == device ? e : -1;
}

// The dispatch/compute green-context pair of one (device, requested dispatch SMs), made with ONE split call and kept
// for the process: every Runtime on that device and split uses it, and none destroys it, because the driver (580)
// does not give back ~8.4 MB of device memory per destroyed pair (measured: scratch probe, docs/reliability.md).
struct GreenPair {
  Partition partition;
  CUgreenCtx green[2] = {nullptr, nullptr};
  CUcontext ctx[2] = {nullptr, nullptr};  // dispatch, compute
  // Debug (GCMOE_DEBUG_WHOLE_GREEN=1): a third green context holding every SM, for the nodes the runtime otherwise
  // puts on the stream's own context; null without the switch.
  CUgreenCtx whole_green = nullptr;
  CUcontext whole = nullptr;
};

// GCMOE_DEBUG_WHOLE_GREEN=1 (read once): where the runtime puts a node on the stream's own context (role 2 alone
// over every SM; GCMOE_GRAPH_CONTEXT=stream), a green context of every SM takes it instead: the same SMs, a green
// context's launch, so that a timing tells the context switch from the SM count.
bool WholeGreenDebug() {
  static const bool on = [] {
    const char* v = std::getenv("GCMOE_DEBUG_WHOLE_GREEN");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

std::mutex& GreenMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

std::string SplitDevice(const CudaDriver& cu_, CUdevice device, unsigned requested, GreenPair* out) {
  GreenPair& g = *out;
  CUdevResource all{};
  GCMOE_CU(cu_.cuDeviceGetDevResource(device, &all, CU_DEV_RESOURCE_TYPE_SM));
  g.partition.total_sms = all.sm.smCount;
  g.partition.alignment = std::max(1u, all.sm.smCoscheduledAlignment);
  const unsigned a = g.partition.alignment;
  if (requested >= g.partition.total_sms) {
    return "gcmoe_moe: dispatch SMs (GC_MOE_SM120_DISPATCH_SMS) = " + std::to_string(requested) +
           " leaves no compute partition on a device with " + std::to_string(g.partition.total_sms) + " SMs";
  }
  const unsigned compute = (g.partition.total_sms - requested) / a * a;
  if (compute < 32 || compute % 2 != 0 || g.partition.total_sms - compute < 2) {
    return "gcmoe_moe: the green-context split of " + std::to_string(g.partition.total_sms) + " SMs (alignment " +
           std::to_string(a) + ", " + std::to_string(requested) + " dispatch SMs requested) gives S_compute = " +
           std::to_string(compute) + ", S_dispatch = " + std::to_string(g.partition.total_sms - compute) +
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
  g.partition.compute_sms = groups[0].sm.smCount;
  g.partition.dispatch_sms = rest.sm.smCount;
  CUdevResourceDesc desc[2];
  GCMOE_CU(cu_.cuDevResourceGenerateDesc(&desc[0], &rest, 1));
  GCMOE_CU(cu_.cuDevResourceGenerateDesc(&desc[1], &groups[0], 1));
  for (int i = 0; i < 2; ++i) {
    GCMOE_CU(cu_.cuGreenCtxCreate(&g.green[i], desc[i], device, CU_GREEN_CTX_DEFAULT_STREAM));
    GCMOE_CU(cu_.cuCtxFromGreenCtx(&g.ctx[i], g.green[i]));
  }
  if (WholeGreenDebug()) {
    CUdevResourceDesc whole;
    GCMOE_CU(cu_.cuDevResourceGenerateDesc(&whole, &all, 1));
    GCMOE_CU(cu_.cuGreenCtxCreate(&g.whole_green, whole, device, CU_GREEN_CTX_DEFAULT_STREAM));
    GCMOE_CU(cu_.cuCtxFromGreenCtx(&g.whole, g.whole_green));
  }
  return "";
}

// The process's pair for (device, requested), created on first use.
std::string AcquireGreenPair(const CudaDriver& cu, CUdevice device, unsigned requested, const GreenPair** out) {
  std::lock_guard<std::mutex> lock(GreenMutex());
  static auto* pairs = new std::map<std::pair<CUdevice, unsigned>, std::unique_ptr<GreenPair>>;
  auto& slot = (*pairs)[{device, requested}];
  if (slot == nullptr) {
    auto g = std::make_unique<GreenPair>();
    std::string err = SplitDevice(cu, device, requested, g.get());
    if (!err.empty()) {
      for (CUgreenCtx gc : {g->green[0], g->green[1], g->whole_green})
        if (gc) cu.cuGreenCtxDestroy(gc);
      pairs->erase({device, requested});
      return err;
    }
    slot = std::move(g);
  }
  *out = slot.get();
  return "";
}

// A process-wide cache of weak references (the last user of an entry frees it), never destroyed at exit.
template <typename T>
struct WeakCache {
  std::mutex mutex;
  std::map<Digest, std::weak_ptr<T>> entries;

  static WeakCache& Instance() {
    static auto* c = new WeakCache;
    return *c;
  }
};

WeakCache<Runtime>& Cache() { return WeakCache<Runtime>::Instance(); }

}  // namespace

namespace {

// Zeroes the workspace `ws` of variant `s` and writes its header (`header` with epoch 0, the spin bound, and no stalled
// expert) and the silu table; the rest needs no initial value (epochs). `first_timeout_ns`: a longer bound for the
// waits of the first call, for a fused variant only (its role 3 of that call sets header.timeout_ns to the steady
// one). Runs in `ws`'s context.
std::string InitWorkspace(const CudaDriver& cu, CUdeviceptr ws, const VariantSpec& s, WorkspaceHeader header,
                          uint64_t first_timeout_ns = 0) {
  header.timeout_ns = std::max(s.timeout_ns, first_timeout_ns);
  header.steady_timeout_ns = s.timeout_ns;
  header.stall_expert = -1;
  GCMOE_CU_OR_RETURN(cu, cu.cuMemsetD8(ws, 0, static_cast<size_t>(s.ws_total)), "cuMemsetD8(workspace)");
  GCMOE_CU_OR_RETURN(cu, cu.cuMemcpyHtoD(ws, &header, sizeof(header)), "cuMemcpyHtoD(workspace header)");
  GCMOE_CU_OR_RETURN(cu, cu.cuMemcpyHtoD(ws + s.ws_silu_table, s.silu_table.data(),
                                         s.silu_table.size() * sizeof(float)),
                     "cuMemcpyHtoD(silu table)");
  return "";
}

}  // namespace

// ---- The fused transport's peer groups (one process driving several GPUs) -----------------------------------------

// The R workspaces of one group of the fused transport (docs/fused_transport.md), one on each of its devices,
// allocated and initialised together when the group's first rank runs: a rank's kernels read and write its peers'
// workspaces from their first call on, so every workspace (zeroed, header with its rank and the peer table, silu
// table) must exist before any rank launches. Peer access is enabled between every pair; a pair without it fails
// with a message naming the devices.
//
// Across processes (CUDA IPC; one device per process in a group, registered as -(1 + its process index) for the
// others): this process's rank allocates and initialises its own workspace and exports its IPC handle (ExportIpc),
// the processes exchange the handles before the first call (gcmoe_jax.ffi, through jax.distributed's key-value
// store: a handle is published only after its workspace was initialised), and ConnectIpc opens every peer's and
// writes the peer table. The runtime then finds the group by (variant, device). Such a group lives until the job
// releases it collectively (SynchronizeIpc, a barrier between the processes, RetireIpc: the peers may read its
// workspace as long as they run, and only they can say when they stop), else until the process exits.
class PeerGroup {
 public:
  static std::shared_ptr<PeerGroup> Get(const CudaDriver& cu, const std::shared_ptr<const VariantSpec>& spec,
                                        const std::vector<int32_t>& ordinals, std::string* error);
  static std::string ExportIpc(const CudaDriver& cu, const VariantSpec& spec, int ordinal, int rank,
                               uint64_t first_timeout_ns, CUipcMemHandle* handle);
  static std::string ConnectIpc(const VariantSpec& spec, int ordinal, const std::vector<CUipcMemHandle>& handles);
  static std::shared_ptr<PeerGroup> FindIpc(const VariantSpec& spec, int ordinal, int rank, std::string* error);
  // Waits for this process's work on the devices of its groups across processes; "" or the driver's error.
  static std::string SynchronizeIpc();
  // Retires every group across processes (after every process synchronised, gcmoe_jax.release_fused_workspaces):
  // their runtimes refuse further calls, and each group's memory is freed with the last runtime that holds it.
  // Returns how many were retired.
  static int RetireIpc();
  ~PeerGroup();
  bool retired() const { return retired_.load(std::memory_order_acquire); }
  CUdeviceptr workspace(int rank) const { return ws_[rank]; }
  // The spin bound of the group's first call (the variant's own outside groups across processes).
  uint64_t first_timeout_ns() const { return first_timeout_ns_; }

 private:
  explicit PeerGroup(const CudaDriver& cu) : cu_(cu) {}
  std::string Init(const VariantSpec& s, const std::vector<int32_t>& ordinals);
  using IpcKey = std::pair<Digest, int>;  // (variant digest, this process's device ordinal)
  static std::map<IpcKey, std::shared_ptr<PeerGroup>>& IpcGroups();  // guarded by IpcMutex()
  static std::mutex& IpcMutex();

  const CudaDriver& cu_;
  std::vector<CUdevice> device_;
  std::vector<CUcontext> primary_;  // retained for the group's life
  std::vector<CUdeviceptr> ws_;
  int ipc_rank_ = -1;      // across processes: this process's rank (its workspace is the one allocated here)
  bool connected_ = false;  // across processes: the peers' workspaces are open and the peer table written
  uint64_t first_timeout_ns_ = 0;
  std::atomic<bool> retired_{false};  // across processes: released collectively; no call may use it any more
};

std::shared_ptr<PeerGroup> PeerGroup::Get(const CudaDriver& cu, const std::shared_ptr<const VariantSpec>& spec,
                                          const std::vector<int32_t>& ordinals, std::string* error) {
  Sha256 sha;
  sha.Add(spec->digest);
  for (int32_t d : ordinals) sha.Add(d);
  const Digest key = sha.Finish();
  WeakCache<PeerGroup>& cache = WeakCache<PeerGroup>::Instance();
  std::lock_guard<std::mutex> lock(cache.mutex);  // the group's other ranks wait here until it is complete
  if (auto hit = cache.entries[key].lock()) return hit;
  std::shared_ptr<PeerGroup> group(new PeerGroup(cu));
  *error = group->Init(*spec, ordinals);
  if (!error->empty()) {
    cache.entries.erase(key);
    return nullptr;
  }
  cache.entries[key] = group;
  return group;
}

std::string PeerGroup::Init(const VariantSpec& s, const std::vector<int32_t>& ordinals) {
  const size_t r = ordinals.size();
  first_timeout_ns_ = s.timeout_ns;  // the group's ranks start together (one process)
  device_.assign(r, 0);
  primary_.assign(r, nullptr);
  ws_.assign(r, 0);
  for (size_t p = 0; p < r; ++p) {
    GCMOE_CU(cu_.cuDeviceGet(&device_[p], ordinals[p]));
    GCMOE_CU(cu_.cuDevicePrimaryCtxRetain(&primary_[p], device_[p]));
  }
  for (size_t p = 0; p < r; ++p) {
    ScopedContext current(cu_, primary_[p]);
    GCMOE_CU(current.status());
    for (size_t q = 0; q < r; ++q) {
      if (q == p) continue;
      int can = 0;
      GCMOE_CU(cu_.cuDeviceCanAccessPeer(&can, device_[p], device_[q]));
      if (!can) {
        return "gcmoe_moe: the fused transport needs peer access between the GPUs of a group, and device " +
               std::to_string(ordinals[p]) + " cannot access device " + std::to_string(ordinals[q]) +
               " (cuDeviceCanAccessPeer); use transport='collective'";
      }
      const CUresult rc = cu_.cuCtxEnablePeerAccess(primary_[q], 0);
      if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
        return CudaErrorMessage(cu_, rc, "cuCtxEnablePeerAccess", __FILE__, __LINE__);
      }
    }
    GCMOE_CU(cu_.cuMemAlloc(&ws_[p], static_cast<size_t>(s.ws_total)));
  }
  WorkspaceHeader header{};
  for (size_t p = 0; p < r; ++p) header.peers[p] = ws_[p];
  for (size_t p = 0; p < r; ++p) {
    ScopedContext current(cu_, primary_[p]);
    GCMOE_CU(current.status());
    header.rank = static_cast<uint32_t>(p);
    std::string err = InitWorkspace(cu_, ws_[p], s, header);
    if (!err.empty()) return err;
  }
  return "";
}

PeerGroup::~PeerGroup() {
  if (ipc_rank_ >= 0) {  // the peers' workspaces were opened in this rank's context
    const size_t me = static_cast<size_t>(ipc_rank_);
    if (primary_[me] == nullptr) return;
    {
      ScopedContext current(cu_, primary_[me]);
      for (size_t p = 0; p < ws_.size(); ++p) {
        if (ws_[p] == 0) continue;
        if (p == me) {
          cu_.cuMemFree(ws_[p]);
        } else {
          cu_.cuIpcCloseMemHandle(ws_[p]);
        }
      }
    }
    cu_.cuDevicePrimaryCtxRelease(device_[me]);
    return;
  }
  for (size_t p = 0; p < primary_.size(); ++p) {
    if (primary_[p] == nullptr) continue;
    {
      ScopedContext current(cu_, primary_[p]);
      if (ws_[p]) cu_.cuMemFree(ws_[p]);
    }
    cu_.cuDevicePrimaryCtxRelease(device_[p]);
  }
}

std::map<PeerGroup::IpcKey, std::shared_ptr<PeerGroup>>& PeerGroup::IpcGroups() {
  static auto* groups = new std::map<IpcKey, std::shared_ptr<PeerGroup>>;  // never destroyed: see the class comment
  return *groups;
}

std::mutex& PeerGroup::IpcMutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

std::string PeerGroup::ExportIpc(const CudaDriver& cu, const VariantSpec& s, int ordinal, int rank,
                                 uint64_t first_timeout_ns, CUipcMemHandle* handle) {
  if (s.ranks < 2 || rank < 0 || rank >= s.ranks) {
    return "gcmoe_ipc_export: rank " + std::to_string(rank) + " of a variant of R = " + std::to_string(s.ranks) +
           " ranks; expected R >= 2 and a rank in [0, R)";
  }
  std::lock_guard<std::mutex> lock(IpcMutex());
  const IpcKey key(s.digest, ordinal);
  auto found = IpcGroups().find(key);
  std::shared_ptr<PeerGroup> group = found == IpcGroups().end() ? nullptr : found->second;
  if (group != nullptr && group->ipc_rank_ != rank) {
    return "gcmoe_ipc_export: device " + std::to_string(ordinal) + " already exported this variant as rank " +
           std::to_string(group->ipc_rank_) + ", not " + std::to_string(rank);
  }
  if (group == nullptr) {
    std::shared_ptr<PeerGroup> g(new PeerGroup(cu));
    const auto& cu_ = cu;  // for GCMOE_CU
    const size_t r = static_cast<size_t>(s.ranks), me = static_cast<size_t>(rank);
    g->device_.assign(r, 0);
    g->primary_.assign(r, nullptr);
    g->ws_.assign(r, 0);
    g->ipc_rank_ = rank;
    GCMOE_CU(cu.cuDeviceGet(&g->device_[me], ordinal));
    GCMOE_CU(cu.cuDevicePrimaryCtxRetain(&g->primary_[me], g->device_[me]));
    ScopedContext current(cu, g->primary_[me]);
    GCMOE_CU(current.status());
    GCMOE_CU(cu.cuMemAlloc(&g->ws_[me], static_cast<size_t>(s.ws_total)));
    WorkspaceHeader header{};
    header.rank = static_cast<uint32_t>(rank);
    header.peers[me] = g->ws_[me];
    // A peer process may still be compiling or loading when this rank's first call waits for it.
    g->first_timeout_ns_ = std::max(first_timeout_ns, s.timeout_ns);
    std::string err = InitWorkspace(cu, g->ws_[me], s, header, g->first_timeout_ns_);
    if (!err.empty()) return err;  // ~PeerGroup frees what was allocated; the registry holds only complete groups
    IpcGroups()[key] = g;
    group = std::move(g);
  }
  const auto& cu_ = cu;
  ScopedContext current(cu, group->primary_[rank]);
  GCMOE_CU(current.status());
  GCMOE_CU(cu.cuIpcGetMemHandle(handle, group->ws_[rank]));
  return "";
}

std::string PeerGroup::ConnectIpc(const VariantSpec& s, int ordinal, const std::vector<CUipcMemHandle>& handles) {
  std::lock_guard<std::mutex> lock(IpcMutex());
  auto it = IpcGroups().find(IpcKey(s.digest, ordinal));
  if (it == IpcGroups().end()) {
    return "gcmoe_ipc_connect: device " + std::to_string(ordinal) + " exported no workspace of this variant "
           "(gcmoe_ipc_export first)";
  }
  PeerGroup& g = *it->second;
  if (handles.size() != g.ws_.size()) {
    return "gcmoe_ipc_connect: " + std::to_string(handles.size()) + " handles for a group of " +
           std::to_string(g.ws_.size()) + " ranks";
  }
  if (g.connected_) return "";
  const CudaDriver& cu_ = g.cu_;
  const size_t me = static_cast<size_t>(g.ipc_rank_);
  ScopedContext current(cu_, g.primary_[me]);
  GCMOE_CU(current.status());
  WorkspaceHeader header{};
  for (size_t p = 0; p < handles.size(); ++p) {
    if (p != me) {
      const CUresult rc = cu_.cuIpcOpenMemHandle(&g.ws_[p], handles[p], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      if (rc != CUDA_SUCCESS) {
        g.ws_[p] = 0;
        return CudaErrorMessage(cu_, rc, ("cuIpcOpenMemHandle(rank " + std::to_string(p) + "'s workspace)").c_str(),
                                __FILE__, __LINE__) +
               "; the fused transport across processes needs CUDA IPC between their GPUs: use transport='collective'";
      }
    }
    header.peers[p] = g.ws_[p];
  }
  GCMOE_CU(cu_.cuMemcpyHtoD(g.ws_[me] + offsetof(WorkspaceHeader, peers), header.peers,
                            handles.size() * sizeof(header.peers[0])));
  g.connected_ = true;
  return "";
}

std::string PeerGroup::SynchronizeIpc() {
  std::lock_guard<std::mutex> lock(IpcMutex());
  for (const auto& [key, g] : IpcGroups()) {
    const CudaDriver& cu_ = g->cu_;
    ScopedContext current(cu_, g->primary_[static_cast<size_t>(g->ipc_rank_)]);
    GCMOE_CU(current.status());
    GCMOE_CU(cu_.cuCtxSynchronize());  // the graphs launched on this device's streams, green-context nodes included
  }
  return "";
}

int PeerGroup::RetireIpc() {
  std::lock_guard<std::mutex> lock(IpcMutex());
  const int n = static_cast<int>(IpcGroups().size());
  for (const auto& [key, g] : IpcGroups()) g->retired_.store(true, std::memory_order_release);
  IpcGroups().clear();  // a later export of the same variant and device starts a new group
  return n;
}

std::shared_ptr<PeerGroup> PeerGroup::FindIpc(const VariantSpec& s, int ordinal, int rank, std::string* error) {
  std::lock_guard<std::mutex> lock(IpcMutex());
  auto it = IpcGroups().find(IpcKey(s.digest, ordinal));
  if (it == IpcGroups().end() || !it->second->connected_ || it->second->ipc_rank_ != rank) {
    *error = "gcmoe_moe: the fused transport's rank " + std::to_string(rank) + " on device " +
             std::to_string(ordinal) + " has peers in other processes, and their workspaces were not exchanged "
             "before this call (gcmoe_jax.ffi.moe_fused_call exchanges them when the call is lowered)";
    return nullptr;
  }
  return it->second;
}

// The group (of `spec->peer_devices`) holding `device` and its rank there; "" or why none.
std::string FindPeerGroup(const VariantSpec& spec, CUdevice device, std::vector<int32_t>* group, int* rank) {
  const size_t r = static_cast<size_t>(spec.ranks);
  for (size_t i = 0; i < spec.peer_devices.size(); ++i) {
    if (spec.peer_devices[i] != static_cast<int32_t>(device)) continue;
    const size_t first = i / r * r;
    group->assign(spec.peer_devices.begin() + first, spec.peer_devices.begin() + first + r);
    *rank = static_cast<int>(i - first);
    return "";
  }
  std::string list;
  for (int32_t d : spec.peer_devices) list += (list.empty() ? "" : ", ") + std::to_string(d);
  return "gcmoe_moe: the fused transport's call runs on device " + std::to_string(device) +
         ", which is in none of its peer groups (devices " + list + ")";
}

std::shared_ptr<Runtime> Runtime::Get(const CudaDriver& cu, std::shared_ptr<const VariantSpec> spec,
                                      CUstream stream, int64_t tokens, float clamp, std::string* error) {
  CUcontext ctx = nullptr;
  CUdevice device = 0;
  CUresult rc = cu.cuStreamGetCtx(stream, &ctx);
  if (rc == CUDA_SUCCESS) {
    ScopedContext current(cu, ctx);
    rc = current.status() != CUDA_SUCCESS ? current.status() : cu.cuCtxGetDevice(&device);
  }
  if (rc != CUDA_SUCCESS) {
    *error = CudaErrorMessage(cu, rc, "cuStreamGetCtx/cuCtxGetDevice", __FILE__, __LINE__);
    return nullptr;
  }
  // The graph-cache key: everything static about the launch. Per-call pointers are not in it (they are updated in
  // the instantiated graph); the stream is, because sharing a workspace is safe only for calls that run in order.
  Sha256 sha;
  sha.Add(spec->digest).Add(tokens).Add(clamp).Add(device).Add(reinterpret_cast<uintptr_t>(stream));
  const Digest key = sha.Finish();
  WeakCache<Runtime>& cache = Cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  for (auto it = cache.entries.begin(); it != cache.entries.end();) {  // drop entries whose call sites are gone
    it = it->second.expired() ? cache.entries.erase(it) : std::next(it);
  }
  if (auto hit = cache.entries[key].lock()) {
    if (hit->Retired().empty()) return hit;  // a released group's runtime serves only the programs traced before it
  }
  std::shared_ptr<Runtime> rt(new Runtime(cu));
  RelaxedCaptureMode relaxed(cu);
  if (spec->ranks > 1) {  // the fused transport: this rank's workspace is its group's (every device in one group)
    std::vector<int32_t> group;
    *error = FindPeerGroup(*spec, device, &group, &rt->rank_);
    const bool across = std::any_of(group.begin(), group.end(), [](int32_t d) { return d < 0; });
    if (error->empty()) {
      rt->group_ = across ? PeerGroup::FindIpc(*spec, static_cast<int>(device), rt->rank_, error)
                          : PeerGroup::Get(cu, spec, group, error);
    }
    if (!error->empty()) {
      cache.entries.erase(key);
      return nullptr;
    }
  }
  *error = rt->Init(std::move(spec), stream, tokens, clamp);
  if (!error->empty()) {
    cache.entries.erase(key);
    return nullptr;
  }
  cache.entries[key] = rt;
  return rt;
}

std::string Runtime::Init(std::shared_ptr<const VariantSpec> spec, CUstream stream, int64_t tokens, float clamp) {
  spec_ = std::move(spec);
  const VariantSpec& s = *spec_;
  GCMOE_CU(cu_.cuStreamGetCtx(stream, &primary_));
  ScopedContext current(cu_, primary_);
  GCMOE_CU(current.status());
  GCMOE_CU(cu_.cuCtxGetDevice(&device_));

  // ---- Green contexts: the device's dispatch/compute pair (one split call per process, device and split).
  const GreenPair* pair = nullptr;
  std::string split_error =
      AcquireGreenPair(cu_, device_, static_cast<unsigned>(std::max<int64_t>(1, s.dispatch_sms)), &pair);
  if (!split_error.empty()) return split_error;
  partition_ = pair->partition;
  if (s.planned_compute_sms != 0 && s.planned_compute_sms != partition_.compute_sms) {
    return "gcmoe_moe: the driver split the device into " + std::to_string(partition_.compute_sms) +
           " compute SMs, but gcmoe_jax.geometry planned " + std::to_string(s.planned_compute_sms) +
           " (device facts differ from the geometry's: check `python -m gcmoe_jax doctor`)";
  }
  role_ctx_[0] = pair->ctx[0];
  role_ctx_[1] = pair->ctx[1];
  stream_ctx_ = pair->whole != nullptr ? pair->whole : primary_;
  // Debug (GCMOE_DEBUG_PRIMARY_CTX=1, read once): every role on the primary context, the grids still sized by the
  // split. Not the virtual ranks' runtimes (ForRank): their partitions are what keeps the ranks apart.
  static const bool primary_only = [] {
    const char* v = std::getenv("GCMOE_DEBUG_PRIMARY_CTX");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  if (primary_only) role_ctx_[0] = role_ctx_[1] = primary_;
  return Build(tokens, clamp);
}

std::shared_ptr<Runtime> Runtime::ForRank(const CudaDriver& cu, std::shared_ptr<const VariantSpec> spec,
                                          CUcontext primary, CUdevice device, const CUcontext ctx[2],
                                          const Partition& partition, int64_t tokens, float clamp,
                                          std::string* error) {
  std::shared_ptr<Runtime> rt(new Runtime(cu));
  rt->spec_ = std::move(spec);
  rt->primary_ = primary;
  rt->stream_ctx_ = primary;  // (unused: a rank's roles keep their partitions)
  rt->device_ = device;
  rt->partition_ = partition;
  rt->role_ctx_[0] = ctx[0];
  rt->role_ctx_[1] = ctx[1];
  ScopedContext current(cu, primary);
  *error = current.status() != CUDA_SUCCESS
               ? CudaErrorMessage(cu, current.status(), "cuCtxPushCurrent", __FILE__, __LINE__)
               : rt->Build(tokens, clamp);
  return error->empty() ? rt : nullptr;
}

std::string Runtime::Build(int64_t tokens, float clamp) {
  const VariantSpec& s = *spec_;
  if (tokens > s.capacity) {
    return "gcmoe_moe: T = " + std::to_string(tokens) + " exceeds the kernel variant's token capacity " +
           std::to_string(s.capacity);
  }
  // Finalize runs after both roles, on the compute partition (a node on the primary context costs ~1.4 us more per
  // replay: one more context switch on the critical path; H200 probe, docs/perf.md). One GPU, up to the variant's
  // `finalize_early_tokens`: beside role 2 instead, on the dispatch partition after role 1, where it waits for role
  // 2's CTAs (header.role2_grid), so the edge role 2 -> role 3 and role 3's launch leave the critical path. Only on
  // SMs role 2 cannot use: a waiting role-3 CTA on role 2's partition could keep a role-2 CTA from being resident.
  // Up to the variant's `solo_tokens` (one GPU, v2 kernels) the graph holds role 2 alone: its CTAs list the routes
  // themselves, and `combining` more CTAs beyond its item grid (they start as item CTAs leave) record an id >= E as
  // role 1 would and do role 3's work, so roles 1 and 3 leave the graph (two nodes, their launches and role 3's
  // wait).
  solo_ = group_ == nullptr && s.ranks == 1 && tokens <= s.solo_tokens && s.solo_blocks > 0;
  const unsigned combining = solo_ ? static_cast<unsigned>(std::max<int64_t>(1, tokens) * s.solo_blocks) : 0u;
  // Role 2 alone over every SM (VariantSpec::solo_all_sms): on the stream's own context, which holds them all, its
  // item grid scaled from the compute partition's SMs to the device's below. The kernel sizes everything grid-wide by
  // its grid, so only the residency check (eq. 6) needs the larger SM count.
  const bool all_sms = solo_ && s.solo_all_sms != 0;
  if (all_sms) role_ctx_[1] = stream_ctx_;
  // The three-node graph on the stream's own context (VariantSpec::graph_on_stream, one GPU): no green-context switch
  // on the layer's critical path. Role 2's grid stays the compute partition's; what the partition guaranteed, that
  // role 1 becomes resident beside all of role 2, is checked by count below. Role 3 then runs after role 2.
  const bool on_stream = !solo_ && group_ == nullptr && s.ranks == 1 && s.graph_on_stream != 0;
  if (on_stream) role_ctx_[0] = role_ctx_[1] = stream_ctx_;
  bool beside = !solo_ && group_ == nullptr && s.ranks == 1 && tokens <= s.finalize_early_tokens &&
                role_ctx_[0] != role_ctx_[1];
  role_ctx_[2] = role_ctx_[beside ? 0 : 1];

  // ---- Cubins and the residency check (eq. 6) at the exact launch configuration.
  unsigned role_sms[kNumRoles] = {partition_.dispatch_sms, all_sms ? partition_.total_sms : partition_.compute_sms,
                                  beside ? partition_.dispatch_sms : partition_.compute_sms};
  if (on_stream) role_sms[0] = role_sms[1] = role_sms[2] = partition_.total_sms;
  // Roles 1 and 2: threads, registers per thread, SMEM per CTA (static + dynamic): on one context a role-1 CTA must
  // fit where a role-2 CTA would (below).
  int64_t cta_use[2][3] = {};
  // A grid of 0 in the spec means: role 1 one CTA, role 2 one CTA per compute SM, role 3 one CTA per token.
  const unsigned auto_grid[kNumRoles] = {1u, partition_.compute_sms, static_cast<unsigned>(std::max<int64_t>(1, tokens))};
  for (int r = 0; r < kNumRoles; ++r) {
    RoleSpec& role = launch_[r];
    role = s.role[r];
    role.cubin.clear();
    if (role.grid == 0) role.grid = auto_grid[r];
    if (r == 1 && all_sms) {  // the planned CTAs per compute SM, on every SM
      role.grid = (role.grid + partition_.compute_sms - 1) / partition_.compute_sms * partition_.total_sms;
    }
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
    if (r == 2 && beside && role.grid > static_cast<int64_t>(per_sm) * role_sms[r]) {
      beside = false;  // every role-3 CTA must be resident beside role 2 (they wait): after role 2 instead
      role_ctx_[2] = role_ctx_[1];
      role_sms[r] = partition_.compute_sms;
    }
    if (on_stream && r < 2) {  // (the green contexts' path asks the driver nothing more)
      int regs = 0, static_smem = 0;
      GCMOE_CU(cu_.cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, fn));
      GCMOE_CU(cu_.cuFuncGetAttribute(&static_smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn));
      cta_use[r][0] = role.block;
      cta_use[r][1] = regs;
      cta_use[r][2] = static_smem + static_cast<int64_t>(role.smem);
    }
    if (r == 1 && on_stream && !(cta_use[0][0] <= cta_use[1][0] && cta_use[0][1] <= cta_use[1][1] &&
                                 cta_use[0][2] <= cta_use[1][2])) {
      return "gcmoe_moe: GCMOE_GRAPH_CONTEXT=stream needs a role-1 CTA to fit where a role-2 CTA would (threads, "
             "registers per thread, SMEM: " + std::to_string(cta_use[0][0]) + ", " + std::to_string(cta_use[0][1]) +
             ", " + std::to_string(cta_use[0][2]) + " B against " + std::to_string(cta_use[1][0]) + ", " +
             std::to_string(cta_use[1][1]) + ", " + std::to_string(cta_use[1][2]) + " B); use GCMOE_GRAPH_CONTEXT=green";
    }
    // On one context the partition no longer keeps role 1's SMs free, so count: role 1's CTAs may land first, each
    // on an SM of its own whose SMEM carveout then need not suit role 2, so each costs role 2 a whole SM; if role 2
    // lands first, the slots it leaves free hold role 1's CTAs, each fitting where a role-2 CTA would (above).
    const int64_t sms = r == 1 && on_stream ? role_sms[r] - std::min<int64_t>(launch_[0].grid, role_sms[r])
                                            : role_sms[r];
    const int64_t resident = static_cast<int64_t>(per_sm) * sms;
    if (role.grid == 0 || role.grid > resident) {
      return "gcmoe_moe: role " + std::to_string(r + 1) + " grid of " + std::to_string(role.grid) +
             " CTAs cannot be resident: " + std::to_string(per_sm) + " CTA(s) per SM at " +
             std::to_string(role.block) + " threads and " + std::to_string(role.smem) + " B dynamic SMEM x " +
             std::to_string(sms) + " SMs = " + std::to_string(resident) + " (eq. 6" +
             (r == 1 && on_stream ? ", less an SM per role-1 CTA: GCMOE_GRAPH_CONTEXT=stream" : "") + ")";
    }
  }
  // Beyond the item grid, which fills role 2's partition: each combining CTA starts when an item CTA leaves, and no
  // item CTA waits for one.
  launch_[1].grid += combining;

  // ---- The pinned mirror of the fault record, then the workspace (InitWorkspace); a rank of a peer group uses the
  // group's workspace, initialised with the group (PeerGroup::Init), and only adds its mirror's address.
  void* host = nullptr;
  GCMOE_CU(cu_.cuMemHostAlloc(&host, sizeof(WorkspaceHeader), CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  host_header_ = static_cast<WorkspaceHeader*>(host);
  std::memset(host_header_, 0, sizeof(WorkspaceHeader));
  CUdeviceptr mirror = 0;
  GCMOE_CU(cu_.cuMemHostGetDevicePointer(&mirror, host, 0));
  if (group_ != nullptr) {
    workspace_ = group_->workspace(rank_);
    GCMOE_CU(cu_.cuMemcpyHtoD(workspace_ + offsetof(WorkspaceHeader, host_mirror), &mirror, sizeof(mirror)));
  } else {
    GCMOE_CU(cu_.cuMemAlloc(&workspace_, static_cast<size_t>(s.ws_total)));
    WorkspaceHeader header{};
    header.host_mirror = mirror;
    header.role2_grid = beside ? launch_[1].grid : 0;
    header.solo = combining;
    std::string err = InitWorkspace(cu_, workspace_, s, header);
    if (!err.empty()) return err;
  }

  // ---- The graph: roles 1 and 2 concurrent roots, role 3 after both (beside role 2: after role 1 only); or role 2
  // alone.
  tokens_ = static_cast<int32_t>(tokens) | (solo_ ? kTokensSolo : 0);  // (role 2's parameter: only it runs then)
  clamp_ = clamp;
  for (int p = 0; p < kNumPointerParams; ++p) param_ptrs_[p] = &ptrs_[p];
  param_ptrs_[kNumPointerParams] = &tokens_;
  param_ptrs_[kNumPointerParams + 1] = &clamp_;
  for (int p = 0; p < kNumAbiParams; ++p) role2_param_ptrs_[p] = param_ptrs_[p];
  for (int m = 0; m < kMaxTensorMaps; ++m) role2_param_ptrs_[kNumAbiParams + m] = &tensormaps_[m];
  ptrs_[12] = workspace_;
  GCMOE_CU(cu_.cuGraphCreate(&graph_, 0));
  for (int r = 0; r < kNumRoles; ++r) {
    if (solo_ && r != 1) continue;
    const CUDA_KERNEL_NODE_PARAMS p = NodeParams(r);
    const CUgraphNode* deps = r == 2 ? node_ : nullptr;
    GCMOE_CU(cu_.cuGraphAddKernelNode(&node_[r], graph_, deps, r == 2 ? (beside ? 1 : 2) : 0, &p));
  }
  GCMOE_CU(cu_.cuGraphInstantiate(&exec_, graph_, 0));
  {
    std::lock_guard<std::mutex> lock(g_last_mutex);
    g_last = LastWorkspace{primary_, workspace_, s.ws_total};
  }
  g_graph_instantiations.fetch_add(1);
  g_live_runtimes.fetch_add(1);
  live_ = true;
  return "";
}

Runtime::~Runtime() {
  if (primary_ == nullptr) return;  // Init failed before it owned anything
  ScopedContext current(cu_, primary_);
  if (exec_) cu_.cuGraphExecDestroy(exec_);
  if (graph_) cu_.cuGraphDestroy(graph_);
  for (CUlibrary lib : library_)
    if (lib) cu_.cuLibraryUnload(lib);
  {
    std::lock_guard<std::mutex> lock(g_last_mutex);
    if (g_last.ptr == workspace_) g_last = LastWorkspace{};
  }
  if (workspace_ && group_ == nullptr) cu_.cuMemFree(workspace_);  // a group's workspace is the group's
  if (host_header_) cu_.cuMemFreeHost(host_header_);
  if (live_) g_live_runtimes.fetch_sub(1);
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
  p.kernelParams = r == 1 ? role2_param_ptrs_ : param_ptrs_;
  return p;
}

std::string Runtime::EncodeTensorMaps() {
  for (size_t i = 0; i < spec_->tensormaps.size(); ++i) {
    const TensorMapSpec& m = spec_->tensormaps[i];
    const CUdeviceptr base = ptrs_[m.param];
    tensormaps_[i] = CUtensorMap{};
    if (base == 0) continue;  // the template graph before the first call: nothing reads it
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(m.dim0), static_cast<cuuint64_t>(m.dim1)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(m.row_stride)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(m.box0), static_cast<cuuint32_t>(m.box1)};
    const cuuint32_t element_strides[2] = {1, 1};
    CUresult rc = cu_.cuTensorMapEncodeTiled(
        &tensormaps_[i], static_cast<CUtensorMapDataType>(m.dtype), 2, reinterpret_cast<void*>(base), dims, strides,
        box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(m.swizzle),
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (rc != CUDA_SUCCESS) {
      char at[32];
      snprintf(at, sizeof(at), "0x%llx", static_cast<unsigned long long>(base));
      return CudaErrorMessage(cu_, rc, "cuTensorMapEncodeTiled", __FILE__, __LINE__) + " (role 2 TensorMap " +
             std::to_string(i) + " of kernel parameter " + std::to_string(m.param) + " at " + at + ": " +
             std::to_string(m.dim0) + " x " + std::to_string(m.dim1) + " elements, box " + std::to_string(m.box0) +
             " x " + std::to_string(m.box1) + ")";
    }
  }
  return "";
}

std::string Runtime::SetParams(const PointerParams& ptrs, bool exec) {
  for (int p = 0; p < kNumPointerParams; ++p) ptrs_[p] = p == 12 ? workspace_ : ptrs[p];
  std::string err = EncodeTensorMaps();
  if (!err.empty()) return err;
  for (int r = 0; r < kNumRoles; ++r) {
    if (node_[r] == nullptr) continue;  // (solo_: role 2 alone)
    const CUDA_KERNEL_NODE_PARAMS p = NodeParams(r);
    if (exec) {
      GCMOE_CU(cu_.cuGraphExecKernelNodeSetParams(exec_, node_[r], &p));
    } else {
      GCMOE_CU(cu_.cuGraphKernelNodeSetParams(node_[r], &p));
    }
  }
  return "";
}

// A fault recorded by an earlier replay (role 3, or role 2's first combining CTA where role 2 runs alone, writes the
// pinned, mapped mirror, so reading it needs no synchronisation; it may lag by the calls still in flight). Clears the
// fault on host and device.
std::string Runtime::ReadFault(CUstream stream) {
  volatile WorkspaceHeader* h = host_header_;
  if (h->error_flag == 0) return "";
  std::string msg = "gcmoe_moe: a role kernel fault was recorded on device " + std::to_string(device_) + ": role " +
                    std::to_string(h->error_role) + ", block " + std::to_string(h->error_block) + ", epoch " +
                    std::to_string(h->error_epoch) + ", counter " + std::to_string(h->error_counter) +
                    ", observed " + std::to_string(h->error_observed);
  // The first call of a group across processes waited with its own, longer bound (InitWorkspace).
  const bool first = h->error_epoch == 1 && group_ != nullptr && group_->first_timeout_ns() > spec_->timeout_ns;
  const std::string bound =
      std::to_string((first ? group_->first_timeout_ns() : spec_->timeout_ns) / 1000000) +
      (first ? " ms, GCMOE_FIRST_WAIT_TIMEOUT_MS (the first call)" : " ms, GCMOE_WAIT_TIMEOUT_MS");
  if (h->error_role == 1) {
    msg += " (role 1 read expert id " + std::to_string(static_cast<int32_t>(h->error_counter)) +
           ", outside [0, E): routes.ids must be < E)";
  } else if (h->error_role == 4) {  // abi.ROLE_TRANSPORT: a wait of the fused transport
    const uint32_t what = h->error_counter & 0xffff0000u, which = h->error_counter & 0xffffu;
    msg += what == 0x40000u   ? " (the fused transport waited for rank " + std::to_string(which) +
                                    " to publish this call, and it did not"
           : what == 0x50000u ? " (the fused transport's pull engine waited for a row's bulk copy from rank " +
                                    std::to_string(which) + " to land"
           : what == 0x90000u ? " (the fused transport's dispatch CTAs waited for block 0's direct scan of the peers"
                              : " (the fused transport waited for the peers to return this rank's rows: " +
                                    std::to_string(h->error_observed) + " row tiles arrived";
    msg += " within " + bound + ": a peer stalled or died; the outputs of that call were set to NaN)";
  } else if (h->error_role == 2 && (h->error_counter & 0xffff0000u) == 0xa0000u) {  // abi.WAIT_QUEUE
    msg += " (role 2 waited longer than " + bound + " for role 1 to close the active queue of the experts hit, " +
           std::to_string(h->error_observed) + " appended, every expert published; the outputs of that call were "
           "set to NaN)";
  } else if (h->error_role == 2 && (h->error_counter & 0xffff0000u) == 0x80000u) {  // abi.WAIT_PIPE
    msg += " (role 2's pipeline waited longer than " + bound + ", for the copies of K128 block " +
           std::to_string(h->error_observed) +
           " (a TMA or bulk copy that never completed: a bad weight pointer or TensorMap); the outputs of that call "
           "were set to NaN)";
  } else if (h->error_role == 3) {  // abi.WAIT_ROLE2 / WAIT_ROLE3: role 3 beside role 2 (twice the bound)
    // Where role 2 runs alone its combining CTAs do role 3's work and record these (error_role 3).
    const std::string who = solo_ ? "role 2's combining CTAs (role 2 runs alone)" : "role 3";
    msg += (h->error_counter & 0xffff0000u) == 0xc0000u
               ? " (" + who + ": the first waited for the others to start, " + std::to_string(h->error_observed) +
                     " did"
               : " (" + who + " waited for role 2's item CTAs to finish, " + std::to_string(h->error_observed) +
                     " did";
    msg += ", longer than twice " + bound + "; the outputs of that call were set to NaN)";
  } else {
    msg += " (a spin-wait exceeded its bound of " + bound + "; the outputs of that call were set to NaN)";
  }
  h->error_flag = 0;
  const uint32_t zero = 0;
  GCMOE_CU(cu_.cuMemcpyHtoDAsync(workspace_ + offsetof(WorkspaceHeader, error_flag), &zero, sizeof(zero), stream));
  return msg;
}

// Counts this call on the board, publishes a fault this runtime found, and returns the newest fault this device
// has not reported yet once it may (see FaultBoard).
std::string Runtime::CheckFault(CUstream stream) {
  std::string own = ReadFault(stream);
  FaultBoard& b = Board();
  std::lock_guard<std::mutex> lock(b.mu);
  const int64_t call = ++b.calls[device_];
  if (!own.empty()) {
    b.generation += 1;
    b.at_call = call;
    b.origin = device_;
    b.message = std::move(own);
  }
  int64_t& reported = b.reported.try_emplace(device_, 0).first->second;
  if (reported == b.generation || (b.calls.size() > 1 && call <= b.at_call)) return "";
  reported = b.generation;
  if (b.origin == device_) return b.message;
  return b.message + "; reported on device " + std::to_string(device_) + " too, so that every rank of this " +
         "process stops at the same call instead of waiting for the faulty one in a collective";
}

std::string Runtime::SyncAndCheck(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  GCMOE_CU(cu_.cuStreamGetCaptureInfo(stream, &status, nullptr, nullptr, nullptr, nullptr, nullptr));
  if (status == CU_STREAM_CAPTURE_STATUS_ACTIVE) return "";  // nothing ran yet: the capture is replayed later
  GCMOE_CU(cu_.cuStreamSynchronize(stream));
  return ReadFault(stream);
}

// Why this rank's group can no longer be used ("" while it can).
std::string Runtime::Retired() const {
  if (group_ == nullptr || !group_->retired()) return "";
  return "gcmoe_moe: the fused transport's workspaces of this program (rank " + std::to_string(rank_) + " on device " +
         std::to_string(device_) + ") were released (gcmoe_jax.release_fused_workspaces); a program traced before "
         "the release cannot run after it: drop it (jax.clear_caches()) and trace the call again";
}

std::string Runtime::Execute(CUstream stream, const PointerParams& ptrs) {
  std::lock_guard<std::mutex> lock(mutex_);
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
    std::string fault = CheckFault(stream);  // a fault of a call before the release is reported first
    if (!fault.empty()) return fault;
  }
  std::string retired = Retired();
  if (!retired.empty()) return retired;
  if (!capturing) {
    const int32_t stall = StallExpertFor(device_);
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
  return LaunchGraph(stream, ptrs);
}

// Debug trace (GCMOE_DEBUG_TRACE=1, read once; ffi/_cuda.py debug_trace): for each graph launch outside a
// capture, the host time of the parameter update and of cuGraphLaunch, and CUDA events on the stream around the
// graph, in a ring of kTraceSlots records. Off by default: it records two events per call.
namespace {
struct TraceRecord {
  int64_t enter_ns = 0, params_ns = 0, launch_ns = 0;
  int updated = 0;
  CUevent start = nullptr, end = nullptr;
  CUcontext ctx = nullptr;
};
constexpr int kTraceSlots = 1024;
struct Trace {
  std::mutex mu;
  std::vector<TraceRecord> ring = std::vector<TraceRecord>(kTraceSlots);
  int64_t next = 0;  // records written so far
};
Trace& TheTrace() {
  static Trace* const t = new Trace();  // never destroyed: its events may outlive the runtimes
  return *t;
}
bool TraceEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("GCMOE_DEBUG_TRACE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}
void DropEvents(const CudaDriver& cu, const TraceRecord& rec) {
  if (rec.start != nullptr) cu.cuEventDestroy(rec.start);
  if (rec.end != nullptr) cu.cuEventDestroy(rec.end);
}
int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

std::string Runtime::LaunchGraph(CUstream stream, const PointerParams& ptrs) {
  const bool trace = TraceEnabled();
  const int64_t t0 = trace ? NowNs() : 0;
  bool updated = false;
  // Parameter updates cost microseconds per node: skip them when XLA hands back the same buffers (steady state).
  PointerParams want = ptrs;
  want[12] = workspace_;
  if (!exec_params_set_ || want != ptrs_) {
    std::string err = SetParams(ptrs, /*exec=*/true);
    if (!err.empty()) return err;
    exec_params_set_ = true;
    updated = true;
  }
  if (!trace) {
    GCMOE_CU(cu_.cuGraphLaunch(exec_, stream));
    return "";
  }
  const int64_t t1 = NowNs();
  // A slot's events are taken out of the ring (made in this runtime's context when they belong to another) before
  // the launch is timed, and the record goes back only when every call succeeded: a failed call leaves the slot
  // empty, its events destroyed.
  Trace& tr = TheTrace();
  std::unique_lock<std::mutex> lock(tr.mu);
  const int64_t index = tr.next++;
  TraceRecord rec = std::exchange(tr.ring[index % kTraceSlots], TraceRecord{});
  lock.unlock();
  auto fail = [&](CUresult rc, const char* what) {
    DropEvents(cu_, rec);
    return CudaErrorMessage(cu_, rc, what, __FILE__, __LINE__);
  };
  CUresult rc = CUDA_SUCCESS;
  if (rec.ctx != primary_) {  // events belong to a context
    DropEvents(cu_, rec);
    rec = TraceRecord{};
    if ((rc = cu_.cuEventCreate(&rec.start, CU_EVENT_DEFAULT)) != CUDA_SUCCESS) return fail(rc, "cuEventCreate");
    if ((rc = cu_.cuEventCreate(&rec.end, CU_EVENT_DEFAULT)) != CUDA_SUCCESS) return fail(rc, "cuEventCreate");
  }
  if ((rc = cu_.cuEventRecord(rec.start, stream)) != CUDA_SUCCESS) return fail(rc, "cuEventRecord");
  const int64_t t2 = NowNs();
  rc = cu_.cuGraphLaunch(exec_, stream);
  const int64_t t3 = NowNs();
  if (rc != CUDA_SUCCESS) return fail(rc, "cuGraphLaunch(exec_, stream)");
  if ((rc = cu_.cuEventRecord(rec.end, stream)) != CUDA_SUCCESS) return fail(rc, "cuEventRecord");
  rec.ctx = primary_;
  rec.enter_ns = t0;
  rec.params_ns = t1 - t0;
  rec.launch_ns = t3 - t2;
  rec.updated = updated ? 1 : 0;
  lock.lock();
  TraceRecord stale = std::exchange(tr.ring[index % kTraceSlots], rec);
  lock.unlock();
  DropEvents(cu_, stale);  // holds events only when 1024 launches overtook this one
  return "";
}

// The trace's records, oldest first, each read after its own events completed: per record host enter (us from
// the first), parameter update (us), cuGraphLaunch (us), updated (0/1), GPU start (us from the first record, -1
// for another context), GPU duration (us). Read when no traced call is in flight (after block_until_ready).
std::string ReadTrace(std::vector<double>* out) {
  if (!TraceEnabled()) return "the trace is off: set GCMOE_DEBUG_TRACE=1 before the process's first CUDA call";
  std::string err;
  const CudaDriver* cu = GetCudaDriver(&err);
  if (cu == nullptr) return err;
  Trace& tr = TheTrace();
  std::vector<TraceRecord> recs;
  {
    std::lock_guard<std::mutex> lock(tr.mu);  // copied out: the waits below hold no lock a launch needs
    const int64_t n = std::min<int64_t>(tr.next, kTraceSlots);
    for (int64_t i = tr.next - n; i < tr.next; ++i) {
      if (tr.ring[i % kTraceSlots].ctx != nullptr) recs.push_back(tr.ring[i % kTraceSlots]);
    }
    tr.next = 0;
  }
  out->clear();
  if (recs.empty()) return "";
  const TraceRecord& f = recs.front();
  for (const TraceRecord& r : recs) {
    ScopedContext current(*cu, r.ctx);
    if (current.status() != CUDA_SUCCESS) return "cuCtxPushCurrent failed";
    GCMOE_CU_OR_RETURN(*cu, cu->cuEventSynchronize(r.end), "cuEventSynchronize");
    float from_first = 0.0f, dur = 0.0f;
    if (r.ctx == f.ctx) {  // events of two contexts cannot be compared
      GCMOE_CU_OR_RETURN(*cu, cu->cuEventElapsedTime(&from_first, f.start, r.start), "cuEventElapsedTime");
    }
    GCMOE_CU_OR_RETURN(*cu, cu->cuEventElapsedTime(&dur, r.start, r.end), "cuEventElapsedTime");
    const double row[6] = {(r.enter_ns - f.enter_ns) / 1e3, r.params_ns / 1e3, r.launch_ns / 1e3,
                           static_cast<double>(r.updated), r.ctx == f.ctx ? 1e3 * from_first : -1.0, 1e3 * dur};
    out->insert(out->end(), row, row + 6);
  }
  return "";
}

std::string Runtime::Launch(CUstream stream, const PointerParams& ptrs) {
  std::lock_guard<std::mutex> lock(mutex_);
  ScopedContext current(cu_, primary_);
  GCMOE_CU(current.status());
  std::string fault = ReadFault(stream);
  if (!fault.empty()) return fault;
  std::string retired = Retired();
  if (!retired.empty()) return retired;
  return LaunchGraph(stream, ptrs);
}

std::string Runtime::SetPeers(int rank, const std::vector<CUdeviceptr>& table) {
  if (rank < 0 || static_cast<size_t>(rank) >= table.size() || table.size() > static_cast<size_t>(kMaxRanks)) {
    return "gcmoe_moe: rank " + std::to_string(rank) + " of a peer table of " + std::to_string(table.size()) +
           " ranks (at most " + std::to_string(kMaxRanks) + ")";
  }
  ScopedContext current(cu_, primary_);
  GCMOE_CU(current.status());
  const uint32_t r = static_cast<uint32_t>(rank);
  GCMOE_CU(cu_.cuMemcpyHtoD(workspace_ + offsetof(WorkspaceHeader, rank), &r, sizeof(r)));
  GCMOE_CU(cu_.cuMemcpyHtoD(workspace_ + offsetof(WorkspaceHeader, peers), table.data(),
                            table.size() * sizeof(CUdeviceptr)));
  return "";
}

std::string Runtime::SetStall(int32_t e) {
  ScopedContext current(cu_, primary_);
  GCMOE_CU(current.status());
  GCMOE_CU(cu_.cuMemcpyHtoD(workspace_ + offsetof(WorkspaceHeader, stall_expert), &e, sizeof(e)));
  stall_applied_ = e;
  return "";
}

#undef GCMOE_CU

}  // namespace gcmoe

// ---- ctypes entry points ------------------------------------------------------------------------------------------

#include "common.h"

// Registers a kernel variant under `key` (gcmoe_jax/ffi/_cuda.py). `config`: capacity, dispatch_sms, timeout_ns,
// ws_total, ws_silu_table[, planned compute SMs[, R ranks of the fused transport[, the tokens up to which role 3 may
// run beside role 2 (abi.FINALIZE_EARLY_TOKENS)[, the tokens up to which the graph holds role 2 alone
// (abi.scan_tokens), role 2's combining CTAs per token then (abi.solo_ctas)[, where it runs alone (0: the compute
// partition, 1: every SM; GCMOE_SOLO_SMS)[, where the three-node graph runs (0: the green contexts, 1: the stream's
// own context; GCMOE_GRAPH_CONTEXT)[, with R > 1 the CUDA ordinals of its peer groups, group-major]]]]]]]
// (int64); `launch`: (grid, block, dynamic smem) of roles 1, 2, 3 (9 uint32); the three
// cubins; the silu table (65536 float32); role 2's TensorMaps (abi.tensormap_fields, 8 int64 each, formal order).
// Returns 0, or -1 with the reason in `error`.
GCMOE_EXPORT int gcmoe_register_variant(const char* key, const int64_t* config, int num_config,
                                        const uint32_t* launch, const void* cubin1, int64_t size1,
                                        const void* cubin2, int64_t size2, const void* cubin3, int64_t size3,
                                        const float* silu_table, int64_t silu_entries, const int64_t* tensormaps,
                                        int num_tensormap_values, char* error, int error_size) {
  if (num_config < 5 || silu_entries != 65536) {
    return gcmoe::FailWith("gcmoe_register_variant: expected at least 5 config values and 65536 silu entries, got " +
                               std::to_string(num_config) + " and " + std::to_string(silu_entries),
                           error, error_size);
  }
  const int64_t ranks = num_config > 6 ? config[6] : 1;
  const int64_t finalize_early_tokens = num_config > 7 ? config[7] : 0;
  const int64_t solo_tokens = num_config > 8 ? config[8] : 0;
  const int64_t solo_blocks = num_config > 9 ? config[9] : 0;
  const int64_t solo_all_sms = num_config > 10 ? config[10] : 0;
  const int64_t graph_on_stream = num_config > 11 ? config[11] : 0;
  // Both 0 (never alone) or both > 0, and one GPU: a config of the layout before these two words (peer devices from
  // index 8) cannot pass as one of this layout.
  if (solo_tokens < 0 || solo_blocks < 0 || (solo_tokens == 0) != (solo_blocks == 0) || config[0] < solo_tokens ||
      (solo_tokens > 0 && ranks != 1)) {
    return gcmoe::FailWith("gcmoe_register_variant: role 2 alone needs 0 <= solo tokens <= the capacity, its "
                               "combining CTAs per token (ceil(H / 2048)) > 0 exactly where solo tokens > 0, and one "
                               "GPU (R = 1) there; got solo tokens " +
                               std::to_string(solo_tokens) + ", combining CTAs per token " +
                               std::to_string(solo_blocks) + ", capacity " + std::to_string(config[0]) + ", R = " +
                               std::to_string(ranks),
                           error, error_size);
  }
  if (solo_all_sms != 0 && (solo_all_sms != 1 || solo_tokens == 0)) {
    return gcmoe::FailWith("gcmoe_register_variant: where role 2 runs alone is 0 (the compute partition) or 1 "
                               "(every SM), and 1 only where it runs alone (solo tokens > 0); got " +
                               std::to_string(solo_all_sms) + " with solo tokens " + std::to_string(solo_tokens),
                           error, error_size);
  }
  if (graph_on_stream != 0 && (graph_on_stream != 1 || ranks != 1)) {
    return gcmoe::FailWith("gcmoe_register_variant: where the three-node graph runs is 0 (the green contexts) or 1 "
                               "(the stream's own context), and 1 only on one GPU (R = 1); got " +
                               std::to_string(graph_on_stream) + " with R = " + std::to_string(ranks),
                           error, error_size);
  }
  const int64_t num_devices = num_config > 12 ? num_config - 12 : 0;
  std::vector<int32_t> peer_devices(config + std::min<int64_t>(num_config, 12), config + num_config);
  // This process's devices (ordinals >= 0) at most once in all; a device of another process is -(1 + its process
  // index), at most once per group, and a group with one has at most one of this process's (CUDA IPC, not peer
  // access, connects it).
  std::vector<int32_t> local;
  bool groups_ok = ranks >= 2 || num_devices == 0;
  for (int64_t g = 0; ranks >= 2 && g + ranks <= num_devices; g += ranks) {
    std::vector<int32_t> remote;
    int64_t mine = 0;
    for (int64_t i = g; i < g + ranks; ++i) {
      const int32_t d = peer_devices[static_cast<size_t>(i)];
      if (d >= 0) {
        local.push_back(d);
        ++mine;
      } else {
        remote.push_back(d);
      }
    }
    std::sort(remote.begin(), remote.end());
    groups_ok = groups_ok && std::adjacent_find(remote.begin(), remote.end()) == remote.end() &&
                (remote.empty() || mine <= 1);
  }
  std::sort(local.begin(), local.end());
  const bool unique = std::adjacent_find(local.begin(), local.end()) == local.end();
  if (ranks < 1 || ranks > gcmoe::kMaxRanks || (ranks == 1) != (num_devices == 0) ||
      (ranks > 1 && num_devices % ranks != 0) || !unique || !groups_ok) {
    return gcmoe::FailWith("gcmoe_register_variant: the fused transport needs R in [2, " +
                               std::to_string(gcmoe::kMaxRanks) + "] and its peer groups' devices (R per group: "
                               "this process's CUDA ordinals, each at most once; a device of process p as -(1 + p), "
                               "at most once per group, beside at most one of this process's); got R = " +
                               std::to_string(ranks) + " and " + std::to_string(num_devices) + " devices",
                           error, error_size);
  }
  const int num_maps = num_tensormap_values / gcmoe::kTensorMapFields;
  if (num_tensormap_values % gcmoe::kTensorMapFields != 0 || num_maps > gcmoe::kMaxTensorMaps) {
    return gcmoe::FailWith("gcmoe_register_variant: role 2's TensorMaps take " +
                               std::to_string(gcmoe::kTensorMapFields) + " values each, at most " +
                               std::to_string(gcmoe::kMaxTensorMaps) + " maps; got " +
                               std::to_string(num_tensormap_values) + " values",
                           error, error_size);
  }
  std::vector<gcmoe::TensorMapSpec> maps(num_maps);
  for (int i = 0; i < num_maps; ++i) {
    const int64_t* f = tensormaps + i * gcmoe::kTensorMapFields;
    maps[i] = gcmoe::TensorMapSpec{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]};
    const gcmoe::TensorMapSpec& m = maps[i];
    // Bytes (CU_TENSOR_MAP_DATA_TYPE_UINT8), or the expanded FP4 path's 4-bit codes unpacked to 16-byte slots
    // (CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B), with the driver's rules for that type checked here, at registration.
    const bool u4 = m.dtype == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B;
    const bool u4_ok = !u4 || (m.dim0 % 128 == 0 && m.box0 == 128 && m.row_stride % 32 == 0 &&
                               (m.swizzle == CU_TENSOR_MAP_SWIZZLE_NONE || m.swizzle == CU_TENSOR_MAP_SWIZZLE_128B));
    if (m.param < 0 || m.param >= gcmoe::kNumPointerParams || (m.dtype != CU_TENSOR_MAP_DATA_TYPE_UINT8 && !u4) ||
        !u4_ok || m.dim0 < 1 || m.dim1 < 1 || m.row_stride % 16 != 0 || m.box0 < 1 || m.box0 > 256 || m.box1 < 1 ||
        m.box1 > 256 || m.swizzle < 0 || m.swizzle > 3) {
      return gcmoe::FailWith("gcmoe_register_variant: TensorMap " + std::to_string(i) + " is malformed (param " +
                                 std::to_string(m.param) + ", dtype " + std::to_string(m.dtype) + ", dims " +
                                 std::to_string(m.dim0) + " x " + std::to_string(m.dim1) + ", row stride " +
                                 std::to_string(m.row_stride) + ", box " + std::to_string(m.box0) + " x " +
                                 std::to_string(m.box1) + ", swizzle " + std::to_string(m.swizzle) +
                                 "; accepted: dtype 0 (bytes) or 14 (16U4_ALIGN16B: dims[0] a multiple of 128, "
                                 "box[0] 128, row stride a multiple of 32, swizzle none or 128 B))",
                             error, error_size);
    }
  }
  auto spec = std::make_shared<gcmoe::VariantSpec>();  // RegisterVariant adds its digest
  spec->tensormaps = std::move(maps);
  spec->capacity = config[0];
  spec->dispatch_sms = config[1];
  spec->timeout_ns = static_cast<uint64_t>(config[2]);
  spec->ws_total = config[3];
  spec->ws_silu_table = config[4];
  spec->planned_compute_sms = num_config > 5 ? config[5] : 0;
  spec->ranks = ranks;
  spec->finalize_early_tokens = finalize_early_tokens;
  spec->solo_tokens = solo_tokens;
  spec->solo_blocks = solo_blocks;
  spec->solo_all_sms = solo_all_sms;
  spec->graph_on_stream = graph_on_stream;
  spec->peer_devices = std::move(peer_devices);
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

// The fused transport across processes (docs/fused_transport.md): this process's rank `rank` of a group of variant
// `key`, on CUDA device ordinal `device`, allocates and initialises its workspace (once; later calls return the same
// handle) and writes its CUDA IPC handle (64 bytes) to `handle`. `first_timeout_ns`: the spin bound of the group's
// first call (the variant's own if smaller). Before the variant's first call, outside capture.
GCMOE_EXPORT int gcmoe_ipc_export(const char* key, int device, int rank, int64_t first_timeout_ns, uint8_t* handle,
                                  char* error, int error_size) {
  std::string why;
  const gcmoe::CudaDriver* cu = gcmoe::GetCudaDriver(&why);
  std::shared_ptr<const gcmoe::VariantSpec> spec = gcmoe::FindVariant(key);
  if (cu != nullptr && spec == nullptr) why = std::string("gcmoe_ipc_export: no variant registered as ") + key;
  CUipcMemHandle h{};
  if (why.empty()) why = gcmoe::PeerGroup::ExportIpc(*cu, *spec, device, rank,
                                                     static_cast<uint64_t>(std::max<int64_t>(first_timeout_ns, 0)), &h);
  if (!why.empty()) return gcmoe::FailWith(why, error, error_size);
  std::memcpy(handle, h.reserved, sizeof(h.reserved));
  return 0;
}

// Opens the workspaces of the other `ranks` - 1 ranks of this process's group of `key` on `device` from `handles`
// (`ranks` x 64 bytes in rank order; this rank's own entry is not read) and writes its peer table. Once per group;
// the variant's calls on `device` may run after it.
GCMOE_EXPORT int gcmoe_ipc_connect(const char* key, int device, const uint8_t* handles, int ranks, char* error,
                                   int error_size) {
  std::shared_ptr<const gcmoe::VariantSpec> spec = gcmoe::FindVariant(key);
  if (spec == nullptr) {
    return gcmoe::FailWith(std::string("gcmoe_ipc_connect: no variant registered as ") + key, error, error_size);
  }
  std::vector<CUipcMemHandle> h(static_cast<size_t>(std::max(ranks, 0)));
  for (size_t p = 0; p < h.size(); ++p) std::memcpy(h[p].reserved, handles + 64 * p, sizeof(h[p].reserved));
  const std::string why = gcmoe::PeerGroup::ConnectIpc(*spec, device, h);
  return why.empty() ? 0 : gcmoe::FailWith(why, error, error_size);
}

// The collective release of the fused transport's groups across processes (gcmoe_jax/ffi/_cuda.py
// release_processes): phase 0 waits for this process's work on their devices (returns 0, or -1 with `error`); then,
// after every process did (a barrier through jax.distributed), phase 1 retires them and returns how many. A retired
// group's runtimes refuse calls; its memory (this rank's workspace, the peers' mappings) is freed with the last one.
GCMOE_EXPORT int gcmoe_ipc_release(int phase, char* error, int error_size) {
  if (phase == 0) {
    const std::string why = gcmoe::PeerGroup::SynchronizeIpc();
    return why.empty() ? 0 : gcmoe::FailWith(why, error, error_size);
  }
  if (phase != 1) {
    return gcmoe::FailWith("gcmoe_ipc_release: phase must be 0 (wait) or 1 (retire), got " + std::to_string(phase),
                           error, error_size);
  }
  return gcmoe::PeerGroup::RetireIpc();
}

// How many graphs were instantiated in this process (tests: one per shape and device, never per call).
GCMOE_EXPORT int64_t gcmoe_graph_instantiations() { return gcmoe::GraphInstantiations(); }

// Debug hook (GCMOE_DEBUG_TRACE=1): writes up to `max_records` trace records (6 doubles each, ReadTrace) to `out`,
// oldest first, and clears the trace. Returns the records written, or -1 with `error` set.
GCMOE_EXPORT int gcmoe_debug_trace(double* out, int max_records, char* error, int error_len) {
  if (out == nullptr || max_records < 0) {
    if (error != nullptr && error_len > 0) std::snprintf(error, static_cast<size_t>(error_len), "bad output buffer");
    return -1;
  }
  std::vector<double> rows;
  const std::string err = gcmoe::ReadTrace(&rows);
  if (!err.empty()) {
    if (error != nullptr && error_len > 0) std::snprintf(error, static_cast<size_t>(error_len), "%s", err.c_str());
    return -1;
  }
  const int n = std::min<int>(static_cast<int>(rows.size() / 6), max_records);
  std::copy(rows.begin(), rows.begin() + 6 * n, out);
  return n;
}

// Runtimes alive in this process (graph-cache entries with a call site; each owns a workspace and a graph).
GCMOE_EXPORT int64_t gcmoe_live_runtimes() { return gcmoe::LiveRuntimes(); }

// Byte offsets of the workspace header's fields in abi.HEADER's order (tests: the two layouts agree).
GCMOE_EXPORT int gcmoe_workspace_header_offsets(int64_t* out, int n) {
  const int64_t offsets[] = {
      offsetof(gcmoe::WorkspaceHeader, epoch),         offsetof(gcmoe::WorkspaceHeader, error_flag),
      offsetof(gcmoe::WorkspaceHeader, timeout_ns),    offsetof(gcmoe::WorkspaceHeader, error_role),
      offsetof(gcmoe::WorkspaceHeader, error_block),   offsetof(gcmoe::WorkspaceHeader, error_epoch),
      offsetof(gcmoe::WorkspaceHeader, error_counter), offsetof(gcmoe::WorkspaceHeader, error_observed),
      offsetof(gcmoe::WorkspaceHeader, stall_expert),  offsetof(gcmoe::WorkspaceHeader, host_mirror),
      offsetof(gcmoe::WorkspaceHeader, x_ready),       offsetof(gcmoe::WorkspaceHeader, rank),
      offsetof(gcmoe::WorkspaceHeader, steady_timeout_ns), offsetof(gcmoe::WorkspaceHeader, peers),
      offsetof(gcmoe::WorkspaceHeader, role2_grid),    offsetof(gcmoe::WorkspaceHeader, solo)};
  const int count = static_cast<int>(sizeof(offsets) / sizeof(offsets[0]));
  for (int i = 0; i < count && i < n; ++i) out[i] = offsets[i];
  return count;
}

// Test hook: role 1 of every later call on device ordinal `device` (-1: every device) never publishes expert `e`
// (-1: off), so role 2 times out.
GCMOE_EXPORT void gcmoe_debug_set_stall_expert(int32_t e, int32_t device) { gcmoe::SetStallExpert(e, device); }

// Debug hook: the size of the most recently initialised Runtime's workspace (0: none alive).
GCMOE_EXPORT int64_t gcmoe_debug_workspace_bytes() {
  std::lock_guard<std::mutex> lock(gcmoe::g_last_mutex);
  return gcmoe::g_last.bytes;
}

// Debug hook (the timeline build, python -m gcmoe_jax.bench.timeline): copies `nbytes` at `offset` of the most recently
// initialised Runtime's workspace to `out`, after the caller waited for its calls (block_until_ready). Returns 0, or
// -1 with `error` set (no runtime alive, a range outside the workspace, a driver error).
GCMOE_EXPORT int gcmoe_debug_read_workspace(int64_t offset, int64_t nbytes, void* out, char* error, int error_len) {
  auto fail = [&](const std::string& msg) {
    if (error != nullptr && error_len > 0) std::snprintf(error, static_cast<size_t>(error_len), "%s", msg.c_str());
    return -1;
  };
  std::string err;
  const gcmoe::CudaDriver* cu = gcmoe::GetCudaDriver(&err);
  if (cu == nullptr) return fail(err);
  std::lock_guard<std::mutex> lock(gcmoe::g_last_mutex);
  const gcmoe::LastWorkspace last = gcmoe::g_last;
  if (last.ptr == 0) return fail("no CUDA runtime is alive in this process (run a gm.moe call first)");
  if (offset < 0 || nbytes < 0 || offset + nbytes > last.bytes) {
    return fail("range [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                ") is outside the workspace of " + std::to_string(last.bytes) + " bytes");
  }
  gcmoe::ScopedContext current(*cu, last.ctx);
  if (current.status() != CUDA_SUCCESS) return fail("cuCtxPushCurrent failed");
  const CUresult r = cu->cuMemcpyDtoH(out, last.ptr + static_cast<CUdeviceptr>(offset), static_cast<size_t>(nbytes));
  if (r != CUDA_SUCCESS) return fail(gcmoe::CudaErrorMessage(*cu, r, "cuMemcpyDtoH", __FILE__, __LINE__));
  return 0;
}
