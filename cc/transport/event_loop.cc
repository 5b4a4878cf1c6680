#include "cc/transport/event_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <pthread.h>
#include <sched.h>

#include <cerrno>
#include <chrono>

#include "cc/log.h"

namespace kungfu {

EventLoop::EventLoop() = default;

EventLoop::~EventLoop() {
  Stop();
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

Status EventLoop::Init() {
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return ErrnoStatus(Code::kInternal, "epoll_create1", errno);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return ErrnoStatus(Code::kInternal, "eventfd", errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) {
    return ErrnoStatus(Code::kInternal, "epoll_ctl", errno);
  }
  return Status::OK();
}

void EventLoop::Start(std::function<int()> after_events, int spin_us, std::function<bool()> busy,
                      std::function<void(std::chrono::steady_clock::duration)> on_stall) {
  after_events_ = std::move(after_events);
  busy_ = std::move(busy);
  on_stall_ = std::move(on_stall);
  spin_us_ = spin_us;
  running_ = true;
  thread_ = std::thread([this] { Run(); });
}

void EventLoop::Stop() {
  if (thread_.joinable()) {
    running_ = false;
    Kick();    // a parked loop thread
    Notify();  // callers waiting for a turn
    Wake();
    thread_.join();
  }
  // A caller may still be in its last iteration (it leaves once it sees running_ false): the leftover
  // tasks are loop work too, so they wait for the drive lock.
  std::lock_guard<std::mutex> drive(drive_mu_);
  std::vector<std::function<void()>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    left.swap(posted_);
  }
  for (auto& t : left) t();
}

namespace {
// The loop a blocking caller on this thread is about to drive, while it starts its collective (DriveUntil).
thread_local const EventLoop* t_about_to_drive = nullptr;
}  // namespace

void EventLoop::Post(std::function<void()> task) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!stopped_) {
      posted_.push_back(std::move(task));
      lock.unlock();
      // Whoever waits in epoll_wait, the loop thread or a driving caller, must look. Not when this
      // thread is about to drive and no caller drives yet: whoever drives first (this thread or one that
      // comes meanwhile) begins with an iteration that does not wait and runs what is posted, and the loop
      // thread leaves it to them. That spares a blocking collective the eventfd's write and read. (A
      // caller that leaves without driving wakes the loop thread for what is left: LeaveDrive.)
      if (t_about_to_drive != this || SomeCallerDrives()) Wake();
      // No caller will run it: the loop thread must, even if it lingers. (A caller that leaves after
      // this read kicks it itself: see LeaveDrive.)
      if (callers_.load() == 0 && parked_.load()) Kick();
      return;
    }
  }
  task();
}

void EventLoop::Kick() {
  {
    std::lock_guard<std::mutex> lock(park_mu_);
    kick_ = true;
  }
  park_cv_.notify_all();
}

bool EventLoop::SomeCallerDrives() {
  std::lock_guard<std::mutex> lock(park_mu_);  // after the post: a driver that starts later takes it
  return caller_driving_;
}

bool EventLoop::HasPosts() {
  std::lock_guard<std::mutex> lock(mu_);
  return !posted_.empty();
}

void EventLoop::Wake() {
  wakes_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t one = 1;
  ssize_t rc = ::write(wake_fd_, &one, sizeof(one));
  (void)rc;  // EAGAIN means a wake-up is already pending: fine
}

void EventLoop::Notify() {
  bool other_drives;
  {
    std::lock_guard<std::mutex> lock(park_mu_);  // a waiter between its check and its sleep sees the change
    other_drives = caller_driving_ && driver_ != std::this_thread::get_id();
  }
  turn_cv_.notify_all();
  // A callback run off the loop (a kernel that finishes on TF's worker pool) must also get the driving
  // caller out of epoll_wait, or it would look at its condition only at the next I/O.
  if (other_drives) Wake();
}

void EventLoop::Add(int fd, uint32_t events, Handler handler) {
  handlers_[fd] = std::move(handler);
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    KF_LOG(Error) << "epoll_ctl ADD fd " << fd << " failed: errno " << errno;
  }
}

void EventLoop::Modify(int fd, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
}

void EventLoop::Remove(int fd) {
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  handlers_.erase(fd);
}

int EventLoop::Iterate(int wait_ms, bool* active, bool loop_thread) {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  const int n = ::epoll_wait(epoll_fd_, events, kMaxEvents, wait_ms);
  // Before anything below can set a deadline: a stop during the sleep counts against the older ones only.
  const auto lost = stall_meter_.Read(std::chrono::steady_clock::now());
  if (lost > std::chrono::steady_clock::duration(0)) {
    if (on_stall_) {
      on_stall_(lost);
    } else {
      stalled_ += lost;
    }
  }
  *active = n > 0;
  for (int i = 0; i < n; ++i) {
    const int fd = events[i].data.fd;
    if (fd == wake_fd_) {
      uint64_t v;
      ssize_t rc = ::read(wake_fd_, &v, sizeof(v));
      (void)rc;
      continue;
    }
    auto it = handlers_.find(fd);
    // A handler may remove itself or others; copy before calling.
    if (it != handlers_.end()) {
      Handler h = it->second;
      h(events[i].events);
    }
  }
  std::vector<std::function<void()>> tasks;
  // The loop's thread leaves what is posted once a caller has come to drive (its collective's start
  // among it), so that the caller runs it: its result then needs no wake-up.
  if (!loop_thread || callers_.load() == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks.swap(posted_);
  }
  for (auto& t : tasks) t();
  if (!tasks.empty()) *active = true;
  const int sleep_ms = after_events_ ? after_events_() : -1;
  stall_meter_.Asked(sleep_ms);
  return sleep_ms;
}

std::chrono::steady_clock::duration EventLoop::TakeStall(std::chrono::steady_clock::time_point now) {
  const auto lost = stalled_ + stall_meter_.Read(now);
  stalled_ = std::chrono::steady_clock::duration(0);
  return lost;
}

namespace {
using Clock = std::chrono::steady_clock;
constexpr auto kLinger = std::chrono::milliseconds(2);
// The loop thread's longest sleep while idle: a backstop that keeps deadlines checked even if its
// wake-up was taken by a driving caller's iteration (the last caller leaving wakes it anyway).
constexpr int kMaxIdleMs = 1000;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// The spin window both drivers (the loop thread, a caller) keep: for spin_us after any activity the
// next iteration polls instead of sleeping, yielding the CPU between empty polls.
class Spin {
 public:
  explicit Spin(int spin_us) : spin_(std::chrono::microseconds(spin_us)) {}
  // Whether the next iteration, which may sleep timeout_ms (0: it would not sleep anyway), should poll.
  bool Polling(int timeout_ms) const { return timeout_ms != 0 && Clock::now() - last_activity_ < spin_; }
  void After(bool active, bool polled) {
    if (active) {
      last_activity_ = Clock::now();
    } else if (polled) {
      sched_yield();
    }
  }
  void Forget() { last_activity_ = Clock::time_point(); }  // the activity was not this driver's

 private:
  const std::chrono::microseconds spin_;
  Clock::time_point last_activity_ = Clock::now();
};
}  // namespace

void EventLoop::Park() {
  std::unique_lock<std::mutex> lock(park_mu_);
  parked_ = true;
  while (running_ && !kick_) {
    if (callers_.load() > 0) {
      park_cv_.wait_for(lock, kLinger);
      continue;
    }
    if (HasPosts()) break;
    const auto idle = std::chrono::nanoseconds(NowNs() - last_exit_ns_.load());
    if (idle >= kLinger) break;
    park_cv_.wait_for(lock, kLinger - idle);
  }
  // Work of the loop's own (a post) ends the linger: what it starts needs the loop from now on.
  if (callers_.load() == 0) last_exit_ns_ = 0;
  kick_ = false;
  parked_ = false;
}

void EventLoop::Run() {
  pthread_setname_np(pthread_self(), "kf_loop");  // how top -H and profilers show it (at most 15 characters)
  Spin spin(spin_us_);
  int timeout_ms = 0;
  while (running_) {
    if (callers_.load() > 0 || std::chrono::nanoseconds(NowNs() - last_exit_ns_.load()) < kLinger) {
      Park();
      timeout_ms = 0;  // look at once (below), but do not spin: the activity was the callers'
      spin.Forget();
    }
    const bool polling = spin.Polling(timeout_ms);
    if (timeout_ms != 0 && !polling) {
      // Idle: sleep until I/O, a post or the next deadline without the drive lock, so that a caller
      // can take it at once; whatever woke the loop is handled by the iteration below.
      epoll_event ev;
      ::epoll_wait(epoll_fd_, &ev, 1, timeout_ms < 0 || timeout_ms > kMaxIdleMs ? kMaxIdleMs : timeout_ms);
      timeout_ms = 0;
      continue;
    }
    bool active = false;
    {
      std::lock_guard<std::mutex> lock(drive_mu_);
      if (callers_.load() > 0) continue;
      timeout_ms = Iterate(0, &active, true);
    }
    spin.After(active, polling);
  }
}

void EventLoop::DriveUntil(const std::function<bool()>& finished, const std::function<void()>& start, bool drive) {
  if (!drive) {
    if (start) start();
    std::unique_lock<std::mutex> lock(park_mu_);
    turn_cv_.wait(lock, [&] { return finished(); });
    return;
  }
  {
    callers_.fetch_add(1);  // first, so that start()'s posts do not kick the loop thread
    bool drove = false, busy = false;
    struct Leave {  // runs on every path out, an exception from start() included
      EventLoop* loop;
      const bool& drove;
      const bool& busy;
      ~Leave() { loop->LeaveDrive(drove, busy); }
    } leave{this, drove, busy};
    if (start) {
      struct AboutToDrive {  // for start()'s posts (Post): cleared on every path out
        explicit AboutToDrive(const EventLoop* loop) { t_about_to_drive = loop; }
        ~AboutToDrive() { t_about_to_drive = nullptr; }
      } about_to_drive(this);
      start();
    }
    std::unique_lock<std::mutex> park(park_mu_);
    turn_cv_.wait(park, [&] { return finished() || !caller_driving_ || !running_; });
    if (!finished() && running_) {
      caller_driving_ = true;
      driver_ = std::this_thread::get_id();
      drove = true;
      park.unlock();
      {
        // The loop thread lets go within one iteration and then parks (callers_ > 0).
        std::lock_guard<std::mutex> drive_lock(drive_mu_);
        Spin spin(spin_us_);
        int timeout_ms = 0;
        while (!finished() && running_) {
          const bool polling = spin.Polling(timeout_ms);
          bool active = false;
          timeout_ms = Iterate(polling ? 0 : timeout_ms, &active, false);
          spin.After(active, polling);
        }
        busy = busy_ && busy_();  // other work in flight (async collectives, requests, unsent data)
      }
      park.lock();
      caller_driving_ = false;
      driver_ = std::thread::id();
    }
  }
  if (finished()) return;
  // The loop has stopped: the callback comes from whoever runs the cancelled ops'.
  std::unique_lock<std::mutex> park(park_mu_);
  turn_cv_.wait(park, [&] { return finished(); });
}

void EventLoop::PollOnce() {
  std::unique_lock<std::mutex> lock(drive_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  bool active = false;
  Iterate(0, &active, false);
}

void EventLoop::LeaveDrive(bool drove, bool busy) {
  turn_cv_.notify_all();  // the next waiting caller's turn
  // The loop thread lingers, parked, in case another blocking call comes soon, unless other work
  // needs the loop now.
  if (drove) last_exit_ns_ = busy ? 0 : NowNs();
  if (callers_.fetch_sub(1) != 1) return;  // a caller still here drives next
  // Work left for it: what was posted after the last iteration (by a thread that saw a caller still
  // here), or what the last driver left in flight.
  const bool work_left = HasPosts() || last_exit_ns_.load() == 0;
  if (parked_.load()) {
    if (work_left) Kick();
  } else if (work_left || !busy_) {  // without the busy hook, whether work is left is not known
    // It may sleep in epoll_wait on a stale timeout, its wake-up taken by a driving caller's iteration:
    // make it look again (deadlines, posts). With nothing left it may sleep on: nothing can time out,
    // and what comes next (I/O, a post from another thread) wakes it. Not parked here usually means it
    // was not run within the linger (a loaded machine); waking it after every blocking call then would
    // cost a write, and a thread switch the CPU cannot spare, per call.
    Wake();
  }
}

}  // namespace kungfu
