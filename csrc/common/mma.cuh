// Warp-level tensor-core primitives shared by the mma.sync families (FA1, FA2):
// ldmatrix, the m16n8k16 MMA, fp32 <-> fp16/bf16 packing, and 16-byte async copies; and the
// sm90 bulk copies and bulk reduce-adds that FA2 and FA3 use without CuTe.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A 16x16 (row-major) a[0]: (g,   2t..2t+1)  a[1]: (g+8, 2t..2t+1)
//                       a[2]: (g,   2t+8..+9)  a[3]: (g+8, 2t+8..+9)
//   B 16x8  ("col")     b[0]: (k = 2t..2t+1, n = g)  b[1]: (k = 2t+8..+9, n = g)
//   C 16x8  (fp32)      c[0..1]: (g, 2t..2t+1)   c[2..3]: (g+8, 2t..2t+1)
// The C fragments of two neighbouring n8 tiles are exactly an A fragment of one k16 slice, which
// is how P = softmax(S) feeds the next MMA straight from registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flash {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

template <typename T> struct MmaType;
template <> struct MmaType<__half> { static constexpr const char* name = "f16"; };
template <> struct MmaType<__nv_bfloat16> { static constexpr const char* name = "bf16"; };

// c += a * b for one 16x8x16 tile, fp32 accumulate. Turing (sm75) has only m16n8k8 for fp16,
// so there the k16 step is two k8 MMAs over the halves of the A and B fragments.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#elif defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[2]), "r"(a[3]), "r"(b1));
  } else {
    __trap();  // no bf16 MMA before sm80; the dispatch never sends bf16 here
  }
#endif
}

// Two fp32 values -> one register of two 16-bit values (low half = x).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t r) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<__half2*>(&r));
  } else {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
  }
}

// 16 bytes global -> shared, zero-filled when !valid. cp.async (bypassing registers and L1) on
// sm80+; Turing has no cp.async, so there it is a plain load and store.
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // With src-size 0 the hardware reads nothing and writes zeros; gmem must still be a
  // well-formed address, so callers pass the tensor base for invalid chunks.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0));
#else
  uint4 v = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
  *reinterpret_cast<uint4*>(smem) = v;
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// sm90 bulk copies (the TMA unit, no tensor map): `bytes` (a multiple of 16, both addresses
// 16-byte aligned) global -> shared, completing on an mbarrier's transaction count. The copies
// of a stage are counted first: bulk_expect(bar, total) arrives once on a barrier initialised
// with count 1; bulk_wait(bar, parity) waits for that phase (one per use of the stage).
__device__ __forceinline__ void bulk_barrier_init(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_expect(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, uint32_t bytes,
                                          uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_addr(smem)), "l"(gmem), "r"(bytes), "r"(smem_addr(bar)) : "memory");
#endif
}
// A 4-D TMA box (tensor map in kernel-parameter space, 128-byte swizzle as encoded) at
// coordinates (c0 innermost .. c3), completing on bar like bulk_copy.
__device__ __forceinline__ void tma_load_4d(void* smem, const void* tensor_map, int c0, int c1,
                                            int c2, int c3, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(smem_addr(smem)), "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1),
        "r"(c2), "r"(c3), "r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\nwait%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
}
// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones
// (bulk copies and reduce-adds reading or writing that memory).
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Orders the global-memory writes this thread has seen (its own, or acquired from others)
// before its later async-proxy accesses of global memory (bulk reduce-adds into it).
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}
// A count read with acquire semantics at GPU scope (a flag another CTA releases).
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* ptr) {
  unsigned v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
#endif
  return v;
}
// *ptr += v with release semantics at GPU scope: this thread's writes (and those it has seen)
// before it for whoever acquires the count.
__device__ __forceinline__ void red_release_gpu_add(unsigned* ptr, unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
#endif
}

// dst[0 .. 4) += (a, b, c, d) in fp32 (dst 16-byte aligned; FA2's dQ fragments, FA3's split
// dK / dV). On sm90 one vector reduction, not atomicAdd(float4*): that one is an ATOMG whose
// (unused) result and branch around it cost more than the add; before it four atomics.
__device__ __forceinline__ void red_add_v4(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

// sm90 bulk reduce-add (FA2's and FA3's dQ accumulators): dst[0 .. bytes) += src[0 .. bytes),
// fp32, shared -> global, as one bulk async-group (bytes a multiple of 16, both 16-byte
// aligned). The writers of src order their stores before it with fence_proxy_async.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;" ::"l"(dst), "r"(smem_addr(src)), "r"(bytes)
               : "memory");
#endif
}
// The same add of int32s (two's complement: the sum mod 2^32, in any order the same bits).
__device__ __forceinline__ void bulk_reduce_add_s32(int* dst, const int* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;" ::"l"(dst), "r"(smem_addr(src)), "r"(bytes)
               : "memory");
#endif
}
// Until the bulk groups this thread issued have read their shared-memory sources, all but
// the last N.
template <int N = 0>
__device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#endif
}
// Until the bulk groups this thread issued are complete (their writes done).
__device__ __forceinline__ void bulk_wait_complete() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

// Reductions over the 4 lanes (a "quad") that share one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace flash
