// Virtual ranks on one GPU; see virtual_ranks.h. Also the ctypes entry points of the fused transport's
// virtual-rank mode: R Runtimes (one per rank, each with its own green-context pair and workspace, the workspaces'
// peer tables pointing at each other) whose graphs are launched at once on R streams.

#include "virtual_ranks.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.h"

namespace gcmoe {

#define GCMOE_VR_CU(expr) GCMOE_CU_OR_RETURN(cu, expr, #expr)

std::string SplitVirtualRanks(const CudaDriver& cu, CUdevice device, int ranks, unsigned dispatch_sms,
                              unsigned compute_sms, VirtualPairs* out) {
  if (ranks < 1 || ranks > kMaxRanks) {
    return "virtual ranks: ranks must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(ranks);
  }
  CUdevResource all{};
  GCMOE_VR_CU(cu.cuDeviceGetDevResource(device, &all, CU_DEV_RESOURCE_TYPE_SM));
  const unsigned group = std::max(1u, all.sm.minSmPartitionSize);
  if (dispatch_sms == 0 || dispatch_sms % group != 0 || compute_sms % group != 0) {
    return "virtual ranks: dispatch SMs must be a positive and compute SMs a non-negative multiple of the device's "
           "minimum partition of " + std::to_string(group) + " SMs, got " + std::to_string(dispatch_sms) + " and " +
           std::to_string(compute_sms);
  }
  unsigned n = all.sm.smCount / group;
  std::vector<CUdevResource> groups(n);
  CUdevResource rest{};
  GCMOE_VR_CU(cu.cuDevSmResourceSplitByCount(groups.data(), &n, &all, &rest, 0, group));
  // The driver makes fewer groups than SMs / group where clusters hold SM counts that are not multiples of the group
  // (H200: 15 groups of 8 from 132 SMs). compute_sms 0: every rank takes as many groups as R ranks leave it.
  if (compute_sms == 0 && n / static_cast<unsigned>(ranks) > dispatch_sms / group) {
    compute_sms = (n / static_cast<unsigned>(ranks) - dispatch_sms / group) * group;
  }
  const unsigned per_rank = dispatch_sms / group + compute_sms / group;
  if (compute_sms == 0 || n < per_rank * static_cast<unsigned>(ranks)) {
    return "virtual ranks: " + std::to_string(all.sm.smCount) + " SMs give " + std::to_string(n) + " groups of " +
           std::to_string(group) + "; " + std::to_string(ranks) + " ranks of " + std::to_string(dispatch_sms) + " + " +
           std::to_string(compute_sms) + " SMs need " + std::to_string(per_rank * ranks);
  }
  for (int r = 0; r < ranks; ++r) {
    CUdevResource* first = &groups[static_cast<size_t>(r) * per_rank];
    const unsigned nd = dispatch_sms / group;
    Partition p;
    p.total_sms = all.sm.smCount;
    p.alignment = group;
    p.dispatch_sms = p.compute_sms = 0;
    for (unsigned i = 0; i < per_rank; ++i) (i < nd ? p.dispatch_sms : p.compute_sms) += first[i].sm.smCount;
    out->partition.push_back(p);
    for (int role = 0; role < 2; ++role) {
      CUdevResourceDesc desc;
      GCMOE_VR_CU(cu.cuDevResourceGenerateDesc(&desc, role == 0 ? first : first + nd, role == 0 ? nd : per_rank - nd));
      CUgreenCtx g = nullptr;
      GCMOE_VR_CU(cu.cuGreenCtxCreate(&g, desc, device, CU_GREEN_CTX_DEFAULT_STREAM));
      out->green.push_back(g);
      CUcontext c = nullptr;
      GCMOE_VR_CU(cu.cuCtxFromGreenCtx(&c, g));
      out->ctx.push_back(c);
    }
  }
  return "";
}

void DestroyVirtualPairs(const CudaDriver& cu, VirtualPairs* pairs) {
  for (CUgreenCtx g : pairs->green) cu.cuGreenCtxDestroy(g);
  pairs->green.clear();
  pairs->ctx.clear();
  pairs->partition.clear();
}

namespace {

// R ranks of one variant on one GPU: the fused transport's virtual-rank mode (tests and `bench`).
struct VirtualRankGroup {
  const CudaDriver& cu;
  CUdevice device = 0;
  CUcontext primary = nullptr;
  VirtualPairs pairs;
  std::vector<std::shared_ptr<Runtime>> ranks;
  std::vector<CUstream> streams;

  explicit VirtualRankGroup(const CudaDriver& driver) : cu(driver) {}
  ~VirtualRankGroup() {  // everything, in reverse order; errors here cannot be reported
    if (primary == nullptr) return;
    CUcontext popped;
    const bool pushed = cu.cuCtxPushCurrent(primary) == CUDA_SUCCESS;
    for (CUstream s : streams) cu.cuStreamSynchronize(s);
    ranks.clear();
    for (CUstream s : streams) cu.cuStreamDestroy(s);
    DestroyVirtualPairs(cu, &pairs);
    if (pushed) cu.cuCtxPopCurrent(&popped);
    cu.cuDevicePrimaryCtxRelease(device);
  }

  std::string Create(const std::string& key, int ordinal, int num_ranks, unsigned dispatch_sms, unsigned compute_sms,
                     const int64_t* tokens, float clamp, int32_t* partition_out) {
    std::shared_ptr<const VariantSpec> spec = FindVariant(key);
    if (spec == nullptr) return "virtual ranks: kernel variant '" + key + "' is not registered";
    GCMOE_VR_CU(cu.cuInit(0));
    GCMOE_VR_CU(cu.cuDeviceGet(&device, ordinal));
    GCMOE_VR_CU(cu.cuDevicePrimaryCtxRetain(&primary, device));
    GCMOE_VR_CU(cu.cuCtxPushCurrent(primary));
    std::string err = SplitVirtualRanks(cu, device, num_ranks, dispatch_sms, compute_sms, &pairs);
    std::vector<CUdeviceptr> table;
    for (int r = 0; err.empty() && r < num_ranks; ++r) {
      partition_out[2 * r] = static_cast<int32_t>(pairs.partition[r].dispatch_sms);
      partition_out[2 * r + 1] = static_cast<int32_t>(pairs.partition[r].compute_sms);
      auto rt = Runtime::ForRank(cu, spec, primary, device, &pairs.ctx[2 * r], pairs.partition[r], tokens[r], clamp,
                                 &err);
      if (rt == nullptr) {
        err = "rank " + std::to_string(r) + ": " + err;
        break;
      }
      table.push_back(rt->workspace());
      ranks.push_back(std::move(rt));
      CUstream s = nullptr;
      CUresult rc = cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
      if (rc != CUDA_SUCCESS) err = CudaErrorMessage(cu, rc, "cuStreamCreate", __FILE__, __LINE__);
      else streams.push_back(s);
    }
    for (int r = 0; err.empty() && r < num_ranks; ++r) err = ranks[r]->SetPeers(r, table);
    CUcontext popped;
    cu.cuCtxPopCurrent(&popped);
    return err;
  }

  // Launches every rank's graph `repeat` times (all queued before any wait: the ranks must overlap), waits, and
  // returns the faults the ranks recorded, joined.
  std::string Run(const uint64_t* ptrs, int repeat, double* seconds) {
    GCMOE_VR_CU(cu.cuCtxPushCurrent(primary));
    std::string err;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; err.empty() && i < repeat; ++i) {
      for (size_t r = 0; err.empty() && r < ranks.size(); ++r) {
        PointerParams p;
        std::copy(ptrs + r * kNumPointerParams, ptrs + (r + 1) * kNumPointerParams, p.begin());
        err = ranks[r]->Launch(streams[r], p);
        if (!err.empty()) err = "rank " + std::to_string(r) + ": " + err;
      }
    }
    for (CUstream s : streams) {
      CUresult rc = cu.cuStreamSynchronize(s);
      if (rc != CUDA_SUCCESS && err.empty()) err = CudaErrorMessage(cu, rc, "cuStreamSynchronize", __FILE__, __LINE__);
    }
    if (seconds != nullptr) {
      *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    // The faults of this run, every rank's: Launch reports only a fault of an EARLIER launch.
    for (size_t r = 0; r < ranks.size(); ++r) {
      std::string f = ranks[r]->SyncAndCheck(streams[r]);
      if (!f.empty()) err += (err.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + f);
    }
    CUcontext popped;
    cu.cuCtxPopCurrent(&popped);
    return err;
  }
};

}  // namespace

#undef GCMOE_VR_CU

}  // namespace gcmoe

// Creates R virtual ranks of the registered variant `key` on device `device`: partition[2 r], [2 r + 1] receive the
// dispatch and compute SMs rank r got. Returns 0 and the group in *handle, or -1 with the reason in `error`.
GCMOE_EXPORT int gcmoe_virtual_ranks_create(const char* key, int device, int ranks, int dispatch_sms,
                                            int compute_sms, const int64_t* tokens, float clamp, void** handle,
                                            int32_t* partition, char* error, int error_size) {
  std::string why;
  const gcmoe::CudaDriver* cu = gcmoe::GetCudaDriver(&why);
  if (cu == nullptr) return gcmoe::FailWith(why, error, error_size);
  auto group = std::make_unique<gcmoe::VirtualRankGroup>(*cu);
  why = group->Create(key, device, ranks, static_cast<unsigned>(dispatch_sms), static_cast<unsigned>(compute_sms),
                      tokens, clamp, partition);
  if (!why.empty()) return gcmoe::FailWith(why, error, error_size);
  *handle = group.release();
  return 0;
}

// Runs every rank `repeat` times at once; `ptrs`: per rank the 13 pointer parameters of abi.PARAMS (the workspace
// slot is ignored). *seconds: host time from the first launch to the last rank's end. 0, or -1 with the faults.
GCMOE_EXPORT int gcmoe_virtual_ranks_run(void* handle, const uint64_t* ptrs, int repeat, double* seconds, char* error,
                                         int error_size) {
  std::string why = static_cast<gcmoe::VirtualRankGroup*>(handle)->Run(ptrs, repeat, seconds);
  return why.empty() ? 0 : gcmoe::FailWith(why, error, error_size);
}

// Test hook: rank `rank`'s role 1 withholds local expert `expert` (-1: off) from the next run on.
GCMOE_EXPORT int gcmoe_virtual_ranks_stall(void* handle, int rank, int expert, char* error, int error_size) {
  auto* g = static_cast<gcmoe::VirtualRankGroup*>(handle);
  if (rank < 0 || static_cast<size_t>(rank) >= g->ranks.size()) {
    return gcmoe::FailWith("virtual ranks: rank " + std::to_string(rank) + " out of range", error, error_size);
  }
  std::string why = g->ranks[rank]->SetStall(expert);
  return why.empty() ? 0 : gcmoe::FailWith(why, error, error_size);
}

GCMOE_EXPORT void gcmoe_virtual_ranks_destroy(void* handle) { delete static_cast<gcmoe::VirtualRankGroup*>(handle); }

// How many SM groups of the device's minimum partition size (*group_size) one split of device `device` makes (a
// simulated split: nothing is created). Returns the count, or -1 with the reason in `error`.
GCMOE_EXPORT int gcmoe_sm_groups(int device, int* group_size, char* error, int error_size) {
  std::string why;
  const gcmoe::CudaDriver* cu = gcmoe::GetCudaDriver(&why);
  if (cu == nullptr) return gcmoe::FailWith(why, error, error_size);
  CUdevice dev = 0;
  CUdevResource all{};
  unsigned n = 0;
  CUresult rc = cu->cuInit(0);
  if (rc == CUDA_SUCCESS) rc = cu->cuDeviceGet(&dev, device);
  if (rc == CUDA_SUCCESS) rc = cu->cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM);
  const unsigned group = std::max(1u, all.sm.minSmPartitionSize);
  if (rc == CUDA_SUCCESS) rc = cu->cuDevSmResourceSplitByCount(nullptr, &n, &all, nullptr, 0, group);
  if (rc != CUDA_SUCCESS) {
    return gcmoe::FailWith(gcmoe::CudaErrorMessage(*cu, rc, "the simulated split", __FILE__, __LINE__), error,
                           error_size);
  }
  *group_size = static_cast<int>(group);
  return static_cast<int>(n);
}
