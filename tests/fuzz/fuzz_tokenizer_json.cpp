// libFuzzer target: a tokenizer file — a Hugging Face tokenizer.json, or origami's own PREFIX.tokenizer.json
// ({"type": "byte" | "gpt2" | "huggingface", ...}) — through tokenizer_from_json, then encoding and decoding
// a text. Input: the JSON, optionally followed by a NUL byte and the text to encode (else a fixed text).
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view all = origami_fuzz::as_text(data, size);
  const size_t nul = all.find('\0');
  const std::string_view json_text = all.substr(0, nul);
  const std::string_view text = nul == std::string_view::npos
      ? std::string_view("Hello world, naïve café 日本語 😀 <|endoftext|></s>  \t\r\n 12345 don't")
      : all.substr(nul + 1);
  const nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;  // not JSON: read_json_file's parse error, tested elsewhere
  origami_fuzz::expect_errors([&] {
    const std::unique_ptr<origami::Tokenizer> tok = origami::tokenizer_from_json(j, "fuzz tokenizer.json");
    const std::vector<int32_t> ids = tok->encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) origami_fuzz::finding("encode gave an id outside the vocabulary", "");
    (void)tok->decode(ids);
    (void)tok->decode_text(ids, true);
    (void)tok->to_json().dump();
  });
  return 0;
}
