// Test helper: N engines as threads in one process over loopback, gloo style.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cc/engine.h"

namespace kungfu::testing {

// Ports the OS considers free right now (bind to 0, read, close).
std::vector<uint16_t> FreePorts(int n);

// A peer list of n loopback peers on free ports.
PeerList LoopbackPeers(int n, uint32_t version = 0);

// Starts n engines concurrently (Start blocks until each has connected to the others).
// tweak, if set, edits each rank's config before start.
std::vector<std::unique_ptr<Engine>> StartCluster(int n, const std::function<void(EngineConfig&)>& tweak = {});

// Runs fn(rank) on n threads and joins them.
void RunRanks(int n, const std::function<void(int)>& fn);

// Waits for one async completion.
class Waiter {
 public:
  DoneCallback Callback();
  Status Wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace kungfu::testing
