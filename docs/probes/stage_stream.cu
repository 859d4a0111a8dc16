// Role 2's stage stream without its math: what an SM can pull through role 2's cp.async pipeline (stage_stream.py).
//
// Each CTA (256 threads) claims items from a counter, as role 2 does; an item is 128 weight rows of one expert over
// its K: kb_n K128 stages of 8 KB (the compact E2M1 tile, rows of 64 B, `[E, K/128, N, 64]`) and, per mode, the
// rows' scale words (`[E, N, K/128]` int32): mode 0 none, 1 one 4-B copy per row and stage (role 2's copies), 2 one
// 8-B copy per row and paired step (GCMOE_ABLATION=scpair); 3: the words MN-major (`[E, K/128, N]`, session 53), a
// stage's 512-B run by 32 16-B copies; 4: mode 3's bytes by the TMA engine (two 1-D bulk copies a stage, thread 0,
// onto the slot's mbarrier; K128 stages per item a multiple of kSlots). Stages sit in kSlots slots, a CTA barrier
// every two, kSlots - 2 stages in flight (role 2's paired steps). After each barrier every thread reads its part of
// the step's two stages from SMEM (so the copies must land) and then spins ``spin`` clocks: the stage's math
// stand-in.
// Built three times, for 1, 2 and 3 CTAs per SM (`__launch_bounds__`), so one cubin answers whether an SM's rate
// grows with its CTAs when the math is left out or replaced by a fixed latency.
#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int kRows = 128;
constexpr int kTile = kRows * 64;          // 8 KB of E2M1 per stage
constexpr int kSlot = kTile + kRows * 8;   // + the scale area (8 B a row: mode 2's pairs)
constexpr int kSlots = 8;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Mode 4: a stage by the TMA engine, one 1-D bulk copy of its 8 KB (and one of its 512 B of MN-major words) onto
// the slot's mbarrier, which thread 0 arms with the bytes to expect; every thread waits on the slot's phase.
__device__ __forceinline__ void bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t mbar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(mbar) : "memory");
}

__device__ __forceinline__ void mbar_expect(uint32_t mbar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mbar), "r"(bytes) : "memory");
}

// Mode 4's mbarrier of slot j, after the slots.
__device__ __forceinline__ uint32_t slot_mbar(uint8_t* smem, int j) { return smem_addr(smem + kSlots * kSlot + j * 8); }

__device__ __forceinline__ void mbar_wait(uint32_t mbar, uint32_t parity) {
  asm volatile("{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT; }"
               ::"r"(mbar), "r"(parity) : "memory");
}

// Stage kb of the item at (w_item, s_item) into slot kb % kSlots; mode 2 copies the scale pair with even stages.
__device__ __forceinline__ void issue(uint8_t* smem, const uint8_t* w_item, const uint32_t* s_item, int kb, int n_rows,
                                      int kb_n, int mode) {
  const int tid = threadIdx.x;
  uint8_t* slot = smem + (kb % kSlots) * kSlot;
  const uint8_t* src = w_item + static_cast<int64_t>(kb) * n_rows * 64;
  if (mode == 4) {
    if (tid == 0) {
      const uint32_t mbar = slot_mbar(smem, kb % kSlots);
      mbar_expect(mbar, kTile + kRows * 4);
      bulk(smem_addr(slot), src, kTile, mbar);
      bulk(smem_addr(slot + kTile), s_item + static_cast<int64_t>(kb) * n_rows, kRows * 4, mbar);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kTile / 16 / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / 4, col = c % 4;
    cp16(smem_addr(slot + row * 64 + ((col ^ ((row / 2) % 4)) << 4)), src + row * 64 + col * 16);
  }
  if (tid < kRows) {
    const uint32_t* word = s_item + static_cast<int64_t>(tid) * kb_n + kb;
    if (mode == 1) {
      cp4(smem_addr(slot + kTile + tid * 4), word);
    } else if (mode == 2 && kb % 2 == 0) {
      uint8_t* pair_slot = smem + ((kb + tid / 64) % kSlots) * kSlot;
      cp8(smem_addr(pair_slot + kTile + (tid % 64) * 8), word);
    }
  }
  if (mode == 3 && tid < kRows / 4) {
    // MN-major words (`[E, K/128, N]`, s_item at the item's first row of block 0): the stage's run of 512 B.
    cp16(smem_addr(slot + kTile + tid * 16), s_item + static_cast<int64_t>(kb) * n_rows + tid * 4);
  }
}

__device__ __forceinline__ void stream_body(const uint8_t* __restrict__ w, const uint32_t* __restrict__ sc,
                                            int experts, int n_rows, int kb_n, int mode, int spin,
                                            unsigned int* counter, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int item_s;
  const int tid = threadIdx.x;
  const int items = experts * (n_rows / kRows);
  uint32_t acc = 0;
  if (mode == 4 && tid == 0) {
    for (int j = 0; j < kSlots; ++j) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(slot_mbar(smem, j)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  int uses = 0;  // (mode 4) completed phases of every slot's mbarrier before this item: kb_n / kSlots an item
  for (;;) {
    if (tid == 0) item_s = atomicAdd(counter, 1u);
    __syncthreads();
    const int item = item_s;
    __syncthreads();  // (item_s read by all before thread 0 claims again)
    if (item >= items) break;
    const int e = item / (n_rows / kRows), rb = item % (n_rows / kRows);
    const uint8_t* w_item = w + (static_cast<int64_t>(e) * kb_n * n_rows + rb * kRows) * 64;
    const uint32_t* s_item = mode >= 3 ? sc + static_cast<int64_t>(e) * kb_n * n_rows + rb * kRows
                                       : sc + (static_cast<int64_t>(e) * n_rows + rb * kRows) * kb_n;
    for (int s = 0; s < kSlots - 2; ++s) {
      if (s < kb_n) issue(smem, w_item, s_item, s, n_rows, kb_n, mode);
      commit();
    }
    for (int kb = 0; kb < kb_n; kb += 2) {
      wait_group<kSlots - 4>();
      if (mode == 4) {
        for (int q = 0; q < 2; ++q) {
          mbar_wait(slot_mbar(smem, (kb + q) % kSlots), (uses + (kb + q) / kSlots) & 1);
        }
      }
      __syncthreads();
      for (int q = 0; q < 2; ++q) {
        const int nk = kb + kSlots - 2 + q;
        if (nk < kb_n) issue(smem, w_item, s_item, nk, n_rows, kb_n, mode);
        commit();
      }
      // The step's two stages: this thread's 32 B of weights and its row's scale word of each.
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const uint8_t* slot = smem + ((kb + q) % kSlots) * kSlot;
        const uint4 v0 = *reinterpret_cast<const uint4*>(slot + tid * 32);
        const uint4 v1 = *reinterpret_cast<const uint4*>(slot + tid * 32 + 16);
        acc ^= v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w;
        if (mode != 0) acc += *reinterpret_cast<const uint32_t*>(slot + kTile + (tid % kRows) * 4);
      }
      if (spin > 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < spin) {
        }
      }
    }
    wait_group<0>();
    __syncthreads();
    uses += kb_n / kSlots;
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // (keeps the reads; practically never stores)
}

}  // namespace

#define STREAM_KERNEL(CTAS)                                                                                         \
  extern "C" __global__ void __launch_bounds__(kThreads, CTAS)                                                      \
      stage_stream_##CTAS(const uint8_t* w, const uint32_t* sc, int experts, int n_rows, int kb_n, int mode,        \
                          int spin, unsigned int* counter, uint32_t* sink) {                                        \
    stream_body(w, sc, experts, n_rows, kb_n, mode, spin, counter, sink);                                           \
  }

STREAM_KERNEL(1)
STREAM_KERNEL(2)
STREAM_KERNEL(3)
