// Per-collective counters: for each collective name, how many calls finished (OK or not), the payload
// bytes this worker sent and received for them, and their completion latency (from the API call to
// the callback: queueing, waiting for peers and moving the data).
//
// Threading: the engine's loop thread records each finished op (one mutex, taken once per op, and a
// hash lookup of the name: no allocation once a name is known); any thread may take a snapshot. The
// table holds at most max_names names; later names are counted together under kOtherName, so names
// made fresh for every call (a name with the step in it) cannot grow it without bound.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kungfu {

struct CollectiveStats {
  int64_t calls = 0;           // finished OK
  int64_t failed = 0;          // finished with an error (not in the latencies)
  int64_t bytes_sent = 0;      // payload bytes this worker wrote for them
  int64_t bytes_received = 0;  // payload bytes this worker received for them
  double total_ms = 0;         // sum of the latencies of the calls that finished OK
  double last_ms = 0;          // latency of the last call that finished OK
  double max_ms = 0;           // the largest of those latencies
};

using NamedCollectiveStats = std::pair<std::string, CollectiveStats>;

class CollectiveStatsTable {
 public:
  static constexpr const char* kOtherName = "(other)";
  static constexpr size_t kDefaultMaxNames = 1024;

  explicit CollectiveStatsTable(size_t max_names = kDefaultMaxNames) : max_names_(max_names) {}

  void Record(const std::string& name, bool ok, int64_t bytes_sent, int64_t bytes_received, double ms);
  // Every name's counters, sorted by name; with reset, the table is emptied in the same step.
  std::vector<NamedCollectiveStats> Snapshot(bool reset);

 private:
  std::mutex mu_;
  const size_t max_names_;  // distinct names with counters of their own, kOtherName not counted
  std::unordered_map<std::string, CollectiveStats> table_;  // guarded by mu_
};

// {"name": {"calls": 3, "failed": 0, "bytes_sent": ..., "bytes_received": ..., "total_ms": ...,
// "last_ms": ..., "max_ms": ...}, ...}: names escaped as JSON strings, for the C API.
std::string CollectiveStatsJson(const std::vector<NamedCollectiveStats>& stats);

}  // namespace kungfu
