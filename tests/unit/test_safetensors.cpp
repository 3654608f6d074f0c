// safetensors reader/writer: round trips, 16-bit float conversions, every validation error, and
// interoperability with the reference `safetensors` Python package (skipped if it is missing).
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "core/error.h"

namespace fs = std::filesystem;
using origami::Error;
using origami::SafetensorsFile;
using origami::TensorInfo;
using origami::TensorWrite;

namespace {

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("origami_st_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // Writes a file by hand: 8-byte length (the header's own unless `claimed_len` is given),
  // the header text and `data_bytes` bytes of data.
  std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                        int64_t claimed_len = -1) const {
    const std::string p = file(name);
    std::ofstream os(p, std::ios::binary);
    const uint64_t n = claimed_len >= 0 ? uint64_t(claimed_len) : header.size();
    os.write(reinterpret_cast<const char*>(&n), 8);
    os << header;
    const std::string data(data_bytes, '\0');
    os << data;
    return p;
  }

  // Opening `path` throws an Error whose message names the file and contains `rule`.
  static void expect_open_error(const std::string& path, const std::string& rule) {
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << "no error for " << path << " (expected '" << rule << "')";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(rule), std::string::npos) << "expected '" << rule << "' in: " << msg;
    }
  }

  fs::path dir_;
};

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<float> ramp(size_t n) {  // exactly representable in F16 and BF16 for small n
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float(i) * 0.5f - 3.25f;
  return v;
}

bool have_python_safetensors() {
  return std::system("/usr/bin/python3 -c 'import safetensors.torch' >/dev/null 2>&1") == 0;
}

int run_python(const std::string& script_path, const std::string& script, const std::string& arg) {
  std::ofstream(script_path) << script;
  return std::system(("/usr/bin/python3 '" + script_path + "' '" + arg + "'").c_str());
}

// Float bit patterns spread over the whole range (subnormals, overflow, ties), no NaN.
std::vector<float> random_floats(size_t n) {
  std::vector<float> v;
  uint64_t s = 0x9e3779b97f4a7c15ull;
  while (v.size() < n) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float f = std::bit_cast<float>(uint32_t(s >> 32));
    if (!std::isnan(f)) v.push_back(f);
  }
  // Hand-picked edge cases: ties at 1, the F16 overflow threshold, F16 subnormal ties, BF16 ties.
  for (float f : {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 65504.0f, 65519.0f, 65520.0f, 0x1p-25f,
                  3 * 0x1p-25f, 0x1p-24f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 3.4e38f, -0.0f})
    v.push_back(f);
  return v;
}

}  // namespace

// ---- round trips ---------------------------------------------------------------------------

TEST_F(Safetensors, RoundTripShapesDtypesAndMetadata) {
  const auto a = ramp(24), b = ramp(5), scalar = std::vector<float>{42.5f};
  const std::vector<int32_t> ids = {7, -3, 2147483647, -2147483647 - 1};
  std::vector<TensorWrite> ws = {
      {"layer.0.w", {2, 3, 4}, a.data()},
      {"scalar", {}, scalar.data()},
      {"empty", {0}, nullptr},
      {"empty3d", {3, 0, 2}, nullptr},
      {"vec", {5}, b.data()},
      {"mat", {4, 6}, a.data()},
      {"half", {5}, b.data(), "F16"},
      {"brain", {5}, b.data(), "BF16"},
      {"ids", {4}, nullptr, "I32", ids.data()},
  };
  const std::string p = file("rt.safetensors");
  origami::write_safetensors(p, ws, {{"format", "pt"}, {"step", "12"}});
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  // Header length is padded to a multiple of 8 with spaces; the file ends right after the data.
  {
    std::ifstream is(p, std::ios::binary);
    uint64_t n = 0;
    is.read(reinterpret_cast<char*>(&n), 8);
    EXPECT_EQ(n % 8, 0u);
    std::string header(n, '\0');
    is.read(header.data(), std::streamsize(n));
    EXPECT_EQ(header.front(), '{');
    EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
    const uint64_t data_bytes = (24 + 1 + 5 + 24) * 4 + 5 * 2 * 2 + 4 * 4;
    EXPECT_EQ(fs::file_size(p), 8 + n + data_bytes);
  }

  const auto f = SafetensorsFile::open(p);
  ASSERT_EQ(f.tensors().size(), ws.size());
  // Empty tensors tie on offsets with their neighbour, so check the order of non-empty ones only.
  std::vector<std::string> order;
  for (const auto& t : f.tensors())
    if (t.numel() > 0) order.push_back(t.name);
  EXPECT_EQ(order, (std::vector<std::string>{"layer.0.w", "scalar", "vec", "mat", "half", "brain", "ids"}));
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  EXPECT_EQ(f.find("nope"), nullptr);

  for (const auto& w : ws) {
    const TensorInfo* t = f.find(w.name);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->dtype, w.dtype);
    EXPECT_EQ(t->shape, w.shape);
    int64_t numel = 1;
    for (auto d : w.shape) numel *= d;
    EXPECT_EQ(t->numel(), numel);
    EXPECT_EQ(t->end - t->begin, uint64_t(numel) * origami::safetensors_dtype_size(w.dtype));
    if (w.dtype == "I32") {
      std::vector<int32_t> got(static_cast<size_t>(numel));
      f.read_i32(*t, got.data());
      EXPECT_EQ(got, ids);
    } else {
      std::vector<float> got(static_cast<size_t>(numel), -1.0f);
      f.read_f32(*t, got.data());
      for (int64_t i = 0; i < numel; ++i) EXPECT_EQ(got[size_t(i)], w.data[i]) << w.name << "[" << i << "]";
    }
  }
  EXPECT_EQ(f.find("scalar")->numel(), 1);
  EXPECT_EQ(f.at("empty3d").numel(), 0);
  EXPECT_NE(error_of([&] { f.at("missing.weight"); }).find("no tensor 'missing.weight'"), std::string::npos);
}

TEST_F(Safetensors, EmptyFileAndMoveSemantics) {
  const std::string p = file("empty.safetensors");
  origami::write_safetensors(p, {});
  EXPECT_EQ(fs::file_size(p), 16u);  // "{}" padded to 8 bytes
  auto f = SafetensorsFile::open(p);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_TRUE(f.metadata().empty());

  const auto v = ramp(3);
  const std::string q = file("one.safetensors");
  origami::write_safetensors(q, {{"a_name_long_enough_to_live_on_the_heap_0123456789", {3}, v.data()}, {"b", {3}, v.data()}});
  std::vector<SafetensorsFile> files;
  files.push_back(SafetensorsFile::open(q));
  files.push_back(SafetensorsFile::open(p));
  SafetensorsFile moved = std::move(files[0]);
  files.clear();
  ASSERT_NE(moved.find("b"), nullptr);  // short (SSO) name is still indexed after the moves
  ASSERT_NE(moved.find("a_name_long_enough_to_live_on_the_heap_0123456789"), nullptr);
  float out[3];
  moved.read_f32(moved.at("b"), out);
  EXPECT_EQ(out[2], v[2]);
  moved = SafetensorsFile::open(p);
  EXPECT_TRUE(moved.tensors().empty());
}

TEST_F(Safetensors, OverwriteReplacesTheFile) {
  const std::string p = file("w.safetensors");
  const auto v = ramp(4);
  origami::write_safetensors(p, {{"x", {4}, v.data()}});
  const auto w = ramp(8);
  origami::write_safetensors(p, {{"y", {2, 4}, w.data()}});
  const auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f.find("x"), nullptr);
  EXPECT_EQ(f.at("y").shape, (std::vector<int64_t>{2, 4}));
}

// ---- 16-bit floats -------------------------------------------------------------------------

TEST_F(Safetensors, HalfConversionsKnownValues) {
  using origami::bf16_to_f32;
  using origami::f16_to_f32;
  using origami::f32_to_bf16;
  using origami::f32_to_f16;
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0400), 0x1p-14f);  // smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)) && f16_to_f32(0x7c00) > 0);
  EXPECT_TRUE(std::isinf(f16_to_f32(0xfc00)) && f16_to_f32(0xfc00) < 0);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_TRUE(std::signbit(f16_to_f32(0x8000)));

  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3c00);      // tie -> even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(f32_to_f16(-1e9f), 0xfc00);
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);      // tie between 0 and 2^-24 -> 0
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);  // tie between 1 and 2 ulps -> 2
  EXPECT_EQ(f32_to_f16(0x1p-14f - 0x1p-26f), 0x0400);  // rounds up into the normals
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(1e-30f), 0x0000);
  EXPECT_EQ(f32_to_f16(std::nanf("")) & 0x7c00, 0x7c00);
  EXPECT_NE(f32_to_f16(std::nanf("")) & 0x03ff, 0);

  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
  EXPECT_EQ(f32_to_bf16(3.14159265f), 0x4049);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);      // tie -> even
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(3.4028235e38f), 0x7f80);       // FLT_MAX rounds to infinity
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::bit_cast<float>(0x7f800001u)))));  // low-payload NaN

  // Every 16-bit value survives a round trip through float (NaNs stay NaN).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = f16_to_f32(uint16_t(h)), b = bf16_to_f32(uint16_t(h));
    if (std::isnan(a)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(a))));
    } else {
      ASSERT_EQ(f32_to_f16(a), h) << std::hex << h;
    }
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(b))));
    } else {
      ASSERT_EQ(f32_to_bf16(b), h) << std::hex << h;
    }
  }
}

// ---- validation ----------------------------------------------------------------------------

TEST_F(Safetensors, RejectsBrokenFiles) {
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  // Sanity: the hand-written good file opens.
  EXPECT_EQ(SafetensorsFile::open(write_raw("good", ok, 8)).tensors().size(), 1u);

  expect_open_error(file("does_not_exist"), "cannot open");
  {
    const std::string p = file("short");
    std::ofstream(p, std::ios::binary) << "abc";
    expect_open_error(p, "too short");
  }
  expect_open_error(dir_.string(), "not a regular file");
  expect_open_error(write_raw("len_past_end", ok, 8, 4096), "runs past the end of the file");
  expect_open_error(write_raw("len_huge", ok, 8, int64_t(1) << 40), "exceeds the format's limit");
  expect_open_error(write_raw("len_zero", "", 0, 0), "does not start with '{'");
  expect_open_error(write_raw("not_brace", "[1,2]   ", 0), "does not start with '{'");
  expect_open_error(write_raw("bad_json", R"({"w":{"dtype":"F32",)", 8), "not valid JSON");
  expect_open_error(write_raw("trailing_junk", ok + "x", 8), "not valid JSON");
  expect_open_error(write_raw("dup", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                     R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                    "names 'w' twice");
  expect_open_error(write_raw("entry", R"({"w":[1]})", 0), "field 'w': expected an object, got [1]");
  expect_open_error(write_raw("unknown_dtype", R"({"w":{"dtype":"F24","shape":[2],"data_offsets":[0,6]}})", 6),
                    "tensor 'w': unknown dtype 'F24'");
  expect_open_error(write_raw("no_dtype", R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8), "field 'w.dtype': missing");
  expect_open_error(write_raw("no_shape", R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8), "field 'w.shape': missing");
  expect_open_error(write_raw("no_offsets", R"({"w":{"dtype":"F32","shape":[2]}})", 8), "field 'w.data_offsets': missing");
  expect_open_error(write_raw("three_offsets", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", 8),
                    "field 'w.data_offsets': expected an array of 2 elements, got [0,4,8]");
  expect_open_error(write_raw("neg_dim", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
                    "field 'w.shape[0]': expected a non-negative integer, got -2");
  expect_open_error(write_raw("float_dim", R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
                    "field 'w.shape[0]': expected a non-negative integer, got 2.0");
  expect_open_error(write_raw("neg_offset", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", 8),
                    "field 'w.data_offsets[0]': expected a non-negative integer, got -1");
  expect_open_error(write_raw("reversed", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
                    "end before they begin");
  expect_open_error(write_raw("past_buffer", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                    "tensor 'w': data_offsets [0,16] run past the end of the data buffer (8 bytes)");
  expect_open_error(write_raw("size_mismatch", R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8),
                    "tensor 'w': data_offsets [0,8] span 8 bytes but shape [2] of F16 needs 4");
  expect_open_error(write_raw("overflow", R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
                    "overflows");
  // 0 elements, but 2^62 x 3 on the way past int64 (numel() forms it in int64)
  expect_open_error(write_raw("partial_overflow", R"({"w":{"dtype":"F32","shape":[4611686018427387904,3,0],"data_offsets":[0,0]}})", 0),
                    "overflows");
  expect_open_error(write_raw("overlap", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
                    "tensor 'b' [4, 12) overlaps tensor 'a' [0, 8)");
  expect_open_error(write_raw("gap", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                     R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
                    "gap of 4 bytes before tensor 'b'");
  expect_open_error(write_raw("trailing", ok, 12), "4 bytes after the last tensor");
  expect_open_error(write_raw("meta_type", R"({"__metadata__":{"format":1}})", 0),
                    "field '__metadata__.format': expected a string, got 1");
  expect_open_error(write_raw("meta_obj", R"({"__metadata__":[1]})", 0), "field '__metadata__': expected an object, got [1]");
}

TEST_F(Safetensors, ReadersRejectWrongDtypes) {
  const std::string p = write_raw(
      "dtypes",
      R"({"big":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"u":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}})",
      0);
  // Patch in data: big = 2^40 (does not fit int32).
  {
    std::fstream fsx(p, std::ios::binary | std::ios::in | std::ios::out | std::ios::app);
    const int64_t big = int64_t(1) << 40;
    fsx.write(reinterpret_cast<const char*>(&big), 8);
    fsx.write("\1\2\3\4\5\6\7\10", 8);
  }
  const auto f = SafetensorsFile::open(p);
  float fo[8];
  int32_t io[8];
  EXPECT_NE(error_of([&] { f.read_f32(f.at("big"), fo); }).find("tensor 'big' has dtype I64, which cannot be read as float"),
            std::string::npos);
  EXPECT_NE(error_of([&] { f.read_i32(f.at("big"), io); }).find("element 0 = 1099511627776 does not fit in int32"),
            std::string::npos);
  EXPECT_NE(error_of([&] { f.read_i32(f.at("u"), io); }).find("has dtype U8, which cannot be read as int32"),
            std::string::npos);
  EXPECT_EQ(f.bytes(f.at("u"))[7], std::byte{8});
}

TEST_F(Safetensors, WriterRejectsBadInputAndReportsIoErrors) {
  const auto v = ramp(4);
  const std::string p = file("w.safetensors");
  auto err = [&](std::vector<TensorWrite> ws, const std::string& where = "") {
    return error_of([&] { origami::write_safetensors(where.empty() ? p : where, ws); });
  };
  EXPECT_NE(err({{"x", {4}, v.data()}, {"x", {4}, v.data()}}).find("tensor 'x': the name appears twice"), std::string::npos);
  EXPECT_NE(err({{"", {4}, v.data()}}).find("empty name"), std::string::npos);
  EXPECT_NE(err({{"__metadata__", {4}, v.data()}}).find("reserved"), std::string::npos);
  EXPECT_NE(err({{"x", {2, -2}, v.data()}}).find("negative or too large dimension"), std::string::npos);
  EXPECT_NE(err({{"x", {4}, nullptr}}).find("no data pointer"), std::string::npos);
  EXPECT_NE(err({{"x", {4}, v.data(), "I32"}}).find("no data pointer for data_i32"), std::string::npos);
  EXPECT_NE(err({{"x", {4}, v.data(), "F64"}}).find("dtype 'F64' cannot be written"), std::string::npos);
  EXPECT_NE(err({{"bad\xff", {4}, v.data()}}).find("not valid UTF-8"), std::string::npos);
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  const std::string missing = file("no_such_dir/w.safetensors");
  const std::string e = err({{"x", {4}, v.data()}}, missing);
  EXPECT_NE(e.find("cannot create safetensors file '" + missing + ".tmp'"), std::string::npos) << e;
  EXPECT_NE(e.find("No such file or directory"), std::string::npos) << e;

  // Disk full: point the temporary name at /dev/full. The existing file must stay intact and
  // the temporary must be cleaned up.
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  origami::write_safetensors(p, {{"old", {4}, v.data()}});
  fs::create_symlink("/dev/full", p + ".tmp");
  const auto big = std::vector<float>(1 << 16, 1.0f);
  const std::string full = err({{"new", {1 << 16}, big.data()}});
  EXPECT_NE(full.find("cannot write safetensors file '" + p + ".tmp'"), std::string::npos) << full;
  EXPECT_NE(full.find("No space left on device"), std::string::npos) << full;
  EXPECT_FALSE(fs::exists(fs::symlink_status(p + ".tmp")));
  const auto f = SafetensorsFile::open(p);
  EXPECT_NE(f.find("old"), nullptr);
  EXPECT_EQ(f.find("new"), nullptr);
}

// ---- interoperability with the reference implementation ------------------------------------

TEST_F(Safetensors, InteropPythonReadsOurFile) {
  if (!have_python_safetensors()) GTEST_SKIP() << "/usr/bin/python3 lacks the safetensors package";
  const auto a = ramp(24);
  const auto r = random_floats(10000);
  const float scalar = 0.125f;
  const std::vector<int32_t> ids = {1, -2, 2147483647};
  const std::string p = file("ours.safetensors");
  origami::write_safetensors(p,
                             {{"model.embed.weight", {4, 6}, a.data()},
                              {"model.scalar", {}, &scalar},
                              {"model.empty", {2, 0}, nullptr},
                              {"ids", {3}, nullptr, "I32", ids.data()},
                              {"r_f32", {int64_t(r.size())}, r.data()},
                              {"r_f16", {int64_t(r.size())}, r.data(), "F16"},
                              {"r_bf16", {int64_t(r.size())}, r.data(), "BF16"}},
                             {{"format", "pt"}, {"origami", "yes"}});
  const std::string script = R"PY(
import sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
p = sys.argv[1]
t = load_file(p)
assert sorted(t) == sorted(["model.embed.weight", "model.scalar", "model.empty", "ids", "r_f32", "r_f16", "r_bf16"]), sorted(t)
w = t["model.embed.weight"]
assert w.dtype == torch.float32 and list(w.shape) == [4, 6]
assert torch.equal(w.flatten(), torch.arange(24, dtype=torch.float32) * 0.5 - 3.25)
assert t["model.scalar"].shape == torch.Size([]) and t["model.scalar"].item() == 0.125
assert list(t["model.empty"].shape) == [2, 0]
assert t["ids"].dtype == torch.int32 and t["ids"].tolist() == [1, -2, 2147483647]
r = t["r_f32"]
# Our float -> 16-bit rounding must match PyTorch's bit for bit.
for name, dt in (("r_f16", torch.float16), ("r_bf16", torch.bfloat16)):
    ours, theirs = t[name], r.to(dt)
    assert ours.dtype == dt
    bad = (ours.view(torch.int16) != theirs.view(torch.int16)).nonzero().flatten()
    assert len(bad) == 0, (name, bad[:5].tolist(), r[bad[:5]].tolist())
with safe_open(p, framework="pt") as f:
    assert f.metadata() == {"format": "pt", "origami": "yes"}, f.metadata()
print("python read origami's file: ok")
)PY";
  EXPECT_EQ(run_python(file("check.py"), script, p), 0);
}

TEST_F(Safetensors, InteropWeReadPythonFile) {
  if (!have_python_safetensors()) GTEST_SKIP() << "/usr/bin/python3 lacks the safetensors package";
  const std::string p = file("theirs.safetensors");
  const std::string script = R"PY(
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
ramp = torch.arange(6, dtype=torch.float32) * 0.5 - 3.25
bits = torch.randint(-32768, 32768, (4096,), dtype=torch.int32, generator=g).to(torch.int16)
r16, rb16 = bits.clone().view(torch.float16), bits.clone().view(torch.bfloat16)
save_file({
    "f32": ramp.reshape(2, 3), "f16": ramp.half(), "bf16": ramp.bfloat16(), "f64": ramp.double() / 3,
    "i64": torch.tensor([5, -6, 2**31 - 1]), "i32": torch.tensor([7, -8], dtype=torch.int32),
    "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
    "r_f16": r16, "r_f16_as_f32": r16.float(), "r_bf16": rb16, "r_bf16_as_f32": rb16.float(),
}, sys.argv[1], metadata={"format": "pt", "who": "python"})
)PY";
  ASSERT_EQ(run_python(file("make.py"), script, p), 0);

  const auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"who", "python"}}));
  EXPECT_EQ(f.tensors().size(), 12u);
  const auto ramp6 = ramp(6);
  auto floats = [&](const char* name) {
    const TensorInfo& t = f.at(name);
    std::vector<float> v(size_t(t.numel()));
    f.read_f32(t, v.data());
    return v;
  };
  EXPECT_EQ(f.at("f32").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.at("f16").dtype, "F16");
  EXPECT_EQ(f.at("bf16").dtype, "BF16");
  EXPECT_EQ(floats("f32"), ramp6);
  EXPECT_EQ(floats("f16"), ramp6);
  EXPECT_EQ(floats("bf16"), ramp6);
  const auto f64 = floats("f64");
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(f64[i], float(double(ramp6[i]) / 3)) << i;
  EXPECT_EQ(f.at("scalar").shape, std::vector<int64_t>{});
  EXPECT_EQ(floats("scalar"), std::vector<float>{2.5f});
  EXPECT_EQ(f.at("empty").shape, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(floats("empty").empty());
  std::vector<int32_t> i64(3), i32(2);
  f.read_i32(f.at("i64"), i64.data());
  f.read_i32(f.at("i32"), i32.data());
  EXPECT_EQ(i64, (std::vector<int32_t>{5, -6, 2147483647}));
  EXPECT_EQ(i32, (std::vector<int32_t>{7, -8}));
  for (const char* name : {"r_f16", "r_bf16"}) {
    const auto ours = floats(name), theirs = floats((std::string(name) + "_as_f32").c_str());
    ASSERT_EQ(ours.size(), theirs.size());
    for (size_t i = 0; i < ours.size(); ++i) {
      if (std::isnan(theirs[i])) {
        EXPECT_TRUE(std::isnan(ours[i])) << name << "[" << i << "]";
      } else {
        ASSERT_EQ(std::bit_cast<uint32_t>(ours[i]), std::bit_cast<uint32_t>(theirs[i])) << name << "[" << i << "]";
      }
    }
  }
}
