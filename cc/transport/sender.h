// A second thread that writes large payloads to sockets for the event loop.
//
// The loop thread does all of a connection's work: it reads, reduces and forwards. A process that runs
// a ring therefore copies every byte into the kernel on the same core that copies the bytes out of it
// and reduces them. Where cores are free, the copy into the kernel can run beside the rest: measured on
// 16 cores with 2 workers, a 16 MiB allreduce took 4.3-4.7 ms with the sender against 9.2-9.7 ms without
// (docs/engine.md, "What the defaults rest on").
// On a machine where every core already has a worker's loop on it, the extra thread only competes,
// so the engine starts one only where there are cores to spare (EngineConfig::send_thread).
//
// Ownership is strict: a connection hands the sender the rest of one payload (a Job), and until the
// job is done the connection neither writes to that socket nor touches the payload's bytes; the sender
// touches nothing else. The job's completion wakes the loop (the wake function), which takes the
// result on its next Flush. Abort takes a job back early (a cancelled collective whose buffer the
// caller may free next, a peer that has left): it returns once the sender has let go of it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kungfu {

class Sender {
 public:
  struct Job {
    int fd = -1;
    const char* data = nullptr;
    uint64_t len = 0;
    // Written by the sender until done; read by the owner once done is true.
    uint64_t written = 0;
    int error = 0;  // errno of a failed send, 0 if none
    std::atomic<bool> done{false};
    bool abort = false;  // guarded by the sender's mutex
  };

  // wake: called (on the sender's thread) when a job is done, to wake the loop. spin_us: how long the
  // thread keeps looking for work after a job before it sleeps.
  Sender(std::function<void()> wake, int spin_us);
  ~Sender();  // Stop()
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  // Writes data[0, len) to fd (non-blocking) in the background. The job must stay alive, and fd open,
  // until done is true or Abort has returned. Returns false after Stop (the caller writes it itself).
  bool Start(Job* job);
  // Takes the job back: on return the sender no longer touches it or its data, and done is true
  // (written says how much went out). A job already done returns at once.
  void Abort(Job* job);
  // Aborts every job and ends the thread; later Starts return false. The wake function is not called
  // after Stop returns.
  void Stop();

 private:
  void Run();
  void Notify();
  // Writes what fd takes; returns true when the job is finished (all written, or an error).
  static bool Write(Job* job);
  void Finish(Job* job);  // with mu_ held

  std::function<void()> wake_;
  const int spin_us_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::vector<Job*> jobs_;  // guarded by mu_: started, not done
  bool stopping_ = false;   // guarded by mu_
  int event_fd_ = -1;       // wakes the thread from poll: a new job, an abort, Stop
  std::thread thread_;
};

}  // namespace kungfu
