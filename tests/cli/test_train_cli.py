"""origami train / dump / generate / ckpt as a user runs them: bad input gives one clear message and
a non-zero exit; a checkpoint saves (DIR/step-N, DIR/latest), resumes exactly (--resume from DIR,
DIR/step-N or its single-file export), gives its weights only with --init-from, exports to a
Hugging Face directory, loads into generate; --help works."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import LLAMA_TINY, byte_dataset  # noqa: E402

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


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILS.append(what)
    return ok


def same_losses(ref, path, what):
    """The losses of the metrics file `path` equal `ref` (8 steps, 1e-6 relative)."""
    got = [json.loads(l)["loss"] for l in open(path)] if os.path.exists(path) else []
    return check(len(ref) == len(got) == 8 and all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(ref, got)),
                 f"{what}: {ref} vs {got}")


def read_safetensors(path):
    """{name: list of floats} of an F32 safetensors file."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for k, v in header.items():
        if k != "__metadata__":
            a, b = v["data_offsets"]
            out[k] = list(struct.unpack("<%df" % ((b - a) // 4), raw[8 + n + a:8 + n + b]))
    return out


def main():
    tmp = tempfile.mkdtemp()
    try:
        data = byte_dataset(tmp, 60)
        cfg = LLAMA_TINY
        cfg_path = os.path.join(tmp, "config.json")
        json.dump(cfg, open(cfg_path, "w"))

        def write_cfg(name, **changes):
            path = os.path.join(tmp, name)
            json.dump({**cfg, **changes}, open(path, "w"))
            return path

        common = ["--data", data, "--micro-batch", "2", "--seq-len", "16", "--threads", "1"]
        # --help everywhere.
        for cmd in (["train"], ["generate"], ["dump"], ["data", "prepare"], ["ckpt"]):
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
        run("train", "--config", cfg_path, "--data", data, "--micro-batch", "2", "--seq-len", "100", ok=False,
            contains="maximum positions")
        run("train", "--config", cfg_path, *common, "--bogus", "1", ok=False, contains="--bogus")
        run("train", "--config", cfg_path, *common, "--grad-reduce-dtype", "fp16", ok=False,
            contains="--grad-reduce-dtype 'fp16' is not one of fp32, bf16")
        # One rank reduces no gradient: the option is accepted and says it changes nothing.
        run("train", "--config", cfg_path, *common, "--grad-reduce-dtype", "bf16", "--steps", "1",
            contains="--grad-reduce-dtype bf16 changes nothing here")
        run("train", "--config", write_cfg("small_vocab.json", vocab_size=100), *common, ok=False, contains="vocab_size")

        # Save, then resume from the checkpoint: steps 1-4 + 5-8 equal steps 1-8 in one run
        # (constant schedule: a cosine schedule spans --steps, which differs between the runs).
        ck = os.path.join(tmp, "ck")
        full = os.path.join(tmp, "full.jsonl")
        part = os.path.join(tmp, "part.jsonl")
        opts = [*common, "--lr", "1e-2", "--warmup", "2", "--lr-schedule", "constant", "--global-batch", "4", "--seed", "5"]
        run("train", "--config", cfg_path, *opts, "--steps", "8", "--metrics", full)
        run("train", "--config", cfg_path, *opts, "--steps", "4", "--save", ck, "--metrics", part)
        # --save DIR: DIR/step-4 holds every rank's shards and the run's files, DIR/latest names it.
        step4 = os.path.join(ck, "step-4")
        latest = open(os.path.join(ck, "latest")).read() if os.path.exists(os.path.join(ck, "latest")) else None
        check(latest == "step-4\n", f"{ck}/latest names the step saved: {latest!r}")
        for f in ("rank-00000.safetensors", "metadata.json", "config.json", "trainer_state.json", "tokenizer.json"):
            check(os.path.exists(os.path.join(step4, f)), f"checkpoint step-4 has {f}")
        state = json.load(open(os.path.join(step4, "trainer_state.json")))
        check(state.get("step") == 4, f"step-4/trainer_state.json says step {state.get('step')}")
        run("ckpt", "info", ck, contains="step: 4")
        # The resumed run (no --config: the checkpoint's config.json) saves into the same DIR: step-8
        # is added and becomes the latest, step-4 stays.
        run("train", "--resume", ck, *opts, "--steps", "8", "--metrics", part, "--save", ck, contains="resuming")
        a = [json.loads(l)["loss"] for l in open(full)]
        same_losses(a, part, "resumed run (--resume DIR) equals the uninterrupted one")
        latest = open(os.path.join(ck, "latest")).read()
        check(latest == "step-8\n" and os.path.isdir(step4), f"the resumed run adds step-8 as latest ({latest!r}), "
              f"step-4 stays: {sorted(os.listdir(ck))}")
        def resumes_equal(source, name, what):
            """--resume SOURCE from step 4 to 8 continues the first 4 steps' metrics like the uninterrupted run."""
            m = os.path.join(tmp, name)
            with open(m, "w") as f:
                f.writelines(open(part).readlines()[:4])
            run("train", "--resume", source, *opts, "--steps", "8", "--metrics", m, contains="resuming")
            same_losses(a, m, what)

        # --resume DIR/step-N: that step, not the latest.
        resumes_equal(step4, "part2.jsonl", "resumed from DIR/step-4 equals the uninterrupted one")

        # A run that fails in a step's validation loses no metrics row: validation comes before the
        # step's save, so the resume replays the step from the save before (saved first, step 4 would
        # resume at 5 with its row never written). Steps 2, 4, 6, 8 validate and save; step 4's
        # validation throws on rank 0 (a test hook), once.
        val = byte_dataset(tmp, 20, "val")
        ev = [*opts, "--eval-data", val, "--eval-every", "2", "--eval-iters", "1", "--save-every", "2"]
        ev_full, ev_part, ev_ck = (os.path.join(tmp, n) for n in ("ev_full.jsonl", "ev_part.jsonl", "ev_ck"))
        run("train", "--config", cfg_path, *ev, "--steps", "8", "--metrics", ev_full, "--save", ev_ck + "_full")
        env = {**os.environ, "ORIGAMI_TEST_FAIL": f"4:0:{os.path.join(tmp, 'ev_failed')}",
               "ORIGAMI_TEST_FAIL_IN": "validation"}
        p = subprocess.run([BIN, "train", "--config", cfg_path, *ev, "--steps", "8", "--metrics", ev_part, "--save",
                            ev_ck], capture_output=True, text=True, timeout=300, env=env)
        latest = open(os.path.join(ev_ck, "latest")).read() if os.path.exists(os.path.join(ev_ck, "latest")) else None
        check(p.returncode != 0 and "step 4's validation" in p.stderr and latest == "step-2\n",
              f"a failure in step 4's validation ends the run before step 4's save (exit {p.returncode}, "
              f"latest {latest!r}): {p.stderr.strip()[-300:]}")
        run("train", "--resume", ev_ck, *ev, "--steps", "8", "--metrics", ev_part, "--save", ev_ck, contains="resuming")
        want, got = ([json.loads(l) for l in open(f)] if os.path.exists(f) else [] for f in (ev_full, ev_part))
        check([r["step"] for r in got] == list(range(1, 9)) and [r.get("val_loss") for r in got] == [
              r.get("val_loss") for r in want] and [r["loss"] for r in got] == [r["loss"] for r in want],
              f"the resumed run's rows are the uninterrupted run's, every step once with its validation loss: "
              f"{[(r['step'], r.get('val_loss')) for r in got]}")

        # ckpt export: a Hugging Face directory; with --optimizer the single-file checkpoint, which
        # --resume continues like the sharded one.
        exp = os.path.join(tmp, "exp")
        run("ckpt", "export", step4, "--hf", exp, "--optimizer", contains="exported")
        for f in ("model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json", "tokenizer.json"):
            check(os.path.exists(os.path.join(exp, f)), f"export --optimizer has {f}")
        run("ckpt", "info", exp, contains="step: 4")
        resumes_equal(exp, "part3.jsonl", "resumed from the single-file export equals the uninterrupted one")
        hf = os.path.join(tmp, "hf")
        run("ckpt", "export", ck, "--hf", hf, contains="exported")
        check(sorted(os.listdir(hf)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"],
              f"export without --optimizer: weights, config and tokenizer (with its eos) only: {sorted(os.listdir(hf))}")

        # --init-from CKPT: the checkpoint's weights only, a new run from step 1 (the schedule's
        # step-1 learning rate, fresh AdamW). One step on one micro-batch: its loss is that of the
        # checkpoint's weights on batch 0, as dump computes it, and the same from the export's
        # model.safetensors; a run from the seed starts elsewhere.
        one = [*common, "--lr", "1e-2", "--warmup", "2", "--lr-schedule", "constant", "--steps", "1"]
        init_m = os.path.join(tmp, "init.jsonl")
        out = run("train", "--init-from", step4, *one, "--metrics", init_m)
        rows = [json.loads(l) for l in open(init_m)] if os.path.exists(init_m) else []
        check("resuming" not in out and [r["step"] for r in rows] == [1] and rows[0]["lr"] == json.loads(
            open(full).readline())["lr"], f"--init-from CKPT starts a new run at step 1 without resuming: "
            f"{[(r['step'], r['lr']) for r in rows]}")
        dump = os.path.join(tmp, "dump.safetensors")
        run("dump", "--init-from", step4, "--data", data, "--micro-batch", "2", "--seq-len", "16", "--threads", "1",
            "--out", dump)
        init_st = os.path.join(tmp, "init_st.jsonl")
        run("train", "--config", cfg_path, "--init-from", os.path.join(exp, "model.safetensors"), *one,
            "--metrics", init_st)
        seed_m = os.path.join(tmp, "seed.jsonl")
        run("train", "--config", cfg_path, *one, "--seed", "5", "--metrics", seed_m)
        l_ck, l_st, l_seed = (json.loads(open(p).readline())["loss"] for p in (init_m, init_st, seed_m))
        l_dump = float(read_safetensors(dump)["loss"][0])
        check(abs(l_ck - l_dump) <= 1e-6 * abs(l_dump) and abs(l_ck - l_st) <= 1e-6 * abs(l_st)
              and abs(l_ck - l_seed) > 1e-3, f"--init-from CKPT step-1 loss {l_ck} = dump of the checkpoint's weights "
              f"{l_dump} = --init-from its model.safetensors {l_st}, not the seeded start's {l_seed}")
        # --init-from and --resume together: one message.
        out = run("train", "--init-from", step4, "--resume", ck, *opts, "--steps", "8", ok=False, contains="--resume")
        check("--init-from" in out, "the message names both --init-from and --resume")
        for source in (ck, exp):  # (the prompt is echoed: the text must go on past it)
            p = subprocess.run([BIN, "generate", "--checkpoint", source, "--prompt", "fortune", "--max-new-tokens", "20"],
                               capture_output=True, text=True, timeout=300)
            check(p.returncode == 0 and p.stdout.startswith("fortune") and len(p.stdout.rstrip("\n")) > len("fortune"),
                  f"generate from {source} continues the prompt: {p.stdout!r} {p.stderr[-200:]!r}")

        # A safetensors file with a wrong shape, or a foreign tensor name, is rejected by name.
        st = open(os.path.join(exp, "model.safetensors"), "rb").read()
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
