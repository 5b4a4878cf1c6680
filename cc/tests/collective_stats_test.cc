// Per-collective counters (cc/collective_stats.h): the table on its own (bound, reset, JSON), and the
// engine's, with N ranks as threads: calls, failures, bytes and latency per collective name.
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cc/collective_stats.h"
#include "cc/engine.h"
#include "cc/tests/cluster.h"
#include "cc/tests/testing.h"

namespace kungfu {
namespace {

using testing::RunRanks;
using testing::StartCluster;

std::map<std::string, CollectiveStats> ByName(const std::vector<NamedCollectiveStats>& v) {
  return std::map<std::string, CollectiveStats>(v.begin(), v.end());
}

TEST(CollectiveStatsTable, CountsBoundsAndResets) {
  CollectiveStatsTable table(2);
  table.Record("a", true, 10, 20, 1.5);
  table.Record("a", true, 10, 20, 0.5);
  table.Record("a", false, 3, 0, 99);  // a failure: bytes count, its latency does not
  table.Record("b", true, 0, 0, 2);
  table.Record("c", true, 1, 1, 4);  // the table is full: counted under "(other)"
  table.Record("d", true, 1, 1, 8);
  auto s = ByName(table.Snapshot(false));
  ASSERT_EQ(s.size(), size_t{3});
  EXPECT_EQ(s["a"].calls, 2);
  EXPECT_EQ(s["a"].failed, 1);
  EXPECT_EQ(s["a"].bytes_sent, 23);
  EXPECT_EQ(s["a"].bytes_received, 40);
  EXPECT_EQ(s["a"].total_ms, 2.0);
  EXPECT_EQ(s["a"].last_ms, 0.5);
  EXPECT_EQ(s["a"].max_ms, 1.5);
  EXPECT_EQ(s[CollectiveStatsTable::kOtherName].calls, 2);
  EXPECT_EQ(s[CollectiveStatsTable::kOtherName].max_ms, 8.0);
  EXPECT_EQ(table.Snapshot(true).size(), size_t{3});
  EXPECT_EQ(table.Snapshot(false).size(), size_t{0});
  table.Record("c", true, 0, 0, 1);  // room again after the reset
  EXPECT_EQ(table.Snapshot(false)[0].first, "c");
}

TEST(CollectiveStatsTable, JsonEscapesNames) {
  CollectiveStats s;
  s.calls = 1;
  s.bytes_sent = 12;
  s.last_ms = s.max_ms = s.total_ms = 0.25;
  const std::string json = CollectiveStatsJson({{"we\"ird\\\n", s}});
  EXPECT_EQ(json,
            "{\"we\\\"ird\\\\\\u000a\": {\"calls\": 1, \"failed\": 0, \"bytes_sent\": 12, \"bytes_received\": 0, "
            "\"total_ms\": 0.250000, \"last_ms\": 0.250000, \"max_ms\": 0.250000}}");
  EXPECT_EQ(CollectiveStatsJson({}), "{}");
}

// Every rank: "grads/a" 3 times (ring or not, by size), "grads/b" once, a barrier.
void RunNamedCollectives(int n, int64_t count) {
  auto engines = StartCluster(n);
  ASSERT_EQ(static_cast<int>(engines.size()), n);
  RunRanks(n, [&](int r) {
    std::vector<float> buf(count, 1.f);
    for (int i = 0; i < 3; ++i) {
      EXPECT_OK(engines[r]->AllReduceSync(buf.data(), buf.data(), count, DType::kFloat32, ReduceOp::kSum, "grads/a"));
    }
    EXPECT_OK(engines[r]->AllReduceSync(buf.data(), buf.data(), 5, DType::kFloat32, ReduceOp::kMax, "grads/b"));
    testing::Waiter w;
    engines[r]->Barrier("sync", w.Callback());
    EXPECT_OK(w.Wait());
  });
  int64_t sent = 0, received = 0;
  for (int r = 0; r < n; ++r) {
    auto s = ByName(engines[r]->collective_stats());
    ASSERT_EQ(s.size(), size_t{3});
    const CollectiveStats& a = s["grads/a"];
    EXPECT_EQ(a.calls, 3);
    EXPECT_EQ(a.failed, 0);
    EXPECT_EQ(s["grads/b"].calls, 1);
    EXPECT_EQ(s["sync"].calls, 1);
    EXPECT_TRUE(a.last_ms > 0 && a.max_ms >= a.last_ms && a.total_ms >= a.max_ms);
    EXPECT_EQ(a.bytes_sent > 0 && a.bytes_received > 0, n > 1);  // one worker moves nothing
    int64_t rank_sent = 0;
    for (auto& [name, st] : s) {
      rank_sent += st.bytes_sent;
      sent += st.bytes_sent;
      received += st.bytes_received;
    }
    EXPECT_EQ(rank_sent, engines[r]->stats().bytes_sent);  // only collectives ran: the same bytes
  }
  EXPECT_EQ(sent, received);  // what one worker sent, another received
  engines[0]->ResetStats();
  EXPECT_EQ(engines[0]->collective_stats().size(), size_t{0});
  EXPECT_EQ(engines[n - 1]->collective_stats(true).size(), n > 1 ? size_t{3} : size_t{0});
  EXPECT_EQ(engines[n - 1]->collective_stats().size(), size_t{0});
}

TEST(CollectiveStats, PerNameCallsBytesAndLatencyNp1To3) {
  for (int n : {1, 2, 3}) {
    RunNamedCollectives(n, 1000);
    RunNamedCollectives(n, 200000);  // the ring
  }
}

TEST(CollectiveStats, FailuresAreCountedApart) {
  const int n = 2;
  auto engines = StartCluster(n);
  RunRanks(n, [&](int r) {
    std::vector<float> buf(r == 1 ? 11 : 10, 1.f);
    Status s = engines[r]->AllReduceSync(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, "bad");
    EXPECT_TRUE(!s.ok());
  });
  for (int r = 0; r < n; ++r) {
    auto s = ByName(engines[r]->collective_stats(true));
    EXPECT_EQ(s["bad"].failed, 1);
    EXPECT_EQ(s["bad"].calls, 0);
    EXPECT_EQ(s["bad"].total_ms, 0.0);
    EXPECT_EQ(engines[r]->collective_stats().size(), size_t{0});  // the read with reset emptied it
  }
}

}  // namespace
}  // namespace kungfu
