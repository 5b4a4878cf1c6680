// Engine internals. Threading and ownership:
//  - loop_ owns conns_, ops_, pending_, next_gen_ and dead_: touched only by the thread driving it (its
//    own, or a blocking caller's in RunAndWait), one at a time under its drive lock. "The loop thread"
//    below means whichever thread that is.
//  - acceptor_ (one thread) accepts and authenticates incoming connections, many handshakes at once,
//    then posts them to the loop.
//  - API calls from any thread build an Op and post it; callbacks run on the loop thread.
//  - stats_ are atomics, readable from any thread; collective_stats_ has its own mutex (the loop thread
//    records each finished op, any thread reads).
//  - store_ (the peer-to-peer variable store) is thread-safe; p2p_ (requests in flight, serving) is
//    loop-thread state like ops_. Their glue to the engine is in cc/p2p/engine_p2p.cc.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cc/collective/op.h"
#include "cc/engine.h"
#include "cc/p2p/p2p.h"
#include "cc/p2p/store.h"
#include "cc/transport/connection.h"
#include "cc/transport/event_loop.h"
#include "cc/transport/handshake.h"
#include "cc/transport/socket.h"
#include "cc/wire.h"

namespace kungfu {

class Engine::Impl : public FrameSink, public OpContext, public P2PContext {
 public:
  explicit Impl(const EngineConfig& config);
  ~Impl() override;

  Status Start();
  void Shutdown();
  void Submit(std::unique_ptr<Op> op);
  void Cancel(const std::string& name, const Status& why);  // any thread
  EngineStats stats() const;
  void ResetStats();
  std::vector<NamedCollectiveStats> CollectiveStats(bool reset) { return collective_stats_.Snapshot(reset); }

  // OpContext.
  int rank() const override { return config_.rank; }
  int size() const override { return config_.peers.size(); }
  const EngineConfig& config() const override { return config_; }
  bool small_star() const { return small_star_; }  // set by Start, then fixed
  void Send(Op* op, int dst, FrameHeader h, const void* data) override;

  // Peer-to-peer (cc/p2p/engine_p2p.cc).
  VariableStore& store() { return store_; }
  void SubmitRequest(PeerRequest r);  // any thread
  bool SendFrame(int dst, FrameHeader h, const std::string& name, const void* data,
                 std::shared_ptr<const void> keep) override;
  Status PeerStatus(int peer) const override;
  bool PeerDeparted(int peer) const override;
  void AbandonTarget(int peer, uint64_t owner) override;

  // FrameSink (from connections, loop thread).
  char* PayloadTarget(int src, const FrameHeader& h, const std::string& name, bool* discard,
                      uint64_t* owner) override;
  void OnFrame(int src, const FrameHeader& h, std::string name, char* data, Buffer owned) override;
  void SettleReceiving(int src);  // drops what receiving_ charged for src's frame in progress
  void OnConnectionError(int peer, const Status& s);
  void Judge(int peer, const Status& s);  // the peer is gone: close to it, fail what involves it
  void LeaveCleanly() { leave_cleanly_ = true; }
  void BeginFinalize();  // loop thread: see Engine::Finalizing
  bool TimedOut() const { return timed_out_; }
  EventLoop& loop() { return loop_; }
  void CheckBroken(Connection* c);

 private:
  using Key = std::pair<std::string, uint64_t>;  // (name, generation)
  struct ActiveOp {
    std::unique_ptr<Op> op;
    Deadline deadline;
  };
  struct PendingFrame {
    int src;
    FrameHeader h;
    Buffer data;
    int64_t cost;  // what it counts in pending_bytes_ (HeldCost)
  };

  Status ConnectToPeers();
  Status AwaitIncoming();
  bool WantSender() const;  // config_.send_thread, with -1 resolved for this machine
  void AcceptLoop();
  void Poison(const Key& key);  // fails the collective when it starts here: a frame for it was dropped
  Fd AcceptNext();                                           // acceptor thread
  void Refused(const std::string& from, const Status& why);  // acceptor thread
  void Admit(Fd fd, int peer);                                // acceptor thread
  void AddConnection(Fd fd, int peer, bool outgoing);
  void SendTraits(Connection* c);                                  // loop thread: the first frame on c
  void OnTraits(int src, const FrameHeader& h, const char* data);  // loop thread: a peer's TRAITS frame
  void StartOp(std::unique_ptr<Op> op);
  void Dispatch(ActiveOp& a, int src, const FrameHeader& h, const char* data);
  void MaybeFinish(uint64_t op_id);
  void Fail(uint64_t op_id, Status s, bool tell_peers);
  void Finish(std::map<Key, ActiveOp>::iterator it, const Status& s);
  void SendAbort(const Key& key, const Status& s);
  void SendGoodbyes();
  void OnPeerLeft(int peer, uint64_t started);
  void OnPeerFinalizing(int peer, uint64_t started);
  // A BYE or FINALIZING frame's payload: what the peer started, by name (started_by_).
  void ReadStartedByName(int peer, const char* data, uint64_t bytes);
  // Whether `peer`, which started `total` collectives before it began to leave, started `op`: exact
  // from its counts by name; from the total alone (no payload), a guess that holds while workers start
  // the same collectives in the same order.
  bool PeerStarted(int peer, uint64_t total, const Op& op) const;
  // Why `op` here can never run on a finalizing peer (that peer never started it), or OK.
  Status NeverJoined(const Op& op) const;
  void OnSendDone(uint64_t op_id);
  void ReportSent();  // OnSendDone for every id in sent_
  int AfterEvents();  // flush, deadlines; returns the loop's next sleep in ms
  // Moves every deadline the loop keeps (collectives, peer-to-peer requests, judge_at_) later by lost:
  // time this process was not run (EventLoop::TakeStall). See AfterEvents.
  void Postpone(Clock::duration lost);
  bool Busy() const;  // work in flight that needs the loop (see EventLoop::Start)
  ActiveOp* FindById(uint64_t op_id, std::map<Key, ActiveOp>::iterator* it);
  std::string Describe(const Op& op) const;

  EngineConfig config_;
  HandshakeParams hs_;
  EventLoop loop_;
  // Writes large payloads beside the loop (EngineConfig::send_thread); null when off. Declared after
  // loop_ and before the connections, so that it outlives them and loop_ outlives it.
  std::unique_ptr<Sender> sender_;
  Fd listener_;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> leave_cleanly_{false};  // say goodbye at shutdown (LeaveCleanly)
  std::atomic<bool> timed_out_{false};      // a collective failed at its deadline since the last success
  bool loop_started_ = false;  // set by Start once the loop thread runs

  // Loop thread state.
  std::vector<std::unique_ptr<Connection>> out_;  // by rank: connections we write to
  std::vector<std::unique_ptr<Connection>> in_;   // by rank: connections we read from
  std::vector<std::unique_ptr<Connection>> retired_;  // replaced or broken, kept until shutdown
  std::map<Key, ActiveOp> ops_;
  std::unordered_map<uint64_t, Key> op_keys_;
  std::map<Key, std::vector<PendingFrame>> pending_;
  // Bytes held for collectives not started yet, counted against max_pending_bytes: the frames in
  // pending_ (each with its header and name, so that frames with no payload are bounded too) plus, from
  // the moment its header is read, each frame still arriving into a buffer of its own (receiving_: by
  // rank, the frame being read from that peer's data stream), so that frames arriving from several peers
  // at once cannot pass the bound together.
  int64_t pending_bytes_ = 0;
  bool poison_full_logged_ = false;  // Poison dropped a frame unmarked (said once)
  std::optional<Deadline> poison_logged_at_;  // Poison's last warning, and how many were not said since
  int64_t poisons_unlogged_ = 0;
  std::unordered_map<int, int64_t> receiving_;
  std::unordered_map<std::string, uint64_t> next_gen_;  // by name: how many times this worker started it
  size_t names_warn_at_ = kManyNames;  // next_gen_'s size at which to warn of names made per call (x10 each time)
  std::vector<Status> dead_;  // by rank: why a peer is gone (OK while alive)
  std::vector<bool> left_;    // by rank: the peer said goodbye (it is in dead_ too)
  // By rank: how many collectives the peer started before it began to finalize (kFinalizing), or -1.
  std::vector<int64_t> finalizing_;
  // By rank: how many times the peer started each name before it began to leave (from its FINALIZING
  // or BYE frame), or nullopt (not heard yet, or sent without).
  std::vector<std::optional<StartedByName>> started_by_;
  int64_t finalized_after_ = -1;  // the same for this worker (BeginFinalize), or -1
  // By rank: the stream this worker writes to closed while the one it reads from is open; judged when
  // that one closes too or at this time, whichever first (see OnConnectionError).
  std::vector<std::optional<Deadline>> judge_at_;
  std::vector<Status> judge_why_;
  bool accept_failing_ = false;  // acceptor thread only: an accept error was logged
  // Acceptor thread only: refused connections are logged at most once per kRefusalLogSeconds (another
  // job on our ports retries many times a second), with the count of those not logged since.
  std::chrono::steady_clock::time_point last_refusal_log_{};
  int64_t refusals_unlogged_ = 0;
  Status first_dead_;
  uint64_t next_op_id_ = 1;
  std::vector<uint64_t> sent_;  // ops whose frames were written, to report outside op code
  VariableStore store_;         // thread-safe: saves come from any thread
  PeerToPeer p2p_{this, &store_};
  std::atomic<int64_t> requests_in_flight_{0};  // submitted to the loop, callback not yet returned

  // Shutdown handshake with the loop.
  std::mutex mu_;
  std::condition_variable cv_;
  bool flushed_ = false;                   // guarded by mu_
  int incoming_ = 0;                       // guarded by mu_: connections from peers registered (Start)
  // Guarded by mu_: by rank, what each peer said of itself in its TRAITS frame (Start waits for all), and
  // how many have; this worker's own entry is filled in by Start.
  std::vector<std::optional<WorkerTraits>> traits_;
  int traits_heard_ = 0;
  Status lost_peer_;  // guarded by mu_: the first peer judged gone (Judge), which ends Start's wait at once
  bool small_star_ = false;  // Start's agreed choice (ChooseSmallStar); fixed once Start returns
  std::atomic<bool> flushing_{false};       // set on the loop once remaining ops are cancelled
  std::vector<bool> writing_;               // by rank: out_ connection registered for EPOLLOUT

  struct Stats {
    std::atomic<int64_t> started{0}, completed{0}, failed{0}, in_flight{0}, max_in_flight{0};
    std::atomic<int64_t> bytes_sent{0}, bytes_received{0}, refused{0};
  } stats_;
  CollectiveStatsTable collective_stats_;
};

}  // namespace kungfu
