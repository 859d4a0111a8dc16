// Role kernels with trivial bodies and the real parameter list (gcmoe_jax/kernels/abi.py PARAMS): they measure the
// runtime's own cost (graph replay, green-context partitions, parameter updates) with the same 3-node graph.
// Role 1 publishes nothing, role 2 does nothing, role 3 advances the epoch so that the protocol stays consistent.
// Built per role: nvcc -cubin -arch=sm_90a -DGCMOE_ROLE=<1|2|3> -o trivial_role<N>.cubin trivial_roles.cu

#include <cstdint>

#define GCMOE_PARAMS                                                                                          \
  const void *x, const void *ids, const void *route_weights, const void *w13, const void *w13_scale,           \
      const void *w2, const void *w2_scale, const void *s13, const void *s13_scale, const void *s2,            \
      const void *s2_scale, void *y, uint32_t *workspace, int32_t tokens, float clamp

#if GCMOE_ROLE == 1
extern "C" __global__ void gcmoe_trivial_role1(GCMOE_PARAMS) {}
#elif GCMOE_ROLE == 2
extern "C" __global__ void gcmoe_trivial_role2(GCMOE_PARAMS) {}
#else
extern "C" __global__ void gcmoe_trivial_role3(GCMOE_PARAMS) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    workspace[0] += 1;  // header.epoch
    // The real role 3's fault check (header.error_flag, then the mirror at header.host_mirror): same cost.
    if (workspace[1] != 0) {
      uint32_t* host = *reinterpret_cast<uint32_t**>(workspace + 10);
      if (host != nullptr) {
        for (int i = 4; i < 9; ++i) host[i] = workspace[i];
        __threadfence_system();
        host[1] = 1;
      }
    }
  }
}
#endif
