// Heap bytes aligned to a cache line: everything the engine sends from or receives into. The kernel
// copies payloads between these and socket buffers, and such a copy is slow when its two sides sit
// a few bytes apart within a page (Connection::Enqueue explains); 64-byte alignment here, together
// with the frame pad, keeps the engine's own buffers out of that case.
#pragma once

#include <cstddef>
#include <memory>
#include <new>

namespace kungfu {

constexpr size_t kBufferAlign = 64;

struct BufferFree {
  void operator()(char* p) const noexcept { ::operator delete[](p, std::align_val_t(kBufferAlign)); }
};
using Buffer = std::unique_ptr<char[], BufferFree>;

inline Buffer NewBuffer(size_t bytes) {
  return Buffer(static_cast<char*>(::operator new[](bytes, std::align_val_t(kBufferAlign))));
}

}  // namespace kungfu
