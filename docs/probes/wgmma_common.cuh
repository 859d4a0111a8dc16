// The wgmma helpers the standalone probes share (wgmma_planes.cu, wgmma_bf16.cu): error checks, the async group's
// fence / commit / wait, the accumulators' pin, the shared-memory matrix descriptor, uploads and a timed launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Pins the accumulator registers in place around the wgmma's issue and wait (the compiler must not move their reads
// or writes across either: the asm statements of both name no register of the accumulators).
template <int R>
__device__ __forceinline__ void pin(float* d) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start, leading and stride byte offsets in
// 16-byte units, no swizzle.
__device__ __forceinline__ uint64_t desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

// Runs ``launch(warm)`` once, then times ``launch(nblk)`` with CUDA events (ms); the launch's errors are checked.
template <typename Launch>
float timed(Launch&& launch, int warm, int nblk) {
  launch(warm);
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  launch(nblk);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  return ms;
}

// A device copy of ``v`` (cudaFree it).
template <typename V>
V* upload(const std::vector<V>& v) {
  V* d = nullptr;
  CHECK(cudaMalloc(&d, v.size() * sizeof(V)));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(V), cudaMemcpyHostToDevice));
  return d;
}
