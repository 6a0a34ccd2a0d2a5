// What the two indexer-logits kernels (indexer_logits.cu: mma.sync; indexer_logits_wgmma.cu:
// warpgroup MMA) receive, and the launcher of the wgmma one (the dispatcher in
// indexer_logits.cu picks the kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/common/paged_cache.h"
#include "ops/cuda/indexer/indexer.h"

namespace dsv4::cuda::indexer_detail {

struct LogitsArgs {
  const __nv_bfloat16* q_fp4;
  const __nv_bfloat16* weights;
  __nv_bfloat16* scores;
  int64_t stride;
  const int32_t* cu_seqlens;
  const int32_t* seq_pos0;
  PagedStoreView keys;
  int ratio;
  int keys_per_cta;
  int heads;  // the real head count (<= the kernel's MMA width); q_fp4 / weights rows hold this
              // many
  int cta_tokens = 0;           // query tokens a CTA's shared memory holds (wgmma kernel's layout)
  bool keys_read_once = false;  // one CTA of tokens a sequence: L2 evict-first for the keys
};

// The warpgroup-MMA logits kernel (IndexerLogitsPath::kWgmma).
void launch_logits_wgmma(const IndexerParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda::indexer_detail
