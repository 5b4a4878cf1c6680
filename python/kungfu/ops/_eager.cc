// kungfu.ops._eager: the way of an eager collective (kungfu/ops/_direct.py) from a TensorFlow EagerTensor to
// the engine's C API and back, in C.
//
// The Python way (tf.experimental.dlpack.to_dlpack, a ctypes call, from_dlpack) took 12-16 us per 4 KiB
// all_reduce on one worker of the 2-core VM, against this way's 6-8 (the engine's call alone: 3.5), and with
// 4 workers on the 2 cores, where that work runs on caches the other workers have just used, 219-271 us
// against 190-225. One call of this module describes the input tensor to the C API as a DLManagedTensor on
// the stack (no copy), runs the collective with the GIL released, and makes its result (the engine's
// 64-byte-aligned buffer) the result tensor, again without a copy. The collectives, their checks and their
// errors are the C API's own (kungfu_all_reduce_dlpack, ...; cc/c_api.h), the same as the DLPack way's.
//
// TensorFlow's private API: getting the TFE_TensorHandle of a Python EagerTensor, and making an EagerTensor
// of a handle, has no public C API. This file uses three functions of TF's Python bindings
// (tensorflow/python/eager/pywrap_tensor.h, exported from tensorflow/python/lib_pywrap_tensorflow_common.so):
// EagerTensor_CheckExact, EagerTensor_Handle and EagerTensorFromHandle. setup() looks them up by their C++
// names in that library, which TF has loaded, and fails naming them if one is gone; _direct.py then warns
// and keeps the DLPack way, and tests/test_ops_eager.py::test_the_private_tf_api_of_the_eager_path_is_there fails.
// (kungfu/ops/_naming.py lists these with the Python-level TF internals the project relies on.) Everything
// else used here is TF's public C API (tensorflow/c/c_api.h, tensorflow/c/eager/c_api.h and
// c_api_experimental.h).
//
// Built by setup.py only (it needs Python's headers); the Bazel build has no Python part.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "cc/dlpack.h"
#include "tensorflow/c/c_api.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"

namespace {

using kungfu::dlpack::DLDataType;
using kungfu::dlpack::DLManagedTensor;

// TF's private functions (pywrap_tensor.h) and the C++ names TF 2.21 exports them under.
using CheckExactFn = bool (*)(const PyObject*);
using HandleFn = TFE_TensorHandle* (*)(const PyObject*);
using FromHandleFn = PyObject* (*)(TFE_TensorHandle*, bool is_packed);
constexpr const char* kCheckExactName = "_Z22EagerTensor_CheckExactPK7_object";
constexpr const char* kHandleName = "_Z18EagerTensor_HandlePK7_object";
constexpr const char* kFromHandleName = "_Z21EagerTensorFromHandleP16TFE_TensorHandleb";

// The C API's eager calls (cc/c_api.h), from the library kungfu loaded (_lib.py): their addresses come from
// Python, so that a library named by KUNGFU_LIBRARY serves here too.
using IntKeyFn = int (*)(const void*, int, const char*, void**, char*, int);  // all-reduce (op), broadcast (root)
using AllGatherFn = int (*)(const void*, const char*, void**, char*, int);
using ConsensusFn = int (*)(const void*, const char*, int*, char*, int);

struct Api {
  CheckExactFn check_exact = nullptr;
  HandleFn handle = nullptr;
  FromHandleFn from_handle = nullptr;
  IntKeyFn all_reduce = nullptr;
  IntKeyFn broadcast = nullptr;
  AllGatherFn all_gather = nullptr;
  ConsensusFn consensus = nullptr;
  bool ready = false;
};
Api api;

constexpr int kNotTaken = -1;  // the C API's answer when it started nothing: the caller runs the op
constexpr int kErrLen = 4096;
constexpr int kMaxDims = 64;  // more dimensions than this: left to the op

// The DLPack dtype of a TF dtype the C API takes (as tf.experimental.dlpack.to_dlpack describes it), or false.
bool ToDLPack(TF_DataType t, DLDataType* out) {
  using namespace kungfu::dlpack;
  switch (t) {
    case TF_HALF: *out = {kDLFloat, 16, 1}; return true;
    case TF_BFLOAT16: *out = {kDLBfloat, 16, 1}; return true;
    case TF_FLOAT: *out = {kDLFloat, 32, 1}; return true;
    case TF_DOUBLE: *out = {kDLFloat, 64, 1}; return true;
    case TF_INT32: *out = {kDLInt, 32, 1}; return true;
    case TF_INT64: *out = {kDLInt, 64, 1}; return true;
    case TF_UINT8: *out = {kDLUInt, 8, 1}; return true;
    case TF_INT8: *out = {kDLInt, 8, 1}; return true;
    case TF_BOOL: *out = {kDLBool, 8, 1}; return true;
    default: return false;
  }
}

// One thread's TF_Status, made once and reused (TF_NewStatus allocates), deleted when the thread ends.
TF_Status* ThreadStatus() {
  thread_local std::unique_ptr<TF_Status, decltype(&TF_DeleteStatus)> status(TF_NewStatus(), &TF_DeleteStatus);
  return status.get();
}

// An input as the C API wants it: a DLManagedTensor that borrows the EagerTensor's buffer (the caller's
// reference keeps it alive through the call; the C API neither keeps nor frees it).
struct Lent {
  DLManagedTensor managed{};
  int64_t shape[kMaxDims];
  TF_DataType dtype = TF_FLOAT;
};

// Fills lent from x. False when the C API cannot take x (not exactly an EagerTensor, not in host memory, a
// dtype it does not take, more than kMaxDims dimensions): the caller then lets the op decide.
bool Lend(PyObject* x, Lent* lent) {
  if (!api.check_exact(x)) return false;
  TFE_TensorHandle* h = api.handle(x);
  if (h == nullptr) return false;
  TF_Status* status = ThreadStatus();
  const char* device = TFE_TensorHandleDeviceType(h, status);
  if (TF_GetCode(status) != TF_OK || device == nullptr || std::strcmp(device, "CPU") != 0) return false;
  lent->dtype = TFE_TensorHandleDataType(h);
  DLDataType dtype;
  if (!ToDLPack(lent->dtype, &dtype)) return false;
  const int ndim = TFE_TensorHandleNumDims(h, status);
  if (TF_GetCode(status) != TF_OK || ndim < 0 || ndim > kMaxDims) return false;
  for (int d = 0; d < ndim; ++d) {
    lent->shape[d] = TFE_TensorHandleDim(h, d, status);
    if (TF_GetCode(status) != TF_OK) return false;
  }
  void* data = TFE_TensorHandleDevicePointer(h, status);  // waits for the op that makes x, if any
  if (TF_GetCode(status) != TF_OK) return false;
  auto& t = lent->managed.dl_tensor;
  t.data = data;
  t.device = {kungfu::dlpack::kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = dtype;
  t.shape = lent->shape;
  t.strides = nullptr;  // TF's tensors are compact, row-major
  t.byte_offset = 0;
  return true;
}

void FreeResult(void*, size_t, void* managed) {
  auto* m = static_cast<DLManagedTensor*>(managed);
  m->deleter(m);
}

// The outcome of a failed call: (code, message), which _direct.py raises as the op's tf.errors class.
PyObject* Failure(int code, const char* message) { return Py_BuildValue("(iy)", code, message); }

// The EagerTensor of the C API's result (dtype: the input's), which takes it over; or null with a Python
// error set, the result freed.
PyObject* Adopt(DLManagedTensor* result, TF_DataType dtype) {
  const auto& t = result->dl_tensor;
  size_t bytes = TF_DataTypeSize(dtype);
  for (int d = 0; d < t.ndim; ++d) bytes *= static_cast<size_t>(t.shape[d]);
  // TF frees the buffer through FreeResult when the tensor goes; on failure TF_NewTensor has called it.
  TF_Tensor* tensor = TF_NewTensor(dtype, t.shape, t.ndim, t.data, bytes, &FreeResult, result);
  if (tensor == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "kungfu: TF_NewTensor refused a collective's result");
    return nullptr;
  }
  TF_Status* status = ThreadStatus();
  TFE_TensorHandle* handle = TFE_NewTensorHandle(tensor, status);
  TF_DeleteTensor(tensor);  // the handle holds its own reference
  if (TF_GetCode(status) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError, "kungfu: TFE_NewTensorHandle failed: %s", TF_Message(status));
    return nullptr;
  }
  return api.from_handle(handle, false);  // takes the handle over
}

bool Ready() {
  if (api.ready) return true;
  PyErr_SetString(PyExc_RuntimeError, "kungfu.ops._eager: setup() has not succeeded");
  return false;
}

// Arguments: exactly n, each checked by the caller's parsing below.
bool Arity(const char* name, Py_ssize_t got, Py_ssize_t want) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, got);
  return false;
}

bool IntArg(PyObject* o, int* out) {
  long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) return false;
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_SetString(PyExc_OverflowError, "kungfu.ops._eager: an int argument is out of range");
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

bool KeyArg(PyObject* o, const char** out) {
  if (!PyBytes_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "kungfu.ops._eager: the key must be bytes");
    return false;
  }
  *out = PyBytes_AS_STRING(o);
  return true;
}

// The calls that return a tensor: all_reduce(x, op, key), broadcast(x, root, key), all_gather(x, key).
// Each returns the result tensor, None when the C API took nothing (the caller runs the op), or
// (code, message) when the collective failed.
template <typename Call>
PyObject* TensorCall(PyObject* x, Call call) {
  Lent lent;
  if (!Lend(x, &lent)) Py_RETURN_NONE;
  void* out = nullptr;
  char err[kErrLen];
  err[0] = '\0';
  int code;
  Py_BEGIN_ALLOW_THREADS
  code = call(&lent.managed, &out, err);
  Py_END_ALLOW_THREADS
  if (code == kNotTaken) Py_RETURN_NONE;
  if (code != 0) return Failure(code, err);
  return Adopt(static_cast<DLManagedTensor*>(out), lent.dtype);
}

// all_reduce(x, op, key) and broadcast(x, root, key): the C API calls of that one shape.
PyObject* IntKeyCall(const char* name, IntKeyFn fn, PyObject* const* args, Py_ssize_t n) {
  int arg;
  const char* key;
  if (!Ready() || !Arity(name, n, 3) || !IntArg(args[1], &arg) || !KeyArg(args[2], &key)) return nullptr;
  return TensorCall(args[0], [&](const void* in, void** out, char* err) {
    return fn(in, arg, key, out, err, kErrLen);
  });
}

PyObject* AllReduce(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return IntKeyCall("all_reduce", api.all_reduce, args, n);
}

PyObject* Broadcast(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return IntKeyCall("broadcast", api.broadcast, args, n);
}

PyObject* AllGather(PyObject*, PyObject* const* args, Py_ssize_t n) {
  const char* key;
  if (!Ready() || !Arity("all_gather", n, 2) || !KeyArg(args[1], &key)) return nullptr;
  return TensorCall(args[0], [&](const void* in, void** out, char* err) {
    return api.all_gather(in, key, out, err, kErrLen);
  });
}

// consensus(x, key): True or False (whether every worker holds the same bytes), None, or (code, message).
PyObject* Consensus(PyObject*, PyObject* const* args, Py_ssize_t n) {
  const char* key;
  if (!Ready() || !Arity("consensus", n, 2) || !KeyArg(args[1], &key)) return nullptr;
  Lent lent;
  if (!Lend(args[0], &lent)) Py_RETURN_NONE;
  int same = 0;
  char err[kErrLen];
  err[0] = '\0';
  int code;
  Py_BEGIN_ALLOW_THREADS
  code = api.consensus(&lent.managed, key, &same, err, kErrLen);
  Py_END_ALLOW_THREADS
  if (code == kNotTaken) Py_RETURN_NONE;
  if (code != 0) return Failure(code, err);
  return PyBool_FromLong(same);
}

bool AddressArg(PyObject* o, void** out) {
  void* p = PyLong_AsVoidPtr(o);
  if (p == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "kungfu.ops._eager: a null C API address");
    return false;
  }
  *out = p;
  return true;
}

// setup(all_reduce, broadcast, all_gather, consensus, pywrap_library): the addresses of the C API's
// kungfu_*_dlpack functions (ints), and the path of TF's lib_pywrap_tensorflow_common.so, whose private
// functions are looked up here. Raises RuntimeError naming what is missing; may be called again.
PyObject* Setup(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!Arity("setup", n, 5)) return nullptr;
  void* fns[4];
  for (int i = 0; i < 4; ++i) {
    if (!AddressArg(args[i], &fns[i])) return nullptr;
  }
  const char* path = PyUnicode_AsUTF8(args[4]);
  if (path == nullptr) return nullptr;
  // Only a library TF has already loaded (RTLD_NOLOAD): this must be TF's running copy, never a second one.
  void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "TensorFlow's %s is not loaded: %s", path, dlerror());
    return nullptr;
  }
  Api found;
  std::string missing;
  const char* names[] = {kCheckExactName, kHandleName, kFromHandleName};
  void* syms[3];
  for (int i = 0; i < 3; ++i) {
    syms[i] = dlsym(lib, names[i]);
    if (syms[i] == nullptr) missing += std::string(missing.empty() ? "" : ", ") + names[i];
  }
  dlclose(lib);  // TF keeps it loaded; this drops only the reference dlopen added
  if (!missing.empty()) {
    PyErr_Format(PyExc_RuntimeError,
                 "TensorFlow's private API changed: %s does not export %s (EagerTensor_CheckExact, "
                 "EagerTensor_Handle and EagerTensorFromHandle of tensorflow/python/eager/pywrap_tensor.h)",
                 path, missing.c_str());
    return nullptr;
  }
  found.check_exact = reinterpret_cast<CheckExactFn>(syms[0]);
  found.handle = reinterpret_cast<HandleFn>(syms[1]);
  found.from_handle = reinterpret_cast<FromHandleFn>(syms[2]);
  found.all_reduce = reinterpret_cast<IntKeyFn>(fns[0]);
  found.broadcast = reinterpret_cast<IntKeyFn>(fns[1]);
  found.all_gather = reinterpret_cast<AllGatherFn>(fns[2]);
  found.consensus = reinterpret_cast<ConsensusFn>(fns[3]);
  found.ready = true;
  api = found;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Setup)), METH_FASTCALL,
     "setup(all_reduce, broadcast, all_gather, consensus, pywrap_library): C API addresses, TF's library."},
    {"all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(AllReduce)), METH_FASTCALL,
     "all_reduce(x, op_code, key) -> tensor, None (not taken) or (code, message)."},
    {"broadcast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Broadcast)), METH_FASTCALL,
     "broadcast(x, root, key) -> tensor, None (not taken) or (code, message)."},
    {"all_gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(AllGather)), METH_FASTCALL,
     "all_gather(x, key) -> tensor, None (not taken) or (code, message)."},
    {"consensus", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Consensus)), METH_FASTCALL,
     "consensus(x, key) -> bool, None (not taken) or (code, message)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "kungfu.ops._eager",
                       "The eager collectives' C way between EagerTensors and the engine (see _direct.py).", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__eager() { return PyModule_Create(&kModule); }
