// The engine's single I/O thread: epoll over every socket, plus a queue of posted tasks.
//
// Threading: Post() may be called from any thread; everything else runs on the loop thread.
// Each iteration waits for I/O (bounded by the next wake-up the owner asks for), handles it,
// runs posted tasks, then calls the owner's AfterEvents() hook (flush sends, check deadlines).
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cc/status.h"

namespace kungfu {

class EventLoop {
 public:
  using Handler = std::function<void(uint32_t events)>;  // epoll event bits

  EventLoop();
  ~EventLoop();
  Status Init();
  // Starts the thread. after_events runs once per iteration on the loop thread and returns how
  // long (ms) the loop may sleep before it must run again (-1: until I/O or a post).
  // For spin_us after any I/O or task the loop polls instead of sleeping (yielding the CPU between
  // polls): a reply that comes within that window is handled without a thread wake-up, which costs
  // tens of microseconds on a virtual machine. 0 disables spinning.
  void Start(std::function<int()> after_events, int spin_us = 0);
  // Stops and joins the thread, then runs what is still posted on the calling thread.
  void Stop();

  // Runs task on the loop thread; once the loop has stopped, on the calling thread instead, so
  // that no task (and no completion callback it would call) is ever lost.
  void Post(std::function<void()> task);

  // Loop thread only.
  void Add(int fd, uint32_t events, Handler handler);
  void Modify(int fd, uint32_t events);
  void Remove(int fd);

 private:
  void Run();
  void Wake();

  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that interrupts epoll_wait for posts and Stop
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::function<int()> after_events_;
  int spin_us_ = 0;
  std::unordered_map<int, Handler> handlers_;
  std::mutex mu_;  // guards posted_ and stopped_
  std::vector<std::function<void()>> posted_;
  bool stopped_ = false;
};

}  // namespace kungfu
