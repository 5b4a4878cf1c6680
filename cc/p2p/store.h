// The local variable store of peer-to-peer requests: name -> the latest saved copy of a tensor.
//
// Threading and ownership: every method is thread-safe (one mutex guards the map, and is never
// held while bytes are copied). A saved copy is an immutable SavedCopy behind a shared_ptr: a save
// builds a new one and swaps it in, so a reader (a response still being written to a socket, a
// local request still copying) keeps the older copy alive and whole, never a mix of two saves.
// Bounded: only the latest copy of each name is kept (older ones live only while a reader holds them).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cc/buffer.h"
#include "cc/dtype.h"
#include "cc/status.h"

namespace kungfu {

struct SavedCopy {
  Buffer data;             // count * DTypeSize(dtype) bytes (null when empty)
  int64_t count = 0;       // elements
  DType dtype = DType::kUInt8;
  uint32_t shape_sig = 0;  // the saver's shape hash (0: none); requests must match it
  int64_t version = 0;     // 0 for the first save of the name, then +1 per save
  int64_t bytes() const { return count * static_cast<int64_t>(DTypeSize(dtype)); }
};

class VariableStore {
 public:
  // Copies count elements of data under name, replacing the previous copy. *version (if not null)
  // receives the new copy's version. InvalidArgument for an empty or too long name, a bad dtype or count.
  Status Save(const std::string& name, const void* data, int64_t count, DType dtype, uint32_t shape_sig,
              int64_t* version);
  // The latest copy of name, or null when nothing was saved under it.
  std::shared_ptr<const SavedCopy> Get(const std::string& name) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const SavedCopy>> copies_;  // guarded by mu_
};

// Checks a request's expectation against a saved copy: InvalidArgument naming both sides, e.g.
// "peer 127.0.0.1:10001 (rank 1) saved 12 float32 elements (shape signature 0x...), this worker asked for 10 ...".
Status CheckRequestMatches(const std::string& holder, int64_t have_count, DType have_dtype, uint32_t have_sig,
                           int64_t want_count, DType want_dtype, uint32_t want_sig);

}  // namespace kungfu
