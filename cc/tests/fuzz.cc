#include "cc/tests/fuzz.h"

#include <cstring>

#include "cc/wire.h"

namespace kungfu::testing {

uint64_t FuzzEnv(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

uint64_t Pick(Rng& rng, uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); }

uint64_t EdgeValue(Rng& rng) {
  static const uint64_t kEdges[] = {0,
                                    1,
                                    2,
                                    7,
                                    8,
                                    63,
                                    64,
                                    255,
                                    256,
                                    kMaxNameBytes,
                                    kMaxNameBytes + 1,
                                    0xffff,
                                    0x7fffffff,
                                    0x80000000,
                                    0xffffffff,
                                    uint64_t{1} << 32,
                                    kMaxPayloadBytes,
                                    kMaxPayloadBytes + 1,
                                    uint64_t{kMaxElements},
                                    uint64_t{kMaxElements} + 1,
                                    uint64_t{0x7fffffffffffffff},
                                    uint64_t{0x8000000000000000},
                                    ~uint64_t{0},
                                    ~uint64_t{0} - 1};
  if (Pick(rng, 4) == 0) return rng();
  return kEdges[Pick(rng, sizeof(kEdges) / sizeof(kEdges[0]))];
}

std::string RandomBytes(Rng& rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

void SetField(uint8_t* header, const Field& f, uint64_t v) { std::memcpy(header + f.at, &v, f.width); }

void MutateHeader(Rng& rng, uint8_t* header) {
  const int n = 1 + static_cast<int>(Pick(rng, 3));
  for (int k = 0; k < n; ++k) {
    switch (Pick(rng, 3)) {
      case 0: header[Pick(rng, kFrameHeaderSize)] ^= static_cast<uint8_t>(1u << Pick(rng, 8)); break;
      case 1: SetField(header, kFields[Pick(rng, kNumFields)], EdgeValue(rng)); break;
      default: header[Pick(rng, kFrameHeaderSize)] = static_cast<uint8_t>(rng()); break;
    }
  }
}

}  // namespace kungfu::testing
