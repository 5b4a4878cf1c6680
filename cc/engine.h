// The collective engine: asynchronous, name-keyed collectives over a versioned peer list.
//
// Design, in short:
//  1. One event loop owns every socket and every in-flight collective; collectives are state machines
//     that advance when a message arrives or a send drains. No thread per operation, and no lock inside
//     an algorithm. The loop runs on a thread of its own, or on a caller that blocks until its
//     collective is done and drives it meanwhile (RunAndWait); one thread at a time either way. One
//     more thread accepts connections and runs the handshake.
//  2. Collectives are keyed by (name, generation): the generation counts how many times this worker
//     has started that name. Workers may start collectives in any order; a message for one not started
//     yet waits in a bounded buffer (max_pending_bytes). There is no per-step negotiation.
//  3. Every message carries the sender's dtype, element count and algorithm; a mismatch fails the
//     collective with InvalidArgument here and tells every other peer (an ABORT frame), so all fail alike.
//  4. Every collective has a deadline (timeout). A peer whose connection closes fails every in-flight
//     collective at once, naming the peer; later collectives fail immediately. A peer that leaves
//     cleanly (LeaveCleanly) says so first, and collectives it has finished too go on without it.
//  5. Callbacks run on the thread driving the loop: they must be quick and must not call back into a
//     blocking wait.
//  6. Buffers passed in must stay valid and unmodified until the callback runs.
//  7. Peer-to-peer (cc/p2p/): each worker keeps a store of named tensors (Save); any worker can fetch
//     one peer's latest copy (Request) without that peer's caller taking part: its loop thread answers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/collective_stats.h"
#include "cc/dtype.h"
#include "cc/peer.h"
#include "cc/status.h"

namespace kungfu {

struct EngineConfig {
  PeerList peers;                     // rank order; version is the cluster version
  int rank = 0;                       // this worker's index into peers
  std::string token;                  // the job secret proven in the handshake
  double timeout_seconds = 60;        // deadline of every blocking wait (KUNGFU_TIMEOUT)
  int64_t ring_threshold_bytes = 256 << 10;  // allreduce at or above this size uses the ring (or halving)
  int64_t chunk_bytes = 1 << 20;      // pipeline piece size of the ring and chain broadcast
  bool halving = true;  // 4, 8, ... workers: halving-doubling for ring sizes up to 2 pieces (KUNGFU_HALVING)
  // Below the ring threshold on 2, 4, 8, ... workers: 1 the star, 0 recursive doubling, -1 the star only where
  // some host runs more workers than it has cores for them (KUNGFU_SMALL_STAR). Workers agree at Start
  // (ChooseSmallStar), so they may be configured differently.
  int small_star = -1;
  int64_t max_pending_bytes = int64_t{1} << 30;  // bound on data buffered for collectives not started
  int spin_us = 200;                  // the loop polls this long after activity before sleeping (KUNGFU_SPIN_US)
  int64_t read_budget_bytes = 4 << 20;  // most read from one peer per wake-up, so no peer starves the others
  bool caller_drives = true;  // RunAndWait() runs the loop on the waiting thread (KUNGFU_CALLER_DRIVES)
  // A second thread writes payloads of 256 KiB and more (cc/transport/sender.h): 1 on, 0 off, -1 where
  // this process may run on at least two cores for each worker on its host (KUNGFU_SEND_THREAD).
  int send_thread = -1;
};

// The engine keeps, for the whole run, how many times each collective name was started (about 150 bytes
// a name). When the names reach this many, and ten times as many again, it warns once: a program that
// makes a fresh name per call (the step number in it) grows that without bound.
constexpr size_t kManyNames = 100000;

// Counters for tests and benchmarks; read with Engine::stats().
struct EngineStats {
  int64_t started = 0;         // collectives started
  int64_t completed = 0;       // collectives finished OK
  int64_t failed = 0;          // collectives finished with an error
  int64_t in_flight = 0;       // started and not yet finished
  int64_t max_in_flight = 0;   // high-water mark of in_flight since the last ResetStats()
  int64_t bytes_sent = 0;      // payload bytes written to sockets
  int64_t bytes_received = 0;  // payload bytes read from sockets
  int64_t refused_handshakes = 0;
  int64_t loop_wakes = 0;      // eventfd writes that made a thread in epoll_wait look (not reset)
};

using DoneCallback = std::function<void(const Status&)>;
// A peer-to-peer request's completion: the status, and the version of the copy received (-1: none).
using RequestCallback = std::function<void(const Status&, int64_t version)>;

class Engine {
 public:
  // Binds the listening port of peers[rank], connects to every other peer (retrying until the
  // deadline while they start), and proves the token both ways.
  static StatusOr<std::unique_ptr<Engine>> Start(const EngineConfig& config);
  // Waits (up to the timeout) for in-flight collectives and queued sends, then closes everything.
  ~Engine();
  // Makes the destructor say goodbye to every peer before it closes, provided nothing in flight had to
  // be cancelled. Call it after a collective that every worker finishes right before leaving (the
  // finalize barrier): a peer still finishing that collective, which needs nothing more from this one,
  // then does not take the closed connection for a failure. Collectives a peer starts after the
  // goodbye, and those in flight there that this worker never started, fail at once naming it.
  // Without it, a closing worker fails its peers' in-flight collectives (a crash looks the same).
  void LeaveCleanly();
  // This worker will start no collective but the finalize barrier (the next one it starts, which every
  // worker joins). Peers hear how many it started before: one waiting in a collective that this worker
  // never started (it left its training loop early) fails at once, naming it, instead of at its timeout.
  void Finalizing();
  // Whether the last collective of this engine to time out did so after the last one to complete: a peer
  // stalled (or is far behind), and it would hold a finalize barrier for another whole deadline too.
  bool TimedOut() const;

  int rank() const;
  int size() const;
  const EngineConfig& config() const;
  // Whether allreduces below the ring threshold use the star on 2, 4, 8, ... workers (as they do on any
  // other number) rather than recursive doubling: the choice every worker agreed on at Start.
  bool small_star() const;

  // out = reduce(in over workers). in == out is allowed. kMean divides by size().
  // shape_sig, when nonzero, is a hash of the caller's tensor shape (ShapeSignature): workers whose element
  // counts agree but whose shapes differ ([2,3] against [6]) then fail with InvalidArgument too.
  void AllReduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, const std::string& name,
                 DoneCallback done, uint32_t shape_sig = 0);
  // buf on root is sent; on the others it is overwritten. Every worker finishes only once every
  // worker has the data (the root commits), so a mismatch anywhere fails the broadcast everywhere.
  void Broadcast(void* buf, int64_t count, DType dtype, int root, const std::string& name, DoneCallback done,
                 uint32_t shape_sig = 0);
  // Worker r contributes counts[r] elements; out holds sum(counts) elements in rank order.
  // Every worker must pass the same counts (checked).
  void AllGather(const void* in, void* out, const std::vector<int64_t>& counts, DType dtype, const std::string& name,
                 DoneCallback done);
  void Barrier(const std::string& name, DoneCallback done);
  // *same = whether every worker passed the same bytes (compared by SHA-256 digest and length).
  void Consensus(const void* data, int64_t nbytes, bool* same, const std::string& name, DoneCallback done);
  // Fails the collective named name that is in flight here, if any, with why, and tells the peers, so
  // theirs fails too. For the parts of a group whose other parts can no longer all succeed. Collectives
  // submitted before this call are covered; a later one of that name is not.
  void Cancel(const std::string& name, const Status& why);

  // ---- Peer-to-peer (cc/p2p/) ----
  // Copies count elements of data into this worker's store under name, replacing the previous copy
  // (only the latest is kept). Versions count the saves of each name from 0; *version, if given,
  // receives this one's. Synchronous and thread-safe; InvalidArgument for a bad name, dtype or count.
  Status Save(const std::string& name, const void* data, int64_t count, DType dtype, uint32_t shape_sig = 0,
              int64_t* version = nullptr);
  // Fetches peer's latest copy of name into out (count elements). done(OK, version) when it came;
  // done(OK, -1) with out untouched when peer has saved nothing under name; InvalidArgument naming
  // both sides when the copy's dtype, count or shape_sig differ; Unavailable naming the peer when it
  // is gone; DeadlineExceeded after the timeout. Any number may be in flight, for any names. A request
  // to this worker itself is answered from its own store on the calling thread, before this returns.
  // Otherwise done runs on the loop thread; out must stay valid until it has run. departed_ok: a peer
  // that has left the cluster (it said goodbye, or announced it was finalizing before its connection
  // closed) answers done(OK, -1), as if it had saved nothing, instead of Unavailable; pair averaging then
  // keeps its own model while the others go on (a peer that crashed while training still fails). Then,
  // unlike a plain "none", out may hold part of a copy cut short by the close: the caller restores it.
  void Request(int peer, const std::string& name, void* out, int64_t count, DType dtype, uint32_t shape_sig,
               RequestCallback done, bool departed_ok = false);

  EngineStats stats() const;
  // Zeroes the resettable counters of stats() and forgets the per-collective ones.
  void ResetStats();
  // Per-collective counters by name (cc/collective_stats.h), sorted; reset empties them at once.
  std::vector<NamedCollectiveStats> collective_stats(bool reset = false);

  // For a caller that blocks until a callback has run (the C API, eager TF kernels): runs start(),
  // which submits the collectives, and returns once finished() holds. Meanwhile the calling thread
  // drives the engine's loop itself (EventLoop::DriveUntil): it does the I/O and runs the callbacks,
  // so neither the start nor the result needs a thread wake-up, which on a machine with fewer cores
  // than busy threads costs more than a small collective. With config().caller_drives false
  // (KUNGFU_CALLER_DRIVES=0) it sleeps while the loop's thread does the work. finished() must be
  // thread-safe; the callback that makes it true calls WakeWaiters() afterwards. Never call this from
  // a callback.
  void RunAndWait(const std::function<void()>& start, const std::function<bool()>& finished);
  void WakeWaiters();
  // From a RunAndWait start() that submits several collectives with work in between (a group's
  // packing): runs one non-blocking loop iteration here, so those already submitted go out meanwhile.
  void Progress();

  // Synchronous helpers for tests and the C API (eager Python calls): run one collective and wait for it
  // (with RunAndWait).
  Status AllReduceSync(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, const std::string& name,
                       uint32_t shape_sig = 0);
  Status BroadcastSync(void* buf, int64_t count, DType dtype, int root, const std::string& name,
                       uint32_t shape_sig = 0);
  Status AllGatherSync(const void* in, void* out, const std::vector<int64_t>& counts, DType dtype,
                       const std::string& name);
  Status BarrierSync(const std::string& name);
  Status ConsensusSync(const void* data, int64_t nbytes, bool* same, const std::string& name);

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  // Runs submit(done) under RunAndWait and returns the status done received.
  Status RunSync(const std::function<void(DoneCallback)>& submit);
  std::unique_ptr<Impl> impl_;
};

// Reads KUNGFU_TIMEOUT, KUNGFU_RING_THRESHOLD, KUNGFU_CHUNK_BYTES, KUNGFU_HALVING, KUNGFU_SMALL_STAR,
// KUNGFU_MAX_PENDING_BYTES, KUNGFU_SPIN_US, KUNGFU_CALLER_DRIVES and KUNGFU_SEND_THREAD into config, leaving
// fields whose variable is unset. Bad values are an InvalidArgument naming the variable.
Status ApplyEnvOverrides(EngineConfig* config);

// What each worker says of itself at Start (the TRAITS frame), so that all of them pick the same algorithm.
struct WorkerTraits {
  int small_star = -1;   // its EngineConfig::small_star
  // The CPUs it may run on: sched_getaffinity's, CPU i as bit i % 8 of byte i / 8; empty if unknown.
  std::string cpu_mask;
};

// The small-message allreduce on 2, 4, 8, ... workers, from every worker's traits (by rank) and the peer
// list, so that every worker computes the same answer: the star if any worker asks for it (small_star 1),
// else recursive doubling if any asks for that (0), else the star if some host runs more workers than
// there are CPUs in the union of their masks (workers on one host are those whose peer entries name the
// same host; a host whose masks are all unknown counts as having enough). With more busy processes than
// cores, every step of a collective waits for a core, and the star's 2(n-1) messages beat doubling's
// n log2(n): measured on 2 cores, 4 KiB, median of the slowest rank after a barrier, 4 workers 87-89 us
// against 104-122, 8 workers 240-270 against 397-455; with a core per worker doubling wins (2 workers:
// 19-23 us against 30-33).
bool ChooseSmallStar(const PeerList& peers, const std::vector<WorkerTraits>& traits);

// This process's CPU mask as WorkerTraits::cpu_mask wants it (trailing zero bytes dropped), or empty.
std::string OwnCpuMask();

// The shape_sig of a tensor of ndims dimensions: FNV-1a over the rank and each dimension (8 bytes each,
// little end first), never 0 (0 means "not checked"). The TF kernels and the C API's DLPack path both use
// it, so an eager call and a graph call of one collective agree on it.
uint32_t ShapeSignature(const int64_t* dims, int ndims);

}  // namespace kungfu
