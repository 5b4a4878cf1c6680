// What every allreduce algorithm (star, recursive doubling, halving-doubling, ring) holds: the caller's
// buffers, what is reduced, how each of its frames describes it, and this worker's place in the cluster.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "cc/collective/op.h"

namespace kungfu {

class AllReduceOp : public Op {
 public:
  AllReduceOp(Algo algo, const void* in, void* out, int64_t count, DType dtype, ReduceOp op, std::string name,
              DoneCallback done, const char* kind = "allreduce")
      : Op(std::move(name), std::move(done)),
        kind_(kind), algo_(algo),
        in_(static_cast<const char*>(in)), out_(static_cast<char*>(out)), count_(count), dtype_(dtype), op_(op),
        esize_(static_cast<int64_t>(DTypeSize(dtype))), bytes_(count * esize_) {}

  const char* kind() const override { return kind_; }
  Algo algo() const override { return algo_; }

 protected:
  // Every frame of this collective carries this, so that peers can check they run the same one.
  FrameShape Shape() const { return {algo_, dtype_, count_, static_cast<uint32_t>(op_)}; }

  // Start() calls it first: n_ and r_ hold from then on.
  void Place(OpContext* ctx) {
    n_ = ctx->size();
    r_ = ctx->rank();
  }

  const char* const kind_;  // "allreduce"; barrier and consensus are star allreduces underneath
  const Algo algo_;
  const char* const in_;
  char* const out_;
  const int64_t count_;
  const DType dtype_;
  const ReduceOp op_;
  const int64_t esize_;  // bytes per element
  const int64_t bytes_;  // count_ * esize_
  int n_ = 1, r_ = 0;
};

}  // namespace kungfu
