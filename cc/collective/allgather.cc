// Allgather with per-worker counts: every worker sends its block, in pieces of chunk_bytes, straight
// to every other worker, and pieces land directly at their place in the output. A worker with an
// empty block still sends one empty frame, so every pair of workers compares their views of the counts.
#include <cstring>
#include <vector>

#include "cc/collective/op.h"

namespace kungfu {

namespace {

class AllGather : public Op {
 public:
  AllGather(const void* in, void* out, std::vector<int64_t> counts, DType dtype, std::string name, DoneCallback done)
      : Op(std::move(name), std::move(done)),
        in_(static_cast<const char*>(in)), out_(static_cast<char*>(out)), counts_(std::move(counts)), dtype_(dtype),
        esize_(static_cast<int64_t>(DTypeSize(dtype))) {}

  const char* kind() const override { return "allgather"; }
  Algo algo() const override { return Algo::kAllGather; }

  Status Start(OpContext* ctx) override {
    n_ = ctx->size();
    r_ = ctx->rank();
    if (static_cast<int>(counts_.size()) != n_) {
      return InvalidArgument("allgather got " + std::to_string(counts_.size()) + " counts for " +
                             std::to_string(n_) + " workers");
    }
    prefix_.assign(n_ + 1, 0);
    got_.assign(n_, 0);
    empty_got_.assign(n_, false);
    for (int i = 0; i < n_; ++i) {
      if (counts_[i] < 0) return InvalidArgument("allgather count is negative");
      prefix_[i + 1] = prefix_[i] + counts_[i];
    }
    total_ = prefix_[n_];
    piece_ = std::max<int64_t>(1, ctx->config().chunk_bytes / esize_);
    char* mine = out_ + prefix_[r_] * esize_;
    if (in_ != mine && counts_[r_] > 0) std::memcpy(mine, in_, counts_[r_] * esize_);
    piece_at_.assign(n_ + 1, 0);
    for (int i = 0; i < n_; ++i) piece_at_[i + 1] = piece_at_[i] + (counts_[i] + piece_ - 1) / piece_;
    got_piece_.assign(static_cast<size_t>(piece_at_[n_]), false);
    for (int i = 0; i < n_; ++i) {
      if (i == r_) continue;
      expected_ += counts_[i];
      if (counts_[i] == 0) ++empty_expected_;
    }
    for (int d = 0; d < n_; ++d) {
      if (d == r_) continue;
      if (counts_[r_] == 0) ctx->Send(this, d, Header(prefix_[r_], 0), mine);
      for (int64_t off = 0; off < counts_[r_]; off += piece_) {
        const int64_t len = std::min(piece_, counts_[r_] - off);
        ctx->Send(this, d, Header(prefix_[r_] + off, len), mine + off * esize_);
      }
    }
    return Status::OK();
  }

  char* DirectTarget(int src, const FrameHeader& h) override {
    int64_t len = 0;
    if (!Agrees(src, h) || !Placement(src, h, &len).ok()) return nullptr;
    return out_ + h.offset * esize_;
  }

  Status OnData(OpContext* ctx, int src, const FrameHeader& h, const char* data) override {
    if (src == r_) return InvalidArgument("allgather frame from this worker itself");
    RETURN_IF_ERROR(CheckAgreement(ctx->config().peers, src, h, ShapeOf(src), "an element count for its block of"));
    int64_t len = 0;
    RETURN_IF_ERROR(Placement(src, h, &len));
    // A piece sent twice must not count as a missing one.
    const bool twice = len == 0 ? empty_got_[src] : got_piece_[piece_at_[src] + (h.offset - prefix_[src]) / piece_];
    if (twice) return InvalidArgument("allgather piece from rank " + std::to_string(src) + " came twice");
    if (len > 0) got_piece_[piece_at_[src] + (h.offset - prefix_[src]) / piece_] = true;
    char* dst = out_ + h.offset * esize_;
    if (data != dst && len > 0) std::memcpy(dst, data, len * esize_);
    received_ += len;
    got_[src] += len;
    if (len == 0) {
      ++empty_received_;
      empty_got_[src] = true;
    }
    return Status::OK();
  }

  bool ReceivedAll() const override { return received_ == expected_ && empty_received_ == empty_expected_; }

  std::string Progress() const override {
    std::vector<int> missing;
    for (int r = 0; r < n_; ++r) {
      if (r != r_ && (got_[r] < counts_[r] || (counts_[r] == 0 && !empty_got_[r]))) missing.push_back(r);
    }
    return "received " + std::to_string(received_) + " of " + std::to_string(expected_) + " elements" +
           (missing.empty() ? std::string() : "; waiting for " + RankList(missing));
  }

 private:
  // Frames from worker src carry its own block size in aux.
  FrameShape ShapeOf(int src) const {
    return {Algo::kAllGather, dtype_, total_, static_cast<uint32_t>(counts_[src])};
  }
  bool Agrees(int src, const FrameHeader& h) const { return src != r_ && src < n_ && SameCollective(h, ShapeOf(src)); }

  Status Placement(int src, const FrameHeader& h, int64_t* len) const {
    const int64_t b = prefix_[src], e = prefix_[src + 1];
    if (b == e) {
      *len = 0;
      if (h.offset == b && h.payload_bytes == 0) return Status::OK();
      return InvalidArgument("allgather frame for an empty block carries data");
    }
    if (h.offset < b || h.offset >= e || (h.offset - b) % piece_ != 0) {
      return InvalidArgument("allgather piece from rank " + std::to_string(src) + " out of place");
    }
    *len = std::min(piece_, e - h.offset);
    if (h.payload_bytes != static_cast<uint64_t>(*len * esize_)) return InvalidArgument("allgather piece has the wrong size");
    return Status::OK();
  }

  FrameHeader Header(int64_t off, int64_t len) const {
    return MakeFrame(ShapeOf(r_), 0, off, static_cast<uint64_t>(len * esize_));
  }

  const char* in_;
  char* out_;
  std::vector<int64_t> counts_;
  DType dtype_;
  int64_t esize_;
  int n_ = 1, r_ = 0;
  std::vector<int64_t> prefix_;
  std::vector<int64_t> got_;     // elements received from each worker
  std::vector<bool> empty_got_;  // whether each worker's empty-block frame came
  std::vector<int64_t> piece_at_;  // by worker: the index of its block's first piece in got_piece_
  std::vector<bool> got_piece_;    // by piece of every block: received
  int64_t total_ = 0, piece_ = 1;
  int64_t expected_ = 0, received_ = 0;
  int empty_expected_ = 0, empty_received_ = 0;
};

}  // namespace

std::unique_ptr<Op> NewAllGather(const void* in, void* out, std::vector<int64_t> counts, DType dtype,
                                 std::string name, DoneCallback done) {
  return std::make_unique<AllGather>(in, out, std::move(counts), dtype, std::move(name), std::move(done));
}

}  // namespace kungfu
