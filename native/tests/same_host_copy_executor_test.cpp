// The same-host copy executor (same_host_copy_executor.hpp): runs queued same-host writes
// in submission order, one slice (at most SameHostCopy::kSliceBytes) per step, counts what
// it copied, drops writes whose transfer already failed, and reports a slice that cannot
// be done. The peer is this very process, reached the way a same-host peer is (its region
// table, process_vm_writev), so every byte really moves.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "same_host_copy_executor.hpp"

namespace kvxfer {
namespace {

constexpr uint64_t MiB = 1024 * 1024;

class SameHostCopies : public ::testing::Test {
 protected:
  void SetUp() override {
    src_.resize(12 * MiB);
    dst_.assign(12 * MiB, 0);
    for (size_t i = 0; i < src_.size(); ++i) src_[i] = static_cast<char>(i * 7 + 3);
    local_.id = 1;
    local_.addr = reinterpret_cast<uintptr_t>(src_.data());
    local_.length = src_.size();
    target_.id = 2;
    target_.addr = reinterpret_cast<uintptr_t>(dst_.data());
    target_.length = dst_.size();
    table_.publish(target_);
    EngineAddress self;
    self.engine_id = kEngineId;
    self.same_host = local_same_host_identity(table_.address(), table_.fd());
    ASSERT_FALSE(self.same_host.host_key.empty()) << "needs /proc";
    peer_ = SameHostPeer::open(self, self.same_host, kEngineId + 1, /*imm_ring=*/false);
    ASSERT_TRUE(peer_) << "this process may write into itself";
    remote_.owner = self;
    remote_.region_id = target_.id;
    remote_.addr = target_.addr;
    remote_.length = target_.length;
  }

  std::unique_ptr<WorkBatch> write(uint64_t src, uint64_t dst, uint64_t len) {
    auto b = std::make_unique<WorkBatch>();
    b->transfer = std::make_shared<TransferState>();
    b->copy = plan_same_host(peer_, nullptr, local_, remote_, {SingleWrite{src, dst, len}, std::nullopt});
    return b;
  }
  bool landed(uint64_t src, uint64_t dst, uint64_t len) const {
    return std::memcmp(src_.data() + src, dst_.data() + dst, len) == 0;
  }

  static constexpr uint64_t kEngineId = 0x5eed;
  std::vector<char> src_, dst_;
  MemoryRegion local_, target_;
  RegionTable table_{kEngineId};
  SameHostPeerPtr peer_;
  MemoryDescriptor remote_;
  SameHostCopyExecutor exec_;
};

TEST_F(SameHostCopies, IdleWithNothingQueued) {
  EXPECT_EQ(exec_.step().step, SameHostCopyExecutor::Step::kIdle);
}

TEST_F(SameHostCopies, CopiesALargeWriteOneSliceAStepAndCountsIt) {
  auto b = write(0, 0, 10 * MiB);  // 4 + 4 + 2 MiB slices
  exec_.enqueue(b.get());
  EXPECT_EQ(exec_.step().step, SameHostCopyExecutor::Step::kProgress);
  EXPECT_TRUE(landed(0, 0, 4 * MiB));
  EXPECT_EQ(dst_[4 * MiB], 0) << "one slice per step";
  EXPECT_EQ(exec_.step().step, SameHostCopyExecutor::Step::kProgress);
  auto last = exec_.step();
  EXPECT_EQ(last.step, SameHostCopyExecutor::Step::kCopied);
  EXPECT_EQ(last.batch, b.get());
  EXPECT_TRUE(landed(0, 0, 10 * MiB));
  EXPECT_TRUE(exec_.empty());
  EXPECT_EQ(exec_.stats().bytes_completed.load(), 10 * MiB);
  EXPECT_EQ(exec_.stats().ops_completed.load(), 3u);
}

TEST_F(SameHostCopies, RunsWritesInSubmissionOrder) {
  auto first = write(0, 0, 1 * MiB), second = write(1 * MiB, 5 * MiB, 1 * MiB);
  exec_.enqueue(first.get());
  exec_.enqueue(second.get());
  EXPECT_EQ(exec_.step().batch, first.get());
  EXPECT_FALSE(landed(1 * MiB, 5 * MiB, 1 * MiB));
  EXPECT_EQ(exec_.step().batch, second.get());
  EXPECT_TRUE(landed(1 * MiB, 5 * MiB, 1 * MiB));
}

TEST_F(SameHostCopies, DropsAWriteWhoseTransferAlreadyFailedWithoutCopying) {
  auto b = write(0, 0, 1 * MiB);
  b->failed = true;
  exec_.enqueue(b.get());
  auto out = exec_.step();
  EXPECT_EQ(out.step, SameHostCopyExecutor::Step::kDropped);
  EXPECT_EQ(dst_[1], 0);
  EXPECT_EQ(exec_.stats().bytes_completed.load(), 0u);
  EXPECT_TRUE(exec_.empty());
}

TEST_F(SameHostCopies, AWithdrawnRegionFailsTheWriteWithTheReason) {
  auto b = write(0, 0, 1 * MiB);
  exec_.enqueue(b.get());
  table_.withdraw(target_);
  auto out = exec_.step();
  EXPECT_EQ(out.step, SameHostCopyExecutor::Step::kFailed);
  EXPECT_NE(out.why.find("no longer registered"), std::string::npos) << out.why;
  EXPECT_EQ(dst_[1], 0);
  EXPECT_EQ(exec_.stats().completion_errors.load(), 1u);
  EXPECT_TRUE(exec_.empty());
}

TEST_F(SameHostCopies, CopyInlineCopiesEverySliceAtOnce) {
  auto b = write(0, 0, 9 * MiB);
  EXPECT_EQ(exec_.copy_inline(*b->copy), "");
  EXPECT_TRUE(landed(0, 0, 9 * MiB));
  EXPECT_EQ(exec_.stats().ops_completed.load(), 3u);
}

}  // namespace
}  // namespace kvxfer
