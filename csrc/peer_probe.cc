// Virtual ranks on one GPU (issue 9, docs/fused_transport.md): R disjoint (dispatch, compute) green-context pairs
// from one split of the device's SMs (virtual_ranks.h), R workspaces, each with a peer table of the R mailboxes, and one
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
#include "virtual_ranks.h"

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
  VirtualPairs pairs;
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
    DestroyVirtualPairs(cu, &pairs);
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

  // R (dispatch, compute) pairs from one split of the device (virtual_ranks.h), a stream on each compute context.
  std::string err = SplitVirtualRanks(cu, st.device, ranks, dispatch_sms, compute_sms, &st.pairs);
  if (!err.empty()) return "gcmoe_peer_probe: " + err;
  std::vector<CUcontext> compute_ctx(ranks);
  for (int r = 0; r < ranks; ++r) {
    partition_out[2 * r] = static_cast<int32_t>(st.pairs.partition[r].dispatch_sms);
    partition_out[2 * r + 1] = static_cast<int32_t>(st.pairs.partition[r].compute_sms);
    compute_ctx[r] = st.pairs.ctx[2 * r + 1];
    CUstream s = nullptr;
    GCMOE_PROBE_CU(cu.cuGreenCtxStreamCreate(&s, st.pairs.green[2 * r + 1], CU_STREAM_NON_BLOCKING, 0));
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
  return why.empty() ? 0 : gcmoe::FailWith(why, error, error_size);
}
