// libFuzzer target: a Megatron .idx through IndexedDataset::open (which validates the whole index against
// the .bin), then reads. Input: 2 bytes giving the .bin's size in 2-byte units, then the .idx.
#include <algorithm>
#include <vector>

#include "data/indexed_dataset.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t bin_bytes = 2 * (size_t(data[0]) | size_t(data[1]) << 8);
  std::string bin(bin_bytes, '\0');
  for (size_t i = 0; i < bin_bytes; ++i) bin[i] = char(i * 7 % 251);
  origami_fuzz::write_file("d.bin", bin);
  origami_fuzz::write_file("d.idx", origami_fuzz::as_text(data + 2, size - 2));
  origami_fuzz::expect_errors([&] {
    const origami::IndexedDataset d = origami::IndexedDataset::open((origami_fuzz::work_dir() / "d").string());
    const uint64_t tokens = d.num_tokens();
    if (tokens > bin_bytes) origami_fuzz::finding("more tokens than the .bin holds", "");
    for (uint64_t i = 0; i < std::min<uint64_t>(d.num_sequences(), 64); ++i) {
      (void)d.sequence_length(i);
      (void)d.sequence_pointer(i);
    }
    for (uint64_t i = 0; i < std::min<uint64_t>(d.num_documents() + 1, 64); ++i) (void)d.document_index(i);
    std::vector<int32_t> out(size_t(std::min<uint64_t>(tokens, 4096)));
    d.read_tokens(0, out.size(), out.data());
    if (tokens > 3) d.read_tokens(tokens - 3, 3, out.data());
  });
  return 0;
}
