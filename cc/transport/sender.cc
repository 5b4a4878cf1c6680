#include "cc/transport/sender.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

namespace kungfu {

namespace {
using Clock = std::chrono::steady_clock;
// Poll's longest wait with jobs blocked on full sockets: a backstop only (the eventfd and POLLOUT wake it).
constexpr int kBlockedPollMs = 100;
}  // namespace

Sender::Sender(std::function<void()> wake, int spin_us) : wake_(std::move(wake)), spin_us_(spin_us) {
  event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (event_fd_ < 0) {
    stopping_ = true;  // no thread: every Start returns false and connections write for themselves
    return;
  }
  thread_ = std::thread([this] { Run(); });
}

Sender::~Sender() {
  Stop();
  if (event_fd_ >= 0) ::close(event_fd_);
}

void Sender::Notify() {
  const uint64_t one = 1;
  ssize_t rc = ::write(event_fd_, &one, sizeof(one));
  (void)rc;  // EAGAIN: a wake-up is already pending
}

bool Sender::Start(Job* job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    job->written = 0;
    job->error = 0;
    job->abort = false;
    job->done.store(false, std::memory_order_relaxed);
    jobs_.push_back(job);
  }
  Notify();
  return true;
}

void Sender::Abort(Job* job) {
  std::unique_lock<std::mutex> lock(mu_);
  if (job->done.load(std::memory_order_acquire)) return;
  job->abort = true;
  Notify();
  done_cv_.wait(lock, [job] { return job->done.load(std::memory_order_acquire); });
}

void Sender::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) {
    Notify();
    thread_.join();
  }
}

void Sender::Finish(Job* job) {
  job->done.store(true, std::memory_order_release);
  wake_();  // under mu_: once Stop or Abort has the lock, no wake-up is still under way
  done_cv_.notify_all();
}

bool Sender::Write(Job* job) {
  while (job->written < job->len) {
    const ssize_t n = ::send(job->fd, job->data + job->written, job->len - job->written, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      job->error = errno;
      return true;
    }
    job->written += static_cast<uint64_t>(n);
  }
  return true;
}

void Sender::Run() {
  pthread_setname_np(pthread_self(), "kf_send");
  std::vector<Job*> mine, finished;
  std::vector<pollfd> fds;
  Clock::time_point last_work = Clock::now();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Jobs aborted or finished since the last round are handed back first, so Abort waits at most one round.
      for (auto it = jobs_.begin(); it != jobs_.end();) {
        const bool drop = stopping_ || (*it)->abort ||
                          std::find(finished.begin(), finished.end(), *it) != finished.end();
        if (drop) {
          Finish(*it);
          it = jobs_.erase(it);
        } else {
          ++it;
        }
      }
      finished.clear();
      if (stopping_) return;
      mine = jobs_;
    }
    bool progressed = false;
    for (Job* job : mine) {
      const uint64_t before = job->written;
      if (Write(job)) finished.push_back(job);
      progressed = progressed || job->written != before;
    }
    if (progressed || !finished.empty()) {
      last_work = Clock::now();
      continue;
    }
    if (mine.empty() && Clock::now() - last_work < std::chrono::microseconds(spin_us_)) {
      // Idle but recently busy: the next piece of a ring usually follows within microseconds.
      uint64_t v;
      if (::read(event_fd_, &v, sizeof(v)) != sizeof(v)) sched_yield();
      continue;
    }
    // Sleep until a socket takes more, a job comes or goes, or Stop.
    fds.clear();
    fds.push_back(pollfd{event_fd_, POLLIN, 0});
    for (Job* job : mine) fds.push_back(pollfd{job->fd, POLLOUT, 0});
    const int rc = ::poll(fds.data(), fds.size(), mine.empty() ? -1 : kBlockedPollMs);
    if (rc > 0 && (fds[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t n = ::read(event_fd_, &v, sizeof(v));
      (void)n;
    }
  }
}

}  // namespace kungfu
