#include "progress_worker.hpp"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "futex_wait.hpp"
#include "sleep_policy.hpp"

namespace kvxfer {
namespace {

// Completions read per fi_cq_read call: enough to drain a burst of small pages at once.
constexpr size_t kCqBatch = 64;
// How often the worker looks for expired transfers.
constexpr int64_t kDeadlineCheckNs = 1'000'000;
ContextTag tag_of(void* context) {
  // Both context types start with fi_context2 followed by their tag.
  return *reinterpret_cast<ContextTag*>(static_cast<char*>(context) + sizeof(struct fi_context2));
}

}  // namespace

ProgressWorker::ProgressWorker(RailGroup& rails, ProgressWorkerSettings settings, ImmRingBoard* imm_ring)
    : rails_(rails),
      settings_(settings),
      inbox_(settings.inbox_max_messages, settings.inbox_max_bytes, engine_stats_),
      imms_(settings.imm_table_capacity, events_, settings.count_claimed_imms_only),
      post_queues_(rails.size(), RailPostQueue(settings.max_inflight_per_rail)),
      deadlines_(settings.transfer_timeout_ns, kDeadlineCheckNs),
      recv_slots_(rails, settings.recv_slots_per_rail, settings.recv_slot_bytes),
      imm_ring_(imm_ring),
      tcp_congestion_(settings.tcp_congestion),
      send_corker_(settings.cork_sends),
      last_burst_ns_(rails.size(), INT64_MIN / 2) {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) throw EngineError("eventfd/epoll failed");
  struct epoll_event ev = {};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  if (imm_ring_) {
    ev.data.fd = imm_ring_->event_fd();  // written by same-host writers while we sleep
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, ev.data.fd, &ev);
  }
  for (size_t r = 0; r < rails_.size(); ++r) {
    int fd = rails_.rail(r).sleep_fd();  // the CQ's wait fd, or the provider's poll set in it
    if (fd < 0) {
      all_rails_have_wait_fd_ = false;
      continue;
    }
    ev.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
  for (size_t r = 0; r < rails_.size(); ++r) stats_.push_back(std::make_unique<RailStats>());
  // Before anyone can know our address: connections the listeners accept inherit it.
  for (size_t r = 0; r < rails_.size(); ++r) {
    tcp_congestion_.watch_local(rails_.rail(r).address(), monotonic_ns());
    send_corker_.add_local(rails_.rail(r).address());
  }
  tcp_congestion_.poll(monotonic_ns());
  owner_ = std::this_thread::get_id();
  if (!settings_.caller_drives_progress) thread_ = std::thread([this] { loop(); });
}

ProgressWorker::~ProgressWorker() {
  stop();
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

void ProgressWorker::stop() {
  if (settings_.caller_drives_progress) {
    if (!stopping_.exchange(true)) shut_down();
    return;
  }
  if (stopping_.exchange(true)) {
    if (thread_.joinable()) thread_.join();
    return;
  }
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
  if (thread_.joinable()) thread_.join();
}

void ProgressWorker::submit(std::unique_ptr<WorkBatch> batch) {
  if (stopping_.load()) throw EngineError("engine is closed");
  if (settings_.caller_drives_progress) {
    check_caller();
    if (!submissions_.try_push(batch.get())) throw EngineError("engine submission queue is full");
    batch.release();
    run_round();  // posts it now: nobody else will
    return;
  }
  push_submission(batch.release());
  wake_if_sleeping();
}

void ProgressWorker::submit_all(std::vector<std::unique_ptr<WorkBatch>>& batches) {
  if (stopping_.load()) throw EngineError("engine is closed");
  if (settings_.caller_drives_progress) {
    check_caller();
    for (auto& batch : batches) {
      // A full queue is drained by a round of our own: this thread is the worker.
      while (!submissions_.try_push(batch.get())) run_round();
      batch.release();
    }
    run_round();
    return;
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    try {
      push_submission(batches[i].get());
    } catch (...) {
      // push_submission freed that batch; the ones not pushed yet go with the vector.
      batches[i].release();
      throw;
    }
    batches[i].release();
    // A long list: let the worker start on the first ones while the rest are queued.
    if ((i & 255) == 255) wake_if_sleeping();
  }
  wake_if_sleeping();
}

void ProgressWorker::push_submission(WorkBatch* raw) {
  int64_t deadline = monotonic_ns() + 5'000'000'000LL;
  while (!submissions_.try_push(raw)) {
    // Full queue: the worker is behind; back off briefly rather than spin on 2 cores.
    if (monotonic_ns() > deadline || stopping_.load()) {
      delete raw;
      throw EngineError("engine submission queue stayed full for 5 s");
    }
    wake_if_sleeping();
    usleep(50);
  }
}

void ProgressWorker::wake_if_sleeping() {
  if (sleeping_.load(std::memory_order_seq_cst)) {
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
}

void ProgressWorker::run_on_worker(std::function<void()> fn, int64_t timeout_ns) {
  if (stopping_.load()) throw EngineError("engine is closed");
  if (settings_.caller_drives_progress) {
    check_caller();
    fn();  // this thread is the owner
    return;
  }
  auto task = std::make_shared<ControlTask>();
  task->fn = std::move(fn);
  if (!controls_.try_push(task)) throw EngineError("engine control queue is full");
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
  int64_t deadline = monotonic_ns() + timeout_ns;
  while (!task->done.load(std::memory_order_acquire)) {
    if (monotonic_ns() >= deadline) throw EngineError("engine worker did not answer in time");
    futex_wait_until(&task->done, 0, std::min(deadline, monotonic_ns() + 100'000'000));
  }
  if (task->failed) throw EngineError(task->error);
}

std::vector<fi_addr_t>& ProgressWorker::peer_addresses(const EngineAddress& peer) {
  auto it = peers_.find(peer.engine_id);
  if (it != peers_.end()) return it->second;
  std::vector<fi_addr_t> addrs;
  for (size_t r = 0; r < rails_.size(); ++r) {
    const std::string& raw = peer.rail_addresses[r % peer.rail_addresses.size()];
    addrs.push_back(rails_.rail(r).insert_peer(raw));
    tcp_congestion_.watch_peer(raw, monotonic_ns());  // its connection opens with the first op
    send_corker_.add_peer(raw);
  }
  return peers_.emplace(peer.engine_id, std::move(addrs)).first->second;
}

ImmediateTracker::RailSources ProgressWorker::source_addresses(const EngineAddress& peer) {
  const auto& sends_to = peer_addresses(peer);  // our rail r <-> the peer's rail r % theirs
  const size_t ours = rails_.size(), theirs = peer.rail_addresses.size();
  ImmediateTracker::RailSources sources(ours);
  // The peer's rail s writes to our rail s % ours: with theirs <= ours (TransferEngine
  // binds only then) that is rail s, whose AV already holds the peer's rail s.
  for (size_t s = 0; s < theirs && s < ours; ++s) sources[s].push_back(sends_to[s]);
  return sources;
}

void ProgressWorker::forget_peer(uint64_t engine_id) {
  auto it = peers_.find(engine_id);
  if (it == peers_.end()) return;
  for (size_t r = 0; r < rails_.size(); ++r) rails_.rail(r).remove_peer(it->second[r]);
  peers_.erase(it);
}

std::vector<SeverResult> ProgressWorker::sever_peer_connections(const EngineAddress& peer) {
  std::vector<RailSocketAddress> ours;
  for (size_t r = 0; r < rails_.size(); ++r) ours.push_back(RailSocketAddress::from_raw(rails_.rail(r).address()));
  std::vector<SeverResult> results;
  for (const auto& raw : peer.rail_addresses)
    results.push_back(sever_tcp_connections_to(RailSocketAddress::from_raw(raw), ours));
  return results;
}

bool ProgressWorker::wait_transfer(TransferState& t, int64_t deadline_ns) {
  if (!settings_.caller_drives_progress) return t.wait_until(deadline_ns);
  if (!t.pending()) return true;
  return drive_until([&t] { return !t.pending(); }, deadline_ns);
}

bool ProgressWorker::wait_counter(CompletionCounter& counter, uint64_t n, int64_t deadline_ns) {
  if (!settings_.caller_drives_progress) return counter.wait_at_least(n, deadline_ns);
  if (counter.finished() >= n) return true;
  return drive_until([&counter, n] { return counter.finished() >= n; }, deadline_ns);
}

bool ProgressWorker::wait_imm(uint32_t imm, uint64_t count, int64_t deadline_ns) {
  if (!settings_.caller_drives_progress) return imms_.wait(imm, count, deadline_ns, stopping_);
  const auto& table = imms_.table();
  bool lost = false;
  bool reached = drive_until(
      [&] {
        if (table.get(imm) >= count) return true;
        lost = table.lost(imm);
        return lost;
      },
      deadline_ns);
  if (lost && table.get(imm) < count) imms_.throw_lost(imm, count);
  return reached;
}

int ProgressWorker::wait_imm_any(const std::vector<std::pair<uint32_t, uint64_t>>& wanted, int64_t deadline_ns,
                                 const std::vector<int>& watched) {
  if (!settings_.caller_drives_progress) return imms_.wait_any(wanted, deadline_ns, stopping_, watched);
  int found = -1;
  drive_until(
      [&] {
        if ((found = imms_.first_done(wanted)) >= 0) return true;
        if (!FdWaiters::any_closed(watched)) return false;
        found = ImmediateTracker::kWatchedFdClosed;
        return true;
      },
      deadline_ns);
  return found;
}

void ProgressWorker::expect_imm(uint32_t imm, uint64_t count, uint64_t token) {
  run_on_worker(
      [this, imm, count, token] {
        imms_.expect(imm, count, token);
        events_.flush();
      },
      5'000'000'000LL);
}

std::optional<std::string> ProgressWorker::recv(int64_t deadline_ns) {
  if (settings_.caller_drives_progress)
    drive_until([this] { return !inbox_.empty(); }, deadline_ns);
  return inbox_.take(deadline_ns, stopping_);
}

std::vector<EngineEvent> ProgressWorker::take_events() { return events_.take(); }

void ProgressWorker::finish_transfer(TransferState& t, TransferStatus status, const std::string& error) {
  if (t.status.load(std::memory_order_relaxed) != static_cast<uint32_t>(TransferStatus::kPending)) return;
  // seq_cst pairs with the waiter's notify_requested store then status load: one side
  // always sees the other, so a notification is never lost.
  t.finish(status, error);
  if (t.notify_requested.load(std::memory_order_seq_cst))
    events_.push({EventKind::kTransferDone, t.id, static_cast<uint32_t>(status)});
}

void ProgressWorker::complete_op(RailOp* op, const std::string* error, bool posted) {
  auto& st = *stats_[op->rail];
  if (error) {
    st.completion_errors.fetch_add(1, std::memory_order_relaxed);
  } else if (posted) {
    // Ops dropped unposted (their transfer had already failed) are not completions.
    st.ops_completed.fetch_add(1, std::memory_order_relaxed);
    st.bytes_completed.fetch_add(op->bytes, std::memory_order_relaxed);
  }
  retire(op->batch, 1, error);
}

void ProgressWorker::retire(WorkBatch* batch, size_t parts, const std::string* error) {
  if (error && !batch->failed) {
    batch->failed = true;
    finish_transfer(*batch->transfer, TransferStatus::kFailed, *error);
  }
  batch->ops_remaining -= parts;
  if (batch->ops_remaining > 0) return;
  if (!batch->failed) finish_transfer(*batch->transfer, TransferStatus::kDone, "");
  for (size_t r = 0; r < batch->payload_registration.size(); ++r)
    rails_.rail(r).deregister(batch->payload_registration[r]);
  deadlines_.release(batch);  // frees it
}

bool ProgressWorker::run_copies() {
  auto out = copies_.step();
  switch (out.step) {
    case SameHostCopyExecutor::Step::kIdle:
      return false;
    case SameHostCopyExecutor::Step::kProgress:
      break;
    case SameHostCopyExecutor::Step::kDropped:
    case SameHostCopyExecutor::Step::kFailed:
      // Failed or past its deadline: its immediates are never posted.
      retire(out.batch, out.batch->ops.size() + 1, out.why.empty() ? nullptr : &out.why);
      break;
    case SameHostCopyExecutor::Step::kCopied:
      // Every byte is in the peer's memory: now the immediates may tell it so.
      send_immediates(out.batch);
      retire(out.batch, 1, nullptr);
      break;
  }
  return true;
}

void ProgressWorker::send_immediates(WorkBatch* batch) {
  ImmRingLane* lane = batch->imm_ring_peer ? batch->imm_ring_peer->imm_lane() : nullptr;
  size_t rung = 0;
  for (auto& op : batch->ops) {
    if (lane && op.has_cq_data && lane->push(op.cq_data)) {
      ++rung;
      continue;
    }
    if (lane) engine_stats_.imm_ring_fallbacks.fetch_add(1, std::memory_order_relaxed);
    post_queues_[op.rail].push(&op);
  }
  if (rung == 0) return;
  lane->notify();
  engine_stats_.imm_ring_sent.fetch_add(rung, std::memory_order_relaxed);
  retire(batch, rung, nullptr);  // in the peer's memory: done, as a completed post would be
}

bool ProgressWorker::drain_imm_ring() {
  if (!imm_ring_) return false;
  const size_t n = imm_ring_->drain([this](uint64_t cq_data, uint64_t writer) { imms_.on_ring_arrival(cq_data, writer); });
  if (n == 0) return false;
  engine_stats_.imm_ring_received.fetch_add(n, std::memory_order_relaxed);
  last_ring_arrival_ns_ = monotonic_ns();
  return true;
}

void ProgressWorker::release_slot(RailOp* op) { post_queues_[op->rail].release(op); }

bool ProgressWorker::drain_submissions() {
  bool did = false;
  std::shared_ptr<ControlTask> task;
  while (controls_.try_pop(task)) {
    try {
      task->fn();
    } catch (const std::exception& e) {
      task->error = e.what();
      task->failed = true;
    }
    task->done.store(1, std::memory_order_release);
    futex_wake_all(&task->done);
    did = true;
  }
  WorkBatch* raw;
  // A bounded number per round so completions keep being read under a submission flood.
  for (int n = 0; n < 256 && submissions_.try_pop(raw); ++n) {
    did = true;
    std::unique_ptr<WorkBatch> batch(raw);
    try {
      if (batch->peer) {
        auto& addrs = peer_addresses(*batch->peer);
        for (auto& op : batch->ops) op.dest = addrs[op.rail];
      }
      if (rails_.caps().mr_local && !batch->payload.empty()) {
        for (size_t r = 0; r < rails_.size(); ++r)
          batch->payload_registration.push_back(
              rails_.rail(r).register_region(batch->payload.data(), batch->payload.size()));
        for (auto& op : batch->ops) op.desc[0] = batch->payload_registration[op.rail].local_desc;
      }
    } catch (const std::exception& e) {
      finish_transfer(*batch->transfer, TransferStatus::kFailed,
                      std::string("cannot reach peer: ") + e.what());
      continue;
    }
    WorkBatch* accepted = deadlines_.track(std::move(batch), monotonic_ns());
    if (accepted->copy)
      copies_.enqueue(accepted);
    else if (accepted->imm_ring_peer)
      send_immediates(accepted);  // the immediates of a write copied inline
    else
      for (auto& op : accepted->ops) post_queues_[op.rail].push(&op);
  }
  return did;
}

namespace {

// The fields fi_msg and fi_msg_rma share, from the op.
template <class Msg>
Msg message_of(RailOp* op) {
  Msg msg = {};
  msg.msg_iov = op->iov;
  msg.desc = op->desc;
  msg.iov_count = op->iov_count;
  msg.addr = op->dest;
  msg.context = op;
  msg.data = op->cq_data;
  return msg;
}

// Posts one op on its rail: a write (with its immediate, if any) or a message.
ssize_t post_op(FabricRail& rail, RailOp* op) {
  uint64_t flags = FI_COMPLETION;
  if (op->has_cq_data) flags |= FI_REMOTE_CQ_DATA;
  if (op->delivery_complete) flags |= FI_DELIVERY_COMPLETE;
  if (op->kind != OpKind::kWrite) return rail.post_send(message_of<struct fi_msg>(op), flags);
  auto msg = message_of<struct fi_msg_rma>(op);
  msg.rma_iov = op->rma;
  msg.rma_iov_count = op->iov_count;
  return rail.post_write(msg, flags);
}

}  // namespace

bool ProgressWorker::post_pending(size_t r) {
  auto& rail = rails_.rail(r);
  auto& st = *stats_[r];
  CorkedBurst burst(send_corker_, post_queues_[r].queued() >= 2);  // the ops leave together
  return post_queues_[r].post_ready(
      [&](RailOp* op) {
        ssize_t rc = post_op(rail, op);
        if (rc == 0) {
          st.ops_posted.fetch_add(1, std::memory_order_relaxed);
          st.bytes_posted.fetch_add(op->bytes, std::memory_order_relaxed);
        }
        return rc;
      },
      // Unposted ops of a failed transfer are not completions; a post error is one.
      [&](RailOp* op, const std::string* why) { complete_op(op, why, /*posted=*/why != nullptr); });
}

bool ProgressWorker::poll_rail(size_t r) {
  auto& rail = rails_.rail(r);
  struct fi_cq_data_entry entries[kCqBatch];
  bool did = false;
  // The acknowledgements the provider sends while it makes progress here leave together
  // while writes arrive in bursts (a poll read two or more completions within the last
  // kCorkPollsAfterBurstNs); a lone write's acknowledgement pays no setsockopt.
  const int64_t now = send_corker_.idle() ? 0 : monotonic_ns();
  CorkedBurst burst(send_corker_, now - last_burst_ns_[r] < kCorkPollsAfterBurstNs);
  size_t entries_read = 0;
  for (;;) {
    ssize_t n = rail.read_completions(entries, kCqBatch);
    if (n == -FI_EAVAIL) {
      struct fi_cq_err_entry err;
      std::string why;
      if (!rail.read_error(&err, &why)) break;
      did = true;
      if (recv_slots_.owns(err.op_context)) {
        if (!stopping_.load()) recv_slots_.repost(err.op_context);
      } else if (err.flags & (FI_RECV | FI_REMOTE_WRITE)) {
        stats_[r]->completion_errors.fetch_add(1, std::memory_order_relaxed);  // not ours to complete
      } else if (err.op_context && tag_of(err.op_context) == ContextTag::kRailOp) {
        auto* op = static_cast<RailOp*>(err.op_context);
        release_slot(op);
        complete_op(op, &why);
      }
      continue;
    }
    if (n <= 0) break;
    did = true;
    entries_read += static_cast<size_t>(n);
    for (ssize_t i = 0; i < n; ++i) {
      auto& e = entries[i];
      if (e.flags & (FI_RECV | FI_REMOTE_WRITE)) {
        if (e.flags & FI_REMOTE_CQ_DATA) {
          imms_.on_arrival(e.data, r, rail.source(i));
          if ((e.data >> 32) != kTrafficOnlyWeight)
            stats_[r]->imm_received.fetch_add(1, std::memory_order_relaxed);
        } else if (recv_slots_.owns(e.op_context)) {
          inbox_.offer(recv_slots_.message(e.op_context), e.len);
        }
        if (recv_slots_.owns(e.op_context)) recv_slots_.repost(e.op_context);
      } else if (e.op_context) {
        auto* op = static_cast<RailOp*>(e.op_context);
        release_slot(op);
        complete_op(op, nullptr);
      }
    }
    if (static_cast<size_t>(n) < kCqBatch) break;
  }
  if (entries_read >= 2) last_burst_ns_[r] = now;
  return did;
}

void ProgressWorker::on_expired(WorkBatch* batch) {
  if (!batch->failed) {
    batch->failed = true;
    finish_transfer(*batch->transfer, TransferStatus::kTimedOut,
                    "transfer did not complete within " + std::to_string(deadlines_.timeout_ns() / 1000000) +
                        " ms (peer dead or unreachable?)");
  }
  // Its posted ops may still complete; the tracker keeps the batch alive until they do.
  // Their inflight slots go back now: ops to a dead peer may never complete, and holding
  // their slots would stall every other peer on the rail once a dead peer had used up the
  // budget.
  for (auto& op : batch->ops) release_slot(&op);
}

int ProgressWorker::wait_for_fds(int64_t timeout_ns) {
  struct epoll_event evs[8];
  int n = -1;
  if (!epoll_pwait2_refused_) {
    struct timespec timeout = {static_cast<time_t>(timeout_ns / 1'000'000'000),
                               static_cast<long>(timeout_ns % 1'000'000'000)};
    n = epoll_pwait2(epoll_fd_, evs, 8, &timeout, nullptr);
    // Kernels before 5.11 have none (ENOSYS); container seccomp profiles older than it refuse
    // it (EPERM). Either way, for good: a failing call per sleep would spin the worker.
    if (n < 0 && (errno == ENOSYS || errno == EPERM)) epoll_pwait2_refused_ = true;
  }
  if (epoll_pwait2_refused_) {
    // Milliseconds, rounded up, or a plain pause below one.
    const int timeout_ms = static_cast<int>((timeout_ns + 999'999) / 1'000'000);
    if (timeout_ns >= 1'000'000) {
      n = epoll_wait(epoll_fd_, evs, 8, timeout_ms);
    } else {
      usleep(static_cast<useconds_t>(timeout_ns / 1000));
      n = 0;
    }
  }
  engine_stats_.worker_wakeups.fetch_add(1, std::memory_order_relaxed);
  woken_by_submitter_ = false;
  for (int i = 0; i < n; ++i) {
    const int fd = evs[i].data.fd;
    if (fd == wake_fd_ || (imm_ring_ && fd == imm_ring_->event_fd())) {
      uint64_t v;
      ssize_t ignored = read(fd, &v, sizeof v);
      (void)ignored;
      woken_by_submitter_ = true;  // real work: no nap
    }
  }
  return n;
}

void ProgressWorker::sleep_until_work(int64_t wake_by_ns) {
  sleeping_.store(1, std::memory_order_seq_cst);
  sleep_policy::Idle idle;
  idle.work_waiting = !(submissions_.empty() && controls_.empty() && copies_.empty());
  for (const auto& queue : post_queues_)
    if (!queue.empty()) idle.ops_queued = true;
  idle.transfers_live = !deadlines_.empty();
  idle.now_ns = monotonic_ns();
  idle.last_activity_ns = last_activity_ns_;
  idle.last_ring_arrival_ns = last_ring_arrival_ns_;
  idle.wake_by_ns = wake_by_ns;
  idle.ops_in_flight = ops_in_flight();
  idle.last_long_gap_ns = last_long_gap_ns_;
  int timeout_ms = sleep_policy::block_timeout_ms(idle);
  const bool only_look = timeout_ms == 0;  // the policy's word, not a CQ with entries to read
  if (imm_ring_) {
    // Flag first, then look: a writer publishes, then reads the flag (ImmRingLane::notify).
    imm_ring_->set_sleeping(true);
    if (imm_ring_->pending()) timeout_ms = -1;
  }
  if (timeout_ms >= 0) {
    if (all_rails_have_wait_fd_) {
      for (size_t r = 0; r < rails_.size(); ++r)
        if (!rails_.rail(r).try_wait()) timeout_ms = 0;
      if (timeout_ms > 0) {
        // The last fd wake-up was spurious if no round has done anything since.
        const bool last_wake_was_spurious = last_fd_wake_ns_ > last_activity_ns_;
        int n = wait_for_fds(timeout_ms * 1'000'000LL);
        if (n > 0 && !woken_by_submitter_) {
          const int64_t now = monotonic_ns();
          last_fd_wake_ns_ = now;
          useconds_t nap = sleep_policy::nap_after_wake_us(now, last_activity_ns_, ops_in_flight(), last_wake_was_spurious);
          if (nap > 0) usleep(nap);
        }
      } else if (only_look) {
        sched_yield();  // a thread waiting for this core gets it first
      }
    } else {
      // A rail the fds cannot speak for (shm): look at it again after a pause, which
      // submitters and same-host immediates still cut short through the fds.
      useconds_t pause = sleep_policy::pause_without_wait_fd_us(monotonic_ns(), last_activity_ns_, timeout_ms);
      wait_for_fds(static_cast<int64_t>(pause) * 1000);
    }
  }
  if (imm_ring_) imm_ring_->set_sleeping(false);
  sleeping_.store(0, std::memory_order_seq_cst);
}

size_t ProgressWorker::ops_in_flight() const {
  size_t n = 0;
  for (const auto& queue : post_queues_) n += queue.inflight();
  return n;
}

void ProgressWorker::fail_everything(const std::string& why) {
  deadlines_.for_each([&](WorkBatch* b) {
    if (!b->failed) {
      b->failed = true;
      finish_transfer(*b->transfer, TransferStatus::kFailed, why);
    }
  });
  WorkBatch* raw;
  while (submissions_.try_pop(raw)) {
    finish_transfer(*raw->transfer, TransferStatus::kFailed, why);
    delete raw;
  }
  std::shared_ptr<ControlTask> task;
  while (controls_.try_pop(task)) {
    task->error = why;
    task->failed = true;
    task->done.store(1);
    futex_wake_all(&task->done);
  }
  events_.flush();
}

bool ProgressWorker::run_round() {
  // Whether this round may end a wait for new work (nothing of ours in flight), rather
  // than a wait for our own ops' completions.
  const bool awaiting_new_work = ops_in_flight() == 0;
  bool did = drain_submissions();
  recv_slots_.retry_refused();
  for (size_t r = 0; r < rails_.size(); ++r) {
    did |= poll_rail(r);
    did |= post_pending(r);
  }
  did |= run_copies();
  did |= drain_imm_ring();
  imms_.after_round();
  if (events_.pending()) events_.flush();
  int64_t now = monotonic_ns();
  deadlines_.expire_due(now, [this](WorkBatch* batch) { on_expired(batch); });
  tcp_congestion_.poll(now);
  if (did) {
    send_corker_.maybe_rescan(now);  // connections opened or closed since the last look
    // An idle spell past the spin, spent waiting for new work, tells how far apart this
    // conversation's requests come (sleep_policy::Idle::last_long_gap_ns); the short ones
    // inside a burst, and the waits for our own completions, do not.
    if (awaiting_new_work && now - last_activity_ns_ > settings_.idle_spin_ns)
      last_long_gap_ns_ = now - last_activity_ns_;
    last_activity_ns_ = now;
  }
  return did;
}

void ProgressWorker::idle(int64_t idle_since, int64_t wake_by_ns) {
  // Yield while the idle spell is young (the next completion is likely microseconds
  // away, and a thread sharing this core gets it meanwhile), then sleep.
  if (monotonic_ns() - idle_since >= settings_.idle_spin_ns)
    sleep_until_work(wake_by_ns);
  else
    sched_yield();
}

void ProgressWorker::loop() {
  // Timer slack of 1 us for this thread: its sleep_policy::kBusyNapUs naps would otherwise last the
  // default 50 us slack longer (3.5x the nap). A/B on an idle machine, net, random pages:
  // 4 KiB +25-35% pages/s, 16 KiB within noise.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  // Named so that top -H, perf and /proc show which thread moves the engine's bytes.
  prctl(PR_SET_NAME, "kvxfer-progress", 0, 0, 0);
  int64_t idle_since = 0;
  while (!stopping_.load(std::memory_order_relaxed)) {
    if (run_round()) {
      idle_since = 0;
      continue;
    }
    if (idle_since == 0) idle_since = monotonic_ns();
    idle(idle_since, INT64_MAX);
  }
  shut_down();
}

bool ProgressWorker::drive_until(const std::function<bool()>& done, int64_t deadline_ns) {
  check_caller();
  int64_t idle_since = 0;
  for (;;) {
    bool did = run_round();
    if (done()) return true;
    if (stopping_.load(std::memory_order_relaxed)) return false;
    if (monotonic_ns() >= deadline_ns) return false;
    if (did) {
      idle_since = 0;
      continue;
    }
    if (idle_since == 0) idle_since = monotonic_ns();
    idle(idle_since, deadline_ns);
  }
}

void ProgressWorker::check_caller() const {
  if (settings_.caller_drives_progress && std::this_thread::get_id() != owner_)
    throw EngineError(
        "this engine's progress is driven by the thread that created it (progress=\"caller\"); "
        "use progress=\"thread\" to share an engine between threads");
}

void ProgressWorker::shut_down() {
  fail_everything("engine closed");
  // Wake everyone blocked on an immediate or a message so they see the close.
  imms_.wake_all();
  inbox_.wake_all();
}

}  // namespace kvxfer
