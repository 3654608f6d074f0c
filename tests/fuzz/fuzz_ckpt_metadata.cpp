// libFuzzer target: a sharded checkpoint's metadata.json, read as `origami ckpt info DIR` reads it
// (Checkpoint::open, then the command's own listing), beside a valid trainer_state.json. The command's
// source is compiled into this target (its functions are file-local); its output goes to /dev/null.
#include <cstdio>

#include "../../apps/cmd_ckpt.cpp"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (!std::freopen("/dev/null", "w", stdout)) std::perror("/dev/null");
  origami_fuzz::write_file("ck/step-1/trainer_state.json", "{\"step\": 1, \"adam_steps\": 1, \"options\": {}}\n");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  origami_fuzz::write_file("ck/step-1/metadata.json", origami_fuzz::as_text(data, size));
  std::string dir = (origami_fuzz::work_dir() / "ck" / "step-1").string();
  char a0[] = "ckpt", a1[] = "info";
  char* argv[] = {a0, a1, dir.data(), nullptr};
  origami_fuzz::expect_errors([&] { origami::cmd_ckpt(3, argv); });
  return 0;
}
