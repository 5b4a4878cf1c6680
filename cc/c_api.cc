// The process-wide engine behind the C API. One mutex guards the pointer; the engine itself is
// thread-safe. A shared_ptr lets a kernel that holds the engine finish even if finalize runs.
//
// A child forked from a worker after kungfu_init (os.fork, multiprocessing's default "fork") gets a copy
// of the engine's memory and its sockets, but none of its threads. Using that engine would write frames
// into the parent's connections, and stopping it would join threads that are not there, so the child
// never touches it: an atfork handler sets it aside for good, and every call then fails naming the fork.
// The DLPack calls are in c_api_dlpack.cc.
#include "cc/c_api.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>

#include "cc/engine.h"

namespace kungfu {
namespace {

std::mutex g_mu;
std::shared_ptr<Engine> g_engine;
std::atomic<bool> g_forked{false};  // this process is a child forked from a worker with an engine
pid_t g_owner = 0;                  // the process whose engine g_engine is (kungfu_init's caller)

// In the child, right after fork: only the forking thread exists, so g_mu may be held by a thread that
// is gone; nothing here locks it. The parent's engine moves into storage that is never destroyed
// (placement new: no allocation), so no destructor at the child's exit runs it.
void AfterForkInChild() {
  if (!g_engine) return;
  g_forked.store(true);
  alignas(std::shared_ptr<Engine>) static unsigned char parked[sizeof(std::shared_ptr<Engine>)];
  new (parked) std::shared_ptr<Engine>(std::move(g_engine));
}

}  // namespace

int Report(const Status& s, char* err, int err_len) {
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, s.message().c_str(), static_cast<size_t>(err_len) - 1);
    err[err_len - 1] = '\0';
  }
  return static_cast<int>(s.code());
}

std::shared_ptr<Engine> GlobalEngine() {
  if (g_forked.load(std::memory_order_relaxed)) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_engine;
}

std::string NoEngineReason() {
  if (g_forked.load()) {
    return "this process (pid " + std::to_string(::getpid()) + ") was forked from KungFu worker pid " +
           std::to_string(g_owner) +
           " after kungfu.init(): a forked child cannot use its parent's engine (the engine's threads did not "
           "come along, and its connections are the parent's); run collectives in the worker process itself";
  }
  return "kungfu is not initialized: call kungfu.init() first (or it was finalized)";
}

}  // namespace kungfu

using kungfu::Status;

extern "C" {

int kungfu_init(const char* peers, int rank, const char* token, double timeout_seconds, uint32_t cluster_version,
                char* err, int err_len) {
  if (kungfu::g_forked.load()) return kungfu::Report(kungfu::FailedPrecondition(kungfu::NoEngineReason()), err, err_len);
  std::lock_guard<std::mutex> lock(kungfu::g_mu);
  if (kungfu::g_engine) {
    return kungfu::Report(kungfu::FailedPrecondition("kungfu is already initialised"), err, err_len);
  }
  kungfu::EngineConfig config;
  const std::string peer_text = peers ? peers : "";
  if (peer_text.empty()) {  // a single worker: the engine opens no port for a cluster of one
    config.peers = kungfu::PeerList({kungfu::PeerID{"127.0.0.1", 0}}, cluster_version);
  } else {
    auto list = kungfu::PeerList::Parse(peer_text, cluster_version);
    if (!list.ok()) return kungfu::Report(list.status(), err, err_len);
    config.peers = std::move(list.value());
  }
  config.rank = rank;
  config.token = token ? token : "";
  if (timeout_seconds > 0) config.timeout_seconds = timeout_seconds;
  Status s = kungfu::ApplyEnvOverrides(&config);
  if (!s.ok()) return kungfu::Report(s, err, err_len);
  auto engine = kungfu::Engine::Start(config);
  if (!engine.ok()) return kungfu::Report(engine.status(), err, err_len);
  kungfu::g_engine = std::shared_ptr<kungfu::Engine>(std::move(engine.value()));
  kungfu::g_owner = ::getpid();
  static const int atfork = pthread_atfork(nullptr, nullptr, kungfu::AfterForkInChild);
  (void)atfork;
  return 0;
}

int kungfu_initialized(void) { return kungfu::GlobalEngine() != nullptr; }

int kungfu_rank(void) {
  auto e = kungfu::GlobalEngine();
  return e ? e->rank() : 0;
}

int kungfu_size(void) {
  auto e = kungfu::GlobalEngine();
  return e ? e->size() : 1;
}

namespace {
int Finalize(bool leave_cleanly) {
  std::shared_ptr<kungfu::Engine> e;
  {
    std::lock_guard<std::mutex> lock(kungfu::g_mu);
    e.swap(kungfu::g_engine);
  }
  if (e && leave_cleanly) e->LeaveCleanly();
  e.reset();  // waits for in-flight work unless a kernel still holds a reference
  return 0;
}
}  // namespace

void kungfu_finalizing(void) {
  auto e = kungfu::GlobalEngine();
  if (e) e->Finalizing();
}

int kungfu_timed_out(void) {
  auto e = kungfu::GlobalEngine();
  return e && e->TimedOut() ? 1 : 0;
}

int kungfu_finalize(void) { return Finalize(false); }

int kungfu_leave(void) { return Finalize(true); }

int kungfu_stats(int64_t* out, int n) {
  auto e = kungfu::GlobalEngine();
  if (!e || out == nullptr) return 0;
  const kungfu::EngineStats s = e->stats();
  const int64_t values[] = {s.started,       s.completed, s.failed,         s.in_flight,
                            s.max_in_flight, s.bytes_sent, s.bytes_received, s.refused_handshakes};
  const int count = n < 8 ? n : 8;
  for (int i = 0; i < count; ++i) out[i] = values[i];
  return count;
}

void kungfu_reset_stats(void) {
  auto e = kungfu::GlobalEngine();
  if (e) e->ResetStats();
}

char* kungfu_collective_stats(int reset) {
  auto e = kungfu::GlobalEngine();
  const std::string text = e ? kungfu::CollectiveStatsJson(e->collective_stats(reset != 0)) : "{}";
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

void kungfu_free(void* p) { std::free(p); }

int kungfu_all_reduce(const void* in, void* out, int64_t count, int dtype, int op, const char* name, char* err,
                      int err_len) {
  auto e = kungfu::GlobalEngine();
  if (!e) return kungfu::Report(kungfu::FailedPrecondition(kungfu::NoEngineReason()), err, err_len);
  if (!kungfu::IsValidDType(static_cast<uint8_t>(dtype)) || !kungfu::IsValidReduceOp(static_cast<uint8_t>(op))) {
    return kungfu::Report(kungfu::InvalidArgument("bad dtype or reduce op"), err, err_len);
  }
  if (count < 0) return kungfu::Report(kungfu::InvalidArgument("negative count"), err, err_len);
  return kungfu::Report(e->AllReduceSync(in, out, count, static_cast<kungfu::DType>(dtype),
                                         static_cast<kungfu::ReduceOp>(op), name ? name : "c_api"),
                        err, err_len);
}

int kungfu_barrier(const char* name, char* err, int err_len) {
  auto e = kungfu::GlobalEngine();
  if (!e) return kungfu::Report(kungfu::FailedPrecondition(kungfu::NoEngineReason()), err, err_len);
  return kungfu::Report(e->BarrierSync(name ? name : "c_api"), err, err_len);
}

}  // extern "C"
