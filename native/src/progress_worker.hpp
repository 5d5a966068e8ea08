// The progress worker: one thread that owns a rail group's domains and completion queues.
// Submitting threads plan a WorkBatch and push it through a lock-free queue; the worker
// resolves peers, hands ops to the rails' post queues and reads completions. Nothing else
// touches libfabric. The rest lives in its own pieces, each owning its state and driven by
// this thread: posting within each rail's inflight budget (rail_post_queue.hpp), deadlines
// and the batches they guard (deadline_tracker.hpp), same-host copies
// (same_host_copy_executor.hpp), immediates and their waiters (immediate_tracker.hpp),
// immediates from same-host peers (same_host_imm_ring.hpp),
// events for asyncio (worker_events.hpp), control-message receive buffers
// (control_recv_slots.hpp) and received messages (control_inbox.hpp), when to sleep
// (sleep_policy.hpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bounded_queue.hpp"
#include "connection_sever.hpp"
#include "engine_types.hpp"
#include "control_inbox.hpp"
#include "control_recv_slots.hpp"
#include "deadline_tracker.hpp"
#include "imm_counter.hpp"
#include "immediate_tracker.hpp"
#include "rail_group.hpp"
#include "rail_post_queue.hpp"
#include "rail_stats.hpp"
#include "same_host_copy_executor.hpp"
#include "send_corking.hpp"
#include "tcp_congestion.hpp"
#include "worker_events.hpp"

namespace kvxfer {

struct ProgressWorkerSettings {
  // Ops in flight per rail: deep enough to keep a TCP stream busy with 16 KiB pages,
  // shallow enough to stay far below the provider's queue and CQ sizes.
  size_t max_inflight_per_rail = 256;
  // How long an idle worker with ops in flight keeps polling before it blocks on its fds
  // (their completions wake it). Short, because this machine class has 2 cores shared by
  // both peers and the Python threads. With nothing in flight it looks until the engine
  // went quiet (sleep_policy::block_timeout_ms).
  int64_t idle_spin_ns = 30'000;
  // A transfer that has not completed by then fails with a timeout (dead or stuck peer).
  int64_t transfer_timeout_ns = 30'000'000'000LL;
  size_t recv_slots_per_rail = 64;
  size_t recv_slot_bytes = 64 * 1024;
  // Slots of the immediate table (a power of two; 16 bytes each: 1 MiB at the default):
  // distinct values counted in the engine's life, or with count_claimed_imms_only the
  // values claimed at one time (see imm_counter.hpp).
  size_t imm_table_capacity = 1 << 16;
  // Count only immediates someone claimed (claim_imm) and drop the rest, for a receiver
  // that knows every value it expects (a decoder: its live reservations). Then no sender,
  // however many values it sprays, can take a slot a reservation needs.
  bool count_claimed_imms_only = false;
  // Received control messages nobody has read yet are held up to both bounds; beyond
  // either, a message is dropped and counted (inbox_dropped_*): a peer that sends and an
  // application that never calls recv must not grow this process without end (64 KiB
  // messages held 256 MiB after 6,000 sends when only the 4096-entry queue bounded it).
  size_t inbox_max_messages = 1024;
  size_t inbox_max_bytes = 16ull << 20;
  // No progress thread: the thread that creates the engine owns its domains and makes
  // progress inside its own calls (submit, waits, recv). Saves the two thread hand-offs
  // of every transfer, which on a small machine are most of a 4 KiB write's latency; the
  // price is that only that thread may use the engine, and nothing moves between calls
  // (no asyncio events, and a passive target must call in to acknowledge writes).
  bool caller_drives_progress = false;
  // TCP congestion control of the connections a socket provider (tcp, net) opens for the
  // rails (tcp_congestion.hpp: under BBR without fq, the engine's connections ran at
  // 0.4x of cubic's speed): names in order of preference, the first the kernel allows
  // wins (reno where an unprivileged process may not set cubic). Empty: the system's choice.
  std::string tcp_congestion = "cubic,reno";
  // TCP_CORK on the rails' connections around each burst of sends (send_corking.hpp): a
  // stream of 4 KiB writes took 2.1 TCP segments per write uncorked, 0.22 corked.
  bool cork_sends = true;
};

class ProgressWorker {
 public:
  // `imm_ring`: where same-host peers leave immediates for this engine (null: nowhere);
  // it must outlive the worker.
  ProgressWorker(RailGroup& rails, ProgressWorkerSettings settings, ImmRingBoard* imm_ring = nullptr);
  ~ProgressWorker();

  // Hands a planned batch to the worker. Throws if the worker is stopped.
  void submit(std::unique_ptr<WorkBatch> batch);
  // Hands many planned batches to the worker, waking it once (submit_many's path).
  void submit_all(std::vector<std::unique_ptr<WorkBatch>>& batches);
  // Runs fn on the worker thread (registration, peers) and waits for it, rethrowing.
  void run_on_worker(std::function<void()> fn, int64_t timeout_ns);

  const ImmCounterTable& imm_counters() const { return imms_.table(); }
  const EngineStats& engine_stats() const { return engine_stats_; }
  void consume_imm(uint32_t imm, uint64_t units) { imms_.table().consume(imm, units); }
  void reset_imm(uint32_t imm) { imms_.table().reset(imm); }
  // Worker thread only (run_on_worker): see ImmediateTracker::bind_source.
  void bind_imm_source(uint32_t imm, ImmediateTracker::RailSources sources, uint64_t engine_id) {
    imms_.bind_source(imm, std::move(sources), engine_id);
  }
  // Worker only: per rail of ours, the AV addresses of the peer's rails that write to it.
  // The peer's rail s writes to our rail s % (our rail count) (RailGroup::remote_rail): with
  // no more rails than ours, rail s hears the peer's rail s and our other rails none.
  ImmediateTracker::RailSources source_addresses(const EngineAddress& peer);
  void unbind_imm_source(uint32_t imm) { imms_.unbind_source(imm); }
  uint64_t imm_foreign_dropped() const { return imms_.foreign_dropped(); }
  // Worker thread only (run_on_worker): see ImmediateTracker::claim and release.
  bool claim_imm(uint32_t imm) { return imms_.claim(imm); }
  void release_imm(uint32_t imm) { imms_.release(imm); }
  uint64_t imm_unclaimed_dropped() const { return imms_.unclaimed_dropped(); }
  bool counts_claimed_imms_only() const { return imms_.claimed_only(); }
  // Waits for a transfer: on its status word, or by making progress where the caller drives.
  bool wait_transfer(TransferState& t, int64_t deadline_ns);
  // Waits until at least n transfers of the counter finished, the same two ways.
  bool wait_counter(CompletionCounter& counter, uint64_t n, int64_t deadline_ns);
  // True once count units of imm arrived, false at the deadline; throws
  // ImmCounterOverflow when imm cannot be counted (ImmCounterTable::lost).
  bool wait_imm(uint32_t imm, uint64_t count, int64_t deadline_ns);
  // The index of the first (immediate, count) of `wanted` that is reached (or whose
  // arrivals are being dropped), -1 at the deadline, ImmediateTracker::kWatchedFdClosed once
  // one of `watched` reports its peer's close: ImmediateTracker::wait_any, the two ways.
  int wait_imm_any(const std::vector<std::pair<uint32_t, uint64_t>>& wanted, int64_t deadline_ns,
                   const std::vector<int>& watched = {});
  // Throws EngineError if progress is caller-driven and this is not the owner thread.
  void check_caller() const;
  void expect_imm(uint32_t imm, uint64_t count, uint64_t token);

  std::optional<std::string> recv(int64_t deadline_ns);

  int event_fd() const { return events_.fd(); }
  std::vector<EngineEvent> take_events();

  const std::vector<std::unique_ptr<RailStats>>& stats() const { return stats_; }
  const RailStats& same_host_stats() const { return copies_.stats(); }
  // Sockets of the rails' connections switched to settings.tcp_congestion, and refused.
  const TcpCongestionSetter& tcp_congestion() const { return tcp_congestion_; }
  // The connections corked around bursts of sends (found at the last look).
  const SendCorker& send_corker() const { return send_corker_; }
  // Copies all of a same-host write on the calling thread. Safe from any thread: it
  // touches only the copy and atomic counters. Returns "" or why it failed.
  std::string copy_inline(SameHostCopy& copy) { return copies_.copy_inline(copy); }
  void stop();

  // Worker-thread-only peer table, used from run_on_worker tasks too.
  std::vector<fi_addr_t>& peer_addresses(const EngineAddress& peer);
  void forget_peer(uint64_t engine_id);
  // Worker only (run_on_worker), so that no read of the provider is under way: severs this
  // process's TCP connections to each of the peer's rail addresses (connection_sever.hpp),
  // one result per rail of the peer.
  std::vector<SeverResult> sever_peer_connections(const EngineAddress& peer);

 private:
  struct ControlTask {
    std::function<void()> fn;
    std::atomic<uint32_t> done{0};
    std::string error;
    bool failed = false;
  };

  void loop();
  // One pass over submissions, completions, posts, copies, events and deadlines; true if
  // anything happened.
  bool run_round();
  // What a round that did nothing is followed by: a yield, or a sleep of at most until
  // wake_by_ns once the idle spell is older than idle_spin_ns.
  void idle(int64_t idle_since, int64_t wake_by_ns);
  // Blocks on the worker's fds (submitters, the same-host ring, the rails' sleep fds) for at
  // most timeout_ns; returns how many were ready and sets woken_by_submitter_ when the
  // wake fd or the ring's was one of them (draining it). Counts a worker wake-up.
  int wait_for_fds(int64_t timeout_ns);
  // Pushes one batch, backing off while the queue is full (thread-driven progress).
  void push_submission(WorkBatch* raw);
  void wake_if_sleeping();
  // Caller-driven progress: rounds until done() or the deadline.
  bool drive_until(const std::function<bool()>& done, int64_t deadline_ns);
  void shut_down();
  bool drain_submissions();
  bool post_pending(size_t rail);
  bool poll_rail(size_t rail);
  void complete_op(RailOp* op, const std::string* error, bool posted = true);
  // Finishes `parts` parts of a batch (failing it with `error` if given); the last one
  // completes the transfer and frees the batch.
  void retire(WorkBatch* batch, size_t parts, const std::string* error);
  // Copies one slice of the oldest same-host write; true if there was one.
  bool run_copies();
  // Sends a same-host write's immediates once its bytes landed: through the peer's
  // immediate ring where it has room, else posted on their rails.
  void send_immediates(WorkBatch* batch);
  // Counts what same-host peers left in our immediate ring; true if anything.
  bool drain_imm_ring();
  void release_slot(RailOp* op);
  void finish_transfer(TransferState& t, TransferStatus status, const std::string& error);
  // Fails a batch whose deadline passed and gives back its ops' inflight slots.
  void on_expired(WorkBatch* batch);
  void sleep_until_work(int64_t wake_by_ns);
  size_t ops_in_flight() const;  // posted, not yet completed, over all rails
  void fail_everything(const std::string& why);

  RailGroup& rails_;
  ProgressWorkerSettings settings_;
  EngineStats engine_stats_;
  EventQueue events_;
  ControlInbox inbox_;
  ImmediateTracker imms_;

  BoundedQueue<WorkBatch*> submissions_{4096};
  BoundedQueue<std::shared_ptr<ControlTask>> controls_{256};

  // Worker-only state.
  std::vector<RailPostQueue> post_queues_;  // one per rail
  SameHostCopyExecutor copies_;
  DeadlineTracker deadlines_;  // owns every accepted batch until it finished
  std::unordered_map<uint64_t, std::vector<fi_addr_t>> peers_;
  std::vector<std::unique_ptr<RailStats>> stats_;
  ControlRecvSlots recv_slots_;  // posted at construction, read once the worker runs
  ImmRingBoard* imm_ring_;        // not owned; null without the same-host path
  TcpCongestionSetter tcp_congestion_;
  SendCorker send_corker_;
  // Per rail: when a poll last read two or more completions (a burst arriving). Polls are
  // corked for kCorkPollsAfterBurstNs after it.
  static constexpr int64_t kCorkPollsAfterBurstNs = 2'000'000;
  std::vector<int64_t> last_burst_ns_;

  std::atomic<uint32_t> sleeping_{0};
  std::atomic<bool> stopping_{false};
  int wake_fd_ = -1;   // eventfd: submitters wake the sleeping worker
  int epoll_fd_ = -1;
  bool all_rails_have_wait_fd_ = true;
  bool woken_by_submitter_ = false;  // the last wait_for_fds: a submitter or the ring woke us
  int64_t last_fd_wake_ns_ = 0;      // the last time a rail's fd (not a submitter) woke us
  bool epoll_pwait2_refused_ = false;  // the kernel or a seccomp profile refused epoll_pwait2
  int64_t last_activity_ns_ = 0;  // worker only: last round that did something
  int64_t last_long_gap_ns_ = 0;  // worker only: see sleep_policy::Idle::last_long_gap_ns
  int64_t last_ring_arrival_ns_ = 0;  // worker only: last round that drained the immediate ring
  std::thread::id owner_;  // the thread that may drive progress when the caller drives it
  std::thread thread_;
};

}  // namespace kvxfer
