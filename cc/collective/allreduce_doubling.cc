// Allreduce by recursive doubling, for small messages on a power-of-two number of workers.
//
// In round k every worker swaps its partial result with worker rank ^ 2^k and reduces the two, so
// after log2(n) rounds everyone holds the full result: log2(n) message delays with every worker busy,
// where the star needs two delays but funnels n-1 messages through rank 0. Both partners compute
// a (op) b with the operands swapped; the ops are commutative, so the results agree bit for bit (min and
// max by their definitions in dtype.cc, for NaN and signed zeros too; a sum of two NaNs with different
// payloads is the one case left that can differ).
// A buffer that has been sent is never written again (each round reduces into a fresh stage buffer),
// so a send still queued in the socket never sees later rounds' data.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cc/buffer.h"
#include "cc/collective/allreduce_op.h"

namespace kungfu {

namespace {

class AllReduceDoubling : public AllReduceOp {
 public:
  AllReduceDoubling(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, std::string name,
                    DoneCallback done)
      : AllReduceOp(Algo::kAllReduceDoubling, in, out, count, dtype, op, std::move(name), std::move(done)) {}

  Status Start(OpContext* ctx) override {
    Place(ctx);
    while ((1 << rounds_) < n_) ++rounds_;
    if ((1 << rounds_) != n_) return Internal("recursive doubling needs a power-of-two cluster size");
    if (n_ == 1) {
      if (in_ != out_ && bytes_ > 0) std::memcpy(out_, in_, bytes_);
      finished_ = true;
      return Status::OK();
    }
    const size_t alloc = static_cast<size_t>(std::max<int64_t>(bytes_, 1));
    for (int k = 0; k < rounds_; ++k) recv_.push_back(NewBuffer(alloc));
    for (int k = 0; k + 1 < rounds_; ++k) stage_.push_back(NewBuffer(alloc));
    got_.assign(rounds_, false);
    first_ = in_;
    if (in_ == out_ && bytes_ > 0) {  // the last round writes out, which round 0 may still be sending
      copy_ = NewBuffer(bytes_);
      std::memcpy(copy_.get(), in_, bytes_);
      first_ = copy_.get();
    }
    SendRound(ctx, 0, first_);
    return Status::OK();
  }

  char* DirectTarget(int src, const FrameHeader& h) override {
    if (!Expected(src, h).ok()) return nullptr;
    return recv_[h.tag].get();
  }

  Status OnData(OpContext* ctx, int src, const FrameHeader& h, const char* data) override {
    RETURN_IF_ERROR(CheckAgreement(ctx->config().peers, src, h, Shape(), "reduce op"));
    RETURN_IF_ERROR(Expected(src, h));
    if (data != recv_[h.tag].get() && bytes_ > 0) std::memcpy(recv_[h.tag].get(), data, bytes_);
    got_[h.tag] = true;
    // Rounds complete in order; a partner of a later round may be ahead of this one.
    while (round_ < rounds_ && got_[round_]) {
      const char* mine = round_ == 0 ? first_ : stage_[round_ - 1].get();
      const bool last = round_ + 1 == rounds_;
      char* dst = last ? out_ : stage_[round_].get();
      Reduce3(dst, mine, recv_[round_].get(), count_, dtype_, op_);
      ++round_;
      if (!last) SendRound(ctx, round_, dst);
    }
    if (round_ == rounds_ && !finished_) {
      if (op_ == ReduceOp::kMean) DivideBy(out_, count_, dtype_, n_);
      finished_ = true;
    }
    return Status::OK();
  }

  bool ReceivedAll() const override { return finished_; }

  std::string Progress() const override {
    return "finished " + std::to_string(round_) + " of " + std::to_string(rounds_) + " rounds; waiting for rank " +
           std::to_string(round_ < rounds_ ? Partner(round_) : r_);
  }

 private:
  int Partner(int round) const { return r_ ^ (1 << round); }

  Status Expected(int src, const FrameHeader& h) const {
    if (!SameCollective(h, Shape())) return InvalidArgument("frame of another collective");
    if (h.tag >= static_cast<uint32_t>(rounds_) || src != Partner(static_cast<int>(h.tag)) || got_[h.tag]) {
      return InvalidArgument("unexpected allreduce round " + std::to_string(h.tag) + " from rank " +
                             std::to_string(src));
    }
    if (h.offset != 0 || h.payload_bytes != static_cast<uint64_t>(bytes_)) {
      return InvalidArgument("allreduce round frame has the wrong size");
    }
    return Status::OK();
  }

  void SendRound(OpContext* ctx, int round, const char* data) {
    ctx->Send(this, Partner(round), MakeFrame(Shape(), static_cast<uint32_t>(round), 0, static_cast<uint64_t>(bytes_)),
              data);
  }

  int rounds_ = 0;  // log2(n)
  int round_ = 0;   // rounds reduced so far
  bool finished_ = false;
  const char* first_ = nullptr;  // what round 0 sends: in, or copy_ when in == out
  Buffer copy_;
  std::vector<Buffer> recv_;     // per round: the partner's partial result
  std::vector<Buffer> stage_;    // per round but the last: our partial result
  std::vector<bool> got_;        // per round: partner's frame received
};

}  // namespace

std::unique_ptr<Op> NewAllReduceDoubling(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                         std::string name, DoneCallback done) {
  return std::make_unique<AllReduceDoubling>(in, out, count, dtype, op, std::move(name), std::move(done));
}

}  // namespace kungfu
