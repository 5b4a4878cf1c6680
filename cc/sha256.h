// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), self-contained so the engine can authenticate
// peers and checksum payloads without linking OpenSSL. Not hardened against side channels beyond
// ConstantTimeEqual; it hashes keys and messages we already hold in memory.
//
// Threading: a Sha256 object is not shared between threads; the free functions are reentrant.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kungfu {

using Digest = std::array<uint8_t, 32>;

class Sha256 {  // incremental
 public:
  Sha256();
  void Update(const void* data, size_t len);
  Digest Finish();  // object may not be reused after

 private:
  void Compress(const uint8_t* block);

  uint32_t state_[8];      // running hash H0..H7
  uint8_t buffer_[64];     // partial block not yet compressed
  size_t buffered_ = 0;    // bytes valid in buffer_
  uint64_t total_len_ = 0; // message length in bytes, for the final length field
};

Digest Sha256Of(const void* data, size_t len);
Digest HmacSha256(const std::string& key, const void* msg, size_t len);
// Compares in time independent of where the bytes differ.
bool ConstantTimeEqual(const void* a, const void* b, size_t len);
std::string HexEncode(const void* data, size_t len);
// Fills buf with cryptographically random bytes from getrandom(2) (fallback /dev/urandom); false on failure.
bool RandomBytes(void* buf, size_t len);

}  // namespace kungfu
