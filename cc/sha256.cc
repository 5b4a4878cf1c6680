// SHA-256 per FIPS 180-4 section 6.2, written for clarity over speed: the engine hashes handshake
// tokens and small control messages, not bulk tensors, so a portable scalar loop is enough.
#include "cc/sha256.h"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

namespace kungfu {
namespace {

constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

constexpr size_t kBlockSize = 64;

inline uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// Big-endian load/store by bytes: independent of host endianness and alignment.
inline uint32_t LoadBe32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}
inline void StoreBe32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 24);
  p[1] = uint8_t(v >> 16);
  p[2] = uint8_t(v >> 8);
  p[3] = uint8_t(v);
}

// Reads exactly len bytes from /dev/urandom; used where getrandom(2) is missing (old kernels, non-Linux).
bool ReadUrandom(uint8_t* out, size_t len) {
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = true;
  while (len > 0) {
    ssize_t n = ::read(fd, out, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ok = false;
      break;
    }
    out += n;
    len -= size_t(n);
  }
  ::close(fd);
  return ok;
}

}  // namespace

Sha256::Sha256()
    : state_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::Compress(const uint8_t* block) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) w[i] = LoadBe32(block + 4 * i);
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
  uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t s1 = Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25);
    uint32_t ch = (e & f) ^ (~e & g);
    uint32_t t1 = h + s1 + ch + kRoundConstants[i] + w[i];
    uint32_t s0 = Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22);
    uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
    uint32_t t2 = s0 + maj;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state_[0] += a;
  state_[1] += b;
  state_[2] += c;
  state_[3] += d;
  state_[4] += e;
  state_[5] += f;
  state_[6] += g;
  state_[7] += h;
}

void Sha256::Update(const void* data, size_t len) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_len_ += len;
  // Top up a partial block first so whole blocks can be compressed straight from the caller's buffer.
  if (buffered_ > 0) {
    size_t take = kBlockSize - buffered_;
    if (take > len) take = len;
    std::memcpy(buffer_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    len -= take;
    if (buffered_ < kBlockSize) return;
    Compress(buffer_);
    buffered_ = 0;
  }
  for (; len >= kBlockSize; p += kBlockSize, len -= kBlockSize) Compress(p);
  if (len > 0) {
    std::memcpy(buffer_, p, len);
    buffered_ = len;
  }
}

Digest Sha256::Finish() {
  // Padding: 0x80, zeros to 56 mod 64, then the message length in bits as a big-endian uint64.
  const uint64_t bit_len = total_len_ * 8;
  uint8_t pad[kBlockSize * 2] = {0x80};
  size_t pad_len = (buffered_ < 56 ? 56 : 120) - buffered_;
  for (int i = 0; i < 8; ++i) pad[pad_len + i] = uint8_t(bit_len >> (56 - 8 * i));
  Update(pad, pad_len + 8);
  Digest out;
  for (int i = 0; i < 8; ++i) StoreBe32(out.data() + 4 * i, state_[i]);
  return out;
}

Digest Sha256Of(const void* data, size_t len) {
  Sha256 h;
  h.Update(data, len);
  return h.Finish();
}

Digest HmacSha256(const std::string& key, const void* msg, size_t len) {
  // RFC 2104: keys longer than the block are hashed first; shorter ones are zero-padded.
  uint8_t k[kBlockSize] = {0};
  if (key.size() > kBlockSize) {
    Digest kd = Sha256Of(key.data(), key.size());
    std::memcpy(k, kd.data(), kd.size());
  } else {
    std::memcpy(k, key.data(), key.size());
  }
  uint8_t ipad[kBlockSize], opad[kBlockSize];
  for (size_t i = 0; i < kBlockSize; ++i) {
    ipad[i] = k[i] ^ 0x36;
    opad[i] = k[i] ^ 0x5c;
  }
  Sha256 inner;
  inner.Update(ipad, kBlockSize);
  inner.Update(msg, len);
  Digest inner_digest = inner.Finish();
  Sha256 outer;
  outer.Update(opad, kBlockSize);
  outer.Update(inner_digest.data(), inner_digest.size());
  return outer.Finish();
}

bool ConstantTimeEqual(const void* a, const void* b, size_t len) {
  // Accumulate every difference instead of returning early, so timing does not reveal the
  // position of the first mismatch (which would let an attacker forge a MAC byte by byte).
  // volatile keeps the compiler from turning the loop back into an early-exit compare.
  const volatile uint8_t* pa = static_cast<const volatile uint8_t*>(a);
  const volatile uint8_t* pb = static_cast<const volatile uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < len; ++i) diff |= uint8_t(pa[i] ^ pb[i]);
  return diff == 0;
}

std::string HexEncode(const void* data, size_t len) {
  static const char kDigits[] = "0123456789abcdef";
  const uint8_t* p = static_cast<const uint8_t*>(data);
  std::string out(len * 2, '\0');
  for (size_t i = 0; i < len; ++i) {
    out[2 * i] = kDigits[p[i] >> 4];
    out[2 * i + 1] = kDigits[p[i] & 0xf];
  }
  return out;
}

bool RandomBytes(void* buf, size_t len) {
  uint8_t* out = static_cast<uint8_t*>(buf);
#if defined(__linux__) && defined(SYS_getrandom)
  // Raw syscall rather than <sys/random.h>, which older glibc (< 2.25) lacks.
  while (len > 0) {
    long n = ::syscall(SYS_getrandom, out, len, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOSYS) break;  // kernel < 3.17: fall back to /dev/urandom below
      return false;
    }
    out += n;
    len -= size_t(n);
  }
  if (len == 0) return true;
#endif
  return ReadUrandom(out, len);
}

}  // namespace kungfu
