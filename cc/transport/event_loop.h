// The engine's I/O loop: epoll over every socket, plus a queue of posted tasks.
//
// Threading. All loop state (the handlers, and through the owner's callbacks every socket and
// collective) is touched by one thread at a time: whichever holds the drive lock. Usually that is the
// loop's own thread. A thread that is about to block until some condition holds (an eager collective
// whose caller waits anyway) may drive the loop itself instead, with DriveUntil(): it then does the I/O
// and runs the callbacks on its own thread, so the result reaches it with no thread wake-up on either
// side, which on a machine with fewer cores than busy threads costs more than the collective itself.
// The loop's thread parks while a caller drives, and goes on once none wants to.
//
// Each iteration polls for I/O, handles it, runs posted tasks, then calls the owner's AfterEvents()
// hook (flush sends, check deadlines), which says how long the loop may sleep.
//
// Time not run. Deadlines are on the monotonic clock, which keeps going while the process is stopped
// (Ctrl-Z, SIGSTOP, a Slurm suspend). The loop notices such a stop from the clock: it reads it when it
// wakes and where the owner checks deadlines (TakeStall), and between two reads it may take as long as
// the sleep after_events asked for, plus StallMeter::kSlack. What goes beyond that is time it was not
// run (stopped, or starved of the CPU), which TakeStall hands to the owner to move its deadlines by.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cc/status.h"

namespace kungfu {

// The arithmetic of "time not run" (above), on times given to it, so that tests can feed it any.
class StallMeter {
 public:
  using Clock = std::chrono::steady_clock;
  // How much later than allowed a read may come before the lateness counts: well above an iteration's
  // work or a scheduling delay, well below a stop someone would notice.
  static constexpr Clock::duration kSlack = std::chrono::seconds(1);

  // A read of the clock: returns how long the loop was not run since the previous read (zero unless
  // that is more than kSlack past what it was allowed). The next read is allowed nothing more, until
  // Asked says how long the loop may now sleep.
  Clock::duration Read(Clock::time_point now) {
    Clock::duration lost{0};
    if (seen_ && !unbounded_) {
      const Clock::duration late = now - *seen_ - may_sleep_;
      if (late > kSlack) lost = late;
    }
    seen_ = now;
    may_sleep_ = Clock::duration(0);
    unbounded_ = false;
    return lost;
  }
  // The loop may now sleep ms (-1: until I/O or a post, which after_events asks only with nothing to
  // time out, so that such a sleep is never counted).
  void Asked(int ms) {
    unbounded_ = ms < 0;
    may_sleep_ = std::chrono::milliseconds(ms < 0 ? 0 : ms);
  }

 private:
  std::optional<Clock::time_point> seen_;
  Clock::duration may_sleep_{0};
  bool unbounded_ = false;
};

class EventLoop {
 public:
  using Handler = std::function<void(uint32_t events)>;  // epoll event bits

  EventLoop();
  ~EventLoop();
  Status Init();
  // Starts the thread. after_events runs once per iteration (under the drive lock) and returns how
  // long (ms) the loop may sleep before it must run again (-1: until I/O or a post).
  // For spin_us after any I/O or task the loop polls instead of sleeping (yielding the CPU between
  // polls): a reply that comes within that window is handled without a thread wake-up, which costs
  // tens of microseconds on a virtual machine. 0 disables spinning. busy, if given, runs under the
  // drive lock and says whether work other than a leaving caller's is in flight: then the loop's thread
  // takes over at once instead of lingering.
  // on_stall, if given, gets the time not run found when the loop wakes, before any handler or task of
  // that iteration runs (so that deadlines they set are not moved by it); without it TakeStall returns it.
  void Start(std::function<int()> after_events, int spin_us = 0, std::function<bool()> busy = nullptr,
             std::function<void(std::chrono::steady_clock::duration)> on_stall = nullptr);
  // Stops and joins the thread, then runs what is still posted on the calling thread.
  void Stop();

  // Runs task on the driving thread; once the loop has stopped, on the calling thread instead, so
  // that no task (and no completion callback it would call) is ever lost.
  void Post(std::function<void()> task);

  // Runs start() (which submits the work, if given), then runs the loop on the calling thread until
  // finished() holds or the loop stops; then, if need be, sleeps until finished() holds. finished must
  // be thread-safe: it becomes true in a callback, which may run on another driving thread, and
  // whoever makes it true calls Notify() afterwards. Callers that wait at once take turns: one
  // drives, the others sleep until their condition holds or the drive lock is free. drive false: only
  // sleep, while the loop's thread does the work. Must not be called from a callback (that thread
  // already drives).
  void DriveUntil(const std::function<bool()>& finished, const std::function<void()>& start = nullptr,
                  bool drive = true);
  // Wakes the callers waiting in DriveUntil to look at their conditions again.
  void Notify();
  // One non-blocking iteration on the calling thread, unless another thread is running one: for a
  // DriveUntil start() that takes a while (packing a group's buckets), so what it has already started
  // goes out meanwhile (the loop thread leaves that to the caller). Never from a callback.
  void PollOnce();
  // How many times the eventfd was written to make a thread in epoll_wait look (for tests and stats).
  int64_t wakes() const { return wakes_.load(std::memory_order_relaxed); }

  // Driving thread only: how long the loop was not run (see "Time not run" above) since the last call,
  // counting a read of the clock at now. The owner calls it where it checks deadlines, with the now it
  // checks them against, and moves them later by what it returns.
  std::chrono::steady_clock::duration TakeStall(std::chrono::steady_clock::time_point now);

  // Driving thread only.
  void Add(int fd, uint32_t events, Handler handler);
  void Modify(int fd, uint32_t events);
  void Remove(int fd);

 private:
  void Run();
  // The loop thread stays out of the way while callers drive, and for a short linger after the last
  // one left (the next blocking call usually comes soon), unless kicked by a post.
  void Park();
  void Kick();
  // A caller leaves DriveUntil (drove: it ran iterations; busy: it left other work in flight).
  void LeaveDrive(bool drove, bool busy);
  bool HasPosts();
  bool SomeCallerDrives();  // a caller holds the drive lock (or is about to, having been let in)
  // One iteration; the drive lock is held. Returns after_events' sleep and whether anything happened.
  // loop_thread: run by the loop's own thread, which leaves posted tasks to a caller come to drive.
  int Iterate(int wait_ms, bool* active, bool loop_thread);
  void Wake();

  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that interrupts epoll_wait for posts and Stop
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::function<int()> after_events_;
  std::function<bool()> busy_;
  std::function<void(std::chrono::steady_clock::duration)> on_stall_;
  int spin_us_ = 0;
  StallMeter stall_meter_;                          // driving thread only
  std::chrono::steady_clock::duration stalled_{0};  // driving thread only: found on waking, not yet taken
  std::unordered_map<int, Handler> handlers_;
  std::mutex mu_;  // guards posted_ and stopped_
  std::vector<std::function<void()>> posted_;
  bool stopped_ = false;

  std::mutex drive_mu_;          // held by the thread running an iteration
  std::atomic<int64_t> wakes_{0};
  std::atomic<int> callers_{0};  // threads inside DriveUntil
  std::atomic<int64_t> last_exit_ns_{0};  // steady clock: when a caller last left DriveUntil
  std::atomic<bool> parked_{false};       // the loop thread is in Park()
  std::mutex park_mu_;
  std::condition_variable park_cv_;  // the parked loop thread
  std::condition_variable turn_cv_;  // callers waiting for their condition or a turn to drive
  bool kick_ = false;                // guarded by park_mu_: a post for the parked loop thread
  bool caller_driving_ = false;      // guarded by park_mu_: a caller holds the drive lock for its wait
  std::thread::id driver_;           // guarded by park_mu_: that caller
};

}  // namespace kungfu
