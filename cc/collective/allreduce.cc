// Allreduce: a star for small messages, a pipelined ring for large ones.
//
// Star (latency-bound sizes): every worker sends its buffer to rank 0, which reduces (half types
// accumulate in float32) and sends the result back. Two message delays, no matter the size of the cluster.
//
// Ring (bandwidth-bound sizes): reduce-scatter then allgather, 2(n-1) steps, each worker sending
// 2(n-1)/n of the buffer. The buffer is cut into n chunks and each chunk into pieces of chunk_bytes;
// a piece received at step t is reduced (t < n-1) or stored (t >= n-1) and forwarded at step t+1, so
// steps overlap and the pipe stays full. Received allgather pieces land directly in the output.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cc/buffer.h"
#include "cc/collective/allreduce_op.h"

namespace kungfu {

namespace {

bool IsHalf(DType d) { return d == DType::kFloat16 || d == DType::kBFloat16; }

void WidenHalf(const void* src, float* dst, int64_t n, DType d) {
  const auto* s = static_cast<const uint16_t*>(src);
  if (d == DType::kFloat16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(s[i]);
  }
}

void NarrowHalf(const float* src, void* dst, int64_t n, DType d) {
  auto* o = static_cast<uint16_t*>(dst);
  if (d == DType::kFloat16) {
    for (int64_t i = 0; i < n; ++i) o[i] = FloatToHalf(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = FloatToBFloat16(src[i]);
  }
}

class AllReduceStar : public AllReduceOp {
 public:
  AllReduceStar(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, std::string name,
                DoneCallback done, const char* kind)
      : AllReduceOp(Algo::kAllReduceStar, in, out, count, dtype, op, std::move(name), std::move(done), kind) {}

  Status Start(OpContext* ctx) override {
    Place(ctx);
    if (in_ != out_ && bytes_ > 0) std::memcpy(out_, in_, bytes_);
    seen_.assign(n_, false);
    if (ctx->rank() != 0) {
      ctx->Send(this, 0, Header(0), out_);
    } else if (IsHalf(dtype_)) {
      acc_.resize(count_);
      WidenHalf(out_, acc_.data(), count_, dtype_);
    }
    if (ctx->rank() == 0 && n_ == 1) Finish(ctx);
    return Status::OK();
  }

  char* DirectTarget(int src, const FrameHeader& h) override {
    if (src == 0 && h.tag == 1 && SameCollective(h, Shape()) && h.payload_bytes == static_cast<uint64_t>(bytes_)) return out_;
    return nullptr;
  }

  Status OnData(OpContext* ctx, int src, const FrameHeader& h, const char* data) override {
    RETURN_IF_ERROR(CheckAgreement(ctx->config().peers, src, h, Shape(), "reduce op"));
    if (h.payload_bytes != static_cast<uint64_t>(bytes_) || h.offset != 0) {
      return InvalidArgument("malformed allreduce frame from rank " + std::to_string(src));
    }
    if (ctx->rank() != 0) {
      if (src != 0 || h.tag != 1 || got_result_) return InvalidArgument("unexpected allreduce result frame");
      if (data != out_ && bytes_ > 0) std::memcpy(out_, data, bytes_);
      got_result_ = true;
      return Status::OK();
    }
    if (h.tag != 0 || src == 0 || seen_[src]) return InvalidArgument("duplicate allreduce contribution");
    seen_[src] = true;
    ++contributions_;
    if (IsHalf(dtype_)) {
      std::vector<float> wide(count_);
      WidenHalf(data, wide.data(), count_, dtype_);
      ReduceInto(acc_.data(), wide.data(), count_, DType::kFloat32, op_);
    } else {
      ReduceInto(out_, data, count_, dtype_, op_);
    }
    if (contributions_ == n_ - 1) Finish(ctx);
    return Status::OK();
  }

  bool ReceivedAll() const override { return got_result_; }

  std::string Progress() const override {
    if (got_result_) return "done";
    if (r_ == 0) {
      std::vector<int> missing;
      for (int r = 1; r < n_; ++r) {
        if (!seen_[r]) missing.push_back(r);
      }
      return "received " + std::to_string(contributions_) + " of " + std::to_string(n_ - 1) +
             " contributions; waiting for " + RankList(missing);
    }
    // Rank 0 answers once every worker's part is in: a worker missing anywhere holds this one up.
    return "sent its part to rank 0, which has not returned the result (it waits for every worker's part)";
  }

 private:
  FrameHeader Header(uint32_t tag) const { return MakeFrame(Shape(), tag, 0, static_cast<uint64_t>(bytes_)); }

  // Root: all contributions are in. Narrow half types, apply the mean, send the result out. The mean
  // divides the sum once rounded to the element type, as every other algorithm does, so a float16 mean
  // overflows when its sum does whatever the algorithm (dividing the float32 sum first would not).
  void Finish(OpContext* ctx) {
    if (IsHalf(dtype_)) NarrowHalf(acc_.data(), out_, count_, dtype_);
    if (op_ == ReduceOp::kMean) DivideBy(out_, count_, dtype_, n_);
    for (int d = 1; d < n_; ++d) ctx->Send(this, d, Header(1), out_);
    got_result_ = true;
  }

  int contributions_ = 0;
  bool got_result_ = false;
  std::vector<bool> seen_;
  std::vector<float> acc_;  // root's float32 accumulator for half types
};

class AllReduceRing : public AllReduceOp {
 public:
  AllReduceRing(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, std::string name,
                DoneCallback done)
      : AllReduceOp(Algo::kAllReduceRing, in, out, count, dtype, op, std::move(name), std::move(done)) {}

  Status Start(OpContext* ctx) override {
    Place(ctx);
    if (n_ == 1) {
      if (in_ != out_ && bytes_ > 0) std::memcpy(out_, in_, bytes_);
      return Status::OK();
    }
    piece_ = std::max<int64_t>(1, ctx->config().chunk_bytes / esize_);
    scratch_ = NewBuffer(piece_ * esize_);
    pieces_per_chunk_ = (count_ / n_ + piece_) / piece_;  // chunks hold count/n elements, or one more
    got_piece_.assign(static_cast<size_t>(2 * n_ * pieces_per_chunk_), false);
    expected_ = (count_ - ChunkSize(r_)) + (count_ - ChunkSize((r_ + 1) % n_));
    // No copy of in to out: step 0 sends our chunk from in, and every chunk of out is written
    // exactly once, either by its reduce-scatter reduction (out = in + received) or by the allgather.
    const int64_t b = ChunkBegin(count_, n_, r_), e = ChunkBegin(count_, n_, r_ + 1);
    for (int64_t off = b; off < e; off += piece_) SendPiece(ctx, 0, off, std::min(piece_, e - off), in_);
    return Status::OK();
  }

  // Allgather pieces land in the output; reduce-scatter pieces in a scratch piece, since this op
  // hears only from its left neighbour and reduces each piece before the next one is read.
  char* DirectTarget(int src, const FrameHeader& h) override {
    int64_t len = 0;
    if (src != Left() || !SameCollective(h, Shape()) || !Placement(h, &len).ok()) return nullptr;
    return h.tag < static_cast<uint32_t>(n_ - 1) ? scratch_.get() : out_ + h.offset * esize_;
  }

  Status OnData(OpContext* ctx, int src, const FrameHeader& h, const char* data) override {
    RETURN_IF_ERROR(CheckAgreement(ctx->config().peers, src, h, Shape(), "reduce op"));
    if (src != Left()) return InvalidArgument("ring frame from rank " + std::to_string(src) + ", not the left neighbour");
    int64_t len = 0, piece = 0;
    RETURN_IF_ERROR(Placement(h, &len, &piece));
    if (got_piece_[piece]) {  // a piece sent twice must not count as a missing one
      return InvalidArgument("ring piece at offset " + std::to_string(h.offset) + " of step " + std::to_string(h.tag) +
                             " came twice");
    }
    got_piece_[piece] = true;
    const int t = static_cast<int>(h.tag);
    char* dst = out_ + h.offset * esize_;
    if (t <= n_ - 2) {
      Reduce3(dst, in_ + h.offset * esize_, data, len, dtype_, op_);
      if (t == n_ - 2 && op_ == ReduceOp::kMean) DivideBy(dst, len, dtype_, n_);
    } else if (data != dst) {
      std::memcpy(dst, data, len * esize_);
    }
    received_ += len;
    if (t < 2 * n_ - 3) SendPiece(ctx, t + 1, h.offset, len, out_);
    return Status::OK();
  }

  bool ReceivedAll() const override { return received_ == expected_; }

  std::string Progress() const override {
    return "received " + std::to_string(received_) + " of " + std::to_string(expected_) +
           " elements from the left neighbour (rank " + std::to_string(Left()) + ")";
  }

 private:
  int Left() const { return (r_ + n_ - 1) % n_; }
  int64_t ChunkSize(int j) const { return ChunkBegin(count_, n_, j + 1) - ChunkBegin(count_, n_, j); }

  // The chunk a frame of step t must fall in, and whether it is one of our pieces; *piece: its index in
  // got_piece_ (the reduce-scatter and the allgather each receive a chunk at most once).
  Status Placement(const FrameHeader& h, int64_t* len, int64_t* piece = nullptr) const {
    const int t = static_cast<int>(h.tag);
    if (t < 0 || t > 2 * n_ - 3) return InvalidArgument("ring step " + std::to_string(t) + " out of range");
    const int j = t <= n_ - 2 ? ((r_ - t - 1) % n_ + n_) % n_ : ((r_ - (t - n_ + 1)) % n_ + n_) % n_;
    const int64_t b = ChunkBegin(count_, n_, j), e = ChunkBegin(count_, n_, j + 1);
    if (h.offset < b || h.offset >= e || (h.offset - b) % piece_ != 0) {
      return InvalidArgument("ring piece at offset " + std::to_string(h.offset) + " is outside chunk " +
                             std::to_string(j));
    }
    *len = std::min(piece_, e - h.offset);
    if (h.payload_bytes != static_cast<uint64_t>(*len * esize_)) return InvalidArgument("ring piece has the wrong size");
    if (piece) *piece = ((t <= n_ - 2 ? 0 : n_) + j) * pieces_per_chunk_ + (h.offset - b) / piece_;
    return Status::OK();
  }

  void SendPiece(OpContext* ctx, int tag, int64_t off, int64_t len, const char* from) {
    const FrameHeader h = MakeFrame(Shape(), static_cast<uint32_t>(tag), off, static_cast<uint64_t>(len * esize_));
    ctx->Send(this, (r_ + 1) % n_, h, from + off * esize_);
  }

  int64_t piece_ = 1;
  int64_t expected_ = 0, received_ = 0;
  int64_t pieces_per_chunk_ = 1;
  std::vector<bool> got_piece_;  // by step phase, chunk and piece: received
  Buffer scratch_;  // one reduce-scatter piece
};

}  // namespace

std::unique_ptr<Op> NewAllReduceStar(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                     std::string name, DoneCallback done, const char* kind) {
  return std::make_unique<AllReduceStar>(in, out, count, dtype, op, std::move(name), std::move(done), kind);
}

std::unique_ptr<Op> NewAllReduceRing(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                                     std::string name, DoneCallback done) {
  return std::make_unique<AllReduceRing>(in, out, count, dtype, op, std::move(name), std::move(done));
}

}  // namespace kungfu
