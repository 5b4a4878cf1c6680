/* A small C API over the process-wide engine, for Python (ctypes) and for the TF kernels.
 *
 * The library holds at most one engine per process. All functions are thread-safe. Functions that
 * can fail return 0 on success and a nonzero status code otherwise, writing the message into err. */
#ifndef KUNGFU_CC_C_API_H_
#define KUNGFU_CC_C_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* peers: "h:p,h:p,..." in rank order; an empty string with rank 0 means a single-worker cluster.
 * timeout_seconds <= 0 keeps the default; KUNGFU_* environment overrides apply afterwards. */
int kungfu_init(const char* peers, int rank, const char* token, double timeout_seconds, uint32_t cluster_version,
                char* err, int err_len);
/* 1 when an engine is running. */
int kungfu_initialized(void);
int kungfu_rank(void);
int kungfu_size(void);
/* Tells the peers that this worker starts no collective but the finalize barrier, which it calls next
 * (Engine::Finalizing). Does nothing without an engine. */
void kungfu_finalizing(void);
/* 1 when a collective of this worker has failed at its deadline and none has completed since
 * (Engine::TimedOut), else 0. */
int kungfu_timed_out(void);
/* Waits for in-flight work (bounded by the timeout) and stops the engine. Safe to call twice. */
int kungfu_finalize(void);
/* kungfu_finalize for a worker whose last collective (the finalize barrier) succeeded: it says goodbye to
 * every peer first, so a peer still finishing that collective does not take this exit for a failure. */
int kungfu_leave(void);
/* Fills up to n counters in EngineStats order: started, completed, failed, in_flight, max_in_flight,
 * bytes_sent, bytes_received, refused_handshakes. Returns how many were written. */
int kungfu_stats(int64_t* out, int n);
/* Zeroes the resettable counters of kungfu_stats and forgets the per-collective ones. */
void kungfu_reset_stats(void);
/* The per-collective counters (cc/collective_stats.h) as JSON text, {"name": {"calls": ..., ...}, ...},
 * in a buffer from malloc that the caller frees with kungfu_free; "{}" without an engine. reset != 0
 * empties the counters in the same step, so no call is counted twice or lost between two reads. */
char* kungfu_collective_stats(int reset);
void kungfu_free(void* p);
/* A blocking float32/int allreduce for tests and tools: dtype and op as in cc/dtype.h wire values. */
int kungfu_all_reduce(const void* in, void* out, int64_t count, int dtype, int op, const char* name, char* err,
                      int err_len);
/* The eager path of kungfu.all_reduce (python/kungfu/ops/_direct.py). in: a DLManagedTensor (the pointer a
 * "dltensor" capsule holds, as tf.experimental.dlpack.to_dlpack makes it); it stays the caller's. Reduces it
 * with op (a cc/dtype.h wire value) under name, blocking, into a new compact tensor of the same dtype and
 * shape, its data 64-byte aligned, which *out receives: a DLManagedTensor whose deleter frees it (hand it to a
 * framework's from_dlpack, or to kungfu_dlpack_free). The shape's signature is checked across workers as the
 * TF kernels check it, so eager and graph calls of one collective meet. Returns 0; -1 when in is not a compact
 * CPU tensor of a dtype the engine reduces, or op is not a reduce op (nothing started, *out left alone: the
 * caller runs the TF op instead); else a status code, the message in err, *out null. */
int kungfu_all_reduce_dlpack(const void* in, int op, const char* name, void** out, char* err, int err_len);
/* The eager paths of kungfu.broadcast, kungfu.all_gather and kungfu.consensus, as kungfu_all_reduce_dlpack's:
 * in is lent, and they take a compact CPU tensor of a dtype the engine reduces, or uint8, int8 or bool (which
 * travel as bytes), returning -1 with nothing started otherwise. Dtype and shape are checked across workers
 * as the TF kernels check them (cc/tensor_meta.h), so eager calls meet graph calls of the same collective.
 * broadcast: *out, a new tensor like in, holds root's data on every worker (InvalidArgument when root is
 * not a rank). all_gather: *out holds every worker's in, concatenated along the first dimension in rank order
 * (a scalar counts as one element; the first dimension may differ between workers). consensus: *same is 1
 * when every worker passed the same dtype, shape and bytes, else 0. */
int kungfu_broadcast_dlpack(const void* in, int root, const char* name, void** out, char* err, int err_len);
int kungfu_all_gather_dlpack(const void* in, const char* name, void** out, char* err, int err_len);
int kungfu_consensus_dlpack(const void* in, const char* name, int* same, char* err, int err_len);
/* Frees a tensor from the DLPack calls above that was never handed on. */
void kungfu_dlpack_free(void* tensor);
/* The eager path of kungfu.barrier: waits, blocking, until every worker has reached the barrier name. */
int kungfu_barrier(const char* name, char* err, int err_len);

#ifdef __cplusplus
}  // extern "C"

#include <memory>
#include <string>
namespace kungfu {
class Engine;
// The process-wide engine for the TF kernels; null before kungfu_init. The shared_ptr keeps the
// engine alive while a kernel uses it, even if finalize runs concurrently.
std::shared_ptr<Engine> GlobalEngine();
// Why GlobalEngine() is null, for the kernels' errors: not initialized (or finalized), or this process
// is a child forked from a worker after kungfu_init, which must never use its parent's engine.
std::string NoEngineReason();
class Status;
// The C API's return of a Status: its code, and its message copied into err (at most err_len bytes with
// the terminating NUL; err may be null).
int Report(const Status& s, char* err, int err_len);
}  // namespace kungfu
#endif

#endif  /* KUNGFU_CC_C_API_H_ */
