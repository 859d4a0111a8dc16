// The GC-MoE CUDA runtime (paper §4.1-4.2, §5.2-5.3): green contexts, the role graph, replay in XLA's stream.
//
// One Runtime per graph-cache key: a SHA-256 over the variant's static bytes (configuration, launch triples, cubin and
// silu-table digests), T, clamp, the device and XLA's stream. Call sites with the same key share it (a model's
// identical layers: one workspace, one graph), which is safe because calls on one stream run in order; the cache
// holds weak references, so the last call site dropped frees it. At first use (outside any stream capture) a Runtime
// allocates the workspace, takes the device's dispatch/compute green-context pair (ONE split call per device and
// split, kept for the process: the driver does not return ~8 MB of device memory per destroyed pair), loads the three
// role cubins with cuLibraryLoadData, checks that every role's grid is resident (eq. 6, occupancy API at the exact
// block size and dynamic SMEM), and builds a 3-node graph: role 1 (dispatch partition) and role 2 (compute partition)
// as concurrent roots synchronised through epoch-tagged flags in the workspace, role 3 (finalize, compute partition)
// after both; or, at T <= VariantSpec::solo_tokens on one GPU, role 2 alone (its extra combining CTAs do roles 1 and
// 3's work). Faults reach the host through a pinned, mapped mirror of the header that role 3 (or role 2's first
// combining CTA) writes only when a fault was recorded (no copy node: it cost ~5 us per replay). Each call updates the
// kernel parameters of the instantiated graph when XLA's buffers changed (no re-instantiation) and launches it into
// XLA's stream, or, when that stream is capturing (XLA command buffers), splices the graph in as a child node.

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
#include "sha256.h"

namespace gcmoe {

inline constexpr int kNumRoles = 3;
inline constexpr int kNumPointerParams = 13;  // gcmoe_jax/kernels/abi.py PARAMS
inline constexpr int kNumAbiParams = kNumPointerParams + 2;  // then tokens and clamp
inline constexpr int kMaxTensorMaps = 4;     // role 2's by-value TensorMaps after the ABI's formals
inline constexpr int kTensorMapFields = 8;   // abi.TENSORMAP_FIELDS

// One TensorMap of role 2 (abi.tensormap_fields): the ABI pointer it maps, its CUtensorMapDataType, two dimensions
// (elements), the row stride (bytes), the box, the CUtensorMapSwizzle.
struct TensorMapSpec {
  int64_t param = 0, dtype = 0, dim0 = 0, dim1 = 0, row_stride = 0, box0 = 0, box1 = 0, swizzle = 0;
};

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
  uint64_t host_mirror;  // device address of the pinned host mirror (role 3 writes it when error_flag is set)
  // The fused transport (abi.HEADER): this rank's published call, its rank, and every rank's workspace address.
  uint32_t x_ready;
  uint32_t rank;
  uint64_t steady_timeout_ns;  // the spin bound after the first call (role 3 of a fused variant's first call copies it)
  uint64_t peers[16];  // abi.MAX_RANKS
  // Role 2's grid where role 3 runs beside it on the dispatch partition and waits for its CTAs (0: after it).
  uint32_t role2_grid;
  // Role 2's combining CTAs where the graph holds it alone (abi.HEADER "solo"; a record, not read by kernels).
  uint32_t solo;
  uint8_t pad[256 - 200];
};
inline constexpr int kMaxRanks = 16;
inline constexpr int32_t kTokensSolo = 1 << 30;  // abi.TOKENS_SOLO
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
  // The fused transport across the GPUs of this process (docs/fused_transport.md): R ranks, and the CUDA ordinals of
  // every peer group, group-major (R per group; every ordinal at most once). ranks == 1: a local variant.
  int64_t ranks = 1;
  // Up to this many tokens role 3 may run beside role 2, on the dispatch partition after role 1, waiting for role 2's
  // CTAs (abi.FINALIZE_EARLY_TOKENS; 0: never, e.g. kernels whose role 3 does not wait).
  int64_t finalize_early_tokens = 0;
  // Up to this many tokens the graph holds role 2 alone (abi.scan_tokens; 0: never, e.g. v1 kernels or
  // GCMOE_SOLO=0): its `tokens` parameter carries kTokensSolo, and it is launched with solo_blocks CTAs per token
  // (at least one token) beyond its grid, which do roles 1 and 3's work (abi.solo_ctas).
  int64_t solo_tokens = 0, solo_blocks = 0;
  // Where role 2 runs alone: 0 on the compute green context (its item grid sized by that partition), 1 on the
  // stream's own context over every SM of the device, its item grid scaled to them (GCMOE_SOLO_SMS=all): role 2
  // alone has no role beside it to keep the dispatch SMs for.
  int64_t solo_all_sms = 0;
  // Where the three-node graph runs (one GPU): 0 on the dispatch and compute green contexts, 1 on the stream's own
  // context (GCMOE_GRAPH_CONTEXT=stream): no green-context switch on the layer's path; role 2's grid stays the
  // compute partition's, and the residency check counts that role 1 fits beside it (Runtime::Build).
  int64_t graph_on_stream = 0;
  std::vector<int32_t> peer_devices;
  std::array<RoleSpec, kNumRoles> role;
  std::vector<TensorMapSpec> tensormaps;  // role 2's, in formal order (none for v1 and for test kernels)
  std::vector<float> silu_table;  // 65536 entries
  Digest digest{};  // SHA-256 over everything above (cubins and the silu table by their own digests)
};

// Registry of variants, by key (the `variant` attribute of the call). Computes `spec->digest`.
void RegisterVariant(const std::string& key, std::shared_ptr<VariantSpec> spec);
std::shared_ptr<const VariantSpec> FindVariant(const std::string& key);

// Per-call device pointers, in kernel parameter order (abi.PARAMS[:13]).
using PointerParams = std::array<CUdeviceptr, kNumPointerParams>;

class PeerGroup;

struct Partition {
  unsigned total_sms = 0, dispatch_sms = 0, compute_sms = 0, alignment = 0;
};

class Runtime {
 public:
  // The Runtime of (spec, tokens, clamp, stream's device, stream) from the process-wide graph cache, built on a
  // miss; null with `*error` set when it cannot run.
  static std::shared_ptr<Runtime> Get(const CudaDriver& cu, std::shared_ptr<const VariantSpec> spec, CUstream stream,
                                      int64_t tokens, float clamp, std::string* error);
  ~Runtime();

  // Runs one call on `stream` (launch or splice into the capture). Returns "" or an error message; a fault recorded
  // by an earlier replay (of this runtime, or of another device's when the process drives several: FaultBoard in
  // gc_runtime.cc) is returned here before anything is launched. Thread-safe.
  std::string Execute(CUstream stream, const PointerParams& ptrs);

  // GCMOE_SYNC_CHECK: waits for the stream, then reports a fault of this call at once.
  std::string SyncAndCheck(CUstream stream);

  // One rank of the fused transport's virtual-rank mode (docs/fused_transport.md), not cached: the graph's roles
  // run on `ctx` (dispatch, compute: this rank's own green-context pair of `partition`) on `device`, whose primary
  // context `primary` the caller keeps retained while the runtime lives.
  static std::shared_ptr<Runtime> ForRank(const CudaDriver& cu, std::shared_ptr<const VariantSpec> spec,
                                          CUcontext primary, CUdevice device, const CUcontext ctx[2],
                                          const Partition& partition, int64_t tokens, float clamp,
                                          std::string* error);
  CUdeviceptr workspace() const { return workspace_; }
  // Writes this rank and the peer table (every rank's workspace, this one's included) into the header: before the
  // first launch, outside any capture.
  std::string SetPeers(int rank, const std::vector<CUdeviceptr>& table);
  // Test hook of one rank: its role 1 withholds local expert `e` (-1: off) from the next launch on.
  std::string SetStall(int32_t e);
  // Launches the graph on `stream` (no capture, no FaultBoard): a fault an earlier launch recorded is returned first.
  std::string Launch(CUstream stream, const PointerParams& ptrs);


 private:
  Runtime(const CudaDriver& cu) : cu_(cu) {}
  std::string Init(std::shared_ptr<const VariantSpec> spec, CUstream stream, int64_t tokens, float clamp);
  // Everything after the green-context pair: cubins, residency, workspace, graph (role_ctx_, partition_ set).
  std::string Build(int64_t tokens, float clamp);
  std::string LaunchGraph(CUstream stream, const PointerParams& ptrs);  // params (when changed), cuGraphLaunch
  std::string Retired() const;  // why this rank's group across processes was released ("" while usable)
  std::string ReadFault(CUstream stream);   // this runtime's fault record, cleared ("" when none)
  std::string CheckFault(CUstream stream);  // ReadFault through the process's FaultBoard
  std::string SetParams(const PointerParams& ptrs, bool exec);
  std::string EncodeTensorMaps();  // role 2's TensorMaps from ptrs_ (a null base pointer leaves its map zeroed)
  CUDA_KERNEL_NODE_PARAMS NodeParams(int role);  // role r's kernel node: kernel, green context, launch, params

  const CudaDriver& cu_;
  std::shared_ptr<const VariantSpec> spec_;
  CUcontext primary_ = nullptr;
  // Where a node goes that the runtime puts on the stream's own context: primary_, or with GCMOE_DEBUG_WHOLE_GREEN=1
  // a green context of every SM (Init).
  CUcontext stream_ctx_ = nullptr;
  CUdevice device_ = 0;
  Partition partition_;
  std::array<RoleSpec, kNumRoles> launch_;  // the launch triples in use (auto grids resolved; no cubin bytes)
  CUcontext role_ctx_[kNumRoles] = {nullptr, nullptr, nullptr};  // dispatch, compute, compute
  CUlibrary library_[kNumRoles] = {nullptr, nullptr, nullptr};
  CUkernel kernel_[kNumRoles] = {nullptr, nullptr, nullptr};
  CUdeviceptr workspace_ = 0;
  std::shared_ptr<PeerGroup> group_;  // the fused transport's group whose workspace this rank uses (owns it)
  int rank_ = 0;
  WorkspaceHeader* host_header_ = nullptr;  // pinned, mapped mirror of the fault record, written by the kernels
  CUgraph graph_ = nullptr;
  CUgraphExec exec_ = nullptr;
  CUgraphNode node_[kNumRoles] = {nullptr, nullptr, nullptr};  // (role 2's alone where solo_)
  bool solo_ = false;  // the graph holds role 2 alone (VariantSpec::solo_tokens, header.solo)
  // Kernel parameter storage (the graph reads it when params are set): 13 pointers, tokens, clamp.
  PointerParams ptrs_{};
  int32_t tokens_ = 0;
  float clamp_ = 0.0f;
  void* param_ptrs_[kNumAbiParams] = {};
  CUtensorMap tensormaps_[kMaxTensorMaps] = {};  // 64-byte aligned by its type
  void* role2_param_ptrs_[kNumAbiParams + kMaxTensorMaps] = {};  // the ABI's, then &tensormaps_[i]
  int32_t stall_applied_ = -1;
  bool exec_params_set_ = false;  // the instantiated graph's nodes hold ptrs_
  std::mutex mutex_;  // call sites sharing this Runtime may call from several threads
  bool live_ = false;  // counted in LiveRuntimes()
};

// Test hooks and counters, reachable through ctypes.
int64_t GraphInstantiations();
int64_t LiveRuntimes();
void SetStallExpert(int32_t e, int32_t device);

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_GC_RUNTIME_H_
