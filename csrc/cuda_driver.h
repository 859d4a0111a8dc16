// The CUDA driver API, resolved at run time.
//
// The library is not linked against libcuda: one libgcmoe_jax_ffi.so serves CPU-only machines (where libcuda.so.1
// is absent and a link-time dependency would make the whole library, CPU handler included, fail to load) and GPU
// machines. Driver entry points are looked up once with cuGetProcAddress, at the CUDA version of the headers.

#ifndef GCMOE_JAX_CSRC_CUDA_DRIVER_H_
#define GCMOE_JAX_CSRC_CUDA_DRIVER_H_

#include <cuda.h>

#include <string>

namespace gcmoe {

// The driver entry points gcmoe uses, one X(name) each; add a line here to use another (issue 5 adds green contexts,
// libraries and graphs). `name` is the API name without version suffix: cuda.h maps some names to versioned symbols
// (cuMemAlloc -> cuMemAlloc_v2), and the member follows that mapping, so `driver.cuMemAlloc(...)` calls the right one.
#define GCMOE_CUDA_DRIVER_FUNCTIONS(X) \
  X(cuInit) \
  X(cuDriverGetVersion) \
  X(cuGetErrorName) \
  X(cuThreadExchangeStreamCaptureMode) \
  X(cuStreamGetCtx) \
  X(cuCtxPushCurrent) \
  X(cuCtxPopCurrent) \
  X(cuCtxGetDevice) \
  X(cuDeviceGetDevResource) \
  X(cuDevSmResourceSplitByCount) \
  X(cuDevResourceGenerateDesc) \
  X(cuGreenCtxCreate) \
  X(cuGreenCtxDestroy) \
  X(cuCtxFromGreenCtx) \
  X(cuLibraryLoadData) \
  X(cuLibraryUnload) \
  X(cuLibraryGetKernelCount) \
  X(cuLibraryEnumerateKernels) \
  X(cuKernelGetFunction) \
  X(cuKernelSetAttribute) \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor) \
  X(cuFuncGetAttribute) \
  X(cuMemAlloc) \
  X(cuMemFree) \
  X(cuMemsetD8) \
  X(cuMemcpyHtoD) \
  X(cuMemcpyHtoDAsync) \
  X(cuMemHostAlloc) \
  X(cuMemFreeHost) \
  X(cuMemHostGetDevicePointer) \
  X(cuGraphCreate) \
  X(cuGraphDestroy) \
  X(cuGraphAddKernelNode) \
  X(cuGraphKernelNodeSetParams) \
  X(cuGraphInstantiateWithFlags) \
  X(cuGraphExecDestroy) \
  X(cuGraphExecKernelNodeSetParams) \
  X(cuGraphLaunch) \
  X(cuStreamGetCaptureInfo) \
  X(cuGraphAddChildGraphNode) \
  X(cuStreamUpdateCaptureDependencies) \
  X(cuStreamSynchronize) \
  X(cuCtxSynchronize) \
  X(cuDeviceGet) \
  X(cuDevicePrimaryCtxRetain) \
  X(cuDeviceCanAccessPeer) \
  X(cuCtxEnablePeerAccess) \
  X(cuDevicePrimaryCtxRelease) \
  X(cuGreenCtxStreamCreate) \
  X(cuLibraryGetKernel) \
  X(cuLaunchKernel) \
  X(cuMemcpyDtoH) \
  X(cuStreamDestroy) \
  X(cuStreamCreate) \
  X(cuTensorMapEncodeTiled) \
  X(cuIpcGetMemHandle) \
  X(cuIpcOpenMemHandle) \
  X(cuIpcCloseMemHandle) \
  X(cuEventCreate) \
  X(cuEventDestroy) \
  X(cuEventRecord) \
  X(cuEventSynchronize) \
  X(cuEventElapsedTime)

struct CudaDriver {
#define GCMOE_CUDA_DRIVER_MEMBER(name) decltype(&::name) name = nullptr;
  GCMOE_CUDA_DRIVER_FUNCTIONS(GCMOE_CUDA_DRIVER_MEMBER)
#undef GCMOE_CUDA_DRIVER_MEMBER
};

// The process-wide driver table, loaded on first use; null with `*error` set when libcuda.so.1 cannot be loaded.
const CudaDriver* GetCudaDriver(std::string* error);

// "file:line: <expr> failed: CUDA_ERROR_..." (DESIGN §6.4).
std::string CudaErrorMessage(const CudaDriver& driver, CUresult result, const char* expr, const char* file, int line);

}  // namespace gcmoe

// In a function that returns the reason it failed as a std::string: returns CudaErrorMessage of `driver` when the
// driver call `expr` fails. Files wrap it as GCMOE_CU(expr) with their driver table (`text` is #expr there, so the
// message shows the call as written).
#define GCMOE_CU_OR_RETURN(driver, expr, text)                                      \
  do {                                                                              \
    CUresult gcmoe_rc_ = (expr);                                                    \
    if (gcmoe_rc_ != CUDA_SUCCESS)                                                  \
      return ::gcmoe::CudaErrorMessage(driver, gcmoe_rc_, text, __FILE__, __LINE__);  \
  } while (0)

#endif  // GCMOE_JAX_CSRC_CUDA_DRIVER_H_
