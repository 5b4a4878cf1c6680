// One TCP connection to one peer, driven by the event loop (loop thread only).
//
// Connections are one-directional for data: this worker writes frames on the connection it opened
// to a peer and reads frames on the connection the peer opened to it. Both kinds also watch for
// EOF/errors so a dead peer is noticed on either side.
//
// Reading parses frames out of a staging buffer; large payloads are read straight into the buffer
// the receiver chose (often the collective's output: zero copy). Writing batches queued frames into
// one sendmsg() and never blocks; a frame's data pointer is borrowed until the frame is written.
// With a Sender (set_sender), a payload of kOffloadBytes or more is written by the sender's thread
// instead, while the loop goes on reading and reducing; frames queued behind it wait for it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "cc/buffer.h"
#include "cc/status.h"
#include "cc/transport/sender.h"
#include "cc/transport/socket.h"
#include "cc/wire.h"

namespace kungfu {

// What the connection hands frames to (the engine).
class FrameSink {
 public:
  virtual ~FrameSink() = default;
  // Where the payload of this frame goes. Return nullptr to have the connection allocate a buffer
  // (passed to OnFrame as owned), or set *discard to read and drop the payload. A pointer into an
  // op's memory sets *owner to the op's id, so the op can abandon it (AbandonTarget) if it ends first.
  virtual char* PayloadTarget(int src, const FrameHeader& h, const std::string& name, bool* discard,
                              uint64_t* owner) = 0;
  virtual void OnFrame(int src, const FrameHeader& h, std::string name, char* data, Buffer owned) = 0;
};

class Connection {
 public:
  // read_budget: the most one OnReadable() reads (at least 1).
  Connection(Fd fd, int peer, FrameSink* sink, uint64_t read_budget = 4 << 20);
  ~Connection();  // takes back a payload the sender is writing
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  // Payloads at least this large go to the sender, if there is one.
  static constexpr uint64_t kOffloadBytes = 256 << 10;
  // Hands large payloads to sender (which must outlive this connection); null: write them here.
  void set_sender(Sender* sender) { sender_ = sender; }
  // The sender is writing a payload of ours: this socket's writability is the sender's business
  // until the sender wakes the loop, and Flush takes the result.
  bool offloaded() const { return offloaded_; }
  // Frames are queued that Flush has not written yet (an abort queued after the iteration's flush).
  bool has_queued() const { return !queue_.empty(); }
  int fd() const { return fd_.get(); }
  int peer() const { return peer_; }
  bool broken() const { return broken_; }
  // Why the connection broke, once: the owner polls this outside any op's code (a write error can
  // happen while an op is sending, and failing ops from there would pull the op out from under itself).
  bool TakeError(Status* why);

  // Reads what is available, up to a budget per call so that one busy peer cannot starve the others;
  // frames go to the sink. Errors are kept for TakeError(). Returns true when it stopped at the budget
  // (more may be waiting), false when the socket had no more or the connection broke.
  bool OnReadable();
  // Marks the connection broken with why (unless it is already) and shuts the socket down both ways,
  // so the peer sees the close now; the fd stays open (and its number taken) until destruction.
  void Close(const Status& why);
  // Queues a frame. data (payload_bytes long) must stay valid until written or cancelled.
  void Enqueue(const FrameHeader& h, const std::string& name, const void* data, uint64_t op_id);
  // Same, but the connection owns the payload.
  void EnqueueOwned(const FrameHeader& h, const std::string& name, Buffer data, uint64_t op_id);
  // Same, but keep holds data alive until the frame is written or dropped (a peer-to-peer response
  // sends from an immutable saved copy that a newer save may replace meanwhile).
  void EnqueueShared(const FrameHeader& h, const std::string& name, const void* data, std::shared_ptr<const void> keep);
  // Writes as much as the socket takes; appends the op id of each fully written frame to sent
  // (the caller reports them later, outside any op's code). Returns true when the queue is empty.
  bool Flush(std::vector<uint64_t>* sent);
  // Drops the op's frames that have not started; copies the unsent rest of a partly written one, so
  // the caller may release the op's buffers now. Returns how many frames were dropped.
  int CancelOp(uint64_t op_id);
  // Drops every queued frame, partly written ones too (the peer has said it needs none of them), and
  // appends their op ids to dropped, as if written.
  void DropQueued(std::vector<uint64_t>* dropped);
  // If a payload is being read into op_id's memory, read the rest of it into nothing instead.
  void AbandonTarget(uint64_t op_id);

 private:
  struct OutFrame {
    uint8_t header[kFrameHeaderSize];
    std::string name;
    const char* data = nullptr;
    uint64_t len = 0;
    Buffer owned;
    std::shared_ptr<const void> keep;  // keeps data alive instead of owned (EnqueueShared)
    uint8_t pad = 0;
    uint64_t written = 0;  // of header + name + pad + payload
    uint64_t op_id = 0;
    uint64_t total() const { return kFrameHeaderSize + name.size() + pad + len; }
  };
  enum class ReadState { kHeader, kPayload };

  void Fail(const Status& s);
  // The front frame is all written but a large payload: hand it to the sender. False if it stopped.
  bool Offload();
  // The sender is done with the front frame's payload: count what it wrote; a finished frame's op id
  // goes to sent.
  void TakeJob(std::vector<uint64_t>* sent);
  bool ParseStaged();
  void BeginPayload();
  void FinishFrame();

  Fd fd_;
  int peer_;
  FrameSink* sink_;
  uint64_t read_budget_;  // see the constructor
  bool broken_ = false;
  bool error_taken_ = false;
  Status error_;

  // Read side.
  std::vector<char> staging_;
  size_t staged_begin_ = 0, staged_end_ = 0;
  ReadState state_ = ReadState::kHeader;
  FrameHeader header_;
  std::string name_;
  char* target_ = nullptr;
  Buffer owned_;
  bool discard_ = false;
  uint64_t target_owner_ = 0;  // op whose memory target_ points into (0: ours or none)
  uint64_t payload_got_ = 0;

  // Write side.
  std::deque<OutFrame> queue_;
  uint64_t queued_end_ = 0;  // stream offset just past the last queued frame (for the pad)
  Sender* sender_ = nullptr;
  Sender::Job job_;           // the front frame's payload, while offloaded_
  bool offloaded_ = false;
};

}  // namespace kungfu
