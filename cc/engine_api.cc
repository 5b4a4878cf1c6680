// The public Engine API: argument checks, the choice of algorithm, building each op and submitting it
// to Engine::Impl (engine.cc); blocking callers (RunAndWait); the environment overrides of the config.
#include "cc/engine.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cc/engine_impl.h"
#include "cc/sha256.h"
#include "cc/wire.h"

namespace kungfu {

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { impl_->Shutdown(); }
void Engine::LeaveCleanly() { impl_->LeaveCleanly(); }

void Engine::Finalizing() {
  Impl* impl = impl_.get();
  impl->loop().Post([impl] { impl->BeginFinalize(); });  // in order with the barrier's start
}

bool Engine::TimedOut() const { return impl_->TimedOut(); }

StatusOr<std::unique_ptr<Engine>> Engine::Start(const EngineConfig& config) {
  auto impl = std::make_unique<Impl>(config);
  Status s = impl->Start();
  if (!s.ok()) {
    impl->Shutdown();
    return s;
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

int Engine::rank() const { return impl_->rank(); }
int Engine::size() const { return impl_->size(); }
const EngineConfig& Engine::config() const { return impl_->config(); }
bool Engine::small_star() const { return impl_->small_star(); }
EngineStats Engine::stats() const { return impl_->stats(); }
void Engine::ResetStats() { impl_->ResetStats(); }
std::vector<NamedCollectiveStats> Engine::collective_stats(bool reset) { return impl_->CollectiveStats(reset); }

namespace {
// The limits every peer enforces on each frame it reads (cc/wire.cc), checked before anything is sent:
// a bad argument then fails this call alone, instead of a peer refusing the frame and dropping the
// connection, which would fail every later collective with this worker.
Status CheckCollective(const char* kind, const std::string& name, DType dtype, const std::vector<int64_t>& counts) {
  std::string why;
  if (name.empty() || name.size() > kMaxNameBytes) {
    why = "the name must be 1 to " + std::to_string(kMaxNameBytes) + " bytes long, not " + std::to_string(name.size());
  } else if (!IsValidDType(static_cast<uint8_t>(dtype))) {
    why = "unknown dtype " + std::to_string(static_cast<int>(dtype));
  }
  for (int64_t c : counts) {
    if (why.empty() && (c < 0 || c > kMaxElements)) {
      why = "the element count " + std::to_string(c) + " is out of range [0, 2^40]";
    }
  }
  if (why.empty()) return Status::OK();
  return InvalidArgument(std::string(kind) + (name.size() <= 200 ? " '" + name + "'" : "") + ": " + why);
}
}  // namespace

void Engine::AllReduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, const std::string& name,
                       DoneCallback done, uint32_t shape_sig) {
  Status bad = CheckCollective("allreduce", name, dtype, {count});
  if (bad.ok() && !IsValidReduceOp(static_cast<uint8_t>(op))) {
    bad = InvalidArgument("allreduce '" + name + "': unknown reduce op " + std::to_string(static_cast<int>(op)));
  }
  if (!bad.ok()) return done(bad);
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  const int n = size();
  const EngineConfig& c = impl_->config();
  const bool pow2 = n > 1 && (n & (n - 1)) == 0;
  // Below the threshold: recursive doubling on 2, 4, 8, ... workers unless they agreed on the star (where
  // cores are short, ChooseSmallStar); the star on any other number.
  const bool doubling = pow2 && !impl_->small_star();
  // With two workers recursive doubling is one swap, moving the same bytes as the ring in one step
  // instead of two: it wins up to about 4x the threshold that suits larger clusters (measured: docs/engine.md,
  // "The small-message crossover").
  const int64_t threshold = n == 2 && doubling ? std::min<int64_t>(4 * c.ring_threshold_bytes, kMaxPayloadBytes)
                                               : c.ring_threshold_bytes;
  const bool ring = n > 1 && bytes >= threshold && count >= n;
  // On 4, 8, ... workers, halving-doubling takes the ring's place while there is nothing to pipeline
  // (each of its steps one piece): 2 log2(n) steps instead of 2(n-1) (docs/engine.md has the figures).
  const bool halving = c.halving && ring && n > 2 && pow2 && bytes <= 2 * c.chunk_bytes;
  auto o = halving    ? NewAllReduceHalving(in, out, count, dtype, op, name, std::move(done))
           : ring     ? NewAllReduceRing(in, out, count, dtype, op, name, std::move(done))
           : doubling ? NewAllReduceDoubling(in, out, count, dtype, op, name, std::move(done))
                      : NewAllReduceStar(in, out, count, dtype, op, name, std::move(done));
  o->shape_sig = shape_sig;
  impl_->Submit(std::move(o));
}

void Engine::Broadcast(void* buf, int64_t count, DType dtype, int root, const std::string& name, DoneCallback done,
                       uint32_t shape_sig) {
  Status bad = CheckCollective("broadcast", name, dtype, {count});
  if (!bad.ok()) return done(bad);
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  const bool chain = size() > 2 && bytes >= impl_->config().ring_threshold_bytes;
  auto o = NewBroadcast(buf, count, dtype, root, chain, name, std::move(done));
  o->shape_sig = shape_sig;
  impl_->Submit(std::move(o));
}

void Engine::AllGather(const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                       const std::string& name, DoneCallback done) {
  Status bad = CheckCollective("allgather", name, dtype, counts);
  if (!bad.ok()) return done(bad);
  impl_->Submit(NewAllGather(in, out, counts, dtype, name, std::move(done)));
}

void Engine::Cancel(const std::string& name, const Status& why) { impl_->Cancel(name, why); }

void Engine::Barrier(const std::string& name, DoneCallback done) {
  Status bad = CheckCollective("barrier", name, DType::kUInt8, {});
  if (!bad.ok()) return done(bad);
  impl_->Submit(
      NewAllReduceStar(nullptr, nullptr, 0, DType::kUInt8, ReduceOp::kMax, name, std::move(done), "barrier"));
}

void Engine::Consensus(const void* data, int64_t nbytes, bool* same, const std::string& name, DoneCallback done) {
  Status bad = CheckCollective("consensus", name, DType::kUInt8, {nbytes});
  if (!bad.ok()) return done(bad);
  // Compare a digest of fixed size, so inputs of different lengths compare (unequal) instead of
  // failing. One MAX allreduce over [d, ~d] yields max(d) and ~min(d): all equal iff max == min.
  constexpr int kLen = 40;
  auto buf = std::make_shared<std::vector<uint8_t>>(2 * kLen);
  const Digest d = Sha256Of(data, static_cast<size_t>(nbytes));
  std::memcpy(buf->data(), d.data(), 32);
  std::memcpy(buf->data() + 32, &nbytes, 8);
  for (int i = 0; i < kLen; ++i) (*buf)[kLen + i] = static_cast<uint8_t>(~(*buf)[i]);
  auto wrapped = [buf, same, done = std::move(done)](const Status& s) {
    if (s.ok()) {
      bool eq = true;
      for (int i = 0; i < kLen; ++i) eq = eq && (*buf)[i] == static_cast<uint8_t>(~(*buf)[kLen + i]);
      *same = eq;
    }
    done(s);
  };
  impl_->Submit(NewAllReduceStar(buf->data(), buf->data(), 2 * kLen, DType::kUInt8, ReduceOp::kMax, name,
                                 std::move(wrapped), "consensus"));
}

void Engine::RunAndWait(const std::function<void()>& start, const std::function<bool()>& finished) {
  impl_->loop().DriveUntil(finished, start, impl_->config().caller_drives);
}

void Engine::WakeWaiters() { impl_->loop().Notify(); }

void Engine::Progress() {
  if (impl_->config().caller_drives) impl_->loop().PollOnce();
}

Status Engine::RunSync(const std::function<void(DoneCallback)>& submit) {
  std::atomic<bool> finished{false};
  Status result;
  RunAndWait(
      [&] {
        submit([&](const Status& s) {
          result = s;
          finished = true;
          WakeWaiters();
        });
      },
      [&] { return finished.load(); });  // the engine guarantees a callback by the op's deadline
  return result;
}

Status Engine::AllReduceSync(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                             const std::string& name, uint32_t shape_sig) {
  return RunSync([&](DoneCallback done) { AllReduce(in, out, count, dtype, op, name, std::move(done), shape_sig); });
}

Status Engine::BroadcastSync(void* buf, int64_t count, DType dtype, int root, const std::string& name,
                             uint32_t shape_sig) {
  return RunSync([&](DoneCallback done) { Broadcast(buf, count, dtype, root, name, std::move(done), shape_sig); });
}

Status Engine::AllGatherSync(const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                             const std::string& name) {
  return RunSync([&](DoneCallback done) { AllGather(in, out, counts, dtype, name, std::move(done)); });
}

Status Engine::BarrierSync(const std::string& name) {
  return RunSync([&](DoneCallback done) { Barrier(name, std::move(done)); });
}

Status Engine::ConsensusSync(const void* data, int64_t nbytes, bool* same, const std::string& name) {
  return RunSync([&](DoneCallback done) { Consensus(data, nbytes, same, name, std::move(done)); });
}

uint32_t ShapeSignature(const int64_t* dims, int ndims) {
  uint32_t h = 2166136261u;
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint8_t>(v >> (8 * i));
      h *= 16777619u;
    }
  };
  mix(ndims);
  for (int d = 0; d < ndims; ++d) mix(dims[d]);
  return h | 1u;
}

namespace {
Status ReadEnvNumber(const char* var, double min, double max, double* out) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') return Status::OK();
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (*end != '\0' || !(x >= min && x <= max)) {
    return InvalidArgument(std::string(var) + "='" + v + "' is not a number between " + FormatNumber(min) +
                           " and " + FormatNumber(max));
  }
  *out = x;
  return Status::OK();
}
}  // namespace

Status ApplyEnvOverrides(EngineConfig* c) {
  double spin = c->spin_us, halving = c->halving ? 1 : 0, drives = c->caller_drives ? 1 : 0,
         send_thread = c->send_thread, small_star = c->small_star;
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_SPIN_US", 0, 1e6, &spin));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_HALVING", 0, 1, &halving));
  if (halving != 0 && halving != 1) return InvalidArgument("KUNGFU_HALVING must be 0 or 1");
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_CALLER_DRIVES", 0, 1, &drives));
  if (drives != 0 && drives != 1) return InvalidArgument("KUNGFU_CALLER_DRIVES must be 0 or 1");
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_SEND_THREAD", -1, 1, &send_thread));
  if (send_thread != 0 && send_thread != 1 && send_thread != -1) {
    return InvalidArgument("KUNGFU_SEND_THREAD must be 1, 0 or -1 (where cores are to spare)");
  }
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_SMALL_STAR", -1, 1, &small_star));
  if (small_star != 0 && small_star != 1 && small_star != -1) {
    return InvalidArgument("KUNGFU_SMALL_STAR must be 1, 0 or -1 (where some host has more workers than cores)");
  }
  c->spin_us = static_cast<int>(spin);
  c->small_star = static_cast<int>(small_star);
  c->halving = halving != 0;
  c->caller_drives = drives != 0;
  c->send_thread = static_cast<int>(send_thread);
  double timeout = c->timeout_seconds, ring = static_cast<double>(c->ring_threshold_bytes),
         chunk = static_cast<double>(c->chunk_bytes), pending = static_cast<double>(c->max_pending_bytes);
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_TIMEOUT", 0.001, 1e7, &timeout));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_RING_THRESHOLD", 0, static_cast<double>(kMaxPayloadBytes), &ring));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_CHUNK_BYTES", 1, static_cast<double>(kMaxPayloadBytes), &chunk));
  RETURN_IF_ERROR(ReadEnvNumber("KUNGFU_MAX_PENDING_BYTES", 0, 1e15, &pending));
  c->timeout_seconds = timeout;
  c->ring_threshold_bytes = static_cast<int64_t>(ring);
  c->chunk_bytes = static_cast<int64_t>(chunk);
  c->max_pending_bytes = static_cast<int64_t>(pending);
  return Status::OK();
}

}  // namespace kungfu
