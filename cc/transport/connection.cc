#include "cc/transport/connection.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kungfu {

namespace {
// Small enough that little of a large payload goes through it (the rest is read in place), large
// enough to take many small frames in one recv().
constexpr size_t kStagingBytes = 64 << 10;
// Payload reads at least this large bypass the staging buffer.
constexpr uint64_t kDirectReadMin = 16 << 10;
constexpr int kMaxIov = 64;
// Payloads at least this large are padded into line with the sender's memory (Enqueue).
constexpr uint64_t kAlignPayloadMin = 16 << 10;
const char kZeros[kMaxPadBytes] = {};
}  // namespace

Connection::Connection(Fd fd, int peer, FrameSink* sink, uint64_t read_budget)
    : fd_(std::move(fd)), peer_(peer), sink_(sink), read_budget_(std::max<uint64_t>(1, read_budget)),
      staging_(kStagingBytes) {}

Connection::~Connection() {
  if (offloaded_) sender_->Abort(&job_);  // before the fd closes and the payload goes
}

void Connection::Fail(const Status& s) {
  if (broken_) return;
  broken_ = true;
  error_ = s;
}

bool Connection::TakeError(Status* why) {
  if (!broken_ || error_taken_) return false;
  error_taken_ = true;
  *why = error_;
  return true;
}

void Connection::Close(const Status& why) {
  Fail(why);
  ::shutdown(fd_.get(), SHUT_RDWR);
}

bool Connection::OnReadable() {
  uint64_t budget = read_budget_;
  while (!broken_ && budget > 0) {
    const uint64_t remaining = header_.payload_bytes - payload_got_;
    char* dst;
    size_t want;
    const bool direct = state_ == ReadState::kPayload && !discard_ && staged_begin_ == staged_end_ &&
                        remaining >= kDirectReadMin;
    if (direct) {
      dst = target_ + payload_got_;
      want = remaining;
    } else {
      if (staged_begin_ == staged_end_) staged_begin_ = staged_end_ = 0;
      if (staged_end_ == staging_.size()) {  // compact
        std::memmove(staging_.data(), staging_.data() + staged_begin_, staged_end_ - staged_begin_);
        staged_end_ -= staged_begin_;
        staged_begin_ = 0;
      }
      dst = staging_.data() + staged_end_;
      want = staging_.size() - staged_end_;
    }
    const ssize_t n = ::recv(fd_.get(), dst, want, 0);
    if (n == 0) {
      Fail(Unavailable("closed the connection"));
      return false;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      if (errno == EINTR) continue;
      Fail(ErrnoStatus(Code::kUnavailable, "connection error", errno));
      return false;
    }
    budget -= std::min<uint64_t>(budget, static_cast<uint64_t>(n));
    if (direct) {
      payload_got_ += static_cast<uint64_t>(n);
      if (payload_got_ == header_.payload_bytes) FinishFrame();
    } else {
      staged_end_ += static_cast<size_t>(n);
      if (!ParseStaged()) return false;
    }
    // A short read took all the socket had: TCP's recv copies until the buffer is full or the queue is
    // empty. The epoll registration is level-triggered, so what arrives next is reported again; a
    // second recv now would only say EAGAIN (one system call per frame a small collective receives).
    if (static_cast<size_t>(n) < want) return false;
  }
  return !broken_;
}

// Consumes staged bytes into frames. Returns false when the connection broke.
bool Connection::ParseStaged() {
  for (;;) {
    if (broken_) return false;
    const size_t avail = staged_end_ - staged_begin_;
    if (state_ == ReadState::kHeader) {
      if (avail < kFrameHeaderSize) return true;
      uint32_t name_len = 0;
      const auto* p = reinterpret_cast<const uint8_t*>(staging_.data() + staged_begin_);
      Status s = DecodeFrameHeader(p, &header_, &name_len);
      if (!s.ok()) {
        Fail(s.WithContext("malformed frame"));
        return false;
      }
      // The name and pad fit in staging: 4 KiB + 63 bytes at most.
      if (avail < kFrameHeaderSize + name_len + header_.pad) return true;
      name_.assign(staging_.data() + staged_begin_ + kFrameHeaderSize, name_len);
      staged_begin_ += kFrameHeaderSize + name_len + header_.pad;
      BeginPayload();
      continue;
    }
    const uint64_t take = std::min<uint64_t>(avail, header_.payload_bytes - payload_got_);
    if (take > 0 && !discard_) std::memcpy(target_ + payload_got_, staging_.data() + staged_begin_, take);
    staged_begin_ += take;
    payload_got_ += take;
    if (payload_got_ < header_.payload_bytes) return true;
    FinishFrame();
  }
}

void Connection::BeginPayload() {
  state_ = ReadState::kPayload;
  payload_got_ = 0;
  discard_ = false;
  target_ = nullptr;
  if (header_.payload_bytes > 0) {
    target_owner_ = 0;
    target_ = sink_->PayloadTarget(peer_, header_, name_, &discard_, &target_owner_);
    if (!discard_ && target_ == nullptr) {
      owned_ = NewBuffer(header_.payload_bytes);
      target_ = owned_.get();
    }
  }
  if (header_.payload_bytes == 0) FinishFrame();
}

void Connection::FinishFrame() {
  state_ = ReadState::kHeader;
  char* data = discard_ ? nullptr : target_;
  const bool dropped = discard_;
  target_ = nullptr;
  discard_ = false;
  if (dropped) {
    owned_.reset();
    return;
  }
  sink_->OnFrame(peer_, header_, std::move(name_), data, std::move(owned_));
  name_.clear();
}

// The pad: the kernel copies a payload from our memory into socket buffers that follow the byte
// stream (a fresh buffer starts at a page boundary), and the receiver's kernel copies it out into
// the receiver's memory. On the AMD EPYC machines this was measured on, such a copy ran up to twice
// as slow when its source and destination sat 1-48 bytes apart within a page (most likely 4K
// aliasing), e.g. a 64-byte-aligned TensorFlow tensor behind a 64-byte header and a 1-byte name.
// So a large payload starts at a stream offset in line, mod 64, with its address here; on the
// receiving side TensorFlow's 64-byte-aligned buffers are then in line too.
void Connection::Enqueue(const FrameHeader& header, const std::string& name, const void* data, uint64_t op_id) {
  FrameHeader h = header;
  const uint64_t before_payload = queued_end_ + kFrameHeaderSize + name.size();
  h.pad = 0;
  if (h.payload_bytes >= kAlignPayloadMin) {
    h.pad = static_cast<uint8_t>((reinterpret_cast<uintptr_t>(data) - before_payload) % kMaxPadBytes);
  }
  queue_.emplace_back();
  OutFrame& f = queue_.back();
  EncodeFrameHeader(h, static_cast<uint32_t>(name.size()), f.header);
  f.name = name;
  f.pad = h.pad;
  f.data = static_cast<const char*>(data);
  f.len = h.payload_bytes;
  f.op_id = op_id;
  queued_end_ += f.total();
}

void Connection::EnqueueOwned(const FrameHeader& h, const std::string& name, Buffer data,
                              uint64_t op_id) {
  Enqueue(h, name, data.get(), op_id);
  queue_.back().owned = std::move(data);
}

void Connection::EnqueueShared(const FrameHeader& h, const std::string& name, const void* data,
                               std::shared_ptr<const void> keep) {
  Enqueue(h, name, data, 0);
  queue_.back().keep = std::move(keep);
}

bool Connection::Offload() {
  OutFrame& f = queue_.front();
  const uint64_t done = f.written - (f.total() - f.len);  // of the payload
  job_.fd = fd_.get();
  job_.data = f.data + done;
  job_.len = f.len - done;
  if (!sender_->Start(&job_)) {
    sender_ = nullptr;  // stopped: write everything here from now on
    return false;
  }
  offloaded_ = true;
  return true;
}

void Connection::TakeJob(std::vector<uint64_t>* sent) {
  offloaded_ = false;
  OutFrame& f = queue_.front();
  f.written += job_.written;
  if (job_.error != 0) {
    Fail(ErrnoStatus(Code::kUnavailable, "send failed", job_.error));
    return;
  }
  if (f.written == f.total()) {
    if (f.op_id != 0) sent->push_back(f.op_id);
    queue_.pop_front();
  }
}

bool Connection::Flush(std::vector<uint64_t>* sent) {
  if (offloaded_) {
    if (!job_.done.load(std::memory_order_acquire)) return false;
    TakeJob(sent);
  }
  while (!broken_ && !queue_.empty()) {
    if (sender_ != nullptr) {
      const OutFrame& f = queue_.front();
      if (f.len >= kOffloadBytes && f.written >= f.total() - f.len && Offload()) return false;
    }
    iovec iov[kMaxIov];
    int n_iov = 0;
    for (auto it = queue_.begin(); it != queue_.end() && n_iov + 4 <= kMaxIov; ++it) {
      uint64_t skip = it->written;
      auto add = [&](const char* base, uint64_t len) {
        if (skip >= len) {
          skip -= len;
          return;
        }
        iov[n_iov].iov_base = const_cast<char*>(base + skip);
        iov[n_iov].iov_len = len - skip;
        ++n_iov;
        skip = 0;
      };
      add(reinterpret_cast<const char*>(it->header), kFrameHeaderSize);
      add(it->name.data(), it->name.size());
      add(kZeros, it->pad);
      if (sender_ != nullptr && it->len >= kOffloadBytes) break;  // the sender writes it, once it is in front
      add(it->data, it->len);
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n_iov;
    const ssize_t n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      if (errno == EINTR) continue;
      Fail(ErrnoStatus(Code::kUnavailable, "send failed", errno));
      return false;
    }
    uint64_t left = static_cast<uint64_t>(n);
    while (left > 0 && !queue_.empty()) {
      OutFrame& f = queue_.front();
      const uint64_t need = f.total() - f.written;
      if (left < need) {
        f.written += left;
        break;
      }
      left -= need;
      const uint64_t op_id = f.op_id;
      queue_.pop_front();
      if (op_id != 0) sent->push_back(op_id);
    }
  }
  return queue_.empty();
}

void Connection::AbandonTarget(uint64_t op_id) {
  if (state_ == ReadState::kPayload && target_owner_ == op_id && !discard_) {
    discard_ = true;
    target_ = nullptr;
  }
}

int Connection::CancelOp(uint64_t op_id) {
  if (offloaded_ && queue_.front().op_id == op_id) {
    sender_->Abort(&job_);  // the op's buffers may go once this returns
    std::vector<uint64_t> finished;  // at most this op's frame: the op is going, nobody waits for it
    TakeJob(&finished);
  }
  int dropped = 0;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->op_id != op_id) {
      ++it;
      continue;
    }
    if (it->written == 0) {
      queued_end_ -= it->total();  // later frames' pads may now be out of line: slower, not wrong
      it = queue_.erase(it);
      ++dropped;
      continue;
    }
    // Partly written: the peer expects the rest of this frame. Keep our own copy of the payload.
    if (!it->owned && !it->keep && it->len > 0) {
      it->owned = NewBuffer(it->len);
      std::memcpy(it->owned.get(), it->data, it->len);
      it->data = it->owned.get();
    }
    it->op_id = 0;
    ++it;
  }
  return dropped;
}

void Connection::DropQueued(std::vector<uint64_t>* dropped) {
  if (offloaded_) {
    sender_->Abort(&job_);
    TakeJob(dropped);
  }
  for (const OutFrame& f : queue_) {
    if (f.op_id != 0) dropped->push_back(f.op_id);
    queued_end_ -= f.total() - f.written;
  }
  queue_.clear();
}

}  // namespace kungfu
