"""Failure behaviour of multi-rank runs (DESIGN.md convention 11: one clear message from rank 0
naming the value and the rule, every rank exits non-zero — never a hang).

(a) Impossible layouts, each under mpirun: mpirun exits non-zero within 30 s, and the combined
    output of all ranks has exactly one line containing "error:", which names the rule (a keyword)
    and the offending values. Each rank runs under a tiny shell wrapper that records its own exit
    status, so the table also shows whether every rank exited non-zero by itself or was killed by
    mpirun (informative; mpirun's status is what is asserted).
    The last case is an error on one rank in the middle of a pipeline step (token ids beyond the
    vocabulary, in a dataset without its tokenizer file): that rank's message, then the job's abort.
(b) A rank dies: a 2-rank TP2 run (every step needs both ranks) is started, and once a metrics
    line has appeared, rank 1's process (a child of mpirun, identified by OMPI_COMM_WORLD_RANK in
    /proc/PID/environ) gets SIGKILL. mpirun must exit non-zero within 60 s. The same with rank 0
    killed.
(c) SIGTERM to mpirun (what a scheduler or a Ctrl-C-like stop does): the job must stop within
    60 s, mpirun exit non-zero, no rank outlive mpirun, and a checkpoint (--save DIR) must exist and
    be complete and consistent: DIR/latest names a step-N directory that has metadata.json (written
    last, it marks a whole step), its trainer_state.json says step N, a step that the metrics file
    reports, `origami ckpt export --optimizer` of it succeeds (every rank's pieces present and
    intact) and the exported model.safetensors is readable; every entry of DIR named step-N is such
    a complete step (unfinished saves are hidden as .step-N.tmp).
    What happens: Open MPI 4's mpirun forwards SIGTERM to the ranks; origami's handler sets a stop
    flag that the ranks combine in the step's metrics all-reduce, so all of them stop after the
    same step, save (each rank writes its own shards, rank 0 then commits the step) and exit 130;
    mpirun then exits 1 (observed: ~2 s after the signal, the checkpoint at the last reported step).
    mpirun sends SIGKILL odls_base_sigkill_timeout (1 s) after the SIGTERM, so
    a model whose checkpoint takes longer than that to write would be cut short (leaving the
    previous committed step, or none); this one (0.4M parameters) takes milliseconds.

Usage: python3 tests/parallel/test_failures.py [a,b,c]
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

FAILS = []
ROWS = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILS.append(what)
    return ok


def wrapped(rcdir, args):
    """Runs origami ARGS under sh, which writes the rank's exit status to rcdir/rc.RANK."""
    script = '"$0" "$@"; rc=$?; echo $rc > %s/rc.${OMPI_COMM_WORLD_RANK:-0}; exit $rc' % rcdir
    return ["sh", "-c", script, h.BIN, *args]


def layout_error(tmp, data, label, np_, cfg_path, extra, keywords, values):
    """(a): one impossible layout. keywords: at least one must appear (case-insensitive) on the
    error line; values: each must appear on it as a separate number."""
    rcdir = os.path.join(tmp, "rc_" + re.sub(r"\W", "_", label))
    os.makedirs(rcdir)
    base = ["--steps", "3", "--seq-len", "16", "--micro-batch", "2", "--threads", "1"]
    given = [f for f in extra if f.startswith("--")]  # (an option is given once: extra's value replaces base's)
    base = [a for k, a in enumerate(base) if a not in given and (k == 0 or base[k - 1] not in given)]
    args = ["train", "--config", cfg_path, "--data", data, *base, *extra]
    t0 = time.time()
    cmd = [h.MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(np_)] + wrapped(rcdir, args)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=h.env(), stdin=subprocess.DEVNULL)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, str(e.stdout or "") + str(e.stderr or "")
    wall = time.time() - t0
    lines = [l for l in out.splitlines() if re.search(r"error( \(rank \d+ of \d+\))?:", l)]  # (one rank's own)
    line = lines[0] if lines else ""
    low = line.lower()
    named = any(k.lower() in low for k in keywords) and all(re.search(r"(?<![\d.])%s(?![\d])" % re.escape(str(v)), line)
                                                          for v in values)
    ranks = []
    for r in range(np_):
        f = os.path.join(rcdir, "rc.%d" % r)
        code = open(f).read().strip() if os.path.exists(f) else ""
        ranks.append(code or "killed")  # no (or an empty) status file: mpirun killed it first
    ok = rc not in (None, 0) and wall < 30 and len(lines) == 1 and named
    ROWS.append((label, np_, " ".join(extra), rc, "%.1f" % wall, len(lines), ",".join(ranks), "ok" if ok else "FAIL",
                 line.strip()[:150]))
    check(ok, "%s: mpirun exit %s after %.1f s, %d 'error:' line(s), names %s %s: %s"
          % (label, rc, wall, len(lines), keywords, values, line.strip()[:200]))
    if not ok:
        print(out[-3000:])


def part_a(tmp, data):
    cfg = lambda name, base, **ch: h.write_json(os.path.join(tmp, name + ".json"), h.load_config(base, **ch))
    gpt2 = os.path.join(h.CONFIGS, "gpt2_tiny.json")
    # TP4 does not divide 6 heads (n_embd 48 and FFN 192 are divisible by 4).
    layout_error(tmp, data, "heads % TP", 4, cfg("heads6", "gpt2_tiny", n_head=6), ["--tp", "4"], ["head"], [6, 4])
    # TP4 does not divide 2 KV heads (8 query heads, hidden 48, FFN 80 are divisible).
    layout_error(tmp, data, "kv heads % TP", 4, cfg("kv2", "llama_tiny", num_key_value_heads=2), ["--tp", "4"],
                 ["kv", "key/value", "key_value", "key-value", "key value"], [2, 4])
    # TP4 does not divide hidden 42 (4 heads of head_dim 8, 4 KV heads, FFN 80 are fine).
    layout_error(tmp, data, "hidden % TP", 4, cfg("hid42", "llama_tiny", hidden_size=42, num_attention_heads=4,
                                                  num_key_value_heads=4, head_dim=8), ["--tp", "4"], ["hidden"], [42, 4])
    # TP4 does not divide FFN 82 (heads 8, kv 4, hidden 48 are fine).
    layout_error(tmp, data, "ffn % TP", 4, cfg("ffn82", "llama_tiny", intermediate_size=82), ["--tp", "4"],
                 ["ffn", "intermediate", "feed", "mlp"], [82, 4])
    # World size 2 ≠ TP2·CP1·DP2·PP1 = 4.
    layout_error(tmp, data, "world != TP*CP*DP*PP", 2, gpt2, ["--tp", "2", "--dp", "2"], ["world", "ranks"], [2, 4])
    # 3 ranks cannot be split into TP2 (DP would be 1.5).
    layout_error(tmp, data, "world % TP", 3, gpt2, ["--tp", "2"], ["world", "ranks"], [3, 2])
    # DP2 · micro-batch 2 = 4 does not divide the global batch 6.
    layout_error(tmp, data, "global batch % (DP*B)", 2, gpt2, ["--global-batch", "6"], ["global"], [6])
    # Sequence parallelism over TP2 with seq-len 15.
    layout_error(tmp, data, "seq-len % TP with SP", 2, gpt2, ["--tp", "2", "--sequence-parallel", "--seq-len", "15"],
                 ["seq"], [15, 2])
    # Pipeline: 2 layers over 4 stages; an explicit split not summing to the layer count; the
    # interleaved schedule with 1 micro-batch per step on 2 stages (needs a multiple of 2).
    layout_error(tmp, data, "layers % PP", 4, gpt2, ["--pp", "4"], ["layers"], [2, 4])
    layout_error(tmp, data, "--pp-layers sum", 2, gpt2, ["--pp", "2", "--pp-layers", "1,2"], ["layers"], [3, 2])
    layout_error(tmp, data, "interleaved micro-batches % PP", 2, cfg("gpt2_l4", "gpt2_tiny", n_layer=4),
                 ["--pp", "2", "--vpp", "2"], ["micro-batches"], [1, 2])
    # A context-parallel degree below 1 (its own mistakes are test_context_parallel.py's).
    layout_error(tmp, data, "--cp 0", 2, gpt2, ["--cp", "0"], ["cp"], [0])
    # ZeRO stage 4 does not exist.
    layout_error(tmp, data, "--zero 4", 2, gpt2, ["--zero", "4"], ["zero"], [4])
    # An error on one rank mid-step, with a message in flight: token ids beyond a 100-token vocabulary in
    # a dataset without its tokenizer file (so not found at open) fail stage 0's first forward under
    # PP2, after it posted the receive of that micro-batch's gradient. The receive was waited for as the
    # error left the step, while stage 1 waited for the activations: a hang instead of the message.
    bare = os.path.join(tmp, "bare")
    for ext in (".bin", ".idx"):
        shutil.copy(data + ext, bare + ext)
    layout_error(tmp, bare, "token id beyond the vocabulary under PP2", 2,
                 cfg("vocab100", "gpt2_tiny", vocab_size=100, bos_token_id=1, eos_token_id=1), ["--pp", "2"],
                 ["vocabulary"], [100])


# ---------------------------------------------------------------------------------------------
# (b), (c): a running job
# ---------------------------------------------------------------------------------------------

def start_job(tmp, data, tag, np_=2, extra=()):
    """A long 2-rank TP2 run of a small gpt2 (n_embd 320, 2 layers, 8 x 64 tokens: ~8 steps/s here);
    returns (Popen, metrics path, checkpoint dir)."""
    cfg = h.write_json(os.path.join(tmp, "kill_cfg.json"), h.load_config("gpt2_tiny", n_embd=320, n_head=4))
    mpath, ck = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag + "_ck")
    args = ["train", "--config", cfg, "--data", data, "--steps", "1000000", "--seq-len", "64", "--micro-batch", "4",
            "--global-batch", "8", "--lr", "1e-3", "--threads", "1", "--quiet", "--metrics", mpath, "--save", ck,
            "--tp", "2", *extra]
    log = open(os.path.join(tmp, tag + ".log"), "w")
    p = subprocess.Popen(h.command(np_, args), stdout=log, stderr=subprocess.STDOUT, env=h.env(),
                         stdin=subprocess.DEVNULL, start_new_session=True)
    return p, mpath, ck, log.name


def wait_metrics(p, mpath, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout and p.poll() is None:
        if os.path.exists(mpath) and os.path.getsize(mpath) > 0:
            return True
        time.sleep(0.1)
    return False


def children(pid):
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:  # no procps: scan /proc
        out = ""
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open("/proc/%s/stat" % d) as f:
                        if f.read().rsplit(")", 1)[1].split()[1] == str(pid):
                            out += d + "\n"
                except OSError:
                    pass
    return [int(x) for x in out.split()]


def rank_pids(mpirun_pid):
    """{rank: pid} of the ranks, found among mpirun's descendants by OMPI_COMM_WORLD_RANK."""
    found, todo = {}, [mpirun_pid]
    while todo:
        for c in children(todo.pop()):
            todo.append(c)
            try:
                env = open("/proc/%d/environ" % c, "rb").read().split(b"\0")
            except OSError:
                continue
            for kv in env:
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    # the deepest process with the variable is the rank itself (not a wrapper)
                    found[int(kv.split(b"=")[1])] = c
    return found


def is_alive(pid):
    """Whether pid exists and is not a zombie."""
    try:
        with open("/proc/%d/status" % pid) as f:
            return not any(l.startswith("State:") and "Z" in l.split()[1] for l in f)
    except OSError:
        return False


def wait_exit(p, timeout):
    t0 = time.time()
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    return rc, time.time() - t0


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def cleanup(p, known=()):
    """Stops mpirun and every rank it started. Open MPI puts each rank in its own process group,
    so the ranks are killed by pid: first SIGTERM to mpirun (it then stops its ranks), then
    SIGKILL to whatever is left."""
    procs = list(known)
    if p.poll() is None:
        procs += descendants(p.pid)
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for pid in procs:
        if is_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def part_b(tmp, data):
    for victim in (1, 0):
        tag = "kill%d" % victim
        p, mpath, ck, log = start_job(tmp, data, tag)
        pids = {}
        try:
            if not check(wait_metrics(p, mpath), "%s: the TP2 job wrote a metrics line" % tag):
                print(open(log).read()[-3000:])
                continue
            pids = rank_pids(p.pid)
            if not check(sorted(pids) == [0, 1], "%s: found both ranks among mpirun's children: %s" % (tag, pids)):
                continue
            steps_before = len(h.read_metrics(mpath, tolerant=True))
            os.kill(pids[victim], signal.SIGKILL)
            rc, dt = wait_exit(p, 60)
            time.sleep(0 if rc is None else 2)
            alive = is_alive(pids[1 - victim])
            ROWS.append(("SIGKILL rank %d" % victim, 2, "after %d steps" % steps_before, rc, "%.1f" % dt, "-",
                         "survivor %s" % ("ALIVE" if alive else "gone"), "ok" if rc not in (None, 0) else "FAIL",
                         " / ".join(l.strip() for l in open(log).read().splitlines()
                                    if re.search(r"signal|exited|killed", l, re.I))[:150]))
            check(rc not in (None, 0) and dt <= 60 and not alive,
                  "%s: SIGKILL to rank %d (pid %d) after %d steps: mpirun exit %s after %.1f s, other rank %s"
                  % (tag, victim, pids[victim], steps_before, rc, dt, "still alive" if alive else "gone"))
        finally:
            cleanup(p, pids.values())


def part_c(tmp, data):
    tag = "term"
    p, mpath, ck, log = start_job(tmp, data, tag)
    pids = {}
    try:
        if not check(wait_metrics(p, mpath), "term: the TP2 job wrote a metrics line"):
            print(open(log).read()[-3000:])
            return
        time.sleep(0.5)
        pids = rank_pids(p.pid)
        p.send_signal(signal.SIGTERM)  # to mpirun only
        rc, dt = wait_exit(p, 60)
        time.sleep(0 if rc is None else 2)
        left = [pid for pid in pids.values() if is_alive(pid)]
        check(sorted(pids) == [0, 1] and not left, "term: no rank outlives mpirun (ranks %s, left: %s)" % (sorted(pids), left))
        recs = h.read_metrics(mpath, tolerant=True)
        step_dir = h.latest_step_dir(ck)
        saved = step_dir is not None
        detail = "no checkpoint (%s/latest absent)" % ck
        consistent = True
        if saved:
            import json
            name = os.path.basename(step_dir)
            steps = {r["step"] for r in recs}
            problems = []
            if not (name.startswith("step-") and name[5:].isdigit()):
                problems.append("latest names %r, not a step-N" % name)
            elif not os.path.isfile(os.path.join(step_dir, "metadata.json")):
                problems.append("%s has no metadata.json" % name)
            st = {}
            if not problems:
                try:
                    st = json.load(open(os.path.join(step_dir, "trainer_state.json")))
                except (OSError, ValueError) as e:
                    problems.append("trainer_state.json unreadable: %s" % e)
            if not problems and (st.get("step") != int(name[5:]) or st.get("step") not in steps):
                problems.append("trainer_state step %s in %s, metrics report steps %s..%s" % (
                    st.get("step"), name, min(steps) if steps else None, max(steps) if steps else None))
            # every visible step-* entry is a committed step: step-N with metadata.json, never a
            # half-written one (those stay hidden as .step-N.tmp until the commit renames them)
            incomplete = [n for n in h.step_entries(ck) if not (
                n[5:].isdigit() and os.path.isfile(os.path.join(ck, n, "metadata.json")))]
            if incomplete:
                problems.append("visible step entries that are not complete step-N dirs: %s" % incomplete)
            if not problems:
                try:
                    x = h.export_checkpoint(step_dir, out=os.path.join(tmp, tag + "_export"), optimizer=True)
                    h.read_safetensors(os.path.join(x, "model.safetensors"))
                    h.read_safetensors(os.path.join(x, "optimizer.safetensors"))
                except Exception as e:  # a missing or truncated piece
                    problems.append("export: %s" % e)
            consistent = not problems
            leftovers = [n for n in os.listdir(ck) if n.startswith(".step-")]
            detail = "checkpoint %s, trainer_state step %s (metrics up to %s)%s%s" % (
                name, st.get("step"), max(steps) if steps else None,
                ", hidden leftovers %s" % leftovers if leftovers else "",
                "" if consistent else " INCONSISTENT: " + "; ".join(problems))
        text = open(log).read()
        ROWS.append(("SIGTERM mpirun", 2, "after %d steps" % len(recs), rc, "%.1f" % dt, "-", detail,
                     "ok" if rc not in (None, 0) and consistent else "FAIL",
                     " / ".join(l for l in text.splitlines() if "signal" in l.lower() or "stopp" in l.lower())[:150]))
        check(rc is not None and dt <= 60, "term: SIGTERM to mpirun: the job stopped after %.1f s (exit %s)" % (dt, rc))
        check(rc not in (None, 0), "term: mpirun exit status is non-zero (%s)" % rc)
        check(saved and consistent, "term: %s" % detail)
        print("      log tail: " + " | ".join(text.strip().splitlines()[-4:])[:600])
    finally:
        cleanup(p, pids.values())


def main():
    parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["a", "b", "c"]
    tmp = h.tmpdir()
    try:
        data = h.prepare_data(tmp)
        if "a" in parts:
            part_a(tmp, data)
        if "b" in parts:
            part_b(tmp, data)
        if "c" in parts:
            part_c(tmp, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(h.fmt_table(("case", "ranks", "flags", "mpirun exit", "s", "error: lines", "ranks' own exit / outcome",
                       "status", "message"), ROWS))
    h.report(FAILS, "all failure checks passed")


if __name__ == "__main__":
    main()
