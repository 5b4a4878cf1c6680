#include "kf_ops/fusion.h"

#include <map>

namespace kungfu_tf {

std::vector<FusionPart> PlanFusion(const std::vector<int64_t>& bytes, const std::vector<int64_t>& counts,
                                   const std::vector<kungfu::DType>& dtypes, int64_t fusion_bytes) {
  std::vector<FusionPart> parts;
  std::vector<int64_t> part_bytes;
  std::map<kungfu::DType, size_t> open;  // dtype -> index of the bucket still taking tensors
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int index = static_cast<int>(i);
    if (fusion_bytes <= 0 || bytes[i] >= fusion_bytes) {
      parts.push_back({{index}, dtypes[i], counts[i], false});
      part_bytes.push_back(bytes[i]);
      continue;
    }
    auto it = open.find(dtypes[i]);
    if (it == open.end() || part_bytes[it->second] + bytes[i] > fusion_bytes) {
      open[dtypes[i]] = parts.size();
      parts.push_back({{}, dtypes[i], 0, true});
      part_bytes.push_back(0);
      it = open.find(dtypes[i]);
    }
    FusionPart& part = parts[it->second];
    part.tensors.push_back(index);
    part.count += counts[i];
    part_bytes[it->second] += bytes[i];
  }
  // A bucket of one tensor needs no copy.
  for (FusionPart& part : parts) {
    if (part.tensors.size() == 1) part.packed = false;
  }
  return parts;
}

}  // namespace kungfu_tf
