// The C API's eager entry points (cc/c_api.h) on the process-wide engine of a single worker:
// kungfu_all_reduce_dlpack (what it takes, what it leaves to the TF op, the tensor it returns and the
// reuse of its blocks), the broadcast, all-gather and consensus beside it, and kungfu_barrier; and the
// tensor descriptions they share with the TF kernels (cc/tensor_meta.h). How eager calls meet other
// workers' ops is tested from Python (tests/test_collectives_mp.py).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cc/c_api.h"
#include "cc/dlpack.h"
#include "cc/tensor_meta.h"
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

Result Copy(const char* which, const Input& in, int root = 0) {
  void* out = nullptr;
  char err[256] = "";
  const std::string w = which;
  const int code = w == "broadcast" ? kungfu_broadcast_dlpack(&in.t, root, "c_api_test/copy", &out, err, sizeof(err))
                                    : kungfu_all_gather_dlpack(&in.t, "c_api_test/copy", &out, err, sizeof(err));
  return {code, static_cast<DLManagedTensor*>(out), err};
}

TEST(CApiDLPack, BroadcastAllGatherAndConsensusOnOneWorker) {
  char err[256] = "";
  for (const char* which : {"broadcast", "all_gather"}) {
    Input in({3});
    Result r = Copy(which, in);
    EXPECT_EQ(r.code, 9);  // FailedPrecondition: no engine yet
    EXPECT_CONTAINS(r.err, "kungfu.init()");
  }
  ASSERT_EQ(kungfu_init("", 0, "token", 0, 0, err, sizeof(err)), 0);
  const dlpack::DLDataType kBool{dlpack::kDLBool, 8, 1}, kInt8{dlpack::kDLInt, 8, 1}, kInt16{dlpack::kDLInt, 16, 1};
  for (const char* which : {"broadcast", "all_gather"}) {
    for (const std::vector<int64_t>& dims :
         {std::vector<int64_t>{2, 3}, std::vector<int64_t>{}, std::vector<int64_t>{0, 4}}) {
      for (const dlpack::DLDataType& dtype : {dlpack::DLDataType{dlpack::kDLFloat, 32, 1}, kBool, kInt8}) {
        Input in(dims, dtype);
        Result r = Copy(which, in);
        ASSERT_EQ(r.code, 0);
        const dlpack::DLTensor& t = r.out->dl_tensor;
        EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 64, uintptr_t{0});
        EXPECT_TRUE(t.data != in.t.dl_tensor.data);
        EXPECT_EQ(int{t.dtype.code}, int{dtype.code});
        // The all-gather of one worker's scalar is a one-element vector; otherwise the shape is kept.
        const bool vector = dims.empty() && std::string(which) == "all_gather";
        EXPECT_EQ(t.ndim, vector ? 1 : static_cast<int32_t>(dims.size()));
        if (vector) EXPECT_EQ(t.shape[0], int64_t{1});
        for (size_t d = 0; d < dims.size(); ++d) EXPECT_EQ(t.shape[d], dims[d]);
        int64_t n = 1;
        for (int64_t d : dims) n *= d;
        EXPECT_EQ(std::memcmp(t.data, in.data.data(), static_cast<size_t>(n) * dtype.bits / 8), 0);
        kungfu_dlpack_free(r.out);
      }
    }
    Input wide({3}, kInt16);  // no collective takes int16: the op says so
    EXPECT_EQ(Copy(which, wide).code, kNotTaken);
  }
  Input in({3});
  Result bad_root = Copy("broadcast", in, 1);
  EXPECT_EQ(bad_root.code, 3);  // InvalidArgument
  EXPECT_CONTAINS(bad_root.err, "root 1 is not a rank of this cluster of size 1");
  EXPECT_TRUE(bad_root.out == nullptr);
  int same = -1;
  EXPECT_EQ(kungfu_consensus_dlpack(&in.t, "c_api_test/consensus", &same, err, sizeof(err)), 0);
  EXPECT_EQ(same, 1);
  EXPECT_EQ(kungfu_consensus_dlpack(&in.t, "c_api_test/consensus", nullptr, err, sizeof(err)), kNotTaken);
  kungfu_finalize();
}

TEST(TensorMeta, GatherRecordsAgreeOnAllButTheFirstDimension) {
  const int64_t a[] = {2, 3}, b[] = {5, 3}, c[] = {2, 4};
  auto records = [](std::vector<std::vector<int64_t>> each) {
    std::vector<int64_t> all;
    for (const auto& r : each) all.insert(all.end(), r.begin(), r.end());
    return all;
  };
  std::vector<int64_t> counts;
  int64_t rows = 0;
  ASSERT_OK(CheckGatherRecords(records({GatherRecord(tf_dtype::kFloat, a, 2), GatherRecord(tf_dtype::kFloat, b, 2)}),
                               3, "g", &counts, &rows));
  EXPECT_EQ(rows, int64_t{7});
  EXPECT_TRUE(counts == (std::vector<int64_t>{6, 15}));
  Status s = CheckGatherRecords(
      records({GatherRecord(tf_dtype::kFloat, a, 2), GatherRecord(tf_dtype::kFloat, c, 2)}), 3, "g", &counts, &rows);
  EXPECT_TRUE(s.code() == Code::kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "allgather 'g': workers disagree on dtype or dimensions after the first: rank 0 has "
                               "float[2,3], rank 1 has float[2,4]");
  s = CheckGatherRecords(records({GatherRecord(tf_dtype::kHalf, a, 2), GatherRecord(tf_dtype::kBool, nullptr, 0)}), 3,
                         "g", &counts, &rows);
  EXPECT_CONTAINS(s.message(), "rank 0 has half[2,3], rank 1 has bool[] (scalar)");
  // Dimensions past the listed ones differ: the message says where, since both shapes print alike.
  std::vector<int64_t> d10(10, 1), e10(10, 1);
  e10[9] = 2;
  s = CheckGatherRecords(records({GatherRecord(tf_dtype::kInt64, d10.data(), 10),
                                  GatherRecord(tf_dtype::kInt64, e10.data(), 10)}),
                         1, "g", &counts, &rows);
  EXPECT_CONTAINS(s.message(), "int64[1,1,1,1,1,1,1,1,1,...]");
  EXPECT_CONTAINS(s.message(), "they differ in a dimension after the first 9");
  std::vector<int64_t> forged = GatherRecord(tf_dtype::kFloat, a, 2);
  forged[2] = -1;  // a first dimension no tensor has
  s = CheckGatherRecords(records({GatherRecord(tf_dtype::kFloat, a, 2), forged}), 3, "g", &counts, &rows);
  EXPECT_CONTAINS(s.message(), "rank 1's first dimension -1 is negative or makes the result too large");
  // Empty tensors whose other dimensions multiply past 2^60: no overflow, an error on every worker.
  const int64_t huge[] = {0, int64_t{1} << 40, int64_t{1} << 40}, wide[] = {int64_t{1} << 30, int64_t{1} << 29};
  EXPECT_EQ(RowElements(huge, 3), int64_t{-1});
  EXPECT_EQ(RowElements(a, 2), int64_t{3});
  EXPECT_EQ(RowElements(nullptr, 0), int64_t{1});
  s = CheckGatherRecords(records({GatherRecord(tf_dtype::kFloat, huge, 3), GatherRecord(tf_dtype::kFloat, huge, 3)}),
                         RowElements(huge, 3), "g", &counts, &rows);
  EXPECT_CONTAINS(s.message(), "a slice along the first dimension has 2^60 elements or more");
  std::vector<std::vector<int64_t>> many(4, GatherRecord(tf_dtype::kFloat, wide, 2));  // 4 x 2^59 elements
  s = CheckGatherRecords(records(many), RowElements(wide, 2), "g", &counts, &rows);
  EXPECT_CONTAINS(s.message(), "rank 2's first dimension 1073741824 is negative or makes the result too large");
}

TEST(TensorMeta, ConsensusBytesSeparateShapesAndDTypesOfEqualData) {
  const int64_t six[] = {6}, two_three[] = {2, 3};
  const char data[6] = {1, 2, 3, 4, 5, 6};
  const auto flat = ConsensusBytes(tf_dtype::kUInt8, six, 1, data, 6);
  EXPECT_TRUE(flat != ConsensusBytes(tf_dtype::kUInt8, two_three, 2, data, 6));
  EXPECT_TRUE(flat != ConsensusBytes(tf_dtype::kInt8, six, 1, data, 6));
  EXPECT_TRUE(flat == ConsensusBytes(tf_dtype::kUInt8, six, 1, data, 6));
  EXPECT_EQ(std::memcmp(flat.data() + flat.size() - 6, data, 6), 0);
  EXPECT_TRUE(BroadcastSignature(six, 1, tf_dtype::kUInt8) != BroadcastSignature(six, 1, tf_dtype::kBool));
  EXPECT_TRUE(BroadcastSignature(six, 1, tf_dtype::kUInt8) != BroadcastSignature(two_three, 2, tf_dtype::kUInt8));
}

}  // namespace
}  // namespace kungfu
