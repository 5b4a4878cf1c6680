#include "cc/collective_stats.h"

#include <algorithm>
#include <cstdio>

namespace kungfu {

void CollectiveStatsTable::Record(const std::string& name, bool ok, int64_t bytes_sent, int64_t bytes_received,
                                  double ms) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = table_.find(name);
  if (it == table_.end()) {
    const bool full = table_.size() - table_.count(kOtherName) >= max_names_;
    it = table_.emplace(full ? std::string(kOtherName) : name, CollectiveStats{}).first;
  }
  CollectiveStats& s = it->second;
  s.bytes_sent += bytes_sent;
  s.bytes_received += bytes_received;
  if (!ok) {
    ++s.failed;
    return;
  }
  ++s.calls;
  s.total_ms += ms;
  s.last_ms = ms;
  s.max_ms = std::max(s.max_ms, ms);
}

std::vector<NamedCollectiveStats> CollectiveStatsTable::Snapshot(bool reset) {
  std::vector<NamedCollectiveStats> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.assign(table_.begin(), table_.end());
    if (reset) table_.clear();
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

namespace {

void AppendJsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out->append(buf);
    } else {
      out->push_back(static_cast<char>(c));
    }
  }
  out->push_back('"');
}

}  // namespace

std::string CollectiveStatsJson(const std::vector<NamedCollectiveStats>& stats) {
  std::string out = "{";
  char buf[256];
  for (size_t i = 0; i < stats.size(); ++i) {
    const CollectiveStats& s = stats[i].second;
    if (i > 0) out += ", ";
    AppendJsonString(stats[i].first, &out);
    std::snprintf(buf, sizeof(buf),
                  ": {\"calls\": %lld, \"failed\": %lld, \"bytes_sent\": %lld, \"bytes_received\": %lld, "
                  "\"total_ms\": %.6f, \"last_ms\": %.6f, \"max_ms\": %.6f}",
                  static_cast<long long>(s.calls), static_cast<long long>(s.failed),
                  static_cast<long long>(s.bytes_sent), static_cast<long long>(s.bytes_received), s.total_ms,
                  s.last_ms, s.max_ms);
    out += buf;
  }
  out += "}";
  return out;
}

}  // namespace kungfu
