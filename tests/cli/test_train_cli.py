"""origami train / dump / generate as a user runs them: bad input gives one clear message and a
non-zero exit; a checkpoint saves, resumes exactly, loads into generate; --help works."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

BIN = os.environ["ORIGAMI_BIN"]
FAILS = []


def run(*args, ok=True, contains=None):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    good = (p.returncode == 0) == ok and (contains is None or contains in out)
    if not ok:  # an error is exactly one 'error:' line naming the problem, never a crash
        good = good and out.count("error:") == 1 and p.returncode == 1
    print(("ok   " if good else "FAIL ") + " ".join(args[:2]) + (f"  -> {contains!r}" if contains else ""))
    if not good:
        FAILS.append(" ".join(args))
        print(out)
    return out


def main():
    tmp = tempfile.mkdtemp()
    try:
        text = os.path.join(tmp, "corpus.txt")
        with open(text, "w") as f:
            for i in range(60):
                f.write(f"fortune number {i}: the quick brown fox jumps over the lazy dog.\n%\n")
        data = os.path.join(tmp, "d")
        run("data", "prepare", "--input", text, "--output", data, "--tokenizer", "byte")
        cfg = {"model_type": "llama", "hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 40, "num_hidden_layers": 2, "vocab_size": 257, "max_position_embeddings": 64}
        cfg_path = os.path.join(tmp, "config.json")
        json.dump(cfg, open(cfg_path, "w"))

        def write_cfg(name, **changes):
            path = os.path.join(tmp, name)
            json.dump({**cfg, **changes}, open(path, "w"))
            return path

        common = ["--data", data, "--micro-batch", "2", "--seq-len", "16", "--threads", "1"]
        # --help everywhere.
        for cmd in (["train"], ["generate"], ["dump"], ["data", "prepare"]):
            run(*cmd, "--help", contains="usage: origami")
        # Bad input: one message naming the value or the file.
        run("train", "--config", cfg_path, "--seq-len", "16", "--data", os.path.join(tmp, "missing"), ok=False, contains="missing")
        shutil.copy(data + ".bin", os.path.join(tmp, "trunc.bin"))
        idx = open(data + ".idx", "rb").read()
        open(os.path.join(tmp, "trunc.idx"), "wb").write(idx[: len(idx) - 5])
        run("train", "--config", cfg_path, "--seq-len", "16", "--data", os.path.join(tmp, "trunc"), ok=False, contains="trunc.idx")
        run("train", "--config", write_cfg("heads.json", num_attention_heads=5), *common, ok=False,
            contains="must divide the hidden size")
        run("train", "--config", write_cfg("rope.json", rope_scaling={"type": "linear", "factor": 2.0}), *common,
            ok=False, contains="rope_scaling")
        run("train", "--config", write_cfg("mt.json", model_type="bert"), *common, ok=False, contains="bert")
        run("train", "--config", cfg_path, *common, "--lr", "-1", ok=False, contains="--lr must not be negative")
        run("train", "--config", cfg_path, *common, "--lr", "abc", ok=False, contains="'abc'")
        run("train", "--config", cfg_path, *common, "--global-batch", "3", ok=False, contains="multiple of --micro-batch")
        run("train", "--config", cfg_path, *common, "--seq-len", "100", ok=False, contains="maximum positions")
        run("train", "--config", cfg_path, *common, "--bogus", "1", ok=False, contains="--bogus")
        run("train", "--config", write_cfg("small_vocab.json", vocab_size=100), *common, ok=False, contains="vocab_size")

        # Save, then resume from the checkpoint: steps 1-4 + 5-8 equal steps 1-8 in one run
        # (constant schedule: a cosine schedule spans --steps, which differs between the runs).
        ck = os.path.join(tmp, "ck")
        full = os.path.join(tmp, "full.jsonl")
        part = os.path.join(tmp, "part.jsonl")
        opts = [*common, "--lr", "1e-2", "--warmup", "2", "--lr-schedule", "constant", "--global-batch", "4", "--seed", "5"]
        run("train", "--config", cfg_path, *opts, "--steps", "8", "--metrics", full)
        run("train", "--config", cfg_path, *opts, "--steps", "4", "--save", ck, "--metrics", part)
        run("train", "--init-from", ck, *opts, "--steps", "8", "--metrics", part, contains="resuming")
        a = [json.loads(l)["loss"] for l in open(full)]
        b = [json.loads(l)["loss"] for l in open(part)]
        same = len(a) == len(b) == 8 and all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a, b))
        print(("ok   " if same else "FAIL ") + f"resumed run equals the uninterrupted one: {a} vs {b}")
        if not same:
            FAILS.append("resume")
        for f in ("model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json", "tokenizer.json"):
            if not os.path.exists(os.path.join(ck, f)):
                FAILS.append("checkpoint lacks " + f)
        run("generate", "--checkpoint", ck, "--prompt", "fortune", "--max-new-tokens", "20", contains="fortune")

        # A safetensors file with a wrong shape, or a foreign tensor name, is rejected by name.
        st = open(os.path.join(ck, "model.safetensors"), "rb").read()
        n = struct.unpack("<Q", st[:8])[0]
        header = json.loads(st[8:8 + n])
        def rewrite(name, mutate):
            h = json.loads(json.dumps(header))
            mutate(h)
            hb = json.dumps(h).encode()
            hb += b" " * (-len(hb) % 8)
            path = os.path.join(tmp, name)
            open(path, "wb").write(struct.pack("<Q", len(hb)) + hb + st[8 + n:])
            return path
        def bad_shape(h):
            h["model.norm.weight"]["shape"] = [4, 6]
        def bad_name(h):
            h["model.normx.weight"] = h.pop("model.norm.weight")
        run("train", "--config", cfg_path, *common, "--init-from", rewrite("shape.safetensors", bad_shape), ok=False,
            contains="model.norm.weight")
        run("train", "--config", cfg_path, *common, "--init-from", rewrite("name.safetensors", bad_name), ok=False,
            contains="model.normx.weight")
    finally:
        shutil.rmtree(tmp)
    if FAILS:
        print("FAILED:", FAILS)
        sys.exit(1)
    print("all CLI checks passed")


main()
