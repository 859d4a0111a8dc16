// What was compiled into this library, for gcmoe_jax.ffi (registration, version checks) and `gcmoe_jax doctor`.

#include <string>

#include "common.h"
#include "moe.h"
#include "xla/ffi/api/c_api.h"

#ifndef GCMOE_VERSION
#define GCMOE_VERSION "unknown"
#endif
#ifndef GCMOE_SOURCE_SHA256
#define GCMOE_SOURCE_SHA256 "unknown"
#endif
#ifndef GCMOE_WITH_CUDA
#define GCMOE_WITH_CUDA 0
#endif
#ifndef GCMOE_CUDA_VERSION
#define GCMOE_CUDA_VERSION ""
#endif

#if defined(__clang__)
#define GCMOE_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define GCMOE_COMPILER "gcc " __VERSION__
#else
#define GCMOE_COMPILER "unknown"
#endif

#define GCMOE_STR_(x) #x
#define GCMOE_STR(x) GCMOE_STR_(x)

// A JSON object. "targets" maps each FFI target to its platforms and, per platform, stage -> exported symbol; Python
// registers exactly these. "flags" mirrors MoeFlags. "ffi_api" is the XLA FFI C API version of the headers this
// library was compiled against: a jaxlib whose runtime API is older refuses the handlers.
GCMOE_EXPORT const char* gcmoe_ffi_build_info() {
  static const std::string info = std::string("{") +                                    //
      "\"version\": \"" GCMOE_VERSION "\", " +                                            //
      "\"source_sha256\": \"" GCMOE_SOURCE_SHA256 "\", " +                                //
      "\"ffi_api\": [" GCMOE_STR(XLA_FFI_API_MAJOR) ", " GCMOE_STR(XLA_FFI_API_MINOR) "], " +  //
      "\"compiler\": \"" GCMOE_COMPILER "\", " +                                             //
      "\"cuda\": " + (GCMOE_WITH_CUDA ? "true" : "false") + ", " +                       //
      "\"cuda_version\": \"" GCMOE_CUDA_VERSION "\", " +                                  //
      "\"flags\": {\"has_shared\": " + std::to_string(gcmoe::kMoeHasShared) +             //
      ", \"has_clamp\": " + std::to_string(gcmoe::kMoeHasClamp) + "}, " +                 //
      "\"targets\": {\"gcmoe_moe_v1\": {\"cpu\": {\"execute\": \"GcmoeMoeCpu\"}" +        //
      (GCMOE_WITH_CUDA ? ", \"CUDA\": {\"instantiate\": \"GcmoeMoeCudaInstantiate\", "
                         "\"execute\": \"GcmoeMoeCudaExecute\", "
                         "\"state_type\": [\"gcmoe_moe_cuda_state_v1\", \"GcmoeMoeCudaStateTypeId\", "
                         "\"GcmoeMoeCudaStateTypeInfo\"]}"
                       : "") +
      // GCMOE_SYNC_CHECK=1 lowers to this one: on CUDA the handler is not command-buffer compatible, so XLA calls
      // it at every execution (ffi_cuda.cc). The state type is the one registered above.
      "}, \"gcmoe_moe_sync_v1\": {\"cpu\": {\"execute\": \"GcmoeMoeCpu\"}" +  //
      (GCMOE_WITH_CUDA ? ", \"CUDA\": {\"instantiate\": \"GcmoeMoeCudaInstantiate\", "
                         "\"execute\": \"GcmoeMoeCudaExecuteSync\"}"
                       : "") +
      "}}}";
  return info.c_str();
}
