// One rail's post queue (rail_post_queue.hpp), with a scripted post function in place of
// libfabric: the inflight budget, each peer's order, a full peer stepped over, ops of
// failed transfers dropped unposted, post errors reported.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "rail_post_queue.hpp"

namespace kvxfer {
namespace {

// Ops to peers, each in a batch of its own (so one can fail alone).
struct Ops {
  std::vector<WorkBatch> batches;
  std::vector<RailOp> ops;
  explicit Ops(const std::vector<fi_addr_t>& dests) : batches(dests.size()), ops(dests.size()) {
    for (size_t i = 0; i < dests.size(); ++i) {
      ops[i].dest = dests[i];
      ops[i].batch = &batches[i];
      ops[i].cq_data = i;  // the op's name in the tests
    }
  }
  // A queue with a budget of `slots`, holding every op in order.
  RailPostQueue queued(size_t slots) {
    RailPostQueue queue(slots);
    for (auto& op : ops) queue.push(&op);
    return queue;
  }
};

// Posts ops, answering EAGAIN for peers in `full` and an error for peers in `broken`.
struct ScriptedRail {
  std::map<fi_addr_t, bool> full;
  std::map<fi_addr_t, bool> broken;
  std::vector<uint64_t> posted;
  ssize_t operator()(RailOp* op) {
    if (full.count(op->dest)) return -FI_EAGAIN;
    if (broken.count(op->dest)) return -FI_EIO;
    posted.push_back(op->cq_data);
    return 0;
  }
};

struct Unposted {
  std::vector<uint64_t> dropped;
  std::vector<std::string> errors;
  void operator()(RailOp* op, const std::string* why) {
    if (why)
      errors.push_back(*why);
    else
      dropped.push_back(op->cq_data);
  }
};

TEST(RailPostQueue, PostsInOrderWithinTheBudgetAndAReleaseLetsTheNextGo) {
  Ops ops({1, 1, 1, 1});
  RailPostQueue queue = ops.queued(2);
  ScriptedRail rail;
  Unposted unposted;
  EXPECT_TRUE(queue.post_ready(std::ref(rail), std::ref(unposted)));
  EXPECT_EQ(rail.posted, (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(queue.inflight(), 2u);
  EXPECT_EQ(queue.queued(), 2u);
  EXPECT_FALSE(queue.post_ready(std::ref(rail), std::ref(unposted)));  // the budget is spent
  queue.release(&ops.ops[0]);
  queue.release(&ops.ops[0]);  // idempotent: one slot per op
  EXPECT_EQ(queue.inflight(), 1u);
  EXPECT_TRUE(queue.post_ready(std::ref(rail), std::ref(unposted)));
  EXPECT_EQ(rail.posted, (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_TRUE(unposted.dropped.empty() && unposted.errors.empty());
}

TEST(RailPostQueue, AFullPeerIsSteppedOverAndKeepsItsOrder) {
  // Peer 7 stopped reading: its ops stay queued, in order; peer 8's behind them go now.
  Ops ops({7, 8, 7, 8});
  RailPostQueue queue = ops.queued(16);
  ScriptedRail rail;
  rail.full[7] = true;
  Unposted unposted;
  EXPECT_TRUE(queue.post_ready(std::ref(rail), std::ref(unposted)));
  EXPECT_EQ(rail.posted, (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(queue.queued(), 2u);
  rail.full.clear();  // it reads again
  EXPECT_TRUE(queue.post_ready(std::ref(rail), std::ref(unposted)));
  EXPECT_EQ(rail.posted, (std::vector<uint64_t>{1, 3, 0, 2}));
  EXPECT_TRUE(queue.empty());
}

TEST(RailPostQueue, AStuckPeerCostsABoundedScanPerPass) {
  // A long queue to a full peer, then one op to a live peer: the pass steps over at most
  // kMaxSkippedPerPass ops, so the live op waits (a bounded cost per turn, not a stall
  // that grows with the stuck peer's backlog); once the stuck ops expire, it goes.
  std::vector<fi_addr_t> dests(RailPostQueue::kMaxSkippedPerPass + 2, 7);
  dests.push_back(8);
  Ops ops(dests);
  RailPostQueue queue = ops.queued(1024);
  ScriptedRail rail;
  rail.full[7] = true;
  Unposted unposted;
  queue.post_ready(std::ref(rail), std::ref(unposted));
  EXPECT_TRUE(rail.posted.empty());
  for (size_t i = 0; i + 1 < ops.ops.size(); ++i) ops.batches[i].failed = true;  // expired
  EXPECT_TRUE(queue.post_ready(std::ref(rail), std::ref(unposted)));
  EXPECT_EQ(rail.posted, (std::vector<uint64_t>{dests.size() - 1}));
  EXPECT_EQ(unposted.dropped.size(), dests.size() - 1);
}

TEST(RailPostQueue, OpsOfAFailedTransferLeaveUnpostedAndPostErrorsAreReported) {
  Ops ops({1, 2, 3});
  ops.batches[0].failed = true;
  RailPostQueue queue = ops.queued(8);
  ScriptedRail rail;
  rail.broken[2] = true;
  Unposted unposted;
  EXPECT_TRUE(queue.post_ready(std::ref(rail), std::ref(unposted)));
  EXPECT_EQ(unposted.dropped, (std::vector<uint64_t>{0}));
  ASSERT_EQ(unposted.errors.size(), 1u);
  EXPECT_NE(unposted.errors[0].find("posting failed"), std::string::npos);
  EXPECT_EQ(rail.posted, (std::vector<uint64_t>{2}));
  EXPECT_EQ(queue.inflight(), 1u);  // neither the dropped nor the failed op holds a slot
  EXPECT_FALSE(ops.ops[0].holds_slot || ops.ops[1].holds_slot);
  EXPECT_TRUE(queue.empty());
}

TEST(RailPostQueue, ManyFullPeersEndThePass) {
  // More full peers than a pass remembers: it stops rather than scan on (the ops behind
  // go on a later pass, once completions were read).
  std::vector<fi_addr_t> dests;
  for (fi_addr_t p = 0; p <= RailPostQueue::kMaxBlockedPeers; ++p) dests.push_back(100 + p);
  dests.push_back(1);
  Ops ops(dests);
  RailPostQueue queue = ops.queued(64);
  ScriptedRail rail;
  for (fi_addr_t p = 0; p <= RailPostQueue::kMaxBlockedPeers; ++p) rail.full[100 + p] = true;
  Unposted unposted;
  queue.post_ready(std::ref(rail), std::ref(unposted));
  EXPECT_TRUE(rail.posted.empty());
  EXPECT_EQ(queue.queued(), dests.size());
}

}  // namespace
}  // namespace kvxfer
