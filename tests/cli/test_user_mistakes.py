"""User mistakes found by probing the commands as a user would (one rank each): each is one clear
message and exit 1 before any long work, where before it lost work, did nothing silently or crashed
late. Every case here failed before its fix:

- `ckpt export --hf` into a checkpoint (a step or the --save root) replaced its config.json and
  tokenizer.json; `train --save` somewhere unwritable trained every step, then failed at the save;
- a run config naming another file of options ("plan", "run-config") was accepted and ignored; a
  cluster file's misspelt key left its setting at the default;
- `plan --layout` took the last of two words fixing one axis ("tp2 tp4", "sp nosp"), listed tp1
  layouts for "sp" and cp1 ones for "cp-comm=a2a"; `--imbalance` was accepted for a dense model;
- `--resume` onto data of another tokenizer only warned, and the checkpoint then decoded with it; a
  resume with another --steps (cosine), --lr, --seed or data order changed the run without a word;
- `dump --step` overflowed to a negative window; `--seed` past 2^63 was "not an integer" and -1 was
  accepted; `profile --out`, `plan --plot` and `plot --out` failed only after their work;
  `data prepare --output DIR/` wrote hidden files DIR/.bin; `plot --out x.svg` wrote PNG bytes;
- an empty value (`--resume=`, `--resume "$UNSET"`, a run config's `"resume": ""`) read as not given:
  a new run started from step 0 (and saved over the old run's steps), `--save=` saved nothing;
- `plot` with standard input closed wrote its PNG to /dev/null; a path that cannot be looked up (a name
  too long, a file where a directory should be) was "no such file"; one pipeline stage refused more
  than 16383 micro-batches a step (an MPI tag limit it does not use), and a document step bounded at
  2^31 micro-batches wrapped to a negative count;
- `plan` never tried TP without sequence parallelism (so a --seq-len TP does not divide lost every TP
  layout), listed a dense model's dp1 layouts once per ZeRO stage, said "no layout" without the
  reason for `vocab` on one device; `train --plan` refused `--batching documents` and
  `--micro-batch-tokens` given beside it, and from a run config still did; a run config's value for
  a key the plan gives (`precision`) was ignored without a word, and one of the wrong type behind a
  flag was not checked;
- `--beta2 0.99999999` (1 as a float: the second moment never grew, the loss went to 4e7) and
  `--eps 1e-50` (0 as a float: NaN weights) were accepted;
- `train --save DIR` without --resume, into a DIR an earlier run filled, replaced that run's steps
  without a word (now an error unless --overwrite-save); `--resume X --save X` with X an export or a
  step (not a run's directory) started again from step 0 and saved inside it; `--save DIR/` against
  `--resume DIR` failed the first time; `--save` a file; an --optimizer export of a run on a Hub
  tokenizer could not be resumed on its data, while the same Hub file with another end-of-document
  token could; a resume on a dataset prepared again at the same prefix, and `--eval-data` that is
  `--data`, said nothing; `--bucket-mb` below one float silently became one bucket of everything;
  `ckpt export --max-shard-gb 1e300` overflowed to one tensor per file; a resume with another --config of
  the same shapes (another RoPE base, norm epsilon, top-k) said nothing; an option given twice kept the
  last value, and --min-lr beside a constant schedule or a plan's layout naming a run config did nothing;
- a dangling `latest` was reported as "no latest"; `ckpt info` with two checkpoints took one;
- routing options at their default value on a dense model, `--mtbf-hours` without `--save-every
  auto` and `launch --cluster` without `--shrink` were accepted and did nothing; `launch` asked for
  --save when given `--save=DIR`; `origami foo` exited 2 (every other mistake exits 1);
- `--save-every AUTO` was "must be an integer", `--cp-a2a-size 0` was taken as not given, `--moe-drop-policy x`
  was told what a drop policy needs, and `launch --np 0` asked for --save."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import LLAMA_TINY, ORIGAMI, byte_dataset, check, expect_error, run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# launch runs mpirun (as root here, in CI's containers)
os.environ.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_WAIT_POLICY": "passive"})
CLUSTER = os.path.join(ROOT, "configs", "clusters", "cpu-2core.json")
GPT2 = {"model_type": "gpt2", "vocab_size": 257, "n_embd": 24, "n_layer": 2, "n_head": 4, "n_positions": 64}
MIXTRAL = {"model_type": "mixtral", "vocab_size": 257, "hidden_size": 24, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 64}


def write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


def main():
    tmp = tempfile.mkdtemp()
    try:
        data = byte_dataset(tmp, 40)
        llama, gpt2, moe = (write(os.path.join(tmp, n + ".json"), c)
                            for n, c in (("llama", LLAMA_TINY), ("gpt2", GPT2), ("mixtral", MIXTRAL)))
        short = ["--data", data, "--micro-batch", "2", "--seq-len", "16", "--threads", "1", "--quiet"]
        ck = os.path.join(tmp, "ck")
        run("train", "--config", llama, *short, "--steps", "2", "--save", ck)
        step2 = os.path.join(ck, "step-2")

        # Checkpoints and outputs.
        for target in (step2, ck):
            expect_error("ckpt export into a checkpoint (%s)" % os.path.basename(target),
                         ["ckpt", "export", step2, "--hf", target],
                         "'%s' is a checkpoint (%s): export into a new directory"
                         % (target, "a --save directory" if target == ck else "a step of one"))
        blocker = os.path.join(tmp, "a_file")
        open(blocker, "w").close()
        expect_error("--save under a file", ["train", "--config", llama, *short, "--steps", "50", "--save",
                                             os.path.join(blocker, "ck")],
                     "cannot create checkpoint directory '%s/ck': Not a directory" % blocker)
        dangling = os.path.join(tmp, "dangling")
        os.makedirs(dangling)
        with open(os.path.join(dangling, "latest"), "w") as f:
            f.write("step-99\n")
        expect_error("a latest naming a removed step", ["ckpt", "info", dangling],
                     "'%s' holds no checkpoint: its latest names 'step-99', which is not a committed step (no "
                     "step-99/metadata.json), and no other step-N is" % dangling)
        expect_error("ckpt info with two checkpoints", ["ckpt", "info", ck, "--checkpoint", step2],
                     "two checkpoints given: '%s' and --checkpoint '%s'; give one" % (ck, step2))

        # Resuming onto data of another tokenizer (a Hugging Face BPE file against the byte one).
        other = os.path.join(tmp, "other")
        tok = {"version": "1.0", "added_tokens": [{"id": 4, "content": "<eos>", "special": True}],
               "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
               "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "d": 3}, "merges": []}}
        text = os.path.join(tmp, "abcd.txt")
        with open(text, "w") as f:
            f.write("abcd " * 400)
        run("data", "prepare", "--input", text, "--output", other, "--tokenizer", write(os.path.join(tmp, "t.json"), tok),
            "--eod-token", "<eos>")
        expect_error("--resume onto data of another tokenizer",
                     ["train", "--resume", ck, "--data", other, "--micro-batch", "2", "--seq-len", "16", "--steps", "4"],
                     "--resume '%s' trained on another tokenizer (%s/tokenizer.json) than --data's (%s.tokenizer.json); "
                     "to train its weights on this data, start from them with --init-from" % (step2, step2, other))

        # ...and onto its own data from an --optimizer export, whose tokenizer.json is the Hub file
        # itself (the dataset's wraps it): the same token ids, so it resumes.
        run("train", "--config", llama, *short, "--data", other, "--steps", "2", "--save", os.path.join(tmp, "hub"))
        hub_export = os.path.join(tmp, "hub_export")
        run("ckpt", "export", os.path.join(tmp, "hub"), "--hf", hub_export, "--optimizer")
        run("train", "--resume", hub_export, *short, "--data", other, "--steps", "3")
        print("ok   an --optimizer export of a run on a Hub tokenizer resumes on its data")
        # The same Hub file with another end-of-document token is another tokenizer.
        other_eod = os.path.join(tmp, "other_eod")
        run("data", "prepare", "--input", text, "--output", other_eod, "--tokenizer", os.path.join(tmp, "t.json"),
            "--eod-token", "a")
        hub2 = os.path.join(tmp, "hub", "step-2")
        expect_error("--resume onto data of another end-of-document token",
                     ["train", "--resume", os.path.join(tmp, "hub"), *short, "--data", other_eod, "--steps", "4"],
                     "--resume '%s' trained on another tokenizer (%s/tokenizer.json) than --data's (%s.tokenizer.json); "
                     "to train its weights on this data, start from them with --init-from" % (hub2, hub2, other_eod))

        # --save into another run's steps: a run that does not resume would replace them; a checkpoint
        # (a step, an export) is no run directory, and its resume started from step 0 before.
        expect_error("--save into another run's directory", ["train", "--config", llama, *short, "--steps", "2",
                                                              "--save", ck],
                     "--save '%s' holds another run's checkpoints (%s), whose steps this run would replace: continue "
                     "it with --resume %s, save elsewhere, or replace them with --overwrite-save" % (ck, step2, ck))
        # Resuming another checkpoint (not one of --save's own steps) would replace them too.
        expect_error("--resume elsewhere and --save into another run's directory",
                     ["train", *short, "--steps", "3", "--resume", hub_export, "--save", ck],
                     "--save '%s' holds another run's checkpoints (%s), whose steps this run (resuming '%s', not that "
                     "directory or one of its steps) would replace: continue it with --resume %s, save elsewhere, or "
                     "replace them with --overwrite-save" % (ck, step2, hub_export, ck))
        for target in (step2, hub_export):
            expect_error("--resume and --save a checkpoint (%s)" % os.path.basename(target),
                         ["train", *short, "--steps", "3", "--resume", target, "--save", target],
                         "--save '%s' is a checkpoint, not a run's directory: save into a directory of step-N "
                         "checkpoints (a new one, or the run's own --save)" % target)
        first = os.path.join(tmp, "first")
        p = run("train", "--config", llama, *short, "--steps", "2", "--resume", first, "--save", first + "/")
        check("no checkpoint in '%s' yet: starting at step 0" % first in p.stdout,
              "--resume DIR --save DIR/ starts the run the first time:\n" + p.stdout + p.stderr)
        expect_error("--bucket-mb below one float", ["train", "--config", llama, *short, "--bucket-mb", "1e-7"],
                     "--bucket-mb must hold one float (at least 4 bytes: 3.815e-06 MiB), got 1e-07")
        expect_error("--save a file", ["train", "--config", llama, *short, "--save", blocker],
                     "--save '%s' is a file: give a directory (it writes DIR/step-N checkpoints)" % blocker)
        expect_error("ckpt export --max-shard-gb 1e300", ["ckpt", "export", step2, "--hf", os.path.join(tmp, "big"),
                                                          "--max-shard-gb", "1e300"],
                     "--max-shard-gb must be positive and at most 9e9 (bytes in 64 bits), got 1e+300")

        # A resume that changes the learning rate's course or the data order says so (it still runs).
        p = run("train", "--resume", ck, *short, "--steps", "4", "--seed", "9", "--lr", "1e-3", "--grad-clip", "0",
                "--weight-decay", "0.05")
        for flag, now, before in (("--steps (the cosine schedule's length)", "4", "2"), ("--seed", "9", "1234"),
                                  ("--lr", "0.001", "0.0003"), ("--grad-clip", "0.0", "1.0"),
                                  ("--weight-decay", "0.05", "0.1")):
            want = "warning: resuming with %s '%s'; '%s' trained with '%s'" % (flag, now, step2, before)
            check(want in p.stderr, "resume warns of %s:\n%s" % (flag, p.stderr))
        print("ok   resuming with another --steps (cosine), --seed, --lr, --grad-clip and --weight-decay warns of each")
        # ...and with another --config of the same shapes that changes the math (RoPE's base, the norm's
        # epsilon); its initialisation no longer matters.
        other_math = write(os.path.join(tmp, "llama_math.json"),
                           dict(LLAMA_TINY, rope_theta=500000.0, rms_norm_eps=1e-5, initializer_range=0.01))
        p = run("train", "--resume", ck, "--config", other_math, *short, "--steps", "3")
        for key, now, before in (("rope_theta", "500000.0", "10000.0"), ("rms_norm_eps", "1e-05", "1e-06")):
            want = "warning: resuming with --config's '%s' = %s; '%s' trained with '%s' = %s" % (key, now, step2, key,
                                                                                                before)
            check(want in p.stderr, "resume warns of the config's %s:\n%s" % (key, p.stderr))
        check("initializer_range" not in p.stderr, "resume warns of the config's initializer_range:\n" + p.stderr)
        p = run("train", "--resume", ck, "--config", llama, *short, "--steps", "3")  # (the defaults it left out, saved)
        check("--config's" not in p.stderr, "a resume with the run's own --config warns:\n" + p.stderr)
        print("ok   resuming with another --config of the same shapes warns of each field that changes the math")

        # A dataset prepared again at the same prefix: the data position the checkpoint's steps reach reads other data.
        redo = byte_dataset(tmp, 40, "redo")
        redo_ck = os.path.join(tmp, "redo_ck")
        run("train", "--config", llama, *short, "--data", redo, "--steps", "2", "--save", redo_ck)
        p = run("train", "--resume", redo_ck, *short, "--data", redo, "--steps", "3")
        check("trained on" not in p.stderr, "a resume on the same data warns of nothing:\n" + p.stderr)
        byte_dataset(tmp, 30, "redo")
        p = run("train", "--resume", redo_ck, *short, "--data", redo, "--steps", "3")
        want = ("warning: resuming on data '%s' of 1940 tokens and 30 documents; '%s' trained on 2590 tokens and 40 "
                "documents there" % (redo, os.path.join(redo_ck, "step-2")))
        check(want in p.stderr, "a resume on data prepared again warns:\n" + p.stderr)
        print("ok   resuming on a dataset prepared again at the same prefix warns")
        p = run("train", "--config", llama, *short, "--steps", "1", "--eval-data", "./" + os.path.relpath(data))
        check("warning: --eval-data './%s' is also training data (--data)" % os.path.relpath(data) in p.stderr,
              "validation data that is training data warns:\n" + p.stderr)
        p = run("train", "--config", llama, *short, "--steps", "1", "--eval-data", redo)
        check("is also training data" not in p.stderr, "validation data of its own warns of nothing:\n" + p.stderr)
        print("ok   --eval-data that is also --data warns")

        # An empty value read as "not given": `--resume "$CKPT"` with CKPT unset started a new run from
        # step 0 (and saved over the old run's directory), `--save=` saved nothing.
        for args, name, meta in ((["--resume="], "resume", "PATH"), (["--resume", ""], "resume", "PATH"),
                                 (["--save="], "save", "DIR")):
            expect_error("train %s" % " ".join(repr(a) for a in args), ["train", "--config", llama, *short, *args],
                         "--%s needs a value (%s), got an empty one" % (name, meta))
        # AdamW runs in float: a beta that rounds to 1 stopped its moment, an eps that rounds to 0 made NaN weights.
        expect_error("--beta2 0.99999999", ["train", "--config", llama, *short, "--beta2", "0.99999999"],
                     "--beta1 and --beta2 must be in [0, 0.99999994] (below 1 as 32-bit floats), got 0.9 and 0.99999999")
        expect_error("--eps 1e-50", ["train", "--config", llama, *short, "--eps", "1e-50"],
                     "--eps must be at least 1.18e-38 (the smallest normal 32-bit float), got 1e-50")
        rc = write(os.path.join(tmp, "rc_empty.json"), {"resume": "", "steps": 2})
        expect_error("a run config's empty \"resume\"", ["train", "--config", llama, *short, "--run-config", rc],
                     "%s: field 'resume': expected a non-empty string, got \"\"" % rc)

        # Files of options.
        for key in ("plan", "run-config"):
            rc = write(os.path.join(tmp, "rc_%s.json" % key), {key: "x.json", "steps": 2})
            expect_error("a run config naming --%s" % key, ["train", "--config", llama, *short, "--run-config", rc],
                         "%s: field '%s': names a file of options, which a run config cannot (it is read first): give "
                         "--%s on the command line" % (rc, key, key))
        # ... nor in a plan's layout (read after the run config, a "run-config" there did nothing).
        plan_file = os.path.join(tmp, "named.plan.json")
        run("plan", "--config", llama, "--cluster", CLUSTER, "--devices", "1", "--global-batch", "2", "--seq-len", "16",
            "--out", plan_file)
        doc = json.load(open(plan_file))
        doc["layout"]["run-config"] = "x.json"
        write(plan_file, doc)
        expect_error("a plan's layout naming --run-config", ["train", "--config", llama, *short, "--plan", plan_file],
                     "%s: field 'layout.run-config': names a file of options, which a plan's layout cannot (it is read "
                     "first): give --run-config on the command line" % plan_file)
        # An option given twice with two values kept the last without a word.
        expect_error("an option given twice", ["train", "--config", llama, *short, "--lr", "1e-3", "--lr", "3e-4"],
                     "--lr is given twice, as '1e-3' and as '3e-4': the last would win and the first be ignored; "
                     "give it once", once=False)
        # A path option followed by another option took its name as the path (a file named "--quiet").
        expect_error("--metrics followed by an option", ["train", "--config", llama, *short, "--metrics", "--quiet"],
                     "--metrics needs a value (FILE), got the option --quiet (a value that starts with -- goes as "
                     "--metrics=VALUE)")
        # A micro-batch past its bound was reported as a default global batch of 0.
        expect_error("--micro-batch past its bound", ["train", "--config", llama, *short[:2], "--seq-len", "16",
                     "--micro-batch", "10000000000"], "--micro-batch must be at most 1073741824, got 10000000000")
        # A run config giving a key twice kept the last without a word.
        twice = os.path.join(tmp, "twice.json")
        with open(twice, "w") as f:
            f.write('{"steps": 1, "steps": 2}')
        expect_error("a run config giving a key twice", ["train", "--config", llama, *short, "--run-config", twice],
                     "run config '%s': gives 'steps' twice in one object (at the top level): the last would win and "
                     "the first be ignored; give it once" % twice)
        # Options that did nothing in their combination (accepted without a word before).
        expect_error("--min-lr beside a constant schedule", ["train", "--config", llama, *short, "--lr-schedule",
                     "constant", "--min-lr", "1e-5"], "--min-lr 1e-05 is the cosine schedule's floor, and "
                     "--lr-schedule constant has none: drop it")
        bad = json.load(open(CLUSTER))
        bad["device"]["kernel_overhead_usec"] = 500
        bad_cluster = write(os.path.join(tmp, "cluster.json"), bad)
        plan = ["plan", "--config", llama, "--devices", "2", "--global-batch", "8", "--seq-len", "16"]
        expect_error("a cluster file's misspelt key", plan + ["--cluster", bad_cluster],
                     "%s: field 'device': unknown key 'kernel_overhead_usec' (the keys are memory_gb, "
                     "memory_bandwidth_gb_s, first_touch_gb_s, bf16, sms, kernel_overhead_us, peak_tflops, "
                     "attention_tflops, gemm, gemm_streaming_gb_s, gemm_streaming_accumulating_gb_s, gemm_efficiency)"
                     % bad_cluster)

        # plan --layout and --imbalance.
        plan += ["--cluster", CLUSTER]
        for words, axis in (("tp2 tp1", "tp"), ("sp nosp", "sp"), ("zero1 zero3", "zero"),
                            ("recompute=full recompute=none", "recompute"), ("fssdp nofssdp", "fssdp")):
            first, second = words.split()
            expect_error("--layout '%s'" % words, plan + ["--layout", words],
                         "--layout: '%s' and '%s' both fix %s: give it once" % (first, second, axis))
        expect_error("--layout 'sp tp1'", plan + ["--layout", "sp tp1"], "--layout 'sp tp1' leaves no layout of 2 "
                     "devices: sp: sequence parallelism splits over TP: it needs tp2 or more")
        expect_error("--layout 'cp-comm=a2a cp1'", plan + ["--layout", "cp-comm=a2a cp1"], "--layout 'cp-comm=a2a cp1' "
                     "leaves no layout of 2 devices: cp-comm=a2a: CP's exchange needs cp2 or more")
        p = run(*plan, "--layout", "sp", "--json")
        layouts = [c["layout"] for c in json.loads(p.stdout[p.stdout.index("["):])]
        check(layouts and all(" sp" in l and "tp1 " not in l for l in layouts),
              "--layout sp lists only layouts with sequence parallelism: %s" % layouts)
        print("ok   --layout sp lists only TP>1 layouts with sequence parallelism: %s" % layouts)
        # Without sp/nosp the search tries TP both with and without sequence parallelism: a --seq-len TP does
        # not divide refused every TP layout (SP's rule), though train accepts --tp 2 without SP.
        p = run("plan", "--config", gpt2, "--devices", "2", "--global-batch", "8", "--seq-len", "63", "--cluster",
                CLUSTER, "--layout", "tp2", "--json")
        layouts = [c["layout"] for c in json.loads(p.stdout[p.stdout.index("["):])]
        check(layouts and all(l.startswith("tp2 ") and " sp" not in l for l in layouts)
              and len(set(layouts)) == len(layouts),
              "--layout tp2 at --seq-len 63 lists TP2 layouts without SP, none twice (a dense model's dp1 layouts "
              "had zero0-3 copies): %s" % layouts)
        print("ok   plan tries TP without sequence parallelism: %s" % layouts[:2])
        # Every layout refused: the reasons that refused the most, with their counts (the first refused had been
        # one of a pipeline split the layouts without a pipeline do not share).
        expect_error("plan --layout cp2 at --seq-len 31", ["plan", "--config", llama, "--devices", "4", "--global-batch",
                     "4", "--seq-len", "31", "--cluster", os.path.join(ROOT, "configs", "clusters", "dgx-h100.json"),
                     "--layout", "cp2"], "the runtime accepts none of the 408 layouts of --layout 'cp2'; 228 layouts: "
                     "--cp 2 cuts each sequence into 2 x 2 chunks: --seq-len (31) must be a multiple of 4; 108: the "
                     "model's 2 layers cannot be split evenly over 4 pipeline stages (2 stages x 2 chunks): give a "
                     "multiple, or an explicit split with --pp-layers (and 1 other reason)")
        expect_error("--layout vocab on one device", ["plan", "--config", llama, "--devices", "1", "--global-batch", "8",
                     "--seq-len", "16", "--cluster", CLUSTER, "--layout", "vocab"], "--layout 'vocab' leaves no layout "
                     "of 1 devices: vocab: vocabulary parallelism needs a pipeline (pp2 or more)")
        # A plan's batch in windows gives way to --micro-batch-tokens and --batching documents given with it.
        plan1 = os.path.join(tmp, "plan1.json")
        run("plan", "--config", llama, "--devices", "1", "--global-batch", "4", "--seq-len", "16", "--cluster", CLUSTER,
            "--out", plan1)
        for extra in ([], ["--micro-batch-tokens", "32"]):
            run("train", "--config", llama, "--data", data, "--seq-len", "16", "--threads", "1", "--quiet", "--plan",
                plan1, "--steps", "1", "--batching", "documents", "--tokens-per-step", "64", *extra)
            # the same options from a run config (they were read after the plan: its micro-batch and global
            # batch stayed, and the error named a field the user never wrote)
            rc = {"batching": "documents", "tokens-per-step": 64, **({"micro-batch-tokens": 32} if extra else {})}
            run("train", "--config", llama, "--data", data, "--seq-len", "16", "--threads", "1", "--quiet", "--plan",
                plan1, "--steps", "1", "--run-config", write(os.path.join(tmp, "docs_rc.json"), rc))
        print("ok   train --plan with --batching documents and --micro-batch-tokens, on the command line or in a "
              "run config")
        # A run config's value for a key the plan gives was ignored without a word (the plan wins).
        bf16_rc = write(os.path.join(tmp, "bf16_rc.json"), {"precision": "bf16"})
        expect_error("a run config against its plan", ["train", "--config", llama, *short, "--plan", plan1,
                     "--run-config", bf16_rc], "%s: field 'precision' gives \"bf16\", and %s: field "
                     "'layout.precision' gives \"fp32\": the first wins, so this one would be ignored; drop one, or "
                     "give --precision on the command line" % (bf16_rc, plan1))
        run("train", "--config", llama, *short, "--plan", plan1, "--run-config", bf16_rc, "--precision", "bf16",
            "--steps", "1")
        # A run config's value of the wrong type was not checked while a flag hid it.
        bad_rc = write(os.path.join(tmp, "bad_rc.json"), {"steps": [10]})
        expect_error("a run config's broken value behind a flag", ["train", "--config", llama, *short, "--steps", "1",
                     "--run-config", bad_rc], "%s: field 'steps': expected a string or a number, got [10]" % bad_rc)
        # Accepted and ignored: --overwrite-save without --save, launch --min-np without --shrink; --vpp on
        # one stage named --pp-schedule interleaved, which the user had not given.
        expect_error("--overwrite-save without --save", ["train", "--config", llama, *short, "--overwrite-save"],
                     "--overwrite-save needs --save DIR")
        expect_error("launch --min-np without --shrink", ["launch", "--np", "2", "--min-np", "1", "--", "train",
                     "--config", llama, *short, "--save", os.path.join(tmp, "minnp")],
                     "--min-np bounds the worlds --shrink chooses between: give --shrink too")
        expect_error("--vpp 2 on one stage", ["train", "--config", llama, *short, "--vpp", "2"],
                     "--vpp 2 splits each pipeline stage into chunks and needs --pp >= 2, got --pp 1")
        expect_error("profile --micro-batch without --config", ["profile", "--out", os.path.join(tmp, "c.json"),
                     "--micro-batch", "8"], "--micro-batch sizes the model's GEMM shapes: give --config too (without "
                     "one the shapes are fixed squares and slabs)")
        # A rule broken by the checkpoint's global batch, which a resume keeps when none is given, named
        # only --global-batch.
        gb_ck = os.path.join(tmp, "gb_ck")
        run("train", "--config", llama, *short, "--steps", "1", "--global-batch", "4", "--save", gb_ck)
        short3 = [w if w != "2" or short[i - 1] != "--micro-batch" else "3" for i, w in enumerate(short)]
        expect_error("a resume whose checkpoint's global batch breaks a rule", ["train", *short3, "--resume", gb_ck,
                     "--save", gb_ck, "--steps", "2"], "--global-batch (4) must be a positive multiple of --micro-batch "
                     "(3); resuming with the checkpoint's global batch 4 (--global-batch not given: the run's steps "
                     "stay the size they were)")
        expect_error("... and under launch", ["launch", "--np", "1", "--", "train", *short3, "--resume", gb_ck, "--save",
                     gb_ck, "--steps", "2"], "--global-batch (4) must be a positive multiple of --micro-batch (3); "
                     "resuming with the checkpoint's global batch 4 (--global-batch not given: the run's steps stay "
                     "the size they were)")
        # ... also where the default size would break another rule (one micro-batch a step, which the
        # interleaved schedule refuses on 2 stages)
        expect_error("... and where the default size breaks another rule", ["launch", "--np", "2", "--", "train",
                     *short3, "--resume", gb_ck, "--save", gb_ck, "--steps", "2", "--pp", "2", "--pp-schedule",
                     "interleaved"], "--global-batch (4) must be a positive multiple of --micro-batch (3); resuming with "
                     "the checkpoint's global batch 4 (--global-batch not given: the run's steps stay the "
                     "size they were)")
        p = run("train", *short, "--resume", gb_ck, "--save", gb_ck, "--steps", "2", "--tp", "3", expect_ok=False)
        check(p.returncode == 1 and "not divisible by TP" in p.stderr and "checkpoint's global batch" not in p.stderr,
              "a mistake of the options' own on a resume does not blame the checkpoint's global batch: %s" % p.stderr)
        # The largest GEMM's operands (here the LM head's, 2^32 rows) against this machine's memory, before
        # minutes of timing.
        p = run("profile", "--out", os.path.join(tmp, "c.json"), "--config", llama, "--micro-batch", "65536",
                "--seq-len", "65536", expect_ok=False)
        check(p.returncode == 1 and "origami profile: error: profile would hold " in p.stderr and "on a rank (the "
              "largest GEMM at --micro-batch x --seq-len rows, with its copies), more than the" in p.stderr,
              "profile of 2^32 rows: %s" % p.stderr)
        print("ok   profile of GEMMs larger than the memory refused before timing: " + p.stderr.strip())
        expect_error("--imbalance for a dense model", plan + ["--imbalance", "1.5"],
                     "--imbalance prices the routing of experts, and this llama model has none")
        p = run("plan", "--config", moe, "--devices", "8", "--global-batch", "8", "--seq-len", "16", "--cluster",
                os.path.join(ROOT, "configs", "clusters", "dgx-h100.json"), "--imbalance", "9")
        check("routing imbalance (--imbalance): 9 (stated; EPd at most d·min(k, E/d)/k: every row its experts can get)"
              in p.stdout, "a stated imbalance above 2 says it is capped:\n" + p.stdout[:600])
        print("ok   a stated --imbalance 9 says each EP degree is capped at the rows its experts can get")

        # Checked before the work, not after it.
        missing = os.path.join(tmp, "missing", "x")
        expect_error("profile --out in a missing directory", ["profile", "--out", missing + ".json"],
                     "--out '%s.json': no directory '%s'" % (missing, os.path.dirname(missing)))
        expect_error("plan --plot in a missing directory", plan + ["--plot", missing + ".png"],
                     "--plot '%s.png': no directory '%s'" % (missing, os.path.dirname(missing)))
        expect_error("plan --plot x.svg", plan + ["--plot", os.path.join(tmp, "x.svg")],
                     "--plot '%s': the plot is a PNG picture, so FILE.png" % os.path.join(tmp, "x.svg"))
        # train's outputs on rank 0, checked with the options (found once the model was built they were one
        # rank's failure, exit 2, which origami launch restarted).
        expect_error("train --metrics in a missing directory", ["train", "--config", llama, *short, "--metrics",
                     missing + ".jsonl"], "--metrics '%s.jsonl': no directory '%s'" % (missing, os.path.dirname(missing)))
        metrics = os.path.join(tmp, "m.jsonl")
        run("train", "--config", llama, *short, "--steps", "2", "--metrics", metrics)
        expect_error("train --tensorboard under a file", ["train", "--config", llama, *short, "--tensorboard",
                     os.path.join(metrics, "tb")], "--tensorboard '%s/tb': '%s' is not a directory" % (metrics, metrics))
        expect_error("plot --out x.svg", ["plot", metrics, "--out", os.path.join(tmp, "x.svg")],
                     "--out '%s': plot writes a PNG picture, so FILE.png" % os.path.join(tmp, "x.svg"))
        # With standard input closed the PNG's descriptor was 0, and gnuplot's /dev/null input replaced it.
        png = os.path.join(tmp, "closed_stdin.png")
        p = subprocess.run([ORIGAMI, "plot", metrics, "--out", png], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, preexec_fn=lambda: os.close(0))
        check(p.returncode == 0 and os.path.getsize(png) > 1000, "plot with standard input closed: exit %d, %s"
              % (p.returncode, p.stderr.strip()))
        print("ok   plot with standard input closed writes its PNG")
        # FSSDP over one expert-data-parallel rank shards nothing and only copies experts: said (plan never
        # proposes it; train took it without a word).
        p = run("train", "--config", moe, *short, "--steps", "1", "--expert-sharding", "fssdp")
        check("warning: --expert-sharding fssdp has one expert-data-parallel rank here: nothing is sharded" in p.stderr,
              "FSSDP on one rank: %s" % p.stderr)
        print("ok   --expert-sharding fssdp on one rank warns that it shards nothing")
        # A row whose "step" is null (an edited or damaged file) was a NaN key of the steps' map: rows merged or
        # dropped without a word.
        rows = [json.loads(l) for l in open(metrics)]
        rows[1]["step"] = None
        null_step = write(os.path.join(tmp, "null_step.jsonl"), None)
        with open(null_step, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        expect_error("plot of a row whose step is null", ["plot", null_step, "--out", os.path.join(tmp, "n.png")],
                     "%s:2: \"step\" is not a number" % null_step)
        # A path that cannot be looked up says why (it said "no such file" for every reason).
        expect_error("--config under a file", ["train", "--config", os.path.join(metrics, "x.json"), *short],
                     "%s/x.json: Not a directory" % metrics)
        # Accumulation over more than the 16383 micro-batches a pipeline's MPI tags allow needs no tags on one
        # stage (it was refused); a bound on micro-batches a step remains.
        run("train", "--config", llama, *short, "--steps", "1", "--micro-batch", "1", "--global-batch", "16400")
        print("ok   one stage accumulates 16400 micro-batches a step")
        expect_error("a document step of 2^30 tokens in rows of 1", ["train", "--config", llama, *short, "--seq-len", "1",
                     "--batching", "documents", "--tokens-per-step", "1073741824", "--balance", "none"],
                     "a step of 1073741825 micro-batches a rank (at most) is more than 1048576: use a larger "
                     "--micro-batch or fewer --tokens-per-step")
        os.makedirs(os.path.join(tmp, "d.png"))
        expect_error("plot --out a directory", ["plot", metrics, "--out", tmp + "/d.png"],
                     "--out '%s/d.png' is a directory: give a file name" % tmp)
        expect_error("data prepare --output DIR/", ["data", "prepare", "--input", text, "--output", tmp + "/",
                                                    "--tokenizer", "byte"],
                     "--output '%s/' is a directory: give a prefix such as DIR/NAME (it writes DIR/NAME.bin, .idx and "
                     ".tokenizer.json)" % tmp)
        check(not os.path.exists(os.path.join(tmp, ".bin")), "data prepare --output DIR/ wrote no DIR/.bin")

        # Numbers.
        dump = ["dump", "--config", llama, "--data", data, "--out", os.path.join(tmp, "d.safetensors")]
        expect_error("dump --step 2^63 - 1", dump + ["--step", "9223372036854775807"],
                     "--step must be in [0, 4611686018427387902] (it reads windows step x B .. step x B + B - 1), "
                     "got 9223372036854775807")
        expect_error("dump --micro-batch 2^62", dump + ["--micro-batch", "4611686018427387904"],
                     "--micro-batch must be in [1, 1073741824], got 4611686018427387904")
        expect_error("--seed -1", ["train", "--config", llama, *short, "--seed", "-1"],
                     "--seed must be an integer in [0, 18446744073709551615], got '-1'")
        expect_error("--seed 2^64", ["train", "--config", llama, *short, "--seed", "18446744073709551616"],
                     "--seed must be an integer in [0, 18446744073709551615], got '18446744073709551616'")
        run("train", "--config", llama, *short, "--steps", "1", "--seed", "18446744073709551615")
        print("ok   --seed 2^64 - 1 trains")

        # Options that would do nothing.
        for flags in (["--moe-aux-loss", "micro"], ["--moe-router-score", "softmax"], ["--expert-sharding", "ep"]):
            expect_error("%s on a dense model" % " ".join(flags), ["train", "--config", gpt2, *short] + flags,
                         "%s is for a mixture-of-experts model, and this gpt2 model has no experts" % flags[0])
        expect_error("dump --moe-capacity-factor 0 on a dense model", dump + ["--moe-capacity-factor", "0"],
                     "--moe-capacity-factor is for a mixture-of-experts model, and this llama model has no experts")
        expect_error("--mtbf-hours without --save-every auto", ["train", "--config", llama, *short, "--mtbf-hours", "5"],
                     "--mtbf-hours sizes --save-every auto's interval, and --save-every is 0")
        # A value that is none is named as such before what the option relates to.
        expect_error("--save-every AUTO", ["train", "--config", llama, *short, "--save-every", "AUTO"],
                     "--save-every must be a step count N or auto, got 'AUTO'")
        expect_error("--cp-a2a-size 0", ["train", "--config", llama, *short, "--cp-a2a-size", "0"],
                     "--cp-a2a-size must be at least 1 (ranks per all-to-all group), got 0")
        expect_error("--moe-drop-policy x", ["train", "--config", moe, *short, "--moe-drop-policy", "x"],
                     "--moe-drop-policy 'x' is not one of probs, position")
        expect_error("launch --np 0", ["launch", "--np", "0", "--", "train", "--config", llama, *short],
                     "--np must be at least 1, got 0")
        expect_error("launch --cluster without --shrink", ["launch", "--np", "1", "--cluster", CLUSTER, "--", "train",
                                                           "--config", llama, *short, "--save", ck],
                     "--cluster prices the worlds --shrink chooses between: give --shrink too")
        expect_error("launch --mpirun ''", ["launch", "--np", "1", "--mpirun", "", "--", "train", "--config", llama,
                                            *short, "--save", ck],
                     "--mpirun needs a value (COMMAND), got an empty one")
        expect_error("launch --mpirun ' '", ["launch", "--np", "1", "--mpirun", " ", "--", "train", "--config", llama,
                                             *short, "--save", ck],
                     "--mpirun is empty: give the launcher's command, for example 'mpirun --oversubscribe'")
        # A hostfile's slots=N is a whole number (it was read with atoi: "4x" gave 4 slots, "x" "no slots").
        for slots in ("4x", "x", "", "-2", "0", "99999999999"):
            bad_hosts = os.path.join(tmp, "hosts_bad")
            with open(bad_hosts, "w") as f:
                f.write("# a comment\nlocalhost slots=%s\n" % slots)
            expect_error("launch --hostfile slots=%s" % slots, ["launch", "--np", "1", "--hostfile", bad_hosts, "--",
                                                                 "train", "--config", llama, *short, "--save", ck],
                         "--hostfile %s: host localhost: 'slots=%s' needs a whole number of slots in [1, 1048576]"
                         % (bad_hosts, slots))
        # launch reads --save=DIR as train does (it had asked for --save DIR).
        saved = os.path.join(tmp, "launched")
        run("launch", "--np", "1", "--mpirun", "mpirun --oversubscribe", "--", "train", "--config", llama, *short,
            "--steps", "2", "--save=" + saved)
        check(os.path.isdir(os.path.join(saved, "step-2")), "launch with --save=DIR saved step-2 there")
        print("ok   launch -- train --save=DIR")
        p = subprocess.run([ORIGAMI, "foo"], capture_output=True, text=True)
        check(p.returncode == 1 and p.stderr.startswith("origami: error: unknown command 'foo'\n"),
              "origami foo: exit %d, %r" % (p.returncode, p.stderr[:80]))
        p = subprocess.run([ORIGAMI, "trian"], capture_output=True, text=True)
        check(p.returncode == 1 and p.stderr.startswith("origami: error: unknown command 'trian' (did you mean "
                                                        "'train'?)\n"), "origami trian: %r" % p.stderr[:80])
        p = subprocess.run([ORIGAMI, "train", "--config", llama, "--seq-lne", "8"], capture_output=True, text=True)
        check(p.returncode == 1 and "unknown option --seq-lne (did you mean --seq-len?)" in p.stderr,
              "train --seq-lne: %r" % p.stderr[:120])
        p = subprocess.run([ORIGAMI], capture_output=True, text=True)
        check(p.returncode == 1 and p.stderr.startswith("origami: error: no command given\n"),
              "origami: exit %d, %r" % (p.returncode, p.stderr[:80]))
        print("ok   origami foo, origami: exit 1, one error line (unknown command, no command); a typo names the "
              "command or option meant")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("all user-mistake checks passed")


if __name__ == "__main__":
    main()
