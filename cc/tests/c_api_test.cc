// The C API's eager entry points (cc/c_api.h) on the process-wide engine of a single worker:
// kungfu_all_reduce_dlpack (what it takes, what it leaves to the TF op, the tensor it returns and the
// reuse of its blocks) and kungfu_barrier. How eager calls meet other workers' ops is tested from Python
// (tests/test_collectives_mp.py).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cc/c_api.h"
#include "cc/dlpack.h"
#include "cc/tests/testing.h"

namespace kungfu {
namespace {

using dlpack::DLManagedTensor;

constexpr int kSum = 1, kMax = 3;  // ReduceOp wire values
constexpr int kNotTaken = -1;

// A caller's tensor: a DLManagedTensor over vectors this struct owns.
struct Input {
  std::vector<float> data;
  std::vector<int64_t> shape, strides;
  DLManagedTensor t{};

  explicit Input(std::vector<int64_t> dims, dlpack::DLDataType dtype = {dlpack::kDLFloat, 32, 1})
      : shape(std::move(dims)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    data.resize(static_cast<size_t>(n) + 1);  // + 1: a valid pointer even when empty
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i) - 2.5f;
    t.dl_tensor.data = data.data();
    t.dl_tensor.device = {dlpack::kDLCPU, 0};
    t.dl_tensor.ndim = static_cast<int32_t>(shape.size());
    t.dl_tensor.dtype = dtype;
    t.dl_tensor.shape = shape.data();
  }
  void SetStrides(std::vector<int64_t> s) {
    strides = std::move(s);
    t.dl_tensor.strides = strides.data();
  }
};

struct Result {
  int code;
  DLManagedTensor* out;
  std::string err;
};

Result Reduce(const Input& in, int op = kSum, const char* name = "c_api_test") {
  void* out = nullptr;
  char err[256] = "";
  const int code = kungfu_all_reduce_dlpack(&in.t, op, name, &out, err, sizeof(err));
  return {code, static_cast<DLManagedTensor*>(out), err};
}

TEST(CApiDLPack, WithoutAnEngineItFailsNamingTheFix) {
  Input in({3});
  Result r = Reduce(in);
  EXPECT_EQ(r.code, 9);  // FailedPrecondition
  EXPECT_CONTAINS(r.err, "kungfu.init()");
  EXPECT_TRUE(r.out == nullptr);
  char err[256] = "";
  EXPECT_EQ(kungfu_barrier("c_api_test/barrier", err, sizeof(err)), 9);
}

TEST(CApiDLPack, ReducesIntoANewAlignedTensorOfTheSameShape) {
  char err[256] = "";
  ASSERT_EQ(kungfu_init("", 0, "token", 0, 0, err, sizeof(err)), 0);
  for (const std::vector<int64_t>& dims : {std::vector<int64_t>{2, 3}, std::vector<int64_t>{}, std::vector<int64_t>{7},
                                           std::vector<int64_t>{2, 0, 4}}) {
    Input in(dims);
    Result r = Reduce(in, kMax);
    ASSERT_EQ(r.code, 0);
    ASSERT_TRUE(r.out != nullptr);
    const dlpack::DLTensor& t = r.out->dl_tensor;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 64, uintptr_t{0});
    EXPECT_TRUE(t.data != in.t.dl_tensor.data);
    EXPECT_EQ(t.ndim, static_cast<int32_t>(dims.size()));
    for (size_t d = 0; d < dims.size(); ++d) EXPECT_EQ(t.shape[d], dims[d]);
    EXPECT_TRUE(t.shape != in.shape.data() || dims.empty());
    EXPECT_TRUE(t.strides == nullptr);
    EXPECT_EQ(t.byte_offset, uint64_t{0});
    EXPECT_EQ(t.device.device_type, dlpack::kDLCPU);
    EXPECT_EQ(int{t.dtype.code}, int{dlpack::kDLFloat});
    EXPECT_EQ(int{t.dtype.bits}, 32);
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    EXPECT_EQ(std::memcmp(t.data, in.data.data(), sizeof(float) * static_cast<size_t>(n)), 0);  // one worker
    kungfu_dlpack_free(r.out);  // the deleter; ASan/valgrind would see a double free or a leak
  }
  // Compact strides given explicitly, and any stride on a dimension of size 1, are taken as well.
  Input strided({2, 1, 3});
  strided.SetStrides({3, 99, 1});
  Result r = Reduce(strided);
  EXPECT_EQ(r.code, 0);
  if (r.out != nullptr) r.out->deleter(r.out);
  EXPECT_EQ(kungfu_barrier("c_api_test/barrier", err, sizeof(err)), 0);
  kungfu_finalize();
}

TEST(CApiDLPack, ResultBlocksAreKeptForTheNextCallOfTheSameSize) {
  char err[256] = "";
  ASSERT_EQ(kungfu_init("", 0, "token", 0, 0, err, sizeof(err)), 0);
  Input big({1 << 18});  // 1 MiB: a block malloc would map afresh each time
  Result first = Reduce(big);
  ASSERT_EQ(first.code, 0);
  void* data = first.out->dl_tensor.data;
  first.out->deleter(first.out);
  Result again = Reduce(big);  // the same block, its pages already there
  ASSERT_EQ(again.code, 0);
  EXPECT_TRUE(again.out->dl_tensor.data == data);
  EXPECT_EQ(std::memcmp(again.out->dl_tensor.data, big.data.data(), sizeof(float) << 18), 0);
  Result other = Reduce(big);  // while the first is alive: another block
  ASSERT_EQ(other.code, 0);
  EXPECT_TRUE(other.out->dl_tensor.data != data);
  again.out->deleter(again.out);
  other.out->deleter(other.out);
  kungfu_finalize();
}

TEST(CApiDLPack, LeavesToTheOpWhatItDoesNotTake) {
  char err[256] = "";
  ASSERT_EQ(kungfu_init("", 0, "token", 0, 0, err, sizeof(err)), 0);
  Input gpu({3});
  gpu.t.dl_tensor.device.device_type = 2;  // kDLCUDA
  Input bytes({3}, {1, 8, 1});             // uint8: the engine reduces no such dtype
  Input lanes({3}, {dlpack::kDLFloat, 32, 4});
  Input transposed({2, 3});
  transposed.SetStrides({1, 2});
  for (const Input* in : {&gpu, &bytes, &lanes, &transposed}) {
    Result r = Reduce(*in);
    EXPECT_EQ(r.code, kNotTaken);
    EXPECT_TRUE(r.out == nullptr);
  }
  Input fine({3});
  EXPECT_EQ(Reduce(fine, 0).code, kNotTaken);  // not a reduce op
  EXPECT_EQ(Reduce(fine, 99).code, kNotTaken);
  void* out = nullptr;
  EXPECT_EQ(kungfu_all_reduce_dlpack(nullptr, kSum, "x", &out, err, sizeof(err)), kNotTaken);
  EXPECT_EQ(kungfu_all_reduce_dlpack(&fine.t, kSum, "x", nullptr, err, sizeof(err)), kNotTaken);
  kungfu_finalize();
}

}  // namespace
}  // namespace kungfu
