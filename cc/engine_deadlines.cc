// Engine: what the loop does after each iteration's events (EventLoop's after_events): write what is
// queued, judge peers whose grace is over, fail collectives past their deadline, and say how long the
// loop may sleep. Also the stop discount those deadlines get (Postpone).
#include <sys/epoll.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "cc/engine_impl.h"
#include "cc/log.h"

namespace kungfu {

// Deadlines. Every collective and peer-to-peer request gets KUNGFU_TIMEOUT on the monotonic clock when it
// starts (StartOp, PeerToPeer::Start), a half-closed peer a short grace (judge_at_), and they are checked
// here, once per loop iteration, by whichever thread drives the loop. That clock keeps running while the
// process is stopped (Ctrl-Z to kfrun, which stops every worker; a Slurm suspend), so without more a job
// resumed after a stop longer than the timeout failed its collectives in flight at once. The loop thus
// counts the time it was not run: it wakes at least every 20 ms while anything here has a deadline (see
// the return below), and a read of the clock that comes more than StallMeter::kSlack (1 s) later than the
// loop asked to sleep means the process was stopped or starved meanwhile. Every deadline then moves
// later by that lateness (Postpone): for a stop found on waking, before that iteration's handlers and
// tasks run (EventLoop's on_stall), so that collectives they start keep their own full timeout; for one
// found here (a long iteration), before any deadline is checked (EventLoop::TakeStall). Each worker measures its
// own stop: workers stopped together and resumed a little apart each keep their full timeout, while
// the peers of one worker stopped alone saw no gap and still time out on it. With no such gap nothing
// changes. The deadlines of start-up (connecting, handshakes) and of Shutdown's drain run on other
// threads and are not moved.
void Engine::Impl::Postpone(Clock::duration lost) {
  for (auto& [key, a] : ops_) a.deadline += lost;
  for (auto& at : judge_at_) {
    if (at) *at += lost;
  }
  p2p_.Postpone(lost);
  if (!ops_.empty() || !p2p_.idle()) {
    KF_LOG(Info) << "rank " << rank() << ": this process did not run for "
                 << std::chrono::duration<double>(lost).count() << " s (stopped or starved); moved the deadlines of "
                 << ops_.size() << " collective(s) and the requests in flight later by that";
  }
}

int Engine::Impl::AfterEvents() {
  bool pending_writes = false;
  ReportSent();
  for (auto& c : out_) {
    if (c) CheckBroken(c.get());  // write errors seen while ops were sending
  }
  for (int d = 0; d < size(); ++d) {
    Connection* c = out_[d].get();
    if (!c || c->broken()) continue;
    const bool empty = c->Flush(&sent_);
    ReportSent();
    CheckBroken(c);
    if (c->broken()) continue;
    // While the sender writes a payload, the socket's room is its business: waking on it here would spin.
    const bool want_out = !empty && !c->offloaded();
    if (want_out != writing_[d]) {
      writing_[d] = want_out;
      loop_.Modify(c->fd(), want_out ? (EPOLLIN | EPOLLOUT) : EPOLLIN);
    }
    pending_writes = pending_writes || !empty;
  }
  const Deadline now = Clock::now();
  if (const Clock::duration lost = loop_.TakeStall(now); lost > Clock::duration(0)) Postpone(lost);
  bool judging = false;
  for (int p = 0; p < size(); ++p) {
    if (judge_at_[p] && now >= *judge_at_[p]) Judge(p, judge_why_[p]);
    judging = judging || judge_at_[p].has_value();
  }
  std::vector<std::pair<uint64_t, std::string>> expired;
  for (auto& [key, a] : ops_) {
    if (now >= a.deadline) expired.emplace_back(a.op->id, a.op->Progress());
  }
  if (!expired.empty()) timed_out_ = true;
  // The peers are told, as for a mismatch: one that comes late to the collective must fail it too, not
  // complete it from what this worker had sent, so that every worker sees the same outcome.
  for (auto& [id, progress] : expired) {
    Fail(id,
         DeadlineExceeded("timed out after " + FormatNumber(config_.timeout_seconds) + " s (KUNGFU_TIMEOUT); " +
                          progress),
         true);
  }
  p2p_.ExpireOverdue(now);
  if (flushing_ && !pending_writes) {
    std::lock_guard<std::mutex> lock(mu_);
    flushed_ = true;
    cv_.notify_all();
  }
  if (ops_.empty() && p2p_.idle() && !pending_writes && !judging) return flushing_ ? 10 : -1;
  return 20;
}

}  // namespace kungfu
