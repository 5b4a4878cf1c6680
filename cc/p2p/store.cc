#include "cc/p2p/store.h"

#include <cstdio>
#include <cstring>

#include "cc/wire.h"

namespace kungfu {

Status VariableStore::Save(const std::string& name, const void* data, int64_t count, DType dtype,
                           uint32_t shape_sig, int64_t* version) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return InvalidArgument("save: a variable name must have 1 to " + std::to_string(kMaxNameBytes) + " bytes");
  }
  if (!IsValidDType(static_cast<uint8_t>(dtype))) return InvalidArgument("save '" + name + "': bad dtype");
  if (count < 0 || count > kMaxElements || (count > 0 && data == nullptr)) {
    return InvalidArgument("save '" + name + "': bad element count " + std::to_string(count));
  }
  // Copy before taking the lock: a large save must not hold up requests of other names.
  auto copy = std::make_shared<SavedCopy>();
  copy->count = count;
  copy->dtype = dtype;
  copy->shape_sig = shape_sig;
  const int64_t bytes = copy->bytes();
  if (bytes > 0) {
    copy->data = NewBuffer(bytes);
    std::memcpy(copy->data.get(), data, static_cast<size_t>(bytes));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = copies_[name];
  // The copy is not shared yet, so setting its version here is still safe; it is immutable once published.
  copy->version = slot ? slot->version + 1 : 0;
  if (version) *version = copy->version;
  slot = std::move(copy);
  return Status::OK();
}

std::shared_ptr<const SavedCopy> VariableStore::Get(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = copies_.find(name);
  return it == copies_.end() ? nullptr : it->second;
}

namespace {
std::string DescribeSide(int64_t count, DType dtype, uint32_t sig) {
  char hex[16];
  std::snprintf(hex, sizeof(hex), "%08x", sig);
  const char* type = IsValidDType(static_cast<uint8_t>(dtype)) ? DTypeName(dtype) : "unknown";
  return std::to_string(count) + " " + type + " elements (shape signature 0x" + hex + ")";
}
}  // namespace

Status CheckRequestMatches(const std::string& holder, int64_t have_count, DType have_dtype, uint32_t have_sig,
                           int64_t want_count, DType want_dtype, uint32_t want_sig) {
  if (have_count == want_count && have_dtype == want_dtype && have_sig == want_sig) return Status::OK();
  return InvalidArgument(holder + " saved " + DescribeSide(have_count, have_dtype, have_sig) +
                         ", this worker asked for " + DescribeSide(want_count, want_dtype, want_sig));
}

}  // namespace kungfu
