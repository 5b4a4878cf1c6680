// Engine tests: N ranks as threads in one process over loopback, np 1 to 4 (and 8), sizes including 0 and 1.
// Values, algorithms and concurrency; arguments that differ across workers or are bad in mismatch_test.cc;
// peers leaving, dying or stalling in lifecycle_test.cc; edge values (NaN, signed zeros, half-type
// overflow) in edge_values_test.cc.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>

#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;
using testing::Waiter;

const DType kAllDTypes[] = {DType::kInt32, DType::kInt64, DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                            DType::kFloat64};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd};

// Values in {1,2,3}: sums and products of up to 4 workers stay exact even in bfloat16.
double Value(int rank, int64_t i) { return static_cast<double>((i + rank) % 3 + 1); }

void Store(void* buf, int64_t i, DType d, double v) {
  switch (d) {
    case DType::kInt32: static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v); break;
    case DType::kInt64: static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v); break;
    case DType::kFloat16: static_cast<uint16_t*>(buf)[i] = FloatToHalf(static_cast<float>(v)); break;
    case DType::kBFloat16: static_cast<uint16_t*>(buf)[i] = FloatToBFloat16(static_cast<float>(v)); break;
    case DType::kFloat32: static_cast<float*>(buf)[i] = static_cast<float>(v); break;
    case DType::kFloat64: static_cast<double*>(buf)[i] = v; break;
    case DType::kUInt8: static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(v); break;
  }
}

double Load(const void* buf, int64_t i, DType d) {
  switch (d) {
    case DType::kInt32: return static_cast<const int32_t*>(buf)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DType::kFloat32: return static_cast<const float*>(buf)[i];
    case DType::kFloat64: return static_cast<const double*>(buf)[i];
    case DType::kUInt8: return static_cast<const uint8_t*>(buf)[i];
  }
  return 0;
}

// The exact expected result, rounded the way the engine rounds (mean: once, in the element type).
double Expected(int n, int64_t i, DType d, ReduceOp op) {
  double acc = Value(0, i);
  for (int r = 1; r < n; ++r) {
    const double v = Value(r, i);
    if (op == ReduceOp::kSum || op == ReduceOp::kMean) acc += v;
    if (op == ReduceOp::kMin) acc = std::min(acc, v);
    if (op == ReduceOp::kMax) acc = std::max(acc, v);
    if (op == ReduceOp::kProd) acc *= v;
  }
  if (op != ReduceOp::kMean) return acc;
  std::vector<char> tmp(8);
  Store(tmp.data(), 0, d, acc);
  DivideBy(tmp.data(), 1, d, n);
  return Load(tmp.data(), 0, d);
}

// Every dtype x op x size on one cluster. A huge threshold picks the small-message algorithm (doubling or
// star), 0 the large-message one: the ring, or on 4, 8, ... workers halving-doubling for buffers of up to
// two pieces unless halving is false.
void SweepAllReduce(int n, int64_t ring_threshold, int64_t chunk_bytes, bool halving = true, int small_star = 0) {
  auto engines = StartCluster(n, [&](EngineConfig& c) {
    c.ring_threshold_bytes = ring_threshold;
    c.chunk_bytes = chunk_bytes;
    c.halving = halving;
    c.small_star = small_star;
  });
  ASSERT_EQ(static_cast<int>(engines.size()), n);
  const int64_t sizes[] = {0, 1, 2, 7, 1000, 65537};
  RunRanks(n, [&](int r) {
    for (DType d : kAllDTypes) {
      for (ReduceOp op : kAllOps) {
        for (int64_t count : sizes) {
          const size_t es = DTypeSize(d);
          std::vector<char> in(count * es + 1), out(count * es + 1);
          for (int64_t i = 0; i < count; ++i) Store(in.data(), i, d, Value(r, i));
          const std::string name = std::string(DTypeName(d)) + "/" + ReduceOpName(op) + "/" + std::to_string(count);
          Status s = engines[r]->AllReduceSync(in.data(), out.data(), count, d, op, name);
          EXPECT_OK(s);
          int bad = 0;
          for (int64_t i = 0; i < count && bad < 3; ++i) {
            const double want = Expected(n, i, d, op), got = Load(out.data(), i, d);
            if (want != got) {
              ++bad;
              EXPECT_EQ(name + "[" + std::to_string(i) + "]=" + std::to_string(got), name + "[" + std::to_string(i) + "]=" + std::to_string(want));
            }
          }
        }
      }
    }
  });
}

TEST(AllReduce, StarExactAllTypesNp1To4) {
  for (int n = 1; n <= 4; ++n) SweepAllReduce(n, int64_t{1} << 26, 1 << 20);
}

TEST(AllReduce, StarInPlaceOfDoublingExactAllTypesNp2And4) {
  for (int n : {2, 4}) SweepAllReduce(n, int64_t{1} << 26, 1 << 20, true, /*small_star=*/1);
}

TEST(AllReduce, RingExactAllTypesNp2To4SmallPieces) {
  // Small pieces make the pipeline run many steps even for small buffers.
  for (int n = 2; n <= 4; ++n) SweepAllReduce(n, 0, 4096, /*halving=*/false);
}

TEST(AllReduce, HalvingExactAllTypesNp4And8) {
  // Threshold 0 and 1 MiB pieces: every size from n elements on runs halving-doubling (odd splits too).
  for (int n : {4, 8}) SweepAllReduce(n, 0, 1 << 20);
}

// An in-place float32 sum of count elements on n workers, reps times under one name, checked exactly.
void InPlaceSum(int n, int64_t count, int reps, const std::function<void(EngineConfig&)>& tweak = {}) {
  auto engines = StartCluster(n, tweak);
  RunRanks(n, [&](int r) {
    for (int rep = 0; rep < reps; ++rep) {  // the same name again: a fresh generation each time
      std::vector<float> buf(count);
      for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<float>(Value(r, i));
      EXPECT_OK(engines[r]->AllReduceSync(buf.data(), buf.data(), count, DType::kFloat32, ReduceOp::kSum, "sum"));
      int bad = 0;
      for (int64_t i = 0; i < count && bad < 3; ++i) {
        if (buf[i] != static_cast<float>(Expected(n, i, DType::kFloat32, ReduceOp::kSum))) ++bad;
      }
      EXPECT_EQ(bad, 0);
    }
  });
}

TEST(AllReduce, InPlaceHalving) {
  InPlaceSum(4, (1 << 20) / 4 + 3, 3);  // default threshold and pieces: 1 MiB is a halving size
}

TEST(Config, HalvingFromTheEnvironment) {
  EngineConfig c;
  EXPECT_TRUE(c.halving);
  setenv("KUNGFU_HALVING", "0", 1);
  EXPECT_OK(ApplyEnvOverrides(&c));
  EXPECT_TRUE(!c.halving);
  setenv("KUNGFU_HALVING", "1", 1);
  EXPECT_OK(ApplyEnvOverrides(&c));
  EXPECT_TRUE(c.halving);
  for (const char* bad : {"yes", "0.5", "2"}) {
    setenv("KUNGFU_HALVING", bad, 1);
    EXPECT_EQ(CodeName(ApplyEnvOverrides(&c).code()), CodeName(Code::kInvalidArgument));
  }
  unsetenv("KUNGFU_HALVING");
}

TEST(AllReduce, InPlaceLargeRing) {
  InPlaceSum(3, (16 << 20) / 4 + 3, 1, [](EngineConfig& c) { c.chunk_bytes = 256 << 10; });
}

TEST(Broadcast, EveryRootStarAndChain) {
  for (int n = 1; n <= 4; ++n) {
    for (int64_t threshold : {int64_t{0}, int64_t{1} << 26}) {
      auto engines = StartCluster(n, [&](EngineConfig& c) {
        c.ring_threshold_bytes = threshold;
        c.chunk_bytes = 1024;
      });
      RunRanks(n, [&](int r) {
        for (int root = 0; root < n; ++root) {
          for (int64_t count : {0, 1, 5000}) {
            std::vector<int64_t> buf(count, r == root ? 0 : -1);
            for (int64_t i = 0; r == root && i < count; ++i) buf[i] = i * 10 + root;
            Waiter w;
            engines[r]->Broadcast(buf.data(), count, DType::kInt64, root, "b" + std::to_string(count), w.Callback());
            EXPECT_OK(w.Wait());
            for (int64_t i = 0; i < count; ++i) {
              if (buf[i] != i * 10 + root) {
                EXPECT_EQ(buf[i], i * 10 + root);
                break;
              }
            }
          }
        }
      });
    }
  }
}

TEST(AllGather, DifferentCountsIncludingEmpty) {
  for (int n = 1; n <= 4; ++n) {
    auto engines = StartCluster(n, [](EngineConfig& c) { c.chunk_bytes = 64; });
    RunRanks(n, [&](int r) {
      std::vector<int64_t> counts;
      for (int i = 0; i < n; ++i) counts.push_back(i == 1 ? 0 : 3 * i + 5);
      int64_t total = 0;
      for (auto c : counts) total += c;
      std::vector<int32_t> in(counts[r]), out(total, -1);
      for (int64_t i = 0; i < counts[r]; ++i) in[i] = r * 1000 + static_cast<int32_t>(i);
      Waiter w;
      engines[r]->AllGather(in.data(), out.data(), counts, DType::kInt32, "gather", w.Callback());
      EXPECT_OK(w.Wait());
      int64_t k = 0;
      for (int src = 0; src < n; ++src) {
        for (int64_t i = 0; i < counts[src]; ++i, ++k) EXPECT_EQ(out[k], src * 1000 + static_cast<int32_t>(i));
      }
    });
  }
}

TEST(Consensus, SameAndDifferentAndBarrier) {
  const int n = 3;
  auto engines = StartCluster(n);
  RunRanks(n, [&](int r) {
    Waiter b;
    engines[r]->Barrier("barrier", b.Callback());
    EXPECT_OK(b.Wait());
    const std::string same = "identical bytes";
    const std::string diff = r == 2 ? "other" : "identical bytes";
    bool s1 = false, s2 = true;
    Waiter w1, w2;
    engines[r]->Consensus(same.data(), same.size(), &s1, "c1", w1.Callback());
    engines[r]->Consensus(diff.data(), diff.size(), &s2, "c2", w2.Callback());
    EXPECT_OK(w1.Wait());
    EXPECT_OK(w2.Wait());
    EXPECT_TRUE(s1);
    EXPECT_TRUE(!s2);
  });
}

TEST(Concurrency, RankDependentPermutationOfTwentyCollectives) {
  const int n = 4;
  auto engines = StartCluster(n, [](EngineConfig& c) {
    c.ring_threshold_bytes = 4096;
    c.chunk_bytes = 4096;
  });
  RunRanks(n, [&](int r) {
    std::vector<int> order(20);
    for (int i = 0; i < 20; ++i) order[i] = i;
    std::mt19937 rng(1234 + r);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::vector<float>> bufs(20);
    std::vector<Waiter> waiters(20);
    // Doubling (12 bytes), the ring (40000 bytes, many pieces) and halving-doubling (6000 bytes, two pieces).
    const size_t sizes[] = {3, 10000, 1500};
    for (int i : order) {
      bufs[i].assign(sizes[i % 3], static_cast<float>(r + i));
      engines[r]->AllReduce(bufs[i].data(), bufs[i].data(), bufs[i].size(), DType::kFloat32, ReduceOp::kSum,
                            "t" + std::to_string(i), waiters[i].Callback());
    }
    for (int i = 0; i < 20; ++i) {
      EXPECT_OK(waiters[i].Wait());
      const float want = static_cast<float>(0 + 1 + 2 + 3 + 4 * i);
      EXPECT_EQ(std::count(bufs[i].begin(), bufs[i].end(), want), static_cast<std::ptrdiff_t>(bufs[i].size()));
    }
    EXPECT_TRUE(engines[r]->stats().max_in_flight >= 2);
  });
}

size_t Occurrences(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// The engine counts each name's calls for the whole run; a program that makes a name per call grows that
// count table without bound, so it is told once the names reach kManyNames (and not at every name after).
TEST(Names, ManyDistinctNamesWarnOnce) {
  auto engines = StartCluster(1);
  float x = 1;
  const std::string text = testing::CaptureStderr([&] {
    for (size_t i = 0; i < kManyNames + 1000; ++i) {
      ASSERT_OK(engines[0]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "step/" + std::to_string(i)));
    }
    for (int i = 0; i < 1000; ++i) {  // a recurring name adds nothing
      ASSERT_OK(engines[0]->AllReduceSync(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, "loss"));
    }
  });
  EXPECT_EQ(Occurrences(text, "distinct collective names so far"), size_t{1});
  EXPECT_CONTAINS(text, std::to_string(kManyNames) + " distinct collective names so far, the latest 'step/" +
                            std::to_string(kManyNames - 1) + "'");
}

TEST(DType, HalfConversionsRoundTrip) {
  for (float f : {0.f, 1.f, -2.5f, 65504.f, 6.1035e-05f, 1e-7f}) {
    EXPECT_EQ(HalfToFloat(FloatToHalf(f)), HalfToFloat(FloatToHalf(HalfToFloat(FloatToHalf(f)))));
  }
  EXPECT_EQ(HalfToFloat(FloatToHalf(3.f)), 3.f);
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(3.f)), 3.f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1e6f)), HalfToFloat(0x7c00));  // overflow to inf
}

// The engine's threads carry names (top -H, per-thread profiles), not the process's.
TEST(Threads, TheEnginesThreadsAreNamed) {
  auto engines = StartCluster(2);
  std::multiset<std::string> names;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    names.insert(name);
  }
  EXPECT_EQ(names.count("kf_loop"), 2u);  // one each
  EXPECT_EQ(names.count("kf_accept"), 2u);
}

}  // namespace
}  // namespace kungfu
