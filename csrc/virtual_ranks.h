// Virtual ranks on one GPU (issue 9, docs/fused_transport.md): R disjoint (dispatch, compute) green-context pairs
// from ONE split of the device's SMs into groups of its minimum partition size; rank r's partitions are unions of
// its own groups. (A second split of a split's remainder is refused by the driver, CUDA_ERROR_INVALID_RESOURCE_
// CONFIGURATION on the H200; a descriptor may combine any outputs of one split.)

#ifndef GCMOE_JAX_CSRC_VIRTUAL_RANKS_H_
#define GCMOE_JAX_CSRC_VIRTUAL_RANKS_H_

#include <cuda.h>

#include <string>
#include <vector>

#include "cuda_driver.h"
#include "gc_runtime.h"

namespace gcmoe {

// Green contexts made by SplitVirtualRanks: per rank (dispatch, compute), each with its context and SM count.
struct VirtualPairs {
  std::vector<CUgreenCtx> green;  // 2 per rank: dispatch, compute
  std::vector<CUcontext> ctx;     // the same order
  std::vector<Partition> partition;  // per rank
};

// Splits `device` into `ranks` pairs of `dispatch_sms` + `compute_sms` SMs (multiples of the device's minimum
// partition size; compute_sms 0: as many as the driver's groups leave each rank). On failure returns the reason and
// leaves in `out` what must still be destroyed.
std::string SplitVirtualRanks(const CudaDriver& cu, CUdevice device, int ranks, unsigned dispatch_sms,
                              unsigned compute_sms, VirtualPairs* out);

// Destroys what SplitVirtualRanks made (the driver keeps ~8.4 MB per destroyed pair: for tests and benchmarks, not
// for a loop).
void DestroyVirtualPairs(const CudaDriver& cu, VirtualPairs* pairs);

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_VIRTUAL_RANKS_H_
