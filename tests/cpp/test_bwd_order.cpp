// The backwards' walk over query tiles (csrc/common/query_tiles.h) and FA2's deterministic dQ
// order, on the CPU, for random lengths, masks (full, causal, two-sided and one-sided windows)
// and grids with more key tiles than the sequence (variable-length batches):
//   - every visible (row, key) lies in the walk of its key tile;
//   - the key tiles that walk a query tile (as the backwards' steps: query_tiles' range, none
//     past the keys) are one unbroken run, and the turns first_key_tile_of gives, n - first,
//     count 0, 1, 2, ... up the key tiles: the order is fixed and every turn comes from an
//     earlier key tile.
// Built with the CUTLASS / CUDA headers (tests/test_plans.py); the device code runs on the host.
#include <algorithm>
using std::max;  // the device code's min / max, on the host
using std::min;

#include <cstdlib>
#include <vector>

#include "common/query_tiles.h"
#include "check.h"

using flash::FwdParams;
using flash::Mask;

constexpr int kBlockM = 64, kBlockN = 128;  // a backward tile (FA3's, fa3_bwd_traits.h)

int main() {
  srand(1);
  for (int it = 0; it < 4000; ++it) {
    FwdParams p;
    p.causal = false;
    p.window_left = p.window_right = -1;
    switch (rand() % 4) {
      case 1: p.causal = true; break;
      case 2: p.window_left = rand() % 300, p.window_right = rand() % 300; break;
      case 3: p.window_left = rand() % 300; break;
    }
    const int seqlen_q = rand() % 700, seqlen_k = rand() % 900;
    const Mask mask(p, seqlen_q, seqlen_k);
    const int key_tiles = flash::div_up(seqlen_k, kBlockN);
    const int grid_tiles = key_tiles + rand() % 3;
    auto walk = [&](int n) {  // [begin, end) of key tile n's walk
      const flash::QueryTiles t = flash::query_tiles<kBlockM, kBlockN>(mask, n);
      return std::pair<int, int>(t.begin, n * kBlockN < seqlen_k ? t.end : 0);
    };
    for (int s = 0; s < 200 && seqlen_q > 0 && seqlen_k > 0; ++s) {
      const int i = rand() % seqlen_q, j = rand() % seqlen_k;
      if (j < mask.key_begin(i) || j >= mask.key_end(i)) continue;
      const auto [begin, end] = walk(j / kBlockN);
      CHECK(begin <= i / kBlockM && i / kBlockM < end);
    }
    for (int m = 0; m < flash::div_up(seqlen_q, kBlockM); ++m) {
      std::vector<int> walkers;  // ascending
      for (int n = 0; n < grid_tiles; ++n) {
        const auto [begin, end] = walk(n);
        if (m < begin || m >= end) continue;
        const int first = flash::first_key_tile_of<kBlockM, kBlockN>(mask, m, n);
        CHECK(n - first == int(walkers.size()));
        walkers.push_back(n);
      }
      for (size_t w = 1; w < walkers.size(); ++w) CHECK(walkers[w] == walkers[w - 1] + 1);
    }
  }
  return check_status("bwd order");
}
