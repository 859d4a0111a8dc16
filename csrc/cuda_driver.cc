// Loading of the CUDA driver (see cuda_driver.h).

#include "cuda_driver.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common.h"

namespace gcmoe {
namespace {

struct LoadResult {
  CudaDriver driver;
  std::string error;
  bool ok = false;
};

LoadResult Load() {
  LoadResult r;
  // RTLD_NOLOAD first: inside a JAX process with a CUDA plugin the driver is already mapped.
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (handle == nullptr) handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    r.error = std::string("cannot load the CUDA driver libcuda.so.1: ") + (why ? why : "unknown dlopen error");
    return r;
  }
  using GetProc = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  auto get_proc = reinterpret_cast<GetProc>(dlsym(handle, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    r.error = "the CUDA driver has no cuGetProcAddress_v2 (driver older than CUDA 12.0)";
    return r;
  }
  // cuGetProcAddress returns the newest ABI of a name up to the requested version. Three names gained a new signature
  // under the same name while cuda.h keeps declaring the old one (cudaTypedefs.h: PFN_cuStreamGetCtx_v12050 takes a
  // third argument, PFN_cuCtxGetDevice_v13000 a second, PFN_cuCtxSynchronize_v13000 a context): ask for the version
  // whose signature the header declares.
  auto version_of = [](const char* name) {
    if (std::strcmp(name, "cuStreamGetCtx") == 0) return 9020;
    if (std::strcmp(name, "cuCtxGetDevice") == 0 || std::strcmp(name, "cuCtxSynchronize") == 0) return 2000;
    return CUDA_VERSION;
  };
  auto resolve = [&](const char* name, void** fn) {
    CUdriverProcAddressQueryResult status;
    if (get_proc(name, fn, version_of(name), CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
        *fn == nullptr) {
      r.error = std::string("the CUDA driver has no ") + name;
      return false;
    }
    return true;
  };
  // The un-expanded name is looked up; cuGetProcAddress returns the version of CUDA_VERSION (these headers).
#define GCMOE_CUDA_DRIVER_RESOLVE(name) \
  if (!resolve(#name, reinterpret_cast<void**>(&r.driver.name))) return r;
  GCMOE_CUDA_DRIVER_FUNCTIONS(GCMOE_CUDA_DRIVER_RESOLVE)
#undef GCMOE_CUDA_DRIVER_RESOLVE
  r.ok = true;
  return r;
}

}  // namespace

const CudaDriver* GetCudaDriver(std::string* error) {
  static const LoadResult* const loaded = new LoadResult(Load());  // once per process, never unloaded
  if (!loaded->ok) {
    if (error != nullptr) *error = loaded->error;
    return nullptr;
  }
  return &loaded->driver;
}

std::string CudaErrorMessage(const CudaDriver& driver, CUresult result, const char* expr, const char* file, int line) {
  const char* name = nullptr;
  if (driver.cuGetErrorName == nullptr || driver.cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "unknown CUresult";
  }
  return std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed: " + name + " (" +
         std::to_string(static_cast<int>(result)) + ")";
}

}  // namespace gcmoe

// The driver version (e.g. 12080 for 12.8) for `python -m gcmoe_jax doctor`, or a negative value with the reason in
// `error` (a buffer of `error_size` bytes). 0 is never returned.
GCMOE_EXPORT int gcmoe_cuda_driver_version(char* error, int error_size) {
  std::string why;
  const gcmoe::CudaDriver* driver = gcmoe::GetCudaDriver(&why);
  int version = 0;
  if (driver != nullptr) {
    const CUresult rc = driver->cuDriverGetVersion(&version);
    if (rc == CUDA_SUCCESS) return version;
    why = gcmoe::CudaErrorMessage(*driver, rc, "cuDriverGetVersion(&version)", __FILE__, __LINE__);
  }
  return gcmoe::FailWith(why, error, error_size);
}
