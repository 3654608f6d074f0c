"""The kinds of fuzz case: each takes a random.Random and a Case (its directory, the seeds, the binary),
writes the mutated input(s) into the case directory and sets the command that reads them.

  config-train  a model config.json (tests/parallel/configs, configs/, configs/models) -> train, 1 step
  config-plan   a model config.json -> plan on 8 devices of the DGX H100 cluster
  cluster       a cluster file (configs/clusters) -> plan
  plan-options  plan's numbers (--global-batch, --seq-len, --devices, --top, --imbalance)
  layout        plan --layout "..."
  plan-file     a `plan --out` file -> train --plan
  run-config    a --run-config file -> train
  checkpoint    one file of a checkpoint (metadata.json, a rank shard, trainer_state.json, config.json,
                latest, tokenizer.json; 1-rank, 2-rank and exported single-directory forms) -> ckpt info,
                ckpt export, train --resume (1 rank, or 2 ranks under mpirun), train --init-from, generate
  tokenizer     a Hub tokenizer.json (GPT-2, Llama-3, Llama-2 families; vocab.json/merges.txt), or the
                text it encodes -> data prepare
  dataset       a dataset's .idx, .bin or PREFIX.tokenizer.json -> data info, data decode, train
  blend         a blend string "W1 P1 W2 P2 ..." -> train --data (and --eval-data)
  train-options train's and generate's numbers
"""
import json
import os
import shutil

import mutators as mu
from seeds import read

# The shape of a 1-step run on a tiny model: small enough for an ASan build, bounded in memory.
TRAIN_SMALL = ["--steps", "1", "--micro-batch", "1", "--seq-len", "8", "--threads", "1", "--memory-limit-gb", "0.25",
               "--quiet"]


class Case:
    def __init__(self, index, kind, directory, seeds, binary, mpi_ok):
        self.index, self.kind, self.dir, self.seeds, self.bin, self.mpi_ok = index, kind, directory, seeds, binary, mpi_ok
        self.argv = None
        self.mpi = False
        self.m = mu.Mutation()
        self.plan_json = False  # the output is plan --json (checked for impossible figures)
        self.blend = False      # the output's data line is checked for zero shares
        self.expect = None      # (what, predicate on the error line): a probe's requirement of its message

    def write(self, name, data):
        p = os.path.join(self.dir, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
        return p

    def command(self):
        """'origami train', 'origami ckpt info', ...: the command that read the input."""
        if not self.argv:
            return ""
        words = self.argv[1:3] if self.argv[1] in ("data", "ckpt") else self.argv[1:2]
        return "origami " + " ".join(words)


_vocab_cache = {}


def vocabulary(name, paths):
    if name not in _vocab_cache:
        texts = []
        for p in paths:
            try:
                texts.append(read(p).decode("utf-8"))
            except (OSError, UnicodeDecodeError):
                pass
        _vocab_cache[name] = mu.json_vocabulary(texts)
    return _vocab_cache[name]


def mutated_json(rng, c, name, src, family, family_paths, indent=1):
    keys, strings = vocabulary(family, family_paths)
    c.m.note("seed %s" % os.path.relpath(src, c.seeds.dir) if src.startswith(c.seeds.dir) else "seed %s" % os.path.basename(src))
    return c.write(name, mu.mutate_json_text(rng, read(src).decode("utf-8"), c.m, keys, strings, indent))


def pick_config(rng, s):
    """A model config of the seeds: the tiny ones three times as often as the Mixtral 8x7B/8x22B ones."""
    names = sorted(s.configs)
    return s.configs[rng.choices(names, [1 if n.startswith("mixtral-8x") else 3 for n in names])[0]]


def train_argv(c, *extra):
    return [c.bin, "train", *extra, *TRAIN_SMALL]


def config_train(rng, c):
    s = c.seeds
    p = mutated_json(rng, c, "config.json", pick_config(rng, s), "config", list(s.configs.values()))
    extra = rng.choice([[], [], ["--attention-mask", "document"], ["--recompute", "full"], ["--moe-capacity-factor", "1.0"]])
    c.argv = train_argv(c, "--config", p, "--data", s.datasets["byte"], *extra)


def plan_argv(c, config, cluster, devices="8", extra=()):
    argv = [c.bin, "plan", "--config", config, "--cluster", cluster]
    if devices is not None:
        argv += ["--devices", devices]
    argv += ["--global-batch", "16", "--seq-len", "256", "--top", "2", *extra]
    return argv


def with_json(rng, c, argv):
    if rng.random() < 0.5:
        c.plan_json = True
        return argv + ["--json"]
    return argv


def config_plan(rng, c):
    s = c.seeds
    p = mutated_json(rng, c, "config.json", pick_config(rng, s), "config", list(s.configs.values()))
    c.argv = with_json(rng, c, plan_argv(c, p, s.clusters["dgx-h100"]))


def cluster(rng, c):
    s = c.seeds
    name = rng.choice(sorted(s.clusters))
    p = mutated_json(rng, c, "cluster.json", s.clusters[name], "cluster", list(s.clusters.values()))
    config = s.configs[rng.choice(["llama_tiny", "mixtral_tiny", "mixtral-8x7b"])]
    # Without --devices the plan covers the whole cluster: only for the 2-device one (its mutations
    # may ask for many more, which the planner must bound).
    devices = None if name == "cpu-2core" and rng.random() < 0.5 else rng.choice(["1", "2", "8"])
    c.argv = with_json(rng, c, plan_argv(c, config, p, devices))


def number_text(rng, m, pool=None):
    v = rng.choice(pool or ["0", "-1", "1", "3", "2147483647", "2147483648", "4294967296", "4294967297",
                            "1000000000000", "9223372036854775807", "9223372036854775808", "18446744073709551617",
                            "-9223372036854775808", "1e3", "1.5", "nan", "inf", "-inf", "0x10", "", " 4", "4 ",
                            "1e308", "1e-320", "99999999999999999999999999", "+2", "2,2"])
    try:
        m.numbers.append(int(v))
    except ValueError:
        pass
    return v


def set_flags(rng, c, argv, flags):
    """Replaces (or adds) 1-2 of `flags` in argv with odd numbers."""
    argv = list(argv)
    for _ in range(rng.choice([1, 1, 2])):
        flag = rng.choice(flags)
        v = number_text(rng, c.m)
        c.m.note("%s %r" % (flag, v), flag.lstrip("-"))
        argv = put_flag(argv, flag, v)
    return argv


def put_flag(argv, flag, value):
    """argv with `flag` set to `value` (replaced where it is, else added)."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def plan_options(rng, c):
    s = c.seeds
    argv = plan_argv(c, s.configs[rng.choice(["mixtral_tiny", "llama_tiny", "mixtral-8x7b"])], s.clusters["dgx-h100"])
    c.argv = with_json(rng, c, set_flags(rng, c, argv, ["--global-batch", "--seq-len", "--devices", "--top",
                                                        "--imbalance"]))


LAYOUT_AXES = ["tp", "cp", "ep", "etp", "pp", "vpp", "zero", "mb"]


def layout_word(rng):
    r = rng.random()
    if r < 0.6:
        return rng.choice(LAYOUT_AXES) + rng.choice(["1", "2", "4", "8", "0", "3", "16", "64", "2147483647", "2147483648",
                                                     "999999999", "4294967296", "", "-1", "1e3", "00002", "²"])
    if r < 0.8:
        return rng.choice(["recompute=", "cp-comm="]) + rng.choice(["none", "selective", "full", "p2p", "a2a", "a2a+p2p",
                                                                    "", "FULL", "p2p,a2a"])
    return rng.choice(["sp", "nosp", "dp2", "tp", "=", "tp2=", "tp 2", "\u00a0tp2", "etp2etp2", "zero9"])


def layout(rng, c):
    s = c.seeds
    words = mu.mutate_words(rng, rng.choice([[], ["tp2", "pp2"], ["tp1", "cp2", "ep2", "etp1", "zero1", "mb1"],
                                             ["recompute=selective", "sp", "cp-comm=a2a"]]), [lambda: layout_word(rng)], c.m)
    spec = (" ".join(words) if rng.random() < 0.8 else "\t".join(words))[:MAX_ARG]
    config = s.configs[rng.choice(["mixtral_tiny", "llama_tiny", "mixtral-8x7b", "qwen2_moe_8e"])]
    c.argv = with_json(rng, c, plan_argv(c, config, s.clusters["dgx-h100"], extra=["--layout", spec]))


def plan_file(rng, c):
    s = c.seeds
    name = rng.choice(sorted(s.plans))
    p = mutated_json(rng, c, "plan.json", s.plans[name], "plan", list(s.plans.values()))
    config = s.configs["llama_tiny" if name == "tiny" else "mixtral_tiny"]
    c.argv = [c.bin, "train", "--plan", p, "--config", config, "--data", s.datasets["byte"], "--steps", "1",
              "--threads", "1", "--memory-limit-gb", "0.25", "--quiet"]


def run_config(rng, c):
    s = c.seeds
    p = mutated_json(rng, c, "run.json", s.path("run_config.json"), "run-config",
                     [s.path("run_config.json"), s.plans["tiny"]])
    # --steps and --threads on the command line win: a mutated step count is a long run, not a bug.
    c.argv = [c.bin, "train", "--run-config", p, "--config", s.configs["llama_tiny"], "--data", s.datasets["byte"],
              "--steps", "1", "--threads", "1", "--memory-limit-gb", "0.25"]


LATEST = ["", "step-999", "step-0", "step--1", "step-99999999999999999999", "../../..", "/", "step-2\n\n",
          "step-2 ", "x" * 5000, "\x00", "step-1\x00step-2", "metadata.json", "latest"]


def fix_metadata(ck_step, shard_name, data):
    """Updates metadata.json's size and checksum of a mutated shard so that the reader gets to it."""
    meta_path = os.path.join(ck_step, "metadata.json")
    try:
        meta = json.loads(read(meta_path))
        for f in meta["files"]:
            if f["name"] == shard_name:
                f["bytes"] = len(data)
                f["checksum"] = mu.checksum_hex(data)
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=1)
    except (ValueError, KeyError, TypeError):
        pass


def checkpoint(rng, c):
    s = c.seeds
    names = sorted(s.checkpoints)
    src = rng.choices(names, [{"one": 3, "two": 2, "gpt2": 1, "export": 2}[n] for n in names])[0]
    ck = os.path.join(c.dir, "ck")
    shutil.copytree(s.checkpoints[src], ck)
    if src == "export":
        step = ck
        files = {"config.json": 3, "model.safetensors": 3, "optimizer.safetensors": 2, "trainer_state.json": 3,
                 "tokenizer.json": 1}
    else:
        step = os.path.join(ck, read(os.path.join(ck, "latest")).decode().strip())
        files = {"metadata.json": 5, "trainer_state.json": 3, "config.json": 3, "latest": 1, "tokenizer.json": 1}
        for f in sorted(os.listdir(step)):
            if f.endswith(".safetensors"):
                files[f] = 2
    names = sorted(files)
    target = rng.choices(names, [files[n] for n in names])[0]
    path = os.path.join(ck, "latest") if target == "latest" else os.path.join(step, target)
    c.m.note("seed checkpoint %s, file %s" % (src, target), target)
    if target == "latest":
        v = rng.choice(LATEST)
        c.m.note("latest -> %r" % v[:40])
        with open(path, "w") as f:
            f.write(v)
    elif target.endswith(".safetensors"):
        data = mu.mutate_safetensors(rng, read(path), c.m)
        with open(path, "wb") as f:
            f.write(data)
        if src != "export" and rng.random() < 0.7:
            fix_metadata(step, target, data)
            c.m.note("metadata's size and checksum updated")
    else:
        family = {"metadata.json": "metadata", "trainer_state.json": "state", "config.json": "config",
                  "tokenizer.json": "tokenizer"}[target]
        pool = [os.path.join(s.checkpoints[n], "step-2", target) for n in s.checkpoints if n != "export"]
        if family == "config":
            pool += list(s.configs.values())
        keys, strings = vocabulary("ck-" + family, pool)
        data = mu.mutate_json_text(rng, read(path).decode("utf-8"), c.m, keys, strings, 1)
        with open(path, "wb") as f:
            f.write(data)

    cmds = ["info", "export", "resume", "init", "generate"] + (["resume-mpi"] if c.mpi_ok and src in ("one", "two") else [])
    cmd = rng.choices(cmds, [3, 2, 3, 1, 2, 0.3][:len(cmds)])[0]
    data_args = ["--data", s.datasets["byte"], "--micro-batch", "2", "--seq-len", "16", "--threads", "1",
                 "--memory-limit-gb", "0.25", "--quiet"]
    if cmd == "info":
        c.argv = [c.bin, "ckpt", "info", ck]
    elif cmd == "export":
        c.argv = [c.bin, "ckpt", "export", ck, "--hf", os.path.join(c.dir, "out")] + \
            (["--optimizer"] if rng.random() < 0.5 else [])
    elif cmd in ("resume", "resume-mpi"):
        c.argv = [c.bin, "train", "--resume", ck, "--steps", "3"] + data_args
        c.mpi = cmd == "resume-mpi"
        if c.mpi:
            c.argv += ["--tp", "2"] if rng.random() < 0.5 else []
    elif cmd == "init":
        config = s.configs[{"one": "llama_tiny", "two": "mixtral_tiny", "gpt2": "gpt2_tiny", "export": "llama_tiny"}[src]]
        c.argv = [c.bin, "train", "--init-from", ck, "--config", config, "--steps", "1"] + data_args
    else:
        c.argv = [c.bin, "generate", "--checkpoint", ck, "--prompt", "the", "--max-new-tokens", "4", "--threads", "1"]
    c.m.note("command: %s" % cmd)


HOSTILE_TEXT = ["\x00", "\ufeff", "\ud7ff", "\U0010ffff", "\u0301" * 2000, "a" * 200000, " " * 100000, "\n" * 1000,
                "<|endoftext|>" * 100, "<s></s><unk>", "%\n%\n%\n", "\r\n" * 500, "😀" * 3000, "\u202e", "\t\u3000\u00a0",
                "0123456789" * 1000, "'s'S'RE'" * 50]


def hostile_text(rng, base, m):
    if rng.random() < 0.5:
        t = rng.choice(HOSTILE_TEXT)
        i = rng.randrange(len(base) + 1)
        m.note("text: inserted %r... (%d chars) at %d" % (t[:10], len(t), i))
        return (base[:i] + t + base[i:]).encode("utf-8", "surrogatepass")
    m.note("text: bytes mutated")
    data = base.encode()
    for _ in range(rng.choice([1, 4, 32])):
        i = rng.randrange(len(data))
        data = data[:i] + rng.choice([b"\xff", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\x00",
                                      b"\xf4\x90\x80\x80", b"\xc0\xaf"]) + data[i:]
    return data


def tokenizer(rng, c):
    s = c.seeds
    if not s.tokenizers:  # no `tokenizers` package: hostile text through the byte tokenizer only
        text = c.write("text.txt", hostile_text(rng, read(s.path("small.txt")).decode(), c.m))
        c.argv = [c.bin, "data", "prepare", "--input", text, "--output", os.path.join(c.dir, "out"), "--threads", "1"]
        return
    text_path = s.path("small.txt")
    r = rng.random()
    names = sorted(s.tokenizers)
    if r < 0.15:  # the text
        text_path = c.write("text.txt", hostile_text(rng, read(text_path).decode(), c.m))
        tok = [s.tokenizers[rng.choice(names)]]
    elif r < 0.25:  # GPT-2's vocab.json + merges.txt
        tok = ["gpt2", "--vocab", s.path("tok", "vocab.json"), "--merges", s.path("tok", "merges.txt")]
        if rng.random() < 0.5:
            tok[2] = mutated_json(rng, c, "vocab.json", s.path("tok", "vocab.json"), "vocab", [s.path("tok", "vocab.json")])
        else:
            c.m.note("merges.txt mutated")
            tok[4] = c.write("merges.txt", mu.mutate_bytes(rng, read(s.path("tok", "merges.txt")), c.m))
    else:
        name = rng.choice(names)
        tok = [mutated_json(rng, c, "tokenizer.json", s.tokenizers[name], "hf-tokenizer", list(s.tokenizers.values()))]
    c.argv = [c.bin, "data", "prepare", "--input", text_path, "--output", os.path.join(c.dir, "out"), "--threads", "1",
              "--tokenizer", *tok]
    if rng.random() < 0.25:
        c.argv += ["--eod-token", rng.choice(["<|endoftext|>", "</s>", "<s>", "", "hello", "\u0120the", "<0x00>", "x" * 999])]


def dataset(rng, c):
    s = c.seeds
    base = "hf" if "hf" in s.datasets and rng.random() < 0.25 else "byte"
    prefix = os.path.join(c.dir, "d")
    for ext in (".bin", ".idx", ".tokenizer.json"):
        shutil.copyfile(s.datasets[base] + ext, prefix + ext)
    target = rng.choices([".idx", ".bin", ".tokenizer.json"], [4, 1, 3])[0]
    c.m.note("seed dataset %s, file %s" % (base, target), target)
    data = read(prefix + target)
    if target == ".idx":
        data = mu.mutate_idx(rng, data, c.m)
    elif target == ".bin":
        data = mu.mutate_bytes(rng, data, c.m)
    else:
        pool = [s.datasets[n] + ".tokenizer.json" for n in s.datasets]
        keys, strings = vocabulary("dataset-tokenizer", pool)
        data = mu.mutate_json_text(rng, data.decode("utf-8"), c.m, keys, strings)
    with open(prefix + target, "wb") as f:
        f.write(data)
    cmd = rng.choice(["info", "decode", "train", "train"] if base == "byte" else ["info", "decode"])
    if cmd == "info":
        c.argv = [c.bin, "data", "info", "--data", prefix]
    elif cmd == "decode":
        c.argv = [c.bin, "data", "decode", "--data", prefix, "--first", "3"] + (["--json"] if rng.random() < 0.5 else [])
    else:
        extra = rng.choice([["--data", prefix], ["--data", prefix, "--attention-mask", "document"],
                            ["--data", s.datasets["byte"], "--eval-data", prefix, "--eval-iters", "1"],
                            ["--data", "1 %s 1 %s" % (s.datasets["byte"], prefix)]])
        c.argv = train_argv(c, "--config", s.configs["llama_tiny"], *extra)
    c.m.note("command: data %s" % cmd if cmd != "train" else "command: train")


def blend_weight(rng, m):
    return number_text(rng, m, ["1", "0.5", "0", "-1", "1e308", "1e-320", "nan", "inf", "-inf", "1e999", "0x1p3",
                                "1e", "", "2147483648", "9" * 400, "1,5", "+0.1", ".5", "5e-324", "-0"])


def blend(rng, c):
    s = c.seeds
    # relative to the case directory (the command's working directory): many parts fit in one argument
    prefixes = [os.path.relpath(p, c.dir) for p in [s.datasets["byte"], s.datasets["byte2"]] + s.aliases +
                ([s.datasets["hf"]] if "hf" in s.datasets else [])]
    words = []
    for _ in range(rng.choice([1, 2, 2, 3, 4])):
        words += [rng.choice(["1", "0.5", "2", "0.25"]), rng.choice(prefixes)]

    def word():
        return rng.choice([lambda: blend_weight(rng, c.m), lambda: rng.choice(prefixes),
                           lambda: rng.choice(["nosuch", "/", "d", "1 " * 3, s.datasets["byte"] + ".bin", "x" * 5000])])()
    if rng.random() < 0.1:  # many parts
        words = []
        for k in range(rng.choice([200, 5000])):
            words += [blend_weight(rng, c.m) if k % 50 == 0 else "1", prefixes[k % len(prefixes)]]
        c.m.note("%d parts" % (len(words) // 2))
    words = mu.mutate_words(rng, words, [word], c.m)
    spec = rng.choice([" ", "  ", "\t", "\n"]).join(words)[:MAX_ARG]
    c.blend = True
    which = "--eval-data" if rng.random() < 0.2 else "--data"
    data = ["--data", s.datasets["byte"], "--eval-data", spec, "--eval-iters", "1"] if which == "--eval-data" \
        else ["--data", spec]
    c.argv = train_argv(c, "--config", s.configs["llama_tiny"], *data)
    c.m.note("%s %r" % (which, spec[:120]), which.lstrip("-"))


MAX_ARG = 100000  # Linux takes at most 128 KiB in one argument


def train_options(rng, c):
    s = c.seeds
    if rng.random() < 0.25 and "one" in s.checkpoints:
        argv = [c.bin, "generate", "--checkpoint", s.checkpoints["one"], "--prompt", "the", "--max-new-tokens", "4",
                "--threads", "1"]
        for _ in range(rng.choice([1, 2])):
            flag = rng.choice(["--max-new-tokens", "--temperature", "--top-k", "--seed"])
            pool = None
            if flag == "--max-new-tokens":  # a long generation is not a bug: no large positive counts
                pool = ["0", "-1", "-2147483649", "18446744073709551617", "1e3", "nan", "", "3x"]
            v = number_text(rng, c.m, pool)
            c.m.note("%s %r" % (flag, v), flag.lstrip("-"))
            argv = put_flag(argv, flag, v)
        c.argv = argv
        return
    argv = train_argv(c, "--config", s.configs[rng.choice(["llama_tiny", "mixtral_tiny", "gpt2_tiny"])],
                      "--data", s.datasets["byte"])
    # Counts of work (--steps, --eval-iters, --global-batch) get no large positive values: a long run is not a bug.
    flags = ["--micro-batch", "--seq-len", "--lr", "--warmup", "--tp", "--pp", "--vpp", "--cp", "--zero", "--ep",
             "--etp", "--bucket-mb", "--memory-limit-gb", "--grad-clip", "--beta1", "--beta2", "--eps", "--seed",
             "--max-skipped-steps", "--loss-spike-factor", "--save-every", "--keep-last", "--moe-capacity-factor",
             "--moe-aux-loss-coef", "--moe-router-bias-update-rate", "--cp-a2a-size", "--weight-decay", "--min-lr"]
    argv = set_flags(rng, c, argv, flags)
    if rng.random() < 0.2:
        flag = rng.choice(["--steps", "--global-batch", "--eval-iters", "--eval-every"])
        v = rng.choice(["0", "-1", "-9223372036854775808", "18446744073709551617", "3", "1e2", "nan"])
        c.m.note("%s %r" % (flag, v), flag.lstrip("-"))
        if v.lstrip("-").isdigit():
            c.m.numbers.append(int(v))
        argv = put_flag(argv, flag, v) + (["--eval-data", s.datasets["byte2"]] if flag.startswith("--eval") else [])
    if rng.random() < 0.15:
        argv += ["--pp-layers", rng.choice(["1,1", "2,0", "-1,3", "2147483648,1", "1,,1", "", "1,1,1,1", "4294967298"])]
        c.m.note("--pp-layers %r" % argv[-1], "pp-layers")
    c.argv = argv


KINDS = {
    "config-train": (config_train, 14),
    "config-plan": (config_plan, 10),
    "cluster": (cluster, 7),
    "plan-options": (plan_options, 5),
    "layout": (layout, 6),
    "plan-file": (plan_file, 5),
    "run-config": (run_config, 5),
    "checkpoint": (checkpoint, 18),
    "tokenizer": (tokenizer, 10),
    "dataset": (dataset, 8),
    "blend": (blend, 6),
    "train-options": (train_options, 6),
}


# ---- probes: the inputs issue 35 reports, run before the random cases of every run (not counted in --cases)

def json_with(path, changes):
    """The JSON file at `path` with `changes` applied to its top level."""
    j = json.loads(read(path))
    j.update(changes)
    return json.dumps(j, indent=1)


def probe_config(c, seed, changes, command):
    s = c.seeds
    p = c.write("config.json", json_with(s.configs[seed], changes))
    c.m.note("%s with %s" % (seed, json.dumps(changes)), list(changes)[0])
    c.m.numbers += [v for v in changes.values() if isinstance(v, int)]
    if command == "train":
        c.argv = train_argv(c, "--config", p, "--data", s.datasets["byte"])
    else:
        c.argv = [c.bin, "plan", "--config", p, "--cluster", s.clusters["dgx-h100"], "--global-batch", "64",
                  "--seq-len", "4096", "--top", "1"] + command


def probe_checkpoint(c, name, file, edit, argv_of):
    s = c.seeds
    ck = os.path.join(c.dir, "ck")
    shutil.copytree(s.checkpoints[name], ck)
    path = os.path.join(ck, "step-2", file)
    j = json.loads(read(path))
    edit(j)
    with open(path, "w") as f:
        json.dump(j, f, indent=1)
    c.m.note("checkpoint %s, %s edited" % (name, file), file)
    c.argv = argv_of(ck)


def _meta_shape(j):
    next(iter(j["tensors"].values()))["shape"] = [1e300, 4]


def _meta_world(j):
    j["layout"]["world"] = "2"


def _state_step(j):
    j["step"] = "2"


def _cluster_source(c):
    p = c.write("cluster.json", json_with(c.seeds.clusters["dgx-h100"], {"source": 1}))
    c.argv = [c.bin, "plan", "--config", c.seeds.configs["mixtral-8x7b"], "--cluster", p, "--devices", "8",
              "--global-batch", "64", "--seq-len", "1024", "--top", "1"]


def _cluster_devices(c):
    p = c.write("cluster.json", json_with(c.seeds.clusters["dgx-h100"], {"nodes": 2**29, "devices_per_node": 8}))
    c.m.numbers += [2**29]
    c.argv = [c.bin, "plan", "--config", c.seeds.configs["mixtral-8x7b"], "--cluster", p, "--devices", "8",
              "--global-batch", "64", "--seq-len", "1024", "--top", "1"]


def _blend_1e308(c):
    s = c.seeds
    c.blend = True
    c.argv = train_argv(c, "--config", s.configs["llama_tiny"], "--data",
                        "1e308 %s 1e308 %s" % (s.datasets["byte"], s.datasets["byte2"]))


def _plan_global_batch(c):
    s = c.seeds
    c.argv = [c.bin, "plan", "--config", s.configs["mixtral-8x7b"], "--cluster", s.clusters["dgx-h100"], "--devices",
              "64", "--global-batch", "1000000000000", "--seq-len", "4096", "--top", "1"]


def _catastrophic_regex(c):
    s = c.seeds
    if "gpt2" not in s.tokenizers:
        c.argv = [c.bin, "data", "info", "--data", s.datasets["byte"]]
        return
    j = json.loads(read(s.tokenizers["gpt2"]))
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    tok = c.write("tokenizer.json", json.dumps(j))
    text = c.write("text.txt", "a" * 5000 + "!\n")
    c.argv = [c.bin, "data", "prepare", "--input", text, "--output", os.path.join(c.dir, "out"), "--tokenizer", tok,
              "--threads", "1"]
    c.expect = ("the message names the tokenizer file", lambda line: tok in line)


PROBES = {
    "intermediate_size 2^61 (train)": lambda c: probe_config(c, "llama_tiny", {"intermediate_size": 2**61}, "train"),
    "num_local_experts 2^31 (plan)": lambda c: probe_config(c, "mixtral-8x7b", {"num_local_experts": 2**31},
                                                            ["--devices", "8"]),
    "plan --global-batch 10^12": _plan_global_batch,
    "num_hidden_layers 100000 (plan, 64 devices)": lambda c: probe_config(c, "mixtral-8x7b",
                                                                         {"num_hidden_layers": 100000}, ["--devices", "64"]),
    "num_local_experts 10^6 (plan, 64 devices)": lambda c: probe_config(c, "mixtral-8x7b",
                                                                       {"num_local_experts": 1000000}, ["--devices", "64"]),
    "num_hidden_layers 10^7 (train)": lambda c: probe_config(c, "llama_tiny", {"num_hidden_layers": 10**7}, "train"),
    "hidden_size 2^31 (plan)": lambda c: probe_config(c, "mixtral-8x7b", {"hidden_size": 2**31}, ["--devices", "8"]),
    "intermediate_size 2^40 (plan)": lambda c: probe_config(c, "mixtral-8x7b", {"intermediate_size": 2**40},
                                                            ["--devices", "8"]),
    "num_hidden_layers 2^31 (train)": lambda c: probe_config(c, "llama_tiny", {"num_hidden_layers": 2**31}, "train"),
    "cluster nodes x devices_per_node = 2^32": _cluster_devices,
    "cluster 'source' a number": _cluster_source,
    "metadata.json shape 1e300 (ckpt info)": lambda c: probe_checkpoint(
        c, "one", "metadata.json", _meta_shape, lambda ck: [c.bin, "ckpt", "info", ck]),
    "metadata.json layout.world a string (ckpt info)": lambda c: probe_checkpoint(
        c, "one", "metadata.json", _meta_world, lambda ck: [c.bin, "ckpt", "info", ck]),
    "trainer_state.json step a string (--resume)": lambda c: probe_checkpoint(
        c, "one", "trainer_state.json", _state_step,
        lambda ck: [c.bin, "train", "--resume", ck, "--steps", "3", "--data", c.seeds.datasets["byte"],
                    "--micro-batch", "2", "--seq-len", "16", "--threads", "1", "--quiet"]),
    "blend 1e308 A 1e308 B": _blend_1e308,
    "catastrophic regex in tokenizer.json": _catastrophic_regex,
}
