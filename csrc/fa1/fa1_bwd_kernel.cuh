// FA1 backward: Algorithm 4 of the FlashAttention paper, recomputing P from (Q, K, LSE).
//
//   D = rowsum(dO o O)                              preprocess kernel, once per row
//   for j in K/V tiles:                             one block per K/V tile (per KV head)
//     load K_j, V_j; dK_j = dV_j = 0                dK_j, dV_j live in registers
//     for each query head sharing this KV head, for i in Q tiles:
//       load Q_i, dO_i, LSE_i, D_i
//       S_ij = Q_i K_j^T;  P_ij = exp(scale S_ij - LSE_i)
//       dV_j += P_ij^T dO_i
//       dP_ij = dO_i V_j^T;  dS_ij = P_ij o (dP_ij - D_i)
//       dK_j += scale dS_ij^T Q_i
//       dQ_i += scale dS_ij K_j                     fp32 atomics into a scratch buffer
//   dQ = dQ_accum in the output dtype               postprocess kernel
//
// Warps split the K/V tile's rows, so each warp computes the transposed products (S^T = K Q^T,
// dP^T = V dO^T) for its 16 keys and accumulates its 16 rows of dK and dV without any
// cross-warp reduction. dQ_i needs a sum over all keys of the tile, so dS^T goes through shared
// memory and the warps then split dQ_i's rows and columns instead.
//
// GQA: one block reduces dK and dV over all query heads of its KV head in registers, so no
// atomics touch dK or dV. dQ is summed over K/V tiles with atomics unless params.deterministic
// asks for one block per KV head walking every K/V tile in order (each dQ element then has one
// writer with a fixed order of additions: bitwise reproducible, slower).
#pragma once

#include <cmath>

#include "fa1/fa1_tiles.h"

namespace flash::fa1 {

// D_r = sum_c dO[r, c] * O[r, c] in fp32; zero for the padding rows up to rows_pad, so the
// main kernel never reads an uninitialised value. Two rows per warp, 16 lanes x 8 columns each.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kNumThreads) bwd_dot_do_o_kernel(const BwdParams p) {
  static_assert(kHeadDim <= 128, "16 lanes x 8 columns cover 128 columns");
  const int64_t rows_pad = round_up(p.seqlen_q, kRowPad);
  const int64_t total_rows = int64_t(p.batch) * p.heads * rows_pad;
  const int lane16 = threadIdx.x % 16;
  for (int64_t row = (int64_t(blockIdx.x) * kNumThreads + threadIdx.x) / 16; row < total_rows;
       row += int64_t(gridDim.x) * kNumThreads / 16) {
    const int64_t bh = row / rows_pad;
    const int r = int(row % rows_pad);
    const int b = int(bh / p.heads), h = int(bh % p.heads);
    float acc = 0.f;
    const int c = lane16 * 8;
    if (r < p.seqlen_q && c < p.head_dim) {
      const uint4 dov = *reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.dout) + b * p.do_strides.batch + r * p.do_strides.row +
          h * p.do_strides.head + c);
      const uint4 ov = *reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.o) + b * p.o_strides.batch + r * p.o_strides.row +
          h * p.o_strides.head + c);
      const uint32_t* dw = reinterpret_cast<const uint32_t*>(&dov);
      const uint32_t* ow = reinterpret_cast<const uint32_t*>(&ov);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 x = unpack2<T>(dw[w]), y = unpack2<T>(ow[w]);
        acc += x.x * y.x + x.y * y.y;
      }
    }
#pragma unroll
    for (int off = 8; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (lane16 == 0) p.dsum[row] = acc;
  }
}

// dQ = softmax_scale * dQ_accum, from fragment order back to (b, s, h, d) in the output dtype.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kNumThreads) bwd_convert_dq_kernel(const BwdParams p) {
  const int64_t rows_pad = round_up(p.seqlen_q, kRowPad);
  const int64_t frags_per_head = rows_pad / 16 * (kHeadDim / 8) * 32;  // one float4 each
  const int64_t total = int64_t(p.batch) * p.heads * frags_per_head;
  for (int64_t idx = int64_t(blockIdx.x) * kNumThreads + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * kNumThreads) {
    const int64_t bh = idx / frags_per_head;
    const int64_t f = idx % frags_per_head;
    const int lane = int(f % 32);
    const int n_tile = int(f / 32 % (kHeadDim / 8));
    const int64_t row_group = f / 32 / (kHeadDim / 8);
    const int b = int(bh / p.heads), h = int(bh % p.heads);
    const int c = n_tile * 8 + 2 * (lane % 4);
    if (c >= p.head_dim) continue;
    const float4 v = *reinterpret_cast<const float4*>(p.dq_accum + bh * rows_pad * kHeadDim +
                                                      f * 4);
    T* dq_head = static_cast<T*>(p.dq) + b * p.dq_strides.batch + h * p.dq_strides.head + c;
    const int r0 = int(row_group * 16) + lane / 4;
    if (r0 < p.seqlen_q) {
      *reinterpret_cast<uint32_t*>(dq_head + r0 * p.dq_strides.row) =
          pack2<T>(v.x * p.softmax_scale, v.y * p.softmax_scale);
    }
    if (r0 + 8 < p.seqlen_q) {
      *reinterpret_cast<uint32_t*>(dq_head + (r0 + 8) * p.dq_strides.row) =
          pack2<T>(v.z * p.softmax_scale, v.w * p.softmax_scale);
    }
  }
}

template <typename T, int kHeadDim>
__device__ __forceinline__ void bwd_block(const BwdParams& p, int kv_tiles_per_block) {
  using Tile = BwdTile<kHeadDim>;
  constexpr int Br = Tile::Br, Bc = Tile::Bc, P = kPitch<kHeadDim>, kDsPitch = Tile::kDsPitch;
  constexpr int kSTiles = Br / 8;        // n8 tiles across a warp's S^T row block (16 keys x Br)
  constexpr int kDTiles = kHeadDim / 8;  // n8 tiles across a warp's dK / dV row block
  // dQ_i (Br x d) split over the warps: kRowGroups groups of 16 rows, kColSplit column slices.
  constexpr int kRowGroups = Br / 16;
  constexpr int kColSplit = kNumWarps / kRowGroups;
  constexpr int kDqCols = kHeadDim / kColSplit;
  static_assert(kRowGroups * kColSplit == kNumWarps && kDqCols % 16 == 0, "dQ warp split");

  extern __shared__ __align__(16) char smem[];
  T* sK = reinterpret_cast<T*>(smem);        // (Bc, d)
  T* sV = sK + Bc * P;                       // (Bc, d)
  T* sQ = sV + Bc * P;                       // (Br, d)
  T* sdO = sQ + Br * P;                      // (Br, d)
  T* sdSt = sdO + Br * P;                    // dS^T: (Bc, Br)
  float* s_lse2 = reinterpret_cast<float*>(sdSt + Bc * kDsPitch);  // (Br) LSE * log2(e)
  float* s_dsum = s_lse2 + Br;                                     // (Br) D

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  const int Tr = cdiv(p.seqlen_q, Br), Tc = cdiv(p.seqlen_k, Bc);
  const int diag = p.seqlen_k - p.seqlen_q;  // query row r sees key c iff c <= r + diag
  const int chunks = cdiv(Tc, kv_tiles_per_block);
  const int64_t bhk = blockIdx.x / chunks;
  const int b = int(bhk / p.heads_k), hk = int(bhk % p.heads_k);
  const int group = p.heads / p.heads_k;
  const int j_begin = (blockIdx.x % chunks) * kv_tiles_per_block;
  const int j_end = min(Tc, j_begin + kv_tiles_per_block);

  const int64_t rows_pad = round_up(p.seqlen_q, kRowPad);
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_strides.batch + hk * p.k_strides.head;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_strides.batch + hk * p.v_strides.head;
  T* dk_head = static_cast<T*>(p.dk) + b * p.dk_strides.batch + hk * p.dk_strides.head;
  T* dv_head = static_cast<T*>(p.dv) + b * p.dv_strides.batch + hk * p.dv_strides.head;

  for (int j = j_begin; j < j_end; ++j) {
    // The first Q tile with a row that sees key j * Bc (causal); all of them otherwise.
    const int first_row = j * Bc - diag;
    const int i_first = !p.causal || first_row <= 0 ? 0 : first_row / Br;

    float dk[kDTiles][4], dv[kDTiles][4];
#pragma unroll
    for (int nt = 0; nt < kDTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.f;
    }

    __syncthreads();  // every warp is done with the previous K_j, V_j
    load_tile<T, Bc, kHeadDim>(sK, k_head, p.k_strides.row, j * Bc, p.seqlen_k, p.head_dim, tid);
    load_tile<T, Bc, kHeadDim>(sV, v_head, p.v_strides.row, j * Bc, p.seqlen_k, p.head_dim, tid);
    copy_async_commit();  // waited on with the first Q_i, or below when no query sees tile j

    for (int h = hk * group; h < (hk + 1) * group; ++h) {
      const int64_t bh = int64_t(b) * p.heads + h;
      const T* q_head = static_cast<const T*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head;
      const T* do_head =
          static_cast<const T*>(p.dout) + b * p.do_strides.batch + h * p.do_strides.head;
      float* dq_acc = p.dq_accum + bh * rows_pad * kHeadDim;

      for (int i = i_first; i < Tr; ++i) {
        __syncthreads();  // every warp is done with Q_i, dO_i, dS^T of the previous step
        load_tile<T, Br, kHeadDim>(sQ, q_head, p.q_strides.row, i * Br, p.seqlen_q, p.head_dim,
                                   tid);
        load_tile<T, Br, kHeadDim>(sdO, do_head, p.do_strides.row, i * Br, p.seqlen_q,
                                   p.head_dim, tid);
        copy_async_commit();
        if (tid < Br) {
          // Rows past seqlen_q get LSE = +inf, so their P is exactly 0.
          const int r = i * Br + tid;
          s_lse2[tid] = r < p.seqlen_q ? p.lse[bh * p.seqlen_q + r] * float(M_LOG2E) : INFINITY;
          s_dsum[tid] = p.dsum[bh * rows_pad + r];
        }
        copy_async_wait<0>();
        __syncthreads();

        // S^T = K_j Q_i^T and dP^T = V_j dO_i^T for this warp's 16 keys: (16, Br) each.
        float st[kSTiles][4], dpt[kSTiles][4];
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          uint32_t ak[4], av[4];
          ldmatrix_x4(ak, sK + (warp * 16 + lane % 16) * P + kk * 16 + (lane / 16) * 8);
          ldmatrix_x4(av, sV + (warp * 16 + lane % 16) * P + kk * 16 + (lane / 16) * 8);
#pragma unroll
          for (int nn = 0; nn < Br / 16; ++nn) {
            const int off = (nn * 16 + lane % 8 + (lane / 16) * 8) * P + kk * 16 +
                            ((lane / 8) % 2) * 8;
            uint32_t bq[4], bdo[4];
            ldmatrix_x4(bq, sQ + off);
            ldmatrix_x4(bdo, sdO + off);
            mma_16816<T>(st[2 * nn], ak, bq[0], bq[1]);
            mma_16816<T>(st[2 * nn + 1], ak, bq[2], bq[3]);
            mma_16816<T>(dpt[2 * nn], av, bdo[0], bdo[1]);
            mma_16816<T>(dpt[2 * nn + 1], av, bdo[2], bdo[3]);
          }
        }

        // P^T = exp2(scale_log2 S^T - LSE2) (0 where masked); dS^T = P^T o (dP^T - D).
        const bool masked =
            (j + 1) * Bc > p.seqlen_k || (p.causal && (j + 1) * Bc - 1 > i * Br + diag);
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int q_local = nt * 8 + 2 * t + (e % 2);
            float pr = exp2f(st[nt][e] * p.softmax_scale_log2 - s_lse2[q_local]);
            if (masked) {
              const int key = j * Bc + warp * 16 + g + 8 * (e / 2);
              if (key >= p.seqlen_k || (p.causal && key > i * Br + q_local + diag)) pr = 0.f;
            }
            st[nt][e] = pr;
            dpt[nt][e] = pr * (dpt[nt][e] - s_dsum[q_local]);
          }
        }

        // dV_j += P^T dO_i and dK_j += dS^T Q_i; P^T and dS^T feed the MMA from registers.
#pragma unroll
        for (int kk = 0; kk < Br / 16; ++kk) {
          const uint32_t ap[4] = {pack2<T>(st[2 * kk][0], st[2 * kk][1]),
                                  pack2<T>(st[2 * kk][2], st[2 * kk][3]),
                                  pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                  pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
          const uint32_t ads[4] = {pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]),
                                   pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]),
                                   pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                   pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
          // dS^T also goes to shared memory for dQ: rows = keys, columns = queries.
          T* ds_row = sdSt + (warp * 16 + g) * kDsPitch + kk * 16 + 2 * t;
          *reinterpret_cast<uint32_t*>(ds_row) = ads[0];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * kDsPitch) = ads[1];
          *reinterpret_cast<uint32_t*>(ds_row + 8) = ads[2];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * kDsPitch + 8) = ads[3];
#pragma unroll
          for (int nn = 0; nn < kHeadDim / 16; ++nn) {
            const int off = (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * P + nn * 16 +
                            (lane / 16) * 8;
            uint32_t bdo[4], bq[4];
            ldmatrix_x4_trans(bdo, sdO + off);
            ldmatrix_x4_trans(bq, sQ + off);
            mma_16816<T>(dv[2 * nn], ap, bdo[0], bdo[1]);
            mma_16816<T>(dv[2 * nn + 1], ap, bdo[2], bdo[3]);
            mma_16816<T>(dk[2 * nn], ads, bq[0], bq[1]);
            mma_16816<T>(dk[2 * nn + 1], ads, bq[2], bq[3]);
          }
        }
        __syncthreads();  // dS^T complete in shared memory

        // dQ_i += dS K_j (the softmax scale is applied once, in the convert kernel).
        const int rg = warp % kRowGroups, col0 = (warp / kRowGroups) * kDqCols;
        float dq[kDqCols / 8][4];
#pragma unroll
        for (int nt = 0; nt < kDqCols / 8; ++nt) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, sdSt + (kk * 16 + lane % 8 + (lane / 16) * 8) * kDsPitch +
                                   rg * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
          for (int nn = 0; nn < kDqCols / 16; ++nn) {
            uint32_t bk[4];
            ldmatrix_x4_trans(bk, sK + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * P + col0 +
                                      nn * 16 + (lane / 16) * 8);
            mma_16816<T>(dq[2 * nn], a, bk[0], bk[1]);
            mma_16816<T>(dq[2 * nn + 1], a, bk[2], bk[3]);
          }
        }
        const int64_t row_group = int64_t(i) * kRowGroups + rg;
#pragma unroll
        for (int nt = 0; nt < kDqCols / 8; ++nt) {
          float* dst = dq_acc + frag_offset<kHeadDim>(row_group, col0 / 8 + nt, lane);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float4*>(dst), make_float4(dq[nt][0], dq[nt][1], dq[nt][2], dq[nt][3]));
#else
#pragma unroll
          for (int e = 0; e < 4; ++e) atomicAdd(dst + e, dq[nt][e]);
#endif
        }
      }
    }

    copy_async_wait<0>();

    // dK_j = scale dS^T Q summed over the tile's queries and the group's heads; dV_j likewise.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = j * Bc + warp * 16 + g + 8 * half;
      if (key >= p.seqlen_k) continue;
#pragma unroll
      for (int nt = 0; nt < kDTiles; ++nt) {
        const int c = nt * 8 + 2 * t;
        if (c >= p.head_dim) continue;
        *reinterpret_cast<uint32_t*>(dk_head + key * p.dk_strides.row + c) =
            pack2<T>(dk[nt][2 * half] * p.softmax_scale, dk[nt][2 * half + 1] * p.softmax_scale);
        *reinterpret_cast<uint32_t*>(dv_head + key * p.dv_strides.row + c) =
            pack2<T>(dv[nt][2 * half], dv[nt][2 * half + 1]);
      }
    }
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kNumThreads) bwd_kernel(const BwdParams p, int kv_tiles_per_block) {
  if constexpr (kCompileBody<T>) {
    bwd_block<T, kHeadDim>(p, kv_tiles_per_block);
  } else {
    __trap();  // the dispatch sends bf16 to sm80+ only
  }
}

}  // namespace flash::fa1
