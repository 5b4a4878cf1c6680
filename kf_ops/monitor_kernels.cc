// Kernels of KfGradientNoiseScale, KfMonitorRecord, KfStepClock, KfResetMonitor, KfSquaredNorm and
// KfConsecutiveSquaredNorms.
//
// State and threading: each monitor name owns one MonitorState in a process-wide registry. The
// registry and every state are guarded by one mutex: the work under it is a few flops, and a monitor
// runs once per step, so one lock costs nothing measurable and keeps the code obvious. The state
// lives outside the kernel so that a retraced tf.function (a new kernel instance) continues the same
// EMA, and so that KfResetMonitor can reach it.
//
// Arithmetic is in double; an estimate is accepted only when it is finite as a float, so the EMAs (a
// convex combination of accepted estimates) always fit the float outputs.
//
// The squared norms are Eigen expressions: one fused, vectorised pass per tensor (and per sum), with no
// temporary; a float32 tensor that one thread sums goes through kf_ops/squares.cc (AVX2 where the CPU
// has it). Each tensor is summed in its accumulation type (float for half and bfloat16, else its own),
// and the tensors' sums in double. A tensor is summed on the op's own thread unless it is very large
// (kParallelElements): in a training step the intra-op pool is busy with the step's other ops, and a
// reduction split over it waits for their turn (profiled: a monitored step's two norms took 5x longer
// split than on one thread, which sums a model of a million floats in about 0.1 ms).
#define EIGEN_USE_THREADS  // the squared norms run on the op's thread-pool device

#include <cfloat>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kf_ops/squares.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace kungfu_tf {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

struct MonitorState {
  bool initialized = false;  // false until the first accepted estimate
  double g_sq = 0;           // EMA of the |G|^2 estimates
  double trace = 0;          // EMA of the tr(Sigma) estimates
  float variance = 0;        // KfMonitorRecord's last accepted gradient variance
  double last_time = 0;      // KfStepClock: steady-clock seconds of its previous call; 0: none yet
  float step_time = 0;       // KfStepClock's last step time and throughput
  float samples_per_sec = 0;
};

std::mutex registry_mu;
std::map<std::string, MonitorState>& Registry() {  // guarded by registry_mu; never destroyed
  static auto* registry = new std::map<std::string, MonitorState>();
  return *registry;
}

bool FiniteFloat(double x) { return std::isfinite(x) && std::fabs(x) <= FLT_MAX; }

// The two unbiased estimates from one step, or false when an input or an estimate is not finite.
// Negative estimates are kept: they are noise around a small true value, and clipping them at 0 would
// bias the EMA upwards.
bool Estimate(double g_small_sq, double g_big_sq, double b_small, double b_big, double* g_sq, double* trace) {
  if (!std::isfinite(g_small_sq) || !std::isfinite(g_big_sq)) return false;
  *g_sq = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small);
  *trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big);
  return FiniteFloat(*g_sq) && FiniteFloat(*trace);
}

// B_simple from the EMAs; 0 means "no estimate yet": before the first estimate, and while either EMA
// is not positive (a negative noise scale or one over a non-positive |G|^2 is meaningless).
double NoiseScale(const MonitorState& s) {
  if (!s.initialized || !(s.g_sq > 0) || !(s.trace > 0)) return 0;
  const double gns = s.trace / s.g_sq;
  return FiniteFloat(gns) ? gns : 0;
}

// One step's estimates into the EMAs (the first accepted one initialises them); a non-finite input or
// estimate leaves them as they were. Called with registry_mu held.
void AddEstimate(MonitorState* state, double g_small_sq, double g_big_sq, double b_small, double b_big,
                 double alpha) {
  double g_sq = 0, trace = 0;
  if (!Estimate(g_small_sq, g_big_sq, b_small, b_big, &g_sq, &trace)) return;
  if (!state->initialized) {
    state->initialized = true;
    state->g_sq = g_sq;
    state->trace = trace;
  } else {
    state->g_sq = (1 - alpha) * state->g_sq + alpha * g_sq;
    state->trace = (1 - alpha) * state->trace + alpha * trace;
  }
}

// |G|^2 / (tr Sigma / batch); 0 unless both are positive and the ratio is finite.
double Snr(double g_sq, double trace, double batch) {
  if (!(g_sq > 0) || !(trace > 0)) return 0;
  const double snr = g_sq * batch / trace;
  return FiniteFloat(snr) ? snr : 0;
}

float Scalar(OpKernelContext* ctx, int i) { return ctx->input(i).scalar<float>()(); }

absl::Status CheckBatches(const std::string& key, double b_small, double b_big) {
  if (std::isfinite(b_big) && b_big > b_small && b_small > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("gradient noise scale '", key, "': needs b_big > b_small > 0, got b_small=",
                                                 b_small, " b_big=", b_big));
}

absl::Status CheckKeyAndAlpha(const std::string& key, float alpha) {
  if (key.empty()) return absl::InvalidArgumentError("gradient noise scale: the key must not be empty");
  if (alpha > 0 && alpha <= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("gradient noise scale '", key, "': alpha must be in (0, 1], got ",
                                                 alpha));
}

void SetFloat(OpKernelContext* ctx, int i, double value) {
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(i, TensorShape({}), &out));
  out->scalar<float>()() = static_cast<float>(value);
}

class GradientNoiseScaleOp : public OpKernel {
 public:
  explicit GradientNoiseScaleOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("alpha", &alpha_));
    OP_REQUIRES_OK(c, CheckKeyAndAlpha(key_, alpha_));
  }

  void Compute(OpKernelContext* ctx) override {
    const double b_small = Scalar(ctx, 2), b_big = Scalar(ctx, 3);
    OP_REQUIRES_OK(ctx, CheckBatches(key_, b_small, b_big));
    MonitorState s;
    {
      std::lock_guard<std::mutex> lock(registry_mu);
      MonitorState& state = Registry()[key_];
      AddEstimate(&state, Scalar(ctx, 0), Scalar(ctx, 1), b_small, b_big, alpha_);
      s = state;
    }
    SetFloat(ctx, 0, NoiseScale(s));
    SetFloat(ctx, 1, s.g_sq);
    SetFloat(ctx, 2, s.trace);
  }

 private:
  std::string key_;  // the monitor's name in the registry
  float alpha_;      // EMA weight of a new estimate, in (0, 1]
};

// A monitored step's bookkeeping in one kernel: what KfGradientNoiseScale, the gradient variance and
// the SNR would give as a dozen ops. Outputs [gns, g_sq, trace, snr, grad_variance]; what the attrs
// leave out stays 0. valid false: the EMAs and the variance stay as they were, and the snr is recomputed
// from the EMAs for snr_batch.
class MonitorRecordOp : public OpKernel {
 public:
  explicit MonitorRecordOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("alpha", &alpha_));
    OP_REQUIRES_OK(c, c->GetAttr("gns", &gns_));
    OP_REQUIRES_OK(c, c->GetAttr("variance", &variance_));
    OP_REQUIRES_OK(c, CheckKeyAndAlpha(key_, alpha_));
  }

  void Compute(OpKernelContext* ctx) override {
    const double small_sq = Scalar(ctx, 0), big_sq = Scalar(ctx, 1), spread_sq = Scalar(ctx, 2);
    const double b_small = Scalar(ctx, 3), b_big = Scalar(ctx, 4), snr_batch = Scalar(ctx, 5);
    const bool valid = ctx->input(6).scalar<bool>()();
    if (gns_) OP_REQUIRES_OK(ctx, CheckBatches(key_, b_small, b_big));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({5}), &out));
    auto v = out->vec<float>();
    v.setZero();
    std::lock_guard<std::mutex> lock(registry_mu);
    MonitorState& state = Registry()[key_];
    if (variance_) {
      const double spread = spread_sq - big_sq;  // mean_i |g_i|^2 - |g_mean|^2
      if (valid) state.variance = FiniteFloat(spread) && spread > 0 ? static_cast<float>(spread) : 0.0f;
      v(4) = state.variance;
    }
    if (gns_) {
      if (valid) AddEstimate(&state, small_sq, big_sq, b_small, b_big, alpha_);
      v(0) = static_cast<float>(NoiseScale(state));
      v(1) = static_cast<float>(state.g_sq);
      v(2) = static_cast<float>(state.trace);
      v(3) = static_cast<float>(Snr(state.g_sq, state.trace, snr_batch));
    }
  }

 private:
  std::string key_;
  float alpha_;
  bool gns_ = false;       // the EMAs, gns and snr
  bool variance_ = false;  // the gradient variance
};

// Throughput from the runtime's clock: the seconds since this key's previous call, and samples over
// them. Outputs [step_time, samples_per_sec]; the first call (no previous one) repeats 0s.
class StepClockOp : public OpKernel {
 public:
  explicit StepClockOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES(c, !key_.empty(), absl::InvalidArgumentError("step clock: the key must not be empty"));
  }

  void Compute(OpKernelContext* ctx) override {
    const double samples = Scalar(ctx, 0);
    const double now =
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({2}), &out));
    auto v = out->vec<float>();
    std::lock_guard<std::mutex> lock(registry_mu);
    MonitorState& state = Registry()[key_];
    const double dt = now - state.last_time;
    if (state.last_time > 0 && dt > 0) {
      state.step_time = static_cast<float>(dt);
      const double rate = samples / dt;
      state.samples_per_sec = FiniteFloat(rate) && rate > 0 ? static_cast<float>(rate) : 0.0f;
    }
    state.last_time = now;
    v(0) = state.step_time;
    v(1) = state.samples_per_sec;
  }

 private:
  std::string key_;
};

class ResetMonitorOp : public OpKernel {
 public:
  explicit ResetMonitorOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    const std::string key(ctx->input(0).scalar<tensorflow::tstring>()());
    std::lock_guard<std::mutex> lock(registry_mu);
    Registry().erase(key);
  }
};

// ---- squared norms ----

using CpuDevice = Eigen::ThreadPoolDevice;
constexpr int64_t kParallelElements = int64_t{1} << 24;  // above this, one thread takes over 5 ms

template <typename T, typename A>
struct Types {
  using Elem = T;  // the tensor's element type
  using Acc = A;   // what its squares are summed in
};

// Calls fn(Types<...>{}) for the tensors' dtype; false for a dtype the ops do not register.
template <typename Fn>
bool ForDType(tensorflow::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case tensorflow::DT_HALF: fn(Types<Eigen::half, float>{}); return true;
    case tensorflow::DT_BFLOAT16: fn(Types<Eigen::bfloat16, float>{}); return true;
    case tensorflow::DT_FLOAT: fn(Types<float, float>{}); return true;
    case tensorflow::DT_DOUBLE: fn(Types<double, double>{}); return true;
    default: return false;
  }
}

template <typename Acc, typename Expr>
double Sum(const CpuDevice& d, int64_t elements, const Expr& e) {
  Eigen::Tensor<Acc, 0, Eigen::RowMajor> s;
  if (elements > kParallelElements) {
    s.device(d) = e.sum();
  } else {
    s = e.sum();
  }
  return static_cast<double>(s());
}

// The sum of squares of one tensor, in its accumulation type.
template <typename T, typename A>
double TensorSquares(const CpuDevice& d, const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {  // squares.cc: AVX2 where the CPU has it
    if (t.NumElements() <= kParallelElements) {
      return kungfu_tf::SumSquares(t.flat<float>().data(), t.NumElements(), kungfu::DType::kFloat32);
    }
  }
  return Sum<A>(d, t.NumElements(), t.flat<T>().template cast<A>().square());
}

absl::Status UnsupportedDType(const Tensor& t, int i) {
  return absl::InvalidArgumentError(absl::StrCat("squared norm: input ", i, " has dtype ",
                                                 tensorflow::DataTypeString(t.dtype()),
                                                 "; cast it to float32 first"));
}

class SquaredNormOp : public OpKernel {
 public:
  explicit SquaredNormOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    const CpuDevice& d = ctx->eigen_cpu_device();
    double total = 0;
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const Tensor& t = ctx->input(i);
      const bool ok = ForDType(t.dtype(), [&](auto types) {
        using T = typename decltype(types)::Elem;
        using A = typename decltype(types)::Acc;
        total += TensorSquares<T, A>(d, t);
      });
      OP_REQUIRES(ctx, ok, UnsupportedDType(t, i));
    }
    SetFloat(ctx, 0, total);
  }
};

class ConsecutiveSquaredNormsOp : public OpKernel {
 public:
  explicit ConsecutiveSquaredNormsOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    const CpuDevice& d = ctx->eigen_cpu_device();
    const int n = ctx->num_inputs() / 2;
    double grad_sq = 0, mean_sq = 0, prev_sq = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& g = ctx->input(i);
      const Tensor& p = ctx->input(n + i);
      OP_REQUIRES(ctx, g.shape() == p.shape(),
                  absl::InvalidArgumentError(absl::StrCat("consecutive squared norms: gradient ", i, " has shape ",
                                                          g.shape().DebugString(), " but the previous one ",
                                                          p.shape().DebugString(), "; keep one previous "
                                                          "gradient per variable, of the variable's shape")));
      const bool ok = ForDType(g.dtype(), [&](auto types) {
        using T = typename decltype(types)::Elem;
        using A = typename decltype(types)::Acc;
        const auto gf = g.flat<T>().template cast<A>();
        const auto pf = p.flat<T>().template cast<A>();
        grad_sq += Sum<A>(d, g.NumElements(), gf.square());
        mean_sq += Sum<A>(d, g.NumElements(), ((gf + pf) * A(0.5)).square());
        prev_sq += Sum<A>(d, g.NumElements(), pf.square());
      });
      OP_REQUIRES(ctx, ok, UnsupportedDType(g, i));
    }
    SetFloat(ctx, 0, grad_sq);
    SetFloat(ctx, 1, mean_sq);
    SetFloat(ctx, 2, prev_sq);
  }
};

REGISTER_KERNEL_BUILDER(Name("KfSquaredNorm").Device(tensorflow::DEVICE_CPU), SquaredNormOp);
REGISTER_KERNEL_BUILDER(Name("KfConsecutiveSquaredNorms").Device(tensorflow::DEVICE_CPU), ConsecutiveSquaredNormsOp);
REGISTER_KERNEL_BUILDER(Name("KfGradientNoiseScale").Device(tensorflow::DEVICE_CPU), GradientNoiseScaleOp);
REGISTER_KERNEL_BUILDER(Name("KfResetMonitor").Device(tensorflow::DEVICE_CPU), ResetMonitorOp);
REGISTER_KERNEL_BUILDER(Name("KfMonitorRecord").Device(tensorflow::DEVICE_CPU), MonitorRecordOp);
REGISTER_KERNEL_BUILDER(Name("KfStepClock").Device(tensorflow::DEVICE_CPU), StepClockOp);

}  // namespace
}  // namespace kungfu_tf
