#!/usr/bin/python3
"""Numbers too large for the arithmetic that sizes a run (issue 35): every case the hostile-input
review found, each ending with exit 1 and exactly one error line naming the value and the rule,
within a second — never a crash, a hang, a wrapped size or a silent truncation.

- Model dimensions beyond their limits (model/config.h, ModelLimits): intermediate_size 2^61 (once a
  heap overflow in Params::init), num_local_experts 2^31 and 10^6 (a SIGFPE and a hang in plan),
  num_hidden_layers 10^5 and 10^7 (hangs), hidden_size 2^31 and intermediate_size 2^40 (plan ranked a
  layout of "0 B"); a model within every limit whose tensors are too many for the parameter table.
- Sizes computed in checked 64-bit arithmetic (core/checked.h): a layout whose activations overflow
  names the model's dimensions and the batch; a checkpoint whose tensor shapes overflow the parameter
  count names the tensor.
- The planner bounded in work: a 10^4-layer Mixtral on 64 H100s is refused in well under a second,
  naming the axes to fix; --global-batch 10^12 (a divisor loop to 10^12) is refused.
- Options: an integer beyond 64 bits, a degree beyond 32 bits (once truncated), a step count beyond
  kMaxSteps, a non-finite number, a --layout degree beyond kMaxDegree; --ep x --etp beyond 32 bits (a
  SIGFPE), --threads out of [0, 4096] in every command (dump and generate took -4 as "all cores"),
  dump's logits refused before its tokens are allocated, plan's zero sizes and an empty --layout mode
  named, profile's --max-mb beyond 64 GiB and a --name that is not UTF-8 refused before the timing.
- Inputs shaped to break the readers: JSON nested 200000 deep (a stack overflow), a path component
  longer than the system's limit (a bare filesystem exception); a cluster file whose device count
  overflowed an int; and a blend whose weights sum to
  infinity runs with the shares it asks for (both were 0).

Run by ctest with ORIGAMI_BIN (build/origami); exits non-zero on the first failed check.
"""
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import LLAMA_TINY, byte_dataset, check, expect_error, run  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
MIXTRAL = os.path.join(ROOT, "configs", "models", "mixtral-8x7b.json")
H100 = os.path.join(ROOT, "configs", "clusters", "dgx-h100.json")
LLAMA = LLAMA_TINY


def config(tmp, name, base, **changes):
    cfg = dict(base)
    cfg.update(changes)
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def plan(cfg, *extra, devices="64", batch="64", seq="4096"):
    return ["plan", "--config", cfg, "--cluster", H100, "--devices", devices, "--global-batch", batch,
            "--seq-len", seq, *extra]


def model_limits(tmp, data):
    with open(MIXTRAL) as f:
        mixtral = json.load(f)
    train = lambda cfg: ["train", "--config", cfg, "--data", data, "--steps", "1", "--seq-len", "32"]  # noqa: E731
    expect_error("intermediate_size 2^61 (was a heap overflow)", train(config(tmp, "ffn61", LLAMA, intermediate_size=2**61)),
                 f"{tmp}/ffn61.json: field 'intermediate_size': expected an integer in [1, 16777216], got 2305843009213693952")
    for name, field, value, most in [("experts31", "num_local_experts", 2**31, 65536),
                                     ("experts1e6", "num_local_experts", 10**6, 65536),
                                     ("layers1e5", "num_hidden_layers", 10**5, 10000),
                                     ("hidden31", "hidden_size", 2**31, 1048576),
                                     ("ffn40", "intermediate_size", 2**40, 16777216)]:
        expect_error(f"plan with {field} {value}", plan(config(tmp, name, mixtral, **{field: value})),
                     f"{tmp}/{name}.json: field '{field}': expected an integer in [1, {most}], got {value}")
    expect_error("num_hidden_layers 10^7 (was a hang)", train(config(tmp, "layers1e7", LLAMA, num_hidden_layers=10**7)),
                 f"{tmp}/layers1e7.json: field 'num_hidden_layers': expected an integer in [1, 10000], got 10000000")
    wide = config(tmp, "wide", mixtral, num_hidden_layers=10000, num_local_experts=65536)
    expect_error("10^4 layers of 2^16 experts: too many tensors", train(wide),
                 f"{wide}: num_hidden_layers 10000 x (16 + 3 x 65536 experts) = 1966240000 tensors is more than "
                 "origami's parameter table holds (2097152)")


def checked_sizes(tmp, data):
    huge = config(tmp, "huge", LLAMA, hidden_size=2**20, num_attention_heads=8, num_key_value_heads=8,
                  max_position_embeddings=2**24)
    expect_error("activations beyond 64 bits", plan(huge, "--layout", "tp1 cp1 pp1 mb1048576 recompute=none", devices="1",
                                                    batch="1048576", seq="16777216"),
                 "the runtime refuses the one layout of --layout 'tp1 cp1 pp1 mb1048576 recompute=none': "
                 "the memory of this run overflows 64-bit arithmetic (hidden_size 1048576, "
                 "intermediate_size 40, num_hidden_layers 2, num_attention_heads 8, vocab_size 257, --micro-batch "
                 "1048576, --seq-len 16777216)")
    ck = os.path.join(tmp, "ck")
    run("train", "--config", config(tmp, "small", LLAMA), "--data", data, "--steps", "1", "--seq-len", "32",
        "--micro-batch", "2", "--threads", "1", "--save", ck)
    meta = os.path.join(ck, "step-1", "metadata.json")
    with open(meta) as f:
        m = json.load(f)
    m["tensors"]["model.embed_tokens.weight"]["shape"] = [2**40, 2**40]
    with open(meta, "w") as f:
        json.dump(m, f)
    expect_error("a checkpoint's shapes beyond 64 bits", ["ckpt", "info", ck],
                 f"'{ck}/step-1': the parameter count overflows 64-bit arithmetic (tensor model.embed_tokens.weight "
                 "of shape [1099511627776, 1099511627776])")


def planner_and_options(tmp, data):
    with open(MIXTRAL) as f:
        mixtral = json.load(f)
    deep = config(tmp, "deep_mixtral", mixtral, num_hidden_layers=10000)
    expect_error("a 10^4-layer Mixtral on 64 H100s: bounded in work", plan(deep),
                 "this search would size about 7.1e+08 tensors (mixtral with 310003 tensors, over every layout of 64 "
                 "devices); the limit is 5e+07: fix axes with --layout (for example \"pp8 ep8\") or plan fewer --devices")
    # A device count of many divisors: counted before any layout is built (the shapes of 40320 devices
    # had taken 12.8 s and 8 GB before this refusal, 720720 devices longer still).
    expect_error("Mixtral on 5040 nodes of 8 H100s: bounded in work before building", ["plan", "--config", MIXTRAL,
                 "--cluster", H100, "--nodes", "5040", "--global-batch", "7680", "--seq-len", "4096", "--top", "1"],
                 "this search would size about 9.5e+08 tensors (mixtral with 995 tensors, over every layout of 40320 "
                 "devices); the limit is 5e+07: fix axes with --layout (for example \"pp8 ep8\") or plan fewer --devices")
    expect_error("--global-batch 10^12 (was a hang)", plan(MIXTRAL, batch="1000000000000"),
                 "--global-batch must be at most 1073741824 (as in 'origami train'), got 1000000000000")
    with open(H100) as f:
        cluster = json.load(f)
    nodes = config(tmp, "nodes29", cluster, nodes=2**29)
    expect_error("a cluster of 2^29 nodes x 8 (was '--devices must be in [1, 0]')", plan(MIXTRAL, devices="8")[:1] +
                 ["--config", MIXTRAL, "--cluster", nodes, "--global-batch", "64", "--seq-len", "4096"],
                 f"{nodes}: field 'nodes': expected an integer in [1, 1048576], got 536870912")
    expect_error("--top 10^12 (was a search that could skip nothing)", plan(MIXTRAL, "--top", "1000000000000"),
                 "--top must be at most 1000, got 1000000000000")
    expect_error("--layout vpp999999999", plan(MIXTRAL, "--layout", "vpp999999999"),
                 "--layout: 'vpp999999999' needs an integer in [1, 1048576] after 'vpp'")
    train = ["train", "--config", config(tmp, "opts", LLAMA), "--data", data, "--seq-len", "32"]
    # (an out-of-type value is told the bound it passed, not the other side's: -2^31 is no --tp either)
    for flag, value, message in [("--tp", "4294967298", "--tp must be an integer of at most 2147483647, got "
                                  "'4294967298'"),
                                 ("--tp", "-4294967298", "--tp must be an integer of at least -2147483648, got "
                                  "'-4294967298'"),
                                 ("--steps", "99999999999999999999", "--steps must be an integer of at most "
                                  "9223372036854775807, got '99999999999999999999'"),
                                 ("--steps", "-99999999999999999999", "--steps must be an integer of at least "
                                  "-9223372036854775808, got '-99999999999999999999'"),
                                 ("--steps", str(2**40), "--steps must be at most 4294967296, got 1099511627776"),
                                 ("--lr", "inf", "--lr must be a number, got 'inf'")]:
        expect_error(f"{flag} {value}", train + [flag, value], message)
    # --ep x --etp was an int product: 2^16 x 2^16 wrapped to 0 (a SIGFPE in the divisibility check).
    wide_moe = config(tmp, "wide_moe", {**LLAMA, "model_type": "mixtral", "num_local_experts": 65536,
                                        "num_experts_per_tok": 2, "intermediate_size": 65536})
    expect_error("--ep 65536 --etp 65536 (was a SIGFPE)", ["train", "--config", wide_moe, "--data", data, "--seq-len",
                 "16", "--micro-batch", "1", "--ep", "65536", "--etp", "65536"],
                 "--ep x --etp (65536 x 65536 = 4294967296) must divide the ranks of a pipeline stage (1 ranks / --pp 1 "
                 "= 1): the experts' mesh ETP x EP x EDP covers the same ranks as TP x CP x DP")
    # --eval-iters under document batching counts steps of documents (its message spoke of windows)
    expect_error("--eval-iters 2^40 under --batching documents", train + ["--batching", "documents", "--tokens-per-step",
                 "256", "--eval-data", data, "--eval-iters", str(2**40)],
                 "--eval-iters must be at most 4294967296 steps of documents, got 1099511627776")
    # --threads: one rule for every command (dump and generate took a negative count as "all cores").
    dump = ["dump", "--config", config(tmp, "dump", LLAMA), "--data", data, "--out", os.path.join(tmp, "d.safetensors")]
    expect_error("dump --threads -4 (was all cores)", dump + ["--threads", "-4"],
                 "--threads must be in [0, 4096] (0: all cores), got -4")
    expect_error("train --threads 5000 (an OpenMP team of that many at start)", train + ["--threads", "5000"],
                 "--threads must be in [0, 4096] (0: all cores), got 5000")
    # dump's logits are checked against the memory before the tokens and weights are allocated.
    p = run(*dump, "--micro-batch", "1073741824", "--seq-len", "64", expect_ok=False)
    check(p.returncode == 1 and "error: dump writes logits [B, T, V] of 1073741824 x 64 x 257 floats" in p.stderr,
          f"dump --micro-batch 2^30: expected the logits' memory refused, got exit {p.returncode}:\n{p.stderr}")
    print("ok   dump --micro-batch 2^30: the logits refused before anything is allocated")
    expect_error("plan --global-batch 0", plan(MIXTRAL, batch="0"), "--global-batch must be positive, got 0")
    # profile: checked before its minutes of timing (--max-mb 1e20 overflowed a size; a --name that is not
    # UTF-8 threw from the JSON writer at the end, the file unwritten)
    profile = ["profile", "--out", os.path.join(tmp, "p.json")]
    expect_error("profile --max-mb 1e20", profile + ["--max-mb", "1e20"],
                 "--max-mb must be in [0.004, 65536] (4 KiB to 64 GiB), got 1e+20")
    expect_error("profile --name of Latin-1 bytes", profile + ["--name", "caf\udce9"],
                 "--name must be UTF-8 text, got bytes that are not")
    expect_error("plan --layout recompute=", plan(MIXTRAL, "--layout", "recompute="),
                 "--layout: 'recompute=': --recompute must be none, selective or full, got ''")


def reader_shapes(tmp, data):
    deep = os.path.join(tmp, "deep.json")
    with open(deep, "w") as f:
        f.write('{"model_type": "llama", "x": ' + "[" * 200000 + "]" * 200000 + "}")
    expect_error("JSON nested 200000 deep (was a stack overflow)", plan(deep),
                 f"model config '{deep}' nests arrays and objects 200001 levels deep; origami reads at most 1000")
    deep_cluster = os.path.join(tmp, "deep_cluster.json")
    with open(deep_cluster, "w") as f:
        f.write('{"name": ' + "[" * 100000 + "]" * 100000 + "}")
    expect_error("a cluster file nested 100000 deep", ["plan", "--config", MIXTRAL, "--cluster", deep_cluster,
                                                       "--global-batch", "64", "--seq-len", "4096"],
                 f"{deep_cluster}: nests arrays and objects 100001 levels deep; origami reads at most 1000")
    long_path = os.path.join(tmp, "x" * 300)
    expect_error("a path component of 300 bytes", ["ckpt", "info", long_path], f"'{long_path}': File name too long")
    other = byte_dataset(tmp, 40, "other")
    p = run("train", "--config", config(tmp, "blend", LLAMA), "--data", f"1e308 {data} 1e308 {other}", "--steps", "1",
            "--seq-len", "32", "--micro-batch", "2", "--threads", "1")
    check(f"data 0.5 {data}" in p.stdout and f"+ 0.5 {other}" in p.stdout,
          "a blend of weights 1e308 and 1e308 runs with shares 0.5 and 0.5:\n" + p.stdout)
    print("ok   a blend of weights 1e308 and 1e308 takes half of each (both shares were 0)")


def main():
    tmp = tempfile.mkdtemp(prefix="origami_sizes_")
    try:
        data = byte_dataset(tmp, 200, "corpus")
        model_limits(tmp, data)
        checked_sizes(tmp, data)
        planner_and_options(tmp, data)
        reader_shapes(tmp, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("test_size_limits: all passed")


if __name__ == "__main__":
    main()
