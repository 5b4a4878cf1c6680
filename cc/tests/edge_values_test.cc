// All-reduce of edge values, by every algorithm: NaN and signed zeros for min and max, and the overflow
// of a half-type mean. N ranks as threads in one process over loopback, as in engine_test.cc.
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cc/dtype.h"
#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;

// min and max over a NaN on one worker and over -0 against +0 give the same bits on every worker, by
// every algorithm: recursive doubling reduces with the operands swapped on the two partners.
TEST(AllReduce, MinMaxOfNaNAndSignedZeroAgreeEverywhere) {
  for (int n = 2; n <= 4; ++n) {
    for (int64_t threshold : {int64_t{1} << 26, int64_t{0}}) {  // doubling or star; halving or ring
      auto engines = StartCluster(n, [&](EngineConfig& c) { c.ring_threshold_bytes = threshold; });
      const int64_t count = 4 * n;  // enough for the ring and halving-doubling to give everyone a piece
      std::vector<std::vector<float>> results(n);
      RunRanks(n, [&](int r) {
        for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
          std::vector<float> in(count, static_cast<float>(r)), out(count);
          for (int64_t i = 0; i < count; i += 4) {
            in[i] = r == 0 ? std::numeric_limits<float>::quiet_NaN() : 1.0f;  // a NaN on rank 0 only
            in[i + 1] = r == 0 ? -0.0f : 0.0f;                                 // -0 on rank 0, +0 elsewhere
            in[i + 2] = r == 1 ? -0.0f : 0.0f;
            in[i + 3] = r == n - 1 ? std::numeric_limits<float>::quiet_NaN() : -0.0f;
          }
          const std::string name = std::string(ReduceOpName(op)) + "/signs";
          ASSERT_OK(engines[r]->AllReduceSync(in.data(), out.data(), count, DType::kFloat32, op, name));
          auto show = [](float v) {
            return std::isnan(v) ? std::string("nan") : v != 0 ? std::to_string(v) : std::signbit(v) ? "-0" : "+0";
          };
          const std::string zero = op == ReduceOp::kMin ? "-0" : "+0";  // min(-0, +0) = -0, max(-0, +0) = +0
          for (int64_t i = 0; i < count; i += 4) {
            const std::string where = name + " rank " + std::to_string(r) + " of " + std::to_string(n) + ": ";
            EXPECT_EQ(where + show(out[i]) + " " + show(out[i + 1]) + " " + show(out[i + 2]) + " " + show(out[i + 3]),
                      where + "nan " + zero + " " + zero + " nan");
          }
          if (op == ReduceOp::kMax) results[r] = out;
        }
      });
      for (int r = 1; r < n; ++r) {  // the same NaN too
        EXPECT_EQ(std::memcmp(results[0].data(), results[r].data(), count * sizeof(float)), 0);
      }
    }
  }
}

// A float16 mean is its sum rounded to float16, then divided: it overflows when the sum does, on every
// algorithm and cluster size. The star used to divide its float32 sum before rounding, so 3 workers
// (star for small buffers) gave 40000 where 2 and 4 (doubling, ring) gave inf.
TEST(AllReduce, HalfMeanOverflowsWithItsSumOnEveryAlgorithm) {
  const float big = 40000.0f;  // representable in float16 (max 65504); any two of them sum past it
  for (int n = 2; n <= 4; ++n) {
    for (int64_t threshold : {int64_t{1} << 26, int64_t{0}}) {  // doubling or star; halving or ring
      auto engines = StartCluster(n, [&](EngineConfig& c) { c.ring_threshold_bytes = threshold; });
      RunRanks(n, [&](int r) {
        for (int64_t count : {int64_t{1}, int64_t{4} * n, int64_t{5000}}) {
          std::vector<uint16_t> in(count, FloatToHalf(big)), out(count);
          in[0] = FloatToHalf(static_cast<float>(r + 1));  // a small mean stays exact
          const std::string name = "half/mean/" + std::to_string(count);
          ASSERT_OK(engines[r]->AllReduceSync(in.data(), out.data(), count, DType::kFloat16, ReduceOp::kMean, name));
          const std::string where = name + " on " + std::to_string(n) + " threshold " + std::to_string(threshold);
          EXPECT_EQ(where + " [0]=" + std::to_string(HalfToFloat(out[0])),
                    where + " [0]=" + std::to_string((n + 1) / 2.0f));
          for (int64_t i = 1; i < count; ++i) {
            if (!std::isinf(HalfToFloat(out[i]))) {
              EXPECT_EQ(where + " [" + std::to_string(i) + "]=" + std::to_string(HalfToFloat(out[i])), where + " inf");
              break;
            }
          }
        }
      });
    }
  }
}

// Two different collectives under one name (an all-gather on one worker, an all-reduce on the other) fail
// both workers at once with InvalidArgument saying so, whichever all-reduce algorithm runs.
TEST(Errors, TwoCollectivesUnderOneNameFailAtOnceSayingSo) {
  for (int64_t threshold : {int64_t{1} << 26, int64_t{0}}) {
    const int n = 2;
    auto engines = StartCluster(n, [&](EngineConfig& c) { c.ring_threshold_bytes = threshold; });
    const auto t0 = std::chrono::steady_clock::now();
    RunRanks(n, [&](int r) {
      std::vector<float> in(8, 1.f), out(8 * n);
      Status s;
      if (r == 0) {
        s = engines[r]->AllReduceSync(in.data(), out.data(), 8, DType::kFloat32, ReduceOp::kSum, "x");
      } else {
        testing::Waiter w;
        engines[r]->AllGather(in.data(), out.data(), std::vector<int64_t>(n, 8), DType::kFloat32, "x", w.Callback());
        s = w.Wait();
      }
      EXPECT_EQ(CodeName(s.code()), CodeName(Code::kInvalidArgument));
      EXPECT_EQ(s.message().find("two different collectives") != std::string::npos, true);
    });
    EXPECT_TRUE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 5.0);
  }
}

}  // namespace
}  // namespace kungfu
