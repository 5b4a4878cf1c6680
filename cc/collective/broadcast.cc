// Broadcast from any root: a star for small messages, a pipelined chain for large ones.
//
// Star: the root sends the buffer to every worker. Chain: root -> root+1 -> ... -> root-1, in pieces
// of chunk_bytes, each worker forwarding a piece as soon as it lands (directly in its buffer).
// Receivers acknowledge (every receiver for the star, the last of the chain); once the root has the
// acknowledgements it sends every receiver a commit. Nobody finishes before the commit, so a mismatch
// found by any worker (an abort) fails the broadcast on every worker, not only on some.
#include <cstring>

#include "cc/collective/op.h"

namespace kungfu {

namespace {

class Broadcast : public Op {
 public:
  Broadcast(void* buf, int64_t count, DType dtype, int root, bool chain, std::string name, DoneCallback done)
      : Op(std::move(name), std::move(done)),
        buf_(static_cast<char*>(buf)), count_(count), dtype_(dtype), root_(root), chain_(chain),
        esize_(static_cast<int64_t>(DTypeSize(dtype))) {}

  const char* kind() const override { return "broadcast"; }
  Algo algo() const override { return chain_ ? Algo::kBroadcastChain : Algo::kBroadcastStar; }

  Status Start(OpContext* ctx) override {
    n_ = ctx->size();
    r_ = ctx->rank();
    if (root_ < 0 || root_ >= n_) {
      return InvalidArgument("broadcast root " + std::to_string(root_) + " is not a rank of this cluster of " +
                             std::to_string(n_));
    }
    piece_ = std::max<int64_t>(1, ctx->config().chunk_bytes / esize_);
    got_piece_.assign(static_cast<size_t>((count_ + piece_ - 1) / piece_), false);
    if (r_ != root_ || n_ == 1) return Status::OK();
    if (chain_) {
      SendAll(ctx, Next());
    } else {
      for (int d = 0; d < n_; ++d) {
        if (d != root_) SendAll(ctx, d);
      }
    }
    return Status::OK();
  }

  char* DirectTarget(int src, const FrameHeader& h) override {
    int64_t len = 0;
    if (src != Prev() || r_ == root_ || !SameCollective(h, Shape()) || !Placement(h, &len).ok()) return nullptr;
    return buf_ + h.offset * esize_;
  }

  Status OnData(OpContext* ctx, int src, const FrameHeader& h, const char* data) override {
    RETURN_IF_ERROR(CheckAgreement(ctx->config().peers, src, h, Shape(), "root"));
    if (r_ == root_ || src != Prev()) return InvalidArgument("unexpected broadcast frame from rank " + std::to_string(src));
    int64_t len = 0;
    RETURN_IF_ERROR(Placement(h, &len));
    // A piece sent twice must not count as a missing one (an empty tensor comes in one frame).
    if (count_ > 0 ? got_piece_[h.offset / piece_] : frames_ > 0) {
      return InvalidArgument("broadcast piece at offset " + std::to_string(h.offset) + " came twice");
    }
    if (count_ > 0) got_piece_[h.offset / piece_] = true;
    char* dst = buf_ + h.offset * esize_;
    if (data != dst && len > 0) std::memcpy(dst, data, len * esize_);
    received_ += len;
    ++frames_;
    if (chain_ && Next() != root_) Forward(ctx, h, len);
    if (HaveData() && (!chain_ || Next() == root_)) ctx->Send(this, root_, Header(FrameKind::kAck, 0, 0), nullptr);
    return Status::OK();
  }

  Status OnAck(OpContext* ctx, int src, const FrameHeader& h) override {
    RETURN_IF_ERROR(CheckAgreement(ctx->config().peers, src, h, Shape(), "root"));
    if (r_ != root_) {  // the root's commit
      if (src != root_ || h.tag != kCommitTag || committed_) return InvalidArgument("unexpected broadcast commit");
      committed_ = true;
      return Status::OK();
    }
    if (h.tag != 0 || ++acks_ > ExpectedAcks()) return InvalidArgument("unexpected broadcast acknowledgement");
    if (src >= 0 && src < n_) {
      acked_.resize(n_);
      // One worker's twice must not count as another's: the root would commit before that one has the data.
      if (acked_[src]) return InvalidArgument("broadcast acknowledgement from rank " + std::to_string(src) + " came twice");
      acked_[src] = true;
    }
    if (acks_ == ExpectedAcks()) {
      FrameHeader commit = Header(FrameKind::kAck, 0, 0);
      commit.tag = kCommitTag;
      for (int d = 0; d < n_; ++d) {
        if (d != root_) ctx->Send(this, d, commit, nullptr);
      }
      committed_ = true;
    }
    return Status::OK();
  }

  bool ReceivedAll() const override {
    if (n_ == 1) return true;
    return committed_ && (r_ == root_ || HaveData());
  }

  std::string Progress() const override {
    if (r_ == root_) {
      const std::string got =
          "received " + std::to_string(acks_) + " of " + std::to_string(ExpectedAcks()) + " acknowledgements";
      if (acks_ == ExpectedAcks()) return got + "; sending the commit";
      if (chain_) {  // only the chain's end acknowledges, once every rank before it has forwarded the data
        return got + "; waiting for the end of the chain, rank " + std::to_string((root_ + n_ - 1) % n_) +
               " (any rank along the chain may be the one holding it up)";
      }
      std::vector<int> missing;
      for (int r = 0; r < n_; ++r) {
        if (r != root_ && (r >= static_cast<int>(acked_.size()) || !acked_[r])) missing.push_back(r);
      }
      return got + "; waiting for " + RankList(missing);
    }
    if (HaveData()) return "waiting for the root's commit";
    return "received " + std::to_string(received_) + " of " + std::to_string(count_) + " elements from rank " +
           std::to_string(Prev());
  }

 private:
  static constexpr uint32_t kCommitTag = 1;
  bool HaveData() const { return received_ == count_ && frames_ >= 1; }
  int ExpectedAcks() const { return chain_ ? 1 : n_ - 1; }
  int Next() const { return (r_ + 1) % n_; }
  int Prev() const { return chain_ ? (r_ + n_ - 1) % n_ : root_; }

  FrameShape Shape() const { return {algo(), dtype_, count_, static_cast<uint32_t>(root_)}; }

  Status Placement(const FrameHeader& h, int64_t* len) const {
    if (count_ == 0) {
      *len = 0;
      return h.offset == 0 && h.payload_bytes == 0 ? Status::OK() : InvalidArgument("malformed broadcast frame");
    }
    if (h.offset % piece_ != 0 || h.offset >= count_) return InvalidArgument("broadcast piece out of place");
    *len = std::min(piece_, count_ - h.offset);
    if (h.payload_bytes != static_cast<uint64_t>(*len * esize_)) return InvalidArgument("broadcast piece has the wrong size");
    return Status::OK();
  }

  FrameHeader Header(FrameKind kind, int64_t off, int64_t len) const {
    return MakeFrame(Shape(), 0, off, static_cast<uint64_t>(len * esize_), kind);
  }

  void SendAll(OpContext* ctx, int dst) {
    if (count_ == 0) return ctx->Send(this, dst, Header(FrameKind::kData, 0, 0), buf_);
    for (int64_t off = 0; off < count_; off += piece_) {
      ctx->Send(this, dst, Header(FrameKind::kData, off, std::min(piece_, count_ - off)), buf_ + off * esize_);
    }
  }

  void Forward(OpContext* ctx, const FrameHeader& in, int64_t len) {
    ctx->Send(this, Next(), Header(FrameKind::kData, in.offset, len), buf_ + in.offset * esize_);
  }

  char* buf_;
  int64_t count_;
  DType dtype_;
  int root_;
  bool chain_;
  int64_t esize_;
  int n_ = 1, r_ = 0;
  int64_t piece_ = 1;
  int64_t received_ = 0;
  int frames_ = 0;
  std::vector<bool> got_piece_;  // by piece: received
  int acks_ = 0;
  std::vector<bool> acked_;  // root: which workers' acknowledgements came
  bool committed_ = false;  // root: commit sent; others: commit received
};

}  // namespace

std::unique_ptr<Op> NewBroadcast(void* buf, int64_t count, DType dtype, int root, bool chain, std::string name,
                                 DoneCallback done) {
  return std::make_unique<Broadcast>(buf, count, dtype, root, chain, std::move(name), std::move(done));
}

}  // namespace kungfu
