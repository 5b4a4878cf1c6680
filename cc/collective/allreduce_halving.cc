// Allreduce by recursive halving and doubling (Rabenseifner), for mid-size messages on a power-of-two
// number of workers (4, 8, ...).
//
// Reduce-scatter by halving: in round k (k = 0 .. L-1, L = log2 n) every worker pairs with rank ^ n/2^(k+1);
// both split the range they still hold into halves, each sends the partner one half and reduces the other
// with what the partner sent. After L rounds each worker holds one fully reduced block of about count/n
// elements. The allgather retraces the rounds in reverse: each worker sends the partner the range it holds
// and receives the partner's, doubling its range each round. Every worker sends 2(n-1)/n of the buffer, as
// in the ring, but in 2 log2(n) steps instead of 2(n-1), and each step waits on one partner only. The
// engine uses it only while the buffer is at most two pipeline pieces, so each step is one frame: past
// that, the ring's piece-by-piece pipelining wins.
//
// Buffers. Round 0 sends from in; reduce-scatter results are written into out, and allgather frames land in
// out directly. A region of out is written again only by the allgather frame of the partner it was sent to
// in the reduce-scatter, which that partner sends only after it has received (so this worker has written) the
// whole of it. A reduce-scatter frame may arrive before the previous round is reduced; it waits in its
// round's own scratch region. Steps finish in order.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cc/buffer.h"
#include "cc/collective/allreduce_op.h"

namespace kungfu {

namespace {

struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

class AllReduceHalving : public AllReduceOp {
 public:
  AllReduceHalving(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, std::string name,
                   DoneCallback done)
      : AllReduceOp(Algo::kAllReduceHalving, in, out, count, dtype, op, std::move(name), std::move(done)) {}

  Status Start(OpContext* ctx) override {
    Place(ctx);
    while ((1 << levels_) < n_) ++levels_;
    if (n_ < 2 || (1 << levels_) != n_ || count_ < n_) {  // the engine picks it only for 4, 8, ... workers
      return Internal("halving-doubling needs a power-of-two cluster size and at least one element per worker");
    }
    if (static_cast<uint64_t>((count_ - count_ / 2) * esize_) > kMaxPayloadBytes) {
      return Internal("halving-doubling sends each step as one frame: the buffer is too large");
    }
    // Round k of the reduce-scatter: the range held before it, split into the half kept and the half sent.
    Range held{0, count_};
    int64_t scratch = 0;
    for (int k = 0; k < levels_; ++k) {
      const int mask = n_ >> (k + 1);
      const int64_t mid = held.begin + held.size() / 2;
      const Range lower{held.begin, mid}, upper{mid, held.end};
      const bool low = (r_ & mask) == 0;
      keep_.push_back(low ? lower : upper);
      send_.push_back(low ? upper : lower);
      scratch_at_.push_back(scratch);
      scratch += keep_.back().size();
      held = keep_.back();
    }
    scratch_ = NewBuffer(scratch * esize_);
    received_.assign(2 * levels_, false);
    SendRange(ctx, 0, send_[0], in_);
    return Status::OK();
  }

  char* DirectTarget(int src, const FrameHeader& h) override {
    if (!SameCollective(h, Shape()) || !Placement(src, h).ok()) return nullptr;
    return Landing(static_cast<int>(h.tag));
  }

  Status OnData(OpContext* ctx, int src, const FrameHeader& h, const char* data) override {
    RETURN_IF_ERROR(CheckAgreement(ctx->config().peers, src, h, Shape(), "reduce op"));
    RETURN_IF_ERROR(Placement(src, h));
    const int t = static_cast<int>(h.tag);
    char* dst = Landing(t);
    if (data != dst && h.payload_bytes > 0) std::memcpy(dst, data, h.payload_bytes);
    received_[t] = true;
    Advance(ctx);
    return Status::OK();
  }

  bool ReceivedAll() const override { return done_all_; }

  std::string Progress() const override {
    if (done_all_) return "done";
    return "at step " + std::to_string(step_) + " of " + std::to_string(2 * levels_) + ", waiting for rank " +
           std::to_string(Partner(step_));
  }

 private:
  // Step t < L is reduce-scatter round t; step L + j is allgather round j, which undoes round L-1-j.
  int Round(int t) const { return t < levels_ ? t : 2 * levels_ - 1 - t; }
  int Partner(int t) const { return r_ ^ (n_ >> (Round(t) + 1)); }
  // What the partner sends at step t: into the half we keep (reduce-scatter), or the half we sent.
  Range Expected(int t) const { return t < levels_ ? keep_[t] : send_[Round(t)]; }

  char* Landing(int t) {
    return t >= levels_ ? out_ + Expected(t).begin * esize_ : scratch_.get() + scratch_at_[t] * esize_;
  }

  Status Placement(int src, const FrameHeader& h) const {
    const int t = static_cast<int>(h.tag);
    if (h.tag >= static_cast<uint32_t>(2 * levels_)) {
      return InvalidArgument("halving step " + std::to_string(h.tag) + " out of range");
    }
    if (src != Partner(t)) {
      return InvalidArgument("halving step " + std::to_string(t) + " frame from rank " + std::to_string(src) +
                             ", not the partner (rank " + std::to_string(Partner(t)) + ")");
    }
    const Range want = Expected(t);
    if (h.offset != want.begin || h.payload_bytes != static_cast<uint64_t>(want.size() * esize_)) {
      return InvalidArgument("halving step " + std::to_string(t) + " frame at offset " + std::to_string(h.offset) +
                             " does not match the range [" + std::to_string(want.begin) + ", " +
                             std::to_string(want.end) + ")");
    }
    if (received_[t]) return InvalidArgument("duplicate halving step " + std::to_string(t) + " frame");
    return Status::OK();
  }

  // Finishes every step whose frames are all in, in order, starting the next one's sends.
  void Advance(OpContext* ctx) {
    while (step_ < 2 * levels_ && received_[step_]) {
      const int t = step_;
      if (t < levels_) {
        const Range k = keep_[t];
        const char* mine = (t == 0 ? in_ : out_) + k.begin * esize_;
        Reduce3(out_ + k.begin * esize_, mine, scratch_.get() + scratch_at_[t] * esize_, k.size(), dtype_, op_);
        if (t == levels_ - 1 && op_ == ReduceOp::kMean) DivideBy(out_ + k.begin * esize_, k.size(), dtype_, n_);
      }
      ++step_;
      if (step_ == 2 * levels_) {
        done_all_ = true;
      } else if (step_ < levels_) {
        SendRange(ctx, step_, send_[step_], out_);
      } else {
        SendRange(ctx, step_, keep_[Round(step_)], out_);  // the range this worker now holds in full
      }
    }
  }

  void SendRange(OpContext* ctx, int t, Range range, const char* from) {
    const FrameHeader h = MakeFrame(Shape(), static_cast<uint32_t>(t), range.begin,
                                    static_cast<uint64_t>(range.size() * esize_));
    ctx->Send(this, Partner(t), h, from + range.begin * esize_);
  }

  int levels_ = 0;  // log2(n)
  int step_ = 0;    // steps finished
  bool done_all_ = false;
  std::vector<Range> keep_, send_;    // per reduce-scatter round
  std::vector<int64_t> scratch_at_;   // per reduce-scatter round: where its frames wait, in elements
  Buffer scratch_;
  std::vector<bool> received_;        // per step: the partner's frame is in
};

}  // namespace

std::unique_ptr<Op> NewAllReduceHalving(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                        std::string name, DoneCallback done) {
  return std::make_unique<AllReduceHalving>(in, out, count, dtype, op, std::move(name), std::move(done));
}

}  // namespace kungfu
