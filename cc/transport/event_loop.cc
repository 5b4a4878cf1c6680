#include "cc/transport/event_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

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

void EventLoop::Start(std::function<int()> after_events, int spin_us) {
  after_events_ = std::move(after_events);
  spin_us_ = spin_us;
  running_ = true;
  thread_ = std::thread([this] { Run(); });
}

void EventLoop::Stop() {
  if (thread_.joinable()) {
    running_ = false;
    Wake();
    thread_.join();
  }
  std::vector<std::function<void()>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    left.swap(posted_);
  }
  for (auto& t : left) t();
}

void EventLoop::Post(std::function<void()> task) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!stopped_) {
      posted_.push_back(std::move(task));
      lock.unlock();
      Wake();
      return;
    }
  }
  task();
}

void EventLoop::Wake() {
  const uint64_t one = 1;
  ssize_t rc = ::write(wake_fd_, &one, sizeof(one));
  (void)rc;  // EAGAIN means a wake-up is already pending: fine
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

void EventLoop::Run() {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  using Clock = std::chrono::steady_clock;
  const auto spin = std::chrono::microseconds(spin_us_);
  auto last_activity = Clock::now();
  int timeout_ms = 0;
  while (running_) {
    const bool spinning = timeout_ms != 0 && Clock::now() - last_activity < spin;
    const int n = ::epoll_wait(epoll_fd_, events, kMaxEvents, spinning ? 0 : timeout_ms);
    if (n > 0) {
      last_activity = Clock::now();
    } else if (spinning) {
      sched_yield();
    }
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks.swap(posted_);
    }
    for (auto& t : tasks) t();
    if (!tasks.empty()) last_activity = Clock::now();
    timeout_ms = after_events_ ? after_events_() : -1;
  }
}

}  // namespace kungfu
