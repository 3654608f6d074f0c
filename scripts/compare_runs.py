#!/usr/bin/env python3
"""Runs a representative set of `origami` runs with two binaries and compares what they produce,
timings aside: exit codes, console output, metrics rows and checkpoint files. For refactors that
must not change behaviour (a "no change" claim in a commit message names this tool's verdict).

    /usr/bin/python3 scripts/compare_runs.py OLD_BINARY NEW_BINARY [--only NAME,...] [--keep DIR]

The set covers the layouts (TP+SP, DP with ZeRO 1 and 2, PP 1F1B and interleaved, recompute, CP p2p,
a2a and a2a+p2p with document masking, EP and ETP with MoE routing options, TP x PP), validation,
blends, resume under another layout, asynchronous saves, fault injection, the routing log, a loss
spike and user errors. What is masked as timing: wall times, rates, CPU seconds, peak RSS, the
measured runtime memory (and the totals that include it), the checkpoint read time, the pipeline
message buffers a step allocated (when a send completes depends on the clock).
Exit 0 when every case is equal; otherwise each difference is printed.
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parallel"))
import harness  # noqa: E402

TIMING_KEYS = {"ms", "tokens_per_s", "gflops", "cpu_s", "pp_busy_ms", "pp_ms", "rss_peak_bytes", "save_blocked_s",
               "moe_times", "memory_bytes_per_rank", "pp_rss_peak_bytes", "pp_message_buffers"}
# Console text that depends on the clock or on the process's measured memory.
MASKS = [(re.compile(r"\d+ tok/s \| [\d.]+ ms \| [\d.]+ GFLOP/s \| eta \S+"), "<timing>"),
         (re.compile(r"\| [\d.]+ ms$", re.M), "| <ms>"),
         (re.compile(r"read in [\d.]+ s"), "read in <s>"),
         (re.compile(r"^memory: .*$", re.M), "memory: <measured>"),
         (re.compile(r"^memory of rank .*$", re.M), "memory of rank <measured>"),
         (re.compile(r"\d+ threads per rank"), "<threads> threads per rank"),
         (re.compile(r"(blocked|took) [\d.]+ ?s"), r"\1 <s>"),
         (re.compile(r"rank \d+ needs [\d.]+ [KMG]?i?B"), "rank <r> needs <bytes>"),
         (re.compile(r"runtime [\d.]+ [KMG]?i?B"), "runtime <bytes>"),
         (re.compile(r", [\d.]+ s\)"), ", <s>)"),
         (re.compile(r"Process name: \[\[\d+,\d+\],\d+\]"), "Process name: <rank>"),
         (re.compile(r"/tmp/\S+?/(old|new)/"), "<dir>/")]


def cases(data, data2, top):
    """(name, ranks, args, env) of every run; {dir} is the run's own directory."""
    cfg = lambda n: os.path.join(harness.CONFIGS, n + ".json")  # noqa: E731
    llama4 = harness.write_json(os.path.join(top, "llama4.json"), harness.load_config("llama_tiny", num_hidden_layers=6))
    base = ["--data", data, "--seq-len", "32", "--micro-batch", "2", "--lr", "3e-3", "--warmup", "2",
            "--threads", "1", "--metrics", "{dir}/metrics.jsonl"]
    llama, gpt2, mixtral, qwen = (["train", "--config", cfg(n)] + base for n in
                                  ("llama_tiny", "gpt2_tiny", "mixtral_8e", "qwen2_moe_8e"))
    ev = ["--eval-data", data2, "--eval-every", "3", "--eval-iters", "2"]
    return [
        ("gpt2_one_rank_eval_save", 0, gpt2 + ["--steps", "6", "--global-batch", "4", "--save", "{dir}/ck",
                                                 "--save-every", "3"] + ev, {}),
        ("llama_tp2_sp", 2, llama + ["--steps", "5", "--tp", "2", "--sequence-parallel"], {}),
        ("llama_dp2_zero1_eval", 2, llama + ["--steps", "5", "--zero", "1", "--global-batch", "8"] + ev, {}),
        ("llama_dp2_zero2", 2, llama + ["--steps", "5", "--zero", "2", "--global-batch", "8"], {}),
        ("llama_pp2_1f1b_recompute", 2, llama + ["--steps", "5", "--pp", "2", "--global-batch", "8",
                                                  "--recompute", "full", "--verbose"], {}),
        ("llama_pp2_interleaved", 2, ["train", "--config", llama4] + base +
         ["--steps", "4", "--pp", "2", "--vpp", "2", "--global-batch", "8", "--pp-layers", "1,2,1,2"], {}),
        ("error_pp_layers", 2, ["train", "--config", llama4] + base +
         ["--steps", "4", "--pp", "2", "--vpp", "2", "--global-batch", "8", "--pp-layers", "1,2,0,1"], {}),
        ("llama_tp2_pp2_save", 4, llama + ["--steps", "4", "--tp", "2", "--pp", "2", "--global-batch", "4",
                                           "--save", "{dir}/ck"], {}),
        ("llama_cp2_p2p_document", 2, llama + ["--steps", "4", "--cp", "2", "--attention-mask", "document"], {}),
        ("llama_cp2_a2a", 2, llama + ["--steps", "4", "--cp", "2", "--cp-comm", "a2a", "--recompute",
                                      "selective"], {}),
        ("llama_cp4_a2a_p2p", 4, llama + ["--steps", "3", "--cp", "4", "--cp-comm", "a2a+p2p", "--cp-a2a-size",
                                          "2", "--seq-len", "64"], {}),
        ("mixtral_ep2_global_capacity_routing_log", 2,
         mixtral + ["--steps", "4", "--ep", "2", "--moe-aux-loss", "global", "--moe-capacity-factor", "1.0",
                    "--global-batch", "8"], {"ORIGAMI_TEST_ROUTING": "{dir}"}),
        ("mixtral_ep2_etp2_seq_pad", 4, mixtral + ["--steps", "3", "--ep", "2", "--etp", "2", "--moe-aux-loss",
                                                   "seq", "--moe-capacity-factor", "1.5", "--moe-pad-to-capacity",
                                                   "--moe-drop-policy", "position"], {}),
        ("qwen_sigmoid_bias_async_save", 2, qwen + ["--steps", "4", "--ep", "2", "--moe-router-score", "sigmoid",
                                              "--moe-router-bias-update-rate", "0.01", "--save", "{dir}/ck",
                                              "--async-save", "--save-every", "2", "--keep-last", "1"], {}),
        ("llama_blend_shuffled", 0, llama + ["--steps", "4", "--data", "1 %s 2 %s" % (data, data2),
                                             "--data-order", "shuffled", "--global-batch", "4"], {}),
        ("llama_nan_fault", 2, llama + ["--steps", "5", "--max-skipped-steps", "1", "--global-batch", "4"],
         {"ORIGAMI_TEST_NAN_GRAD": "2:1"}),
        ("llama_nan_stop", 2, llama + ["--steps", "5", "--global-batch", "4", "--save", "{dir}/ck", "--save-every",
                                       "1"], {"ORIGAMI_TEST_NAN_GRAD": "3:0"}),
        ("llama_loss_spike_quiet", 0, llama + ["--steps", "20", "--lr", "2", "--grad-clip", "0", "--lr-schedule",
                                               "constant", "--loss-spike-factor", "1.01", "--quiet"], {}),
        ("error_tp", 2, llama + ["--steps", "2", "--tp", "3"], {}),
        ("error_eval_every", 0, llama + ["--steps", "2", "--eval-every", "2"], {}),
        ("error_nan_env", 0, llama + ["--steps", "2"], {"ORIGAMI_TEST_NAN_GRAD": "x"}),
        ("error_memory", 2, llama + ["--steps", "2", "--memory-limit-gb", "0.001"], {}),
        ("error_metrics_path", 0, llama[:-1] + ["/nonexistent/m.jsonl", "--steps", "2"], {}),
    ]


def resume_cases(data, first_dir):
    cfg = os.path.join(harness.CONFIGS, "gpt2_tiny.json")
    args = ["train", "--config", cfg, "--data", data, "--seq-len", "32", "--micro-batch", "2", "--lr", "3e-3",
            "--warmup", "2", "--threads", "1", "--metrics", "{dir}/metrics.jsonl", "--global-batch", "4"]
    ck = os.path.join(first_dir, "ck", "step-3")
    return [("gpt2_resume_dp2", 2, args + ["--steps", "8", "--resume", ck], {}),
            ("gpt2_init_from_pp2", 2, args + ["--steps", "2", "--init-from", ck, "--pp", "2"], {}),
            ("error_resume_done", 0, args + ["--steps", "3", "--resume", ck], {})]


def normalise_text(s):
    for pat, rep in MASKS:
        s = pat.sub(rep, s)
    # An asynchronous save commits at whichever step's poll finds every rank done: its line moves.
    lines = s.splitlines()
    saved = sorted(l for l in lines if l.startswith("saved checkpoint"))
    return "\n".join([l for l in lines if not l.startswith("saved checkpoint")] + saved)


def strip_row(row, async_save):
    row = {k: v for k, v in row.items() if k not in TIMING_KEYS}
    if async_save:  # the commit's world collectives run at whichever step's poll finds every rank done
        row["comm_bytes"].pop("world", None)
    if "cp" in row:
        row["cp"] = {k: v for k, v in row["cp"].items() if k not in ("ring_s", "ring_wait_s")}
    row.pop("memory_bytes", None)  # the neediest rank depends on each rank's measured runtime memory
    return row


def files_of(d):
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, d)] = p
    return out


def normalise_file(rel, path, async_save=False):
    with open(path, "rb") as f:
        b = f.read()
    if rel.endswith("metrics.jsonl"):
        return [strip_row(json.loads(l), async_save) for l in b.decode().splitlines() if l.strip()]
    if rel.endswith(".json") or rel.endswith(".jsonl"):
        text = normalise_text(b.decode())
        return re.sub(r'"(saved_at|save_s|seconds|time)": [^,}\n]+', r'"\1": <t>', text)
    return b


def run_case(binary, case, d):
    name, np_, args, env = case
    os.makedirs(d, exist_ok=True)
    args = [a.replace("{dir}", d) for a in args]  # (harness.run gives each option once)
    env = {k: v.replace("{dir}", d) for k, v in env.items()}
    code, out, _ = harness.run(np_, args, timeout=300, binary=binary, extra_env=env)
    with open(os.path.join(d, "console.txt"), "w") as f:
        f.write(out)
    return code, out


def compare(name, old_dir, new_dir, old, new):
    diffs = []
    if old[0] != new[0]:
        diffs.append("exit code %s -> %s" % (old[0], new[0]))
    a, b = files_of(old_dir), files_of(new_dir)
    if set(a) != set(b):
        diffs.append("files differ: only old %s, only new %s" % (sorted(set(a) - set(b)), sorted(set(b) - set(a))))
    for rel in sorted(set(a) & set(b)):
        x, y = (normalise_file(rel, f[rel], "async" in name) for f in (a, b))
        if rel == "console.txt":
            x, y = normalise_text(x.decode() if isinstance(x, bytes) else x), normalise_text(
                y.decode() if isinstance(y, bytes) else y)
        if x != y:
            detail = ""
            if isinstance(x, list):
                for i, (r1, r2) in enumerate(zip(x, y)):
                    if r1 != r2:
                        keys = sorted(k for k in set(r1) | set(r2) if r1.get(k) != r2.get(k))
                        detail = " (row %d: %s)" % (i, ", ".join("%s %s -> %s" % (k, r1.get(k), r2.get(k))
                                                                 for k in keys))
                        break
            elif isinstance(x, str):
                lx, ly = x.splitlines(), y.splitlines()
                for i, (l1, l2) in enumerate(zip(lx, ly)):
                    if l1 != l2:
                        detail = " (line %d: %r -> %r)" % (i + 1, l1, l2)
                        break
                else:
                    detail = " (%d vs %d lines)" % (len(lx), len(ly))
            diffs.append("%s differs%s" % (rel, detail))
    return diffs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--keep", default="", help="keep the runs' directories under DIR")
    a = ap.parse_args()
    top = a.keep or tempfile.mkdtemp(prefix="origami_compare_")
    os.makedirs(top, exist_ok=True)
    harness.BIN = a.new  # data prepare
    data = harness.prepare_data(top, "train", n_docs=150, seed=3)
    data2 = harness.prepare_data(top, "valid", n_docs=60, seed=9)
    only = set(filter(None, a.only.split(",")))
    todo = cases(data, data2, top)
    failures, done = [], 0
    for stage in (0, 1):
        for case in todo:
            if only and case[0] not in only:
                continue
            od, nd = (os.path.join(top, which, case[0]) for which in ("old", "new"))
            old, new = run_case(a.old, case, od), run_case(a.new, case, nd)
            diffs = compare(case[0], od, nd, old, new)
            done += 1
            print("%-45s exit %-4s %s" % (case[0], new[0], "equal" if not diffs else "DIFFERENT"), flush=True)
            for d in diffs:
                print("    " + d)
            if diffs:
                failures.append(case[0])
        if stage == 0:
            first = os.path.join(top, "old", "gpt2_one_rank_eval_save")
            todo = resume_cases(data, first) if os.path.isdir(os.path.join(first, "ck")) else []
    if not a.keep:
        shutil.rmtree(top, ignore_errors=True)
    print("%d passed, %d failed" % (done - len(failures), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
