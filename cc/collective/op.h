// A collective in flight: a state machine the engine drives on its loop thread.
//
// The engine calls Start() once, then OnData()/OnAck() for each frame addressed to this
// (name, generation), in arrival order per peer. An op never fails or finishes itself: it returns a
// Status (the engine then fails it, telling peers when the error is InvalidArgument) and reports
// ReceivedAll(); the engine finishes it once that holds and all its sends have drained.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cc/dtype.h"
#include "cc/engine.h"
#include "cc/status.h"
#include "cc/wire.h"

namespace kungfu {

class Op;

// The engine, as seen by an algorithm.
class OpContext {
 public:
  virtual ~OpContext() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const EngineConfig& config() const = 0;
  // Queues a frame of op to dst. The op's name, generation and the cluster version are filled in,
  // and payload_bytes must be set. data must stay valid until the op finishes.
  virtual void Send(Op* op, int dst, FrameHeader h, const void* data) = 0;
};

class Op {
 public:
  Op(std::string name, DoneCallback done) : name_(std::move(name)), done_(std::move(done)) {}
  virtual ~Op() = default;

  virtual const char* kind() const = 0;  // "allreduce", for messages
  virtual Algo algo() const = 0;         // what its frames carry
  virtual Status Start(OpContext* ctx) = 0;
  // A buffer to read this DATA frame's payload into directly, or nullptr (the engine buffers it).
  // Must validate the frame's placement before returning a pointer into user memory.
  virtual char* DirectTarget(int /*src*/, const FrameHeader& /*h*/) { return nullptr; }
  virtual Status OnData(OpContext* ctx, int src, const FrameHeader& h, const char* data) = 0;
  virtual Status OnAck(OpContext* ctx, int src, const FrameHeader& h);
  virtual bool ReceivedAll() const = 0;
  // "waiting for 2 of 3 contributions", for the deadline error.
  virtual std::string Progress() const = 0;

  const std::string& name() const { return name_; }
  DoneCallback& done() { return done_; }

  // Engine bookkeeping.
  uint64_t id = 0;
  uint64_t generation = 0;
  int64_t outstanding_sends = 0;
  uint32_t shape_sig = 0;  // sent in every frame and compared with the peers' (0: not checked)
  std::chrono::steady_clock::time_point submitted;  // when the API call handed it to the engine
  int64_t bytes_sent = 0;      // payload bytes of its frames queued to peers
  int64_t bytes_received = 0;  // payload bytes of its DATA frames dispatched to it

 private:
  std::string name_;
  DoneCallback done_;
};

// What every frame of a collective says about it, so that peers can check they run the same one.
struct FrameShape {
  Algo algo;
  DType dtype;
  int64_t count;  // elements of the whole collective
  uint32_t aux;   // reduce op, root, or the sender's own block size
};

// A frame of that collective.
FrameHeader MakeFrame(const FrameShape& s, uint32_t tag, int64_t offset, uint64_t payload_bytes,
                      FrameKind kind = FrameKind::kData);
// Whether a peer's frame describes the same collective (the cheap test for DirectTarget).
bool SameCollective(const FrameHeader& h, const FrameShape& s);
// InvalidArgument when a peer's frame comes from another kind of collective than mine (an all-gather
// against an all-reduce): one name given to two different collectives.
Status CheckSameKind(const PeerList& peers, int src, Algo theirs, Algo mine);
// The same test as SameCollective with an error that names both sides:
// "peer 127.0.0.1:10001 (rank 1) has 12 float32 elements, this worker 10".
Status CheckAgreement(const PeerList& peers, int src, const FrameHeader& h, const FrameShape& s,
                      const char* aux_name);

// "rank 2", "ranks 1, 3" (the first 8, then "and N more"; "no rank" for none), for what a collective
// still waits for.
std::string RankList(const std::vector<int>& ranks);

// Chunk j of n over count elements: [ChunkBegin(j), ChunkBegin(j + 1)).
inline int64_t ChunkBegin(int64_t count, int n, int j) { return count * j / n; }

// Factories (one file per algorithm family).
// kind names the op in errors: barrier and consensus are star allreduces underneath.
std::unique_ptr<Op> NewAllReduceStar(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                     std::string name, DoneCallback done, const char* kind = "allreduce");
// Small messages on a power-of-two number of workers (2, 4, 8, ...).
std::unique_ptr<Op> NewAllReduceDoubling(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                         std::string name, DoneCallback done);
// Mid-size messages on 4, 8, ... workers: recursive halving, then doubling (Rabenseifner).
std::unique_ptr<Op> NewAllReduceHalving(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                        std::string name, DoneCallback done);
std::unique_ptr<Op> NewAllReduceRing(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                     std::string name, DoneCallback done);
std::unique_ptr<Op> NewBroadcast(void* buf, int64_t count, DType dtype, int root, bool chain, std::string name,
                                 DoneCallback done);
std::unique_ptr<Op> NewAllGather(const void* in, void* out, std::vector<int64_t> counts, DType dtype,
                                 std::string name, DoneCallback done);

}  // namespace kungfu
