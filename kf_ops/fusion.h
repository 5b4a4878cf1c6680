// Tensor fusion for the group all-reduce: which tensors share one engine all-reduce.
//
// Small tensors cost more in per-message latency than in bytes, so tensors smaller than
// fusion_bytes are packed, per dtype and in list order, into buckets of at most fusion_bytes.
// Larger tensors go alone, reduced in place with no copy. The plan depends only on the sizes and
// dtypes, so every worker computes the same plan from the same list.
#pragma once

#include <cstdint>
#include <vector>

#include "cc/dtype.h"

namespace kungfu_tf {

struct FusionPart {
  std::vector<int> tensors;  // indices into the list, in list order
  kungfu::DType dtype{};     // shared by all its tensors
  int64_t count = 0;         // total elements
  bool packed = false;       // true when the tensors are copied into one bucket buffer
};

// bytes[i], counts[i] and dtypes[i] describe tensor i. fusion_bytes <= 0 disables fusion.
std::vector<FusionPart> PlanFusion(const std::vector<int64_t>& bytes, const std::vector<int64_t>& counts,
                                   const std::vector<kungfu::DType>& dtypes, int64_t fusion_bytes);

}  // namespace kungfu_tf
