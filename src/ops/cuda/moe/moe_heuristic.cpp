// Which grouped expert GEMM (path, token tile) runs a MoE layer's batch: by shape only, apart
// from the kernels (moe_gemm.cuh, moe_gemm_stream.cuh), so a benchmark or a test can force
// either. Never a fallback: a forced choice that does not fit throws.
#include <algorithm>

#include "core/error.h"
#include "ops/cuda/moe/moe.h"
#include "ops/cuda/moe/moe_config.h"
#include "ops/cuda/moe/moe_gemm.cuh"

namespace dsv4::cuda::moe {
namespace {

// Mean rows per active expert (the tokens are spread over min(E, pairs) experts at most).
long rows_per_expert(const MoeDeviceWeights& w, int m, int top_k) {
  const long pairs = long(m) * top_k;
  const long active = std::max<long>(1, std::min<long>(w.n_experts, pairs));
  return (pairs + active - 1) / active;
}

bool tiled_fits(const MoeDeviceWeights& w, int tile_n) {
  const int bm = gemm_tile_rows(tile_n);
  return bm > 0 && (2 * w.inter) % bm == 0 && w.dim % bm == 0;
}

int tiled_tile(const MoeDeviceWeights& w, int m, int top_k) {
  // Expected rows per active expert decide the token tile; a tile whose weight-row block
  // does not divide both projections is skipped for the next smaller one. The 128 tile
  // narrows its MMA to the quarters a tile's rows need, so it also serves 33..128 rows.
  const long per = rows_per_expert(w, m, top_k);
  const int want = per <= kTiledTile8MaxRows ? 8 : per <= kTiledTile32MaxRows ? 32 : 128;
  for (int t : {128, 64, 32, 8})
    if (t <= want && tiled_fits(w, t)) return t;
  return 8;  // BM = 64 divides every validated shape
}

// A token takes an expert at most once, so an expert holds at most m rows: up to 16 tokens
// every expert is one tile (one pass over its weights). Beyond, 16 keeps experts with a few
// more rows than the mean in one pass; the tile's cost is shared memory, not bytes (only a
// tile's real rows are loaded) nor ALU (the dequantisation is per weight, not per token).
// Items are 64-row blocks; K runs in 128-wide blocks.
bool stream_fits(const MoeDeviceWeights& w) {
  return w.dim % 128 == 0 && w.inter % 128 == 0;
}

int stream_tile(const MoeDeviceWeights& w, int m, int top_k) {
  return m <= 8 || rows_per_expert(w, m, top_k) <= kStreamTile8MaxRows ? 8 : 16;
}

}  // namespace

const char* moe_gemm_path_name(MoeGemmPath p) {
  switch (p) {
    case MoeGemmPath::kAuto:
      return "auto";
    case MoeGemmPath::kStream:
      return "stream";
    case MoeGemmPath::kTiled:
      return "tiled";
    case MoeGemmPath::kTiledWs:
      return "tiled_ws";
  }
  return "?";
}

MoeGemmChoice moe_gemm_choice(const MoeDeviceWeights& w, int m, int top_k, MoeGemmPath path,
                              int tile_n, MoeDownQuant quant) {
  MoeGemmChoice c;
  if (path == MoeGemmPath::kAuto) {
    // tile_n given: the contract of MoeArgs::tile_n before the stream path existed (tiled).
    // Otherwise the stream path up to a few rows per expert where it fits (moe_config.h,
    // kStreamAutoMaxRowsPerExpert: measured faster there), the tiled GEMM beyond.
    path =
        tile_n == 0 && rows_per_expert(w, m, top_k) <= kStreamAutoMaxRowsPerExpert && stream_fits(w)
            ? MoeGemmPath::kStream
            : MoeGemmPath::kTiled;
    // Where the tiled path would take its 128 tile, the warp-specialised kernel instead (measured
    // faster, moe_config.h kWsTile256MinRows): its 128 tile, or its 256 tile from that many rows
    // an expert.
    if (path == MoeGemmPath::kTiled && tile_n == 0 && tiled_tile(w, m, top_k) == 128) {
      path = MoeGemmPath::kTiledWs;
      tile_n = rows_per_expert(w, m, top_k) >= kWsTile256MinRows && tiled_fits(w, 256) ? 256 : 128;
    }
  }
  c.path = path;
  if (path == MoeGemmPath::kStream) {
    c.tile_n = tile_n ? tile_n : stream_tile(w, m, top_k);
    DSV4_CHECK(c.tile_n == 8 || c.tile_n == 16, "moe: stream expert GEMM token tile ", c.tile_n,
               " (8 or 16 supported)");
    DSV4_CHECK(stream_fits(w), "moe: stream expert GEMM needs dim and inter multiples of 128 (",
               w.dim, ", ", w.inter, ")");
    c.quant_in_down = quant == MoeDownQuant::kAuto ? m <= kStreamQuantInDownMaxTokens
                                                   : quant == MoeDownQuant::kInDown;
  } else if (path == MoeGemmPath::kTiledWs) {
    c.tile_n = tile_n ? tile_n : 256;
    DSV4_CHECK(c.tile_n == 128 || c.tile_n == 256,
               "moe: the warp-specialised tiled expert GEMM's token tile is 128 or 256, not ",
               c.tile_n);
    DSV4_CHECK(tiled_fits(w, c.tile_n), "moe: token tile ", c.tile_n, " (weight rows ",
               gemm_tile_rows(c.tile_n), ") does not fit inter ", w.inter, " / dim ", w.dim);
    c.quant_in_down = false;
    DSV4_CHECK(quant != MoeDownQuant::kInDown,
               "moe: the warp-specialised tiled expert GEMM takes the separately quantised "
               "activations");
  } else {
    c.tile_n = tile_n ? tile_n : tiled_tile(w, m, top_k);
    DSV4_CHECK(tiled_fits(w, c.tile_n), "moe: token tile ", c.tile_n, " (weight rows ",
               gemm_tile_rows(c.tile_n), ") does not fit inter ", w.inter, " / dim ", w.dim);
    c.quant_in_down = moe_fuses_act_quant(c.tile_n);
    DSV4_CHECK(quant == MoeDownQuant::kAuto || c.quant_in_down == (quant == MoeDownQuant::kInDown),
               "moe: the tiled expert GEMM with token tile ", c.tile_n,
               c.quant_in_down ? " quantises the down GEMM's activations itself"
                               : " takes the separately quantised activations");
  }
  return c;
}

int moe_default_tile_n(const MoeDeviceWeights& w, int m, int top_k) {
  return moe_gemm_choice(w, m, top_k).tile_n;
}

}  // namespace dsv4::cuda::moe
