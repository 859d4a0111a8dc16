// Virtual ranks on one GPU (issue 9, docs/fused_transport.md): R disjoint (dispatch, compute) green-context pairs
// from two structured splits of the device's SMs, R workspaces, each with a peer table of the R mailboxes, and one
// probe kernel per rank launched at once on R streams of the compute green contexts (csrc/kernels/peer_probe.cu).
// It checks what the fused transport's virtual-rank mode stands on before any protocol runs: the R pairs can be
// made with the partition the geometry plans (`geometry.split_virtual_ranks`), kernels in disjoint partitions run
// concurrently, and each reaches the others' workspaces through the table. Everything is created and freed by the
// call (the driver keeps ~8.4 MB per destroyed green-context pair: a test hook, not for a loop).

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "cuda_driver.h"

namespace gcmoe {
namespace {

constexpr size_t kMailboxOffset = 512;  // the peer table (<= 64 u64) precedes the mailbox in each workspace
constexpr size_t kWorkspaceBytes = 4096;

#define GCMOE_PROBE_CU(expr) GCMOE_CU_OR_RETURN(cu, expr, #expr)

struct ProbeState {
  const CudaDriver& cu;
  CUdevice device = 0;
  CUcontext primary = nullptr;
  bool pushed = false;
  std::vector<CUgreenCtx> green;  // compute, then dispatch, per rank
  std::vector<CUstream> streams;
  std::vector<CUdeviceptr> workspaces;
  CUdeviceptr seen = 0;
  CUlibrary library = nullptr;

  explicit ProbeState(const CudaDriver& driver) : cu(driver) {}
  ~ProbeState() {  // frees whatever was made, in reverse order; errors here cannot be reported
    for (CUstream s : streams) cu.cuStreamDestroy(s);
    if (library != nullptr) cu.cuLibraryUnload(library);
    for (CUdeviceptr p : workspaces) cu.cuMemFree(p);
    if (seen != 0) cu.cuMemFree(seen);
    for (CUgreenCtx g : green) cu.cuGreenCtxDestroy(g);
    CUcontext popped;
    if (pushed) cu.cuCtxPopCurrent(&popped);
    if (primary != nullptr) cu.cuDevicePrimaryCtxRelease(device);
  }
};

std::string Probe(const CudaDriver& cu, int ordinal, int ranks, unsigned dispatch_sms, unsigned compute_sms,
                  const void* cubin, uint64_t timeout_ns, uint32_t* seen_out, int32_t* partition_out) {
  if (ranks < 1 || ranks > 64) return "gcmoe_peer_probe: ranks must be in [1, 64], got " + std::to_string(ranks);
  ProbeState st(cu);
  GCMOE_PROBE_CU(cu.cuInit(0));
  GCMOE_PROBE_CU(cu.cuDeviceGet(&st.device, ordinal));
  GCMOE_PROBE_CU(cu.cuDevicePrimaryCtxRetain(&st.primary, st.device));
  GCMOE_PROBE_CU(cu.cuCtxPushCurrent(st.primary));
  st.pushed = true;

  // Two structured splits: R compute groups of compute_sms, then R dispatch groups of dispatch_sms from the rest.
  CUdevResource all{}, rest{}, rest2{};
  GCMOE_PROBE_CU(cu.cuDeviceGetDevResource(st.device, &all, CU_DEV_RESOURCE_TYPE_SM));
  std::vector<CUdevResource> compute(ranks), dispatch(ranks);
  unsigned nc = static_cast<unsigned>(ranks), nd = static_cast<unsigned>(ranks);
  GCMOE_PROBE_CU(cu.cuDevSmResourceSplitByCount(compute.data(), &nc, &all, &rest, 0, compute_sms));
  if (nc != static_cast<unsigned>(ranks)) {
    return "gcmoe_peer_probe: " + std::to_string(all.sm.smCount) + " SMs give " + std::to_string(nc) +
           " compute group(s) of " + std::to_string(compute_sms) + ", not " + std::to_string(ranks);
  }
  GCMOE_PROBE_CU(cu.cuDevSmResourceSplitByCount(dispatch.data(), &nd, &rest, &rest2, 0, dispatch_sms));
  if (nd != static_cast<unsigned>(ranks)) {
    return "gcmoe_peer_probe: the " + std::to_string(rest.sm.smCount) + " SMs left give " + std::to_string(nd) +
           " dispatch group(s) of " + std::to_string(dispatch_sms) + ", not " + std::to_string(ranks);
  }
  std::vector<CUcontext> compute_ctx(ranks);
  for (int r = 0; r < ranks; ++r) {
    partition_out[2 * r] = static_cast<int32_t>(dispatch[r].sm.smCount);
    partition_out[2 * r + 1] = static_cast<int32_t>(compute[r].sm.smCount);
    for (CUdevResource* res : {&compute[r], &dispatch[r]}) {
      CUdevResourceDesc desc;
      GCMOE_PROBE_CU(cu.cuDevResourceGenerateDesc(&desc, res, 1));
      CUgreenCtx g = nullptr;
      GCMOE_PROBE_CU(cu.cuGreenCtxCreate(&g, desc, st.device, CU_GREEN_CTX_DEFAULT_STREAM));
      st.green.push_back(g);
    }
    GCMOE_PROBE_CU(cu.cuCtxFromGreenCtx(&compute_ctx[r], st.green[2 * r]));
    CUstream s = nullptr;
    GCMOE_PROBE_CU(cu.cuGreenCtxStreamCreate(&s, st.green[2 * r], CU_STREAM_NON_BLOCKING, 0));
    st.streams.push_back(s);
  }

  // Workspaces: the peer table (every rank's mailbox address) at offset 0, the mailbox at kMailboxOffset.
  for (int r = 0; r < ranks; ++r) {
    CUdeviceptr p = 0;
    GCMOE_PROBE_CU(cu.cuMemAlloc(&p, kWorkspaceBytes));
    st.workspaces.push_back(p);
    GCMOE_PROBE_CU(cu.cuMemsetD8(p, 0, kWorkspaceBytes));
  }
  std::vector<uint64_t> table(ranks);
  for (int r = 0; r < ranks; ++r) table[r] = st.workspaces[r] + kMailboxOffset;
  for (int r = 0; r < ranks; ++r) {
    GCMOE_PROBE_CU(cu.cuMemcpyHtoD(st.workspaces[r], table.data(), table.size() * sizeof(uint64_t)));
  }
  const size_t seen_bytes = static_cast<size_t>(ranks) * ranks * sizeof(uint32_t);
  GCMOE_PROBE_CU(cu.cuMemAlloc(&st.seen, seen_bytes));
  GCMOE_PROBE_CU(cu.cuMemsetD8(st.seen, 0, seen_bytes));

  GCMOE_PROBE_CU(cu.cuLibraryLoadData(&st.library, cubin, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel kernel = nullptr;
  GCMOE_PROBE_CU(cu.cuLibraryGetKernel(&kernel, st.library, "gcmoe_peer_probe"));
  // Every launch is queued before any is waited for: the kernels must overlap to see each other's writes.
  std::vector<CUdeviceptr> table_ptr(st.workspaces);
  std::vector<int32_t> rank_arg(ranks);
  int32_t ranks_arg = ranks;
  uint64_t timeout_arg = timeout_ns;
  for (int r = 0; r < ranks; ++r) {
    rank_arg[r] = r;
    void* params[] = {&table_ptr[r], &rank_arg[r], &ranks_arg, &timeout_arg, &st.seen};
    GCMOE_PROBE_CU(cu.cuCtxPushCurrent(compute_ctx[r]));
    CUfunction fn = nullptr;
    CUresult rc = cu.cuKernelGetFunction(&fn, kernel);
    if (rc == CUDA_SUCCESS) rc = cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, st.streams[r], params, nullptr);
    CUcontext popped;
    cu.cuCtxPopCurrent(&popped);
    if (rc != CUDA_SUCCESS) {
      const std::string what = "the launch of rank " + std::to_string(r);
      return CudaErrorMessage(cu, rc, what.c_str(), __FILE__, __LINE__);
    }
  }
  for (CUstream s : st.streams) GCMOE_PROBE_CU(cu.cuStreamSynchronize(s));
  GCMOE_PROBE_CU(cu.cuMemcpyDtoH(seen_out, st.seen, seen_bytes));
  return "";
}

#undef GCMOE_PROBE_CU

}  // namespace
}  // namespace gcmoe

// Runs the virtual-rank probe on device ordinal `device`: fills seen[ranks * ranks] (rank r saw seen[r * ranks + p]
// from rank p: p + 1, or 0 if it never arrived) and partition[ranks * 2] (dispatch, compute SMs each rank got).
// Returns 0, or -1 with the reason in `error`.
GCMOE_EXPORT int gcmoe_peer_probe(int device, int ranks, int dispatch_sms, int compute_sms, const void* cubin,
                                  int64_t timeout_ns, uint32_t* seen, int32_t* partition, char* error,
                                  int error_size) {
  std::string why;
  const gcmoe::CudaDriver* cu = gcmoe::GetCudaDriver(&why);
  if (cu != nullptr) {
    why = gcmoe::Probe(*cu, device, ranks, static_cast<unsigned>(dispatch_sms), static_cast<unsigned>(compute_sms),
                       cubin, static_cast<uint64_t>(timeout_ns), seen, partition);
  }
  if (why.empty()) return 0;
  if (error != nullptr && error_size > 0) {
    const size_t n = std::min(why.size(), static_cast<size_t>(error_size - 1));
    why.copy(error, n);
    error[n] = '\0';
  }
  return -1;
}
