// What the fuzz tests share (fuzz_test.cc: the decoders and the frame parser; fuzz_strangers_test.cc:
// junk on a live cluster's ports; fuzz_peer_test.cc: mutated frames from a peer that knows the token):
// deterministic random choices, values on the decoders' bounds, header mutation, and a waiter that stops
// the process rather than hang. Seeds are fixed; KF_FUZZ_SEED=n KF_FUZZ_ROUNDS=m searches longer by hand.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>

#include "cc/engine.h"
#include "cc/transport/socket.h"

namespace kungfu::testing {

using Rng = std::mt19937_64;

// The value of an environment variable as a number, or fallback when unset.
uint64_t FuzzEnv(const char* name, uint64_t fallback);
double Seconds(Clock::time_point since);
// A uniform choice of 0 .. n-1.
uint64_t Pick(Rng& rng, uint64_t n);
// Values that sit on the bounds the decoders check, or far past them.
uint64_t EdgeValue(Rng& rng);
std::string RandomBytes(Rng& rng, size_t n);

// The header's fields: offset and width (wire.cc's layout).
struct Field {
  int at, width;
};
inline constexpr Field kFields[] = {{0, 4},  {4, 2},  {6, 1},  {7, 1},  {8, 1},  {9, 1},  {10, 2}, {12, 4},
                                    {16, 4}, {20, 4}, {24, 4}, {28, 4}, {32, 8}, {40, 8}, {48, 8}, {56, 8}};
inline constexpr size_t kNumFields = sizeof(kFields) / sizeof(kFields[0]);

void SetField(uint8_t* header, const Field& f, uint64_t v);
// Flips bits, sets fields to edge values, or overwrites random bytes of a 64-byte header.
void MutateHeader(Rng& rng, uint8_t* header);

// Waits for one completion, but not forever: a collective that outlives its deadline by far is a hang,
// and the test stops the process (its buffers may still be written to) rather than wait on it.
class TimedWaiter {
 public:
  DoneCallback Callback() {
    return [this](const Status& s) { Set(s); };
  }
  RequestCallback RequestDone() {
    return [this](const Status& s, int64_t version) {
      version_ = version;
      Set(s);
    };
  }
  Status Wait(double seconds, const std::string& what) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) {
      std::fprintf(stderr, "  %s did not finish within %.0f s: the engine hangs\n", what.c_str(), seconds);
      std::abort();
    }
    return status_;
  }
  int64_t version() const { return version_; }

 private:
  void Set(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
  int64_t version_ = -2;
};

}  // namespace kungfu::testing
