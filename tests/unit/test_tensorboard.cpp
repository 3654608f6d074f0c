// TensorBoard event encoding (train/tensorboard.h): CRC-32C against its published check value, the
// TFRecord framing and the scan for intact records, and the scalars taken from a metrics row.
// (tests/parallel/test_watching.py reads whole event files with TensorBoard's own reader.)
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "train/tensorboard.h"

using namespace origami;

TEST(TensorBoard, Crc32cMatchesTheCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);  // the CRC-32C check value (RFC 3720, B.4)
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8a9136aau);  // RFC 3720 B.4: 32 bytes of zeros
}

TEST(TensorBoard, RecordsAreFramedAndTruncationIsFound) {
  const std::string a = tf_record("first event"), b = tf_record(std::string(300, 'x'));
  ASSERT_EQ(a.size(), 16 + std::string("first event").size());
  uint64_t n = 0;
  std::memcpy(&n, a.data(), 8);
  EXPECT_EQ(n, 11u);
  const std::string both = a + b;
  EXPECT_EQ(intact_records(both), both.size());
  for (size_t cut = 1; cut < b.size(); cut += 37) EXPECT_EQ(intact_records(both.substr(0, both.size() - cut)), a.size());
  std::string corrupt = both;
  corrupt[a.size() + 20] ^= 1;  // a flipped bit in the second record's data
  EXPECT_EQ(intact_records(corrupt), a.size());
  EXPECT_EQ(intact_records(""), 0u);
}

TEST(TensorBoard, ScalarsOfAMetricsRow) {
  const nlohmann::json dense = {{"step", 3}, {"loss", 2.5}, {"lm_loss", 2.5}, {"aux_loss", 0.0}, {"z_loss", 0.0},
                                {"lr", 1e-3}, {"grad_norm", 0.75}, {"tokens_per_s", 1000.0}, {"ms", 12.0},
                                {"gflops", 3.0}, {"rss_peak_bytes", 1 << 20}};
  const auto s = tensorboard_scalars(dense);
  auto find = [&](const std::string& tag) {
    for (const auto& [t, v] : s)
      if (t == tag) return double(v);
    return -1.0;
  };
  EXPECT_EQ(find("train/loss"), 2.5);
  EXPECT_EQ(find("train/grad_norm"), 0.75);
  EXPECT_EQ(find("perf/step_ms"), 12.0);
  EXPECT_EQ(find("train/update_skipped"), 0.0);
  EXPECT_EQ(find("train/aux_loss"), -1.0);  // dense: no router losses
  EXPECT_EQ(find("val/loss"), -1.0);        // no evaluation at this step
  nlohmann::json moe = dense;
  moe["expert_imbalance"] = 1.25, moe["expert_sync_imbalance"] = 1.5, moe["val_loss"] = 2.25;
  moe["skipped"] = "the loss is not finite";
  moe["memory_bytes"] = {{"total", 4096}};
  const auto m = tensorboard_scalars(moe);
  EXPECT_EQ(m.size(), s.size() + 6);  // the two imbalances, aux, z, val, predicted memory
  const std::string event = scalar_event(1.5, 3, m);
  EXPECT_NE(event.find("moe/expert_imbalance"), std::string::npos);
  EXPECT_NE(event.find("moe/expert_sync_imbalance"), std::string::npos);
  EXPECT_EQ(event[0], 0x09);  // Event.wall_time: field 1, 64-bit
}
