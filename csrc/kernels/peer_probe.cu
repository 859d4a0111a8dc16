// Virtual-rank probe (issue 9): one launch per rank, each in its rank's compute green context, all R at once.
// `table` is the peer table in the rank's own workspace: table[p] = rank p's mailbox (R u32 slots). Lane 0 writes
// rank + 1 into slot `rank` of every mailbox (release, GPU scope), then waits, bounded by `timeout_ns`, until each
// slot of its own mailbox is set (acquire) and stores what it saw into seen[rank * ranks + p] (0: never arrived).
// The waits only end with every value when the R kernels run concurrently in their disjoint partitions.
// Built: nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -o peer_probe.cubin peer_probe.cu

#include <cstdint>

extern "C" __global__ void gcmoe_peer_probe(const uint64_t* table, int32_t rank, int32_t ranks, uint64_t timeout_ns,
                                            uint32_t* seen) {
  if (threadIdx.x != 0) return;
  for (int p = 0; p < ranks; ++p) {
    uint32_t* box = reinterpret_cast<uint32_t*>(table[p]);
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(box + rank), "r"(static_cast<uint32_t>(rank + 1))
                 : "memory");
  }
  const uint32_t* mine = reinterpret_cast<const uint32_t*>(table[rank]);
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (int p = 0; p < ranks; ++p) {
    uint32_t v = 0;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(mine + p) : "memory");
      uint64_t now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (v != 0 || now - start > timeout_ns) break;
      __nanosleep(128);
    }
    seen[rank * ranks + p] = v;
  }
}
