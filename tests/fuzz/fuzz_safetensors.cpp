// libFuzzer target: a safetensors file (header length, JSON header, data) through SafetensorsFile::open
// and every tensor's conversion to float and int32.
#include <vector>

#include "ckpt/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = origami_fuzz::write_file("input.safetensors", origami_fuzz::as_text(data, size));
  origami_fuzz::expect_errors([&] {
    const origami::SafetensorsFile f = origami::SafetensorsFile::open(path);
    std::vector<float> x;
    std::vector<int32_t> n;
    for (const origami::TensorInfo& t : f.tensors()) {
      // open() checked every byte range against the file, so numel() is bounded by its size.
      if (f.find(t.name) != &t) origami_fuzz::finding("find() does not return the tensor", t.name.c_str());
      if (t.numel() < 0 || uint64_t(t.numel()) > size) origami_fuzz::finding("numel beyond the file", t.name.c_str());
      (void)f.bytes(t);
      x.resize(size_t(t.numel()));
      n.resize(size_t(t.numel()));
      origami_fuzz::expect_errors([&] { f.read_f32(t, x.data()); });
      origami_fuzz::expect_errors([&] { f.read_i32(t, n.data()); });
    }
    (void)f.metadata();
  });
  return 0;
}
