// Known-answer tests for SHA-256 (FIPS 180-4 examples) and HMAC-SHA256 (RFC 4231), plus the small
// helpers the handshake code relies on.
#include "cc/sha256.h"

#include <cstring>
#include <string>
#include <vector>

#include "cc/tests/testing.h"

namespace kungfu {
namespace {

std::string HexOf(const Digest& d) { return HexEncode(d.data(), d.size()); }
std::string ShaHex(const std::string& s) { return HexOf(Sha256Of(s.data(), s.size())); }
std::string HmacHex(const std::string& key, const std::string& msg) {
  return HexOf(HmacSha256(key, msg.data(), msg.size()));
}

TEST(Sha256, EmptyString) {
  EXPECT_EQ(ShaHex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, Abc) {
  EXPECT_EQ(ShaHex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, TwoBlockMessage) {
  // 56 bytes: the length field no longer fits in the first block, so padding spills into a second.
  EXPECT_EQ(ShaHex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, OneMillionAIncremental) {
  // Odd chunk sizes exercise every path in Update: topping up a partial block, whole blocks, leftovers.
  const std::string chunk(1000, 'a');
  const size_t sizes[] = {1, 63, 64, 65, 127, 7, 333};
  Sha256 h;
  size_t fed = 0, i = 0;
  while (fed < 1000000) {
    size_t n = sizes[i++ % (sizeof(sizes) / sizeof(sizes[0]))];
    if (n > 1000000 - fed) n = 1000000 - fed;
    h.Update(chunk.data(), n);
    fed += n;
  }
  EXPECT_EQ(HexOf(h.Finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, IncrementalMatchesOneShotAtEveryLength) {
  // Around the 55/56/64-byte padding boundaries, split at every point.
  std::string msg;
  for (int i = 0; i < 130; ++i) msg.push_back(char('A' + i % 26));
  for (size_t len = 0; len <= msg.size(); ++len) {
    Digest want = Sha256Of(msg.data(), len);
    for (size_t cut = 0; cut <= len; cut += 13) {
      Sha256 h;
      h.Update(msg.data(), cut);
      h.Update(msg.data() + cut, len - cut);
      ASSERT_TRUE(h.Finish() == want);
    }
  }
}

TEST(HmacSha256, Rfc4231Case1) {
  EXPECT_EQ(HmacHex(std::string(20, '\x0b'), "Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(HmacSha256, Rfc4231Case2KeyShorterThanDigest) {
  EXPECT_EQ(HmacHex("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(HmacSha256, Rfc4231Case3) {
  EXPECT_EQ(HmacHex(std::string(20, '\xaa'), std::string(50, '\xdd')),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
}

TEST(HmacSha256, Rfc4231Case6KeyLongerThanBlock) {
  EXPECT_EQ(HmacHex(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(HexEncode, LowercaseTwoDigitsPerByte) {
  const uint8_t bytes[] = {0x00, 0x0f, 0xa5, 0xff};
  EXPECT_EQ(HexEncode(bytes, sizeof(bytes)), "000fa5ff");
  EXPECT_EQ(HexEncode(bytes, 0), "");
}

TEST(ConstantTimeEqual, EqualAndDiffering) {
  const uint8_t a[] = {1, 2, 3, 4, 5};
  uint8_t b[] = {1, 2, 3, 4, 5};
  EXPECT_TRUE(ConstantTimeEqual(a, b, sizeof(a)));
  EXPECT_TRUE(ConstantTimeEqual(a, b, 0));
  for (size_t i = 0; i < sizeof(b); ++i) {
    b[i] ^= 0x80;
    EXPECT_TRUE(!ConstantTimeEqual(a, b, sizeof(a)));
    b[i] ^= 0x80;
  }
}

TEST(RandomBytes, FillsBufferAndDiffersBetweenCalls) {
  std::vector<uint8_t> x(64, 0), y(64, 0);
  ASSERT_TRUE(RandomBytes(x.data(), x.size()));
  ASSERT_TRUE(RandomBytes(y.data(), y.size()));
  // 2^-512 chance of a false failure for each check.
  EXPECT_TRUE(x != std::vector<uint8_t>(64, 0));
  EXPECT_TRUE(x != y);
  EXPECT_TRUE(RandomBytes(x.data(), 0));
  // A large request may be split by getrandom(2); it must still be filled completely.
  std::vector<uint8_t> big(1 << 20, 0);
  ASSERT_TRUE(RandomBytes(big.data(), big.size()));
  EXPECT_TRUE(std::memcmp(big.data() + big.size() - 64, std::vector<uint8_t>(64, 0).data(), 64) != 0);
}

}  // namespace
}  // namespace kungfu
