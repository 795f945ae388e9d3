// FA1 forward: Algorithm 1 of the FlashAttention paper (Dao et al., 2022).
//
//   for j in 0 .. Tc-1:                      outer loop over K/V tiles, staged in shared memory
//     load K_j, V_j
//     for i in 0 .. Tr-1:                    inner loop over Q tiles
//       load Q_i, and O_i, l_i, m_i from global memory
//       S_ij = Q_i K_j^T                     (tensor cores, fp32 accumulate)
//       m~_ij = rowmax(S_ij); P~_ij = exp(S_ij - m~_ij); l~_ij = rowsum(P~_ij)
//       m_new = max(m_i, m~_ij); l_new = e^(m_i - m_new) l_i + e^(m~_ij - m_new) l~_ij
//       O_i = diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~_ij - m_new) P~_ij V_j)
//       write O_i, l_i = l_new, m_i = m_new back to global memory
//
// The running O lives in an fp32 scratch buffer (params.workspace), not in the output dtype,
// so Tc read-modify-write steps do not each round it to fp16. The step that visits a Q tile's
// last K/V tile writes the output and LSE instead. Two departures from the paper, both to fill
// a GPU larger than the batch * heads of a long-sequence run: a block walks only a slice of the
// Q tiles (params.q_tiles_per_block; one block per (batch, head) when that covers all of them),
// and e^(m~_ij - m_new) is folded into P~ by exponentiating against m_new directly.
//
// All exponentials are exp2 with softmax_scale * log2(e) folded into the scores: m and l are
// kept in that base-2 domain and converted to a natural-log LSE once, at the end.
#pragma once

#include <cmath>

#include "fa1/fa1_tiles.h"

namespace flash::fa1 {

struct FwdShape {
  int Br, Bc, Tr, Tc, diag;  // diag = seqlen_k - seqlen_q: row r sees key c iff c <= r + diag
  bool causal;

  // The last K/V tile that Q tile i sees (-1: none, every row of the tile is masked).
  __device__ int last_kv_tile(int i, int seqlen_q) const {
    if (!causal) return Tc - 1;
    const int last_key = min(seqlen_q, (i + 1) * Br) - 1 + diag;
    return last_key < 0 ? -1 : min(Tc - 1, last_key / Bc);
  }
  // The first Q tile that sees any key of K/V tile j.
  __device__ int first_q_tile(int j) const {
    if (!causal) return 0;
    const int first_row = j * Bc - diag;
    return first_row <= 0 ? 0 : first_row / Br;
  }
  // Whether tile (i, j) has any masked element: keys past seqlen_k or above the diagonal.
  __device__ bool needs_mask(int i, int j, int seqlen_k) const {
    return (j + 1) * Bc > seqlen_k || (causal && (j + 1) * Bc - 1 > i * Br + diag);
  }
};

template <typename T, int kHeadDim, bool kWide>
__device__ __forceinline__ void fwd_block(const FwdParams& p) {
  using Tile = FwdTile<kHeadDim, kWide>;
  constexpr int Br = Tile::Br, Bc = Tile::Bc, P = kPitch<kHeadDim>;
  constexpr int kSTiles = Bc / 8;        // n8 tiles across a warp's S row block
  constexpr int kOTiles = kHeadDim / 8;  // n8 tiles across a warp's O row block

  extern __shared__ __align__(16) char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // (Br, d)
  T* sK = sQ + Br * P;                 // (Bc, d)
  T* sV = sK + Bc * P;                 // (Bc, d)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // this lane's accumulator rows g, g+8 and columns 2t, 2t+1

  const FwdShape shape{Br, Bc, cdiv(p.seqlen_q, Br), cdiv(p.seqlen_k, Bc),
                       p.seqlen_k - p.seqlen_q, p.causal};
  // Blocks of one (batch, head) are consecutive, so they share K/V through L2.
  const int chunks = cdiv(shape.Tr, p.q_tiles_per_block);
  const int64_t bh = blockIdx.x / chunks;
  const int b = int(bh / p.heads), h = int(bh % p.heads);
  const int hk = h / (p.heads / p.heads_k);
  const int i_begin = (blockIdx.x % chunks) * p.q_tiles_per_block;
  const int i_end = min(shape.Tr, i_begin + p.q_tiles_per_block);

  const T* q_head = static_cast<const T*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_strides.batch + hk * p.k_strides.head;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_strides.batch + hk * p.v_strides.head;
  T* o_head = static_cast<T*>(p.o) + b * p.o_strides.batch + h * p.o_strides.head;
  float* lse_head = p.lse + bh * p.seqlen_q;

  // Scratch: O (rows_pad x kHeadDim, fragment order), then m and l (rows_pad each) per head.
  const int64_t rows_pad = round_up(p.seqlen_q, kRowPad);
  const int64_t num_heads_total = int64_t(p.batch) * p.heads;
  float* o_acc = static_cast<float*>(p.workspace) + bh * rows_pad * kHeadDim;
  float* m_run = static_cast<float*>(p.workspace) + num_heads_total * rows_pad * kHeadDim +
                 bh * rows_pad;
  float* l_run = m_run + num_heads_total * rows_pad;

  // Q tiles whose rows all see no key (causal with seqlen_q > seqlen_k): O = 0, LSE = +inf.
  for (int i = i_begin; i < i_end && shape.last_kv_tile(i, p.seqlen_q) < 0; ++i) {
    for (int idx = tid; idx < Br * kHeadDim; idx += kNumThreads) {
      const int r = i * Br + idx / kHeadDim, c = idx % kHeadDim;
      if (r < p.seqlen_q && c < p.head_dim) o_head[r * p.o_strides.row + c] = T(0.f);
    }
    for (int r = i * Br + tid; r < min(p.seqlen_q, (i + 1) * Br); r += kNumThreads) {
      lse_head[r] = INFINITY;
    }
  }
  if (i_begin >= i_end) return;
  const int j_end = shape.last_kv_tile(i_end - 1, p.seqlen_q);

  int q_in_smem = -1;  // with one Q tile per block, Q_i stays in shared memory across j
  for (int j = 0; j <= j_end; ++j) {
    const int i_first = max(i_begin, shape.first_q_tile(j));
    __syncthreads();  // every warp is done with the previous K_j, V_j
    load_tile<T, Bc, kHeadDim>(sK, k_head, p.k_strides.row, j * Bc, p.seqlen_k, p.head_dim, tid);
    load_tile<T, Bc, kHeadDim>(sV, v_head, p.v_strides.row, j * Bc, p.seqlen_k, p.head_dim, tid);

    for (int i = i_first; i < i_end; ++i) {
      if (i != i_first) __syncthreads();  // every warp is done with the previous Q_i
      if (i != q_in_smem) {
        load_tile<T, Br, kHeadDim>(sQ, q_head, p.q_strides.row, i * Br, p.seqlen_q, p.head_dim,
                                   tid);
        q_in_smem = i;
      }
      copy_async_commit();

      // Each warp owns 16 rows of the Q tile: rows r0 = row_base + g and r1 = r0 + 8.
      const int row_base = i * Br + warp * 16;
      const int64_t row_group = row_base / 16;
      const int j_last = shape.last_kv_tile(i, p.seqlen_q);

      // m_i, l_i now (their loads fly while the tensor cores compute S_ij); O_i only after the
      // softmax, when S_ij has shrunk to P~_ij in 16-bit, so S and O are never live together.
      float m_old[2] = {-INFINITY, -INFINITY}, l_old[2] = {0.f, 0.f};
      if (j > 0) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          m_old[half] = m_run[row_base + g + 8 * half];
          l_old[half] = l_run[row_base + g + 8 * half];
        }
      }

      copy_async_wait<0>();
      __syncthreads();

      // S_ij = Q_i K_j^T for this warp's 16 rows: (16, Bc) in kSTiles C fragments.
      float s[kSTiles][4];
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const T* q_warp = sQ + warp * 16 * P;
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, q_warp + (lane % 16) * P + kk * 16 + (lane / 16) * 8);
#pragma unroll
        for (int nn = 0; nn < Bc / 16; ++nn) {
          uint32_t bk[4];
          ldmatrix_x4(bk, sK + (nn * 16 + lane % 8 + (lane / 16) * 8) * P + kk * 16 +
                              ((lane / 8) % 2) * 8);
          mma_16816<T>(s[2 * nn], a, bk[0], bk[1]);
          mma_16816<T>(s[2 * nn + 1], a, bk[2], bk[3]);
        }
      }

      // Scale into the exp2 domain; mask keys past seqlen_k and above the causal diagonal.
      const bool masked = shape.needs_mask(i, j, p.seqlen_k);
      float m_tile[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[nt][e] * p.softmax_scale_log2;
          if (masked) {
            const int r = row_base + g + 8 * (e / 2);
            const int c = j * Bc + nt * 8 + 2 * t + (e % 2);
            if (c >= p.seqlen_k || (p.causal && c > r + shape.diag)) x = -INFINITY;
          }
          s[nt][e] = x;
          m_tile[e / 2] = fmaxf(m_tile[e / 2], x);
        }
      }

      // m_new = max(m_i, m~_ij); P~ = exp(S - m_new); l_new = e^(m_i - m_new) l_i + rowsum(P~).
      float m_new[2], scale_old[2], inv_l_new[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        m_new[half] = fmaxf(m_old[half], quad_max(m_tile[half]));
        // A row with no visible key so far keeps m = -inf; exponentiate against 0 so that
        // exp2(-inf - m) is 0, not NaN.
        const float m_use = m_new[half] == -INFINITY ? 0.f : m_new[half];
        float row_sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
          s[nt][2 * half] = exp2f(s[nt][2 * half] - m_use);
          s[nt][2 * half + 1] = exp2f(s[nt][2 * half + 1] - m_use);
          row_sum += s[nt][2 * half] + s[nt][2 * half + 1];
        }
        const float alpha = exp2f(m_old[half] - m_use);
        const float l_new = alpha * l_old[half] + quad_sum(row_sum);
        scale_old[half] = alpha * l_old[half];  // diag(l_i) e^(m_i - m_new)
        inv_l_new[half] = l_new > 0.f ? 1.f / l_new : 0.f;
        l_old[half] = l_new;
      }

      // Two neighbouring S C-fragments are one A fragment of P~ (see common/mma.cuh).
      uint32_t pa[Bc / 16][4];
#pragma unroll
      for (int kk = 0; kk < Bc / 16; ++kk) {
        pa[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      }

      // O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + P~ V_j).
      float o[kOTiles][4];
#pragma unroll
      for (int nt = 0; nt < kOTiles; ++nt) {
        if (j == 0) {
          o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
        } else {
          const float4 v4 = *reinterpret_cast<const float4*>(
              o_acc + frag_offset<kHeadDim>(row_group, nt, lane));
          o[nt][0] = v4.x * scale_old[0]; o[nt][1] = v4.y * scale_old[0];
          o[nt][2] = v4.z * scale_old[1]; o[nt][3] = v4.w * scale_old[1];
        }
      }
#pragma unroll
      for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
        for (int nn = 0; nn < kHeadDim / 16; ++nn) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, sV + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * P + nn * 16 +
                                    (lane / 16) * 8);
          mma_16816<T>(o[2 * nn], pa[kk], bv[0], bv[1]);
          mma_16816<T>(o[2 * nn + 1], pa[kk], bv[2], bv[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < kOTiles; ++nt) {
        o[nt][0] *= inv_l_new[0]; o[nt][1] *= inv_l_new[0];
        o[nt][2] *= inv_l_new[1]; o[nt][3] *= inv_l_new[1];
      }

      if (j < j_last) {
        // Write O_i, m_i, l_i back for the next K/V tile.
#pragma unroll
        for (int nt = 0; nt < kOTiles; ++nt) {
          *reinterpret_cast<float4*>(o_acc + frag_offset<kHeadDim>(row_group, nt, lane)) =
              make_float4(o[nt][0], o[nt][1], o[nt][2], o[nt][3]);
        }
        if (t == 0) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            m_run[row_base + g + 8 * half] = m_new[half];
            l_run[row_base + g + 8 * half] = l_old[half];
          }
        }
      } else {
        // Last K/V tile this Q tile sees: O in the output dtype and LSE = ln(l) + m (natural
        // log); a row that saw no key keeps O = 0 and gets LSE = +inf.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = row_base + g + 8 * half;
          if (r >= p.seqlen_q) continue;
          T* o_row = o_head + r * p.o_strides.row;
#pragma unroll
          for (int nt = 0; nt < kOTiles; ++nt) {
            const int c = nt * 8 + 2 * t;
            if (c < p.head_dim) {
              *reinterpret_cast<uint32_t*>(o_row + c) =
                  pack2<T>(o[nt][2 * half], o[nt][2 * half + 1]);
            }
          }
          if (t == 0) {
            lse_head[r] = l_old[half] > 0.f
                              ? (m_new[half] + log2f(l_old[half])) * float(M_LN2)
                              : INFINITY;
          }
        }
      }
    }
  }
}

template <typename T, int kHeadDim, bool kWide>
__global__ void __launch_bounds__(kNumThreads) fwd_kernel(const FwdParams p) {
  if constexpr (kCompileBody<T, kWide>) {
    fwd_block<T, kHeadDim, kWide>(p);
  } else {
    __trap();  // run_fwd and the dispatch send bf16 and wide tiles to sm80+ only
  }
}

}  // namespace flash::fa1
