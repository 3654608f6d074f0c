"""Universal checkpoints: every rank writes its own shards, any layout resumes any checkpoint.

- Reshard matrix: a dense model (gpt2, tied embedding, vocabulary padded under TP) and an MoE model
  (mixtral, 8 experts), 4 layers each, save after 5 steps under each layout below and resume under
  every other to step 10: every pair's losses equal the uninterrupted one-rank run within 1e-5
  relative (constant learning rate, so a 5-step run is the first half of the 10-step one).
- Save -> load -> save under one layout is byte-identical (every file of step-10).
- Faults: kill -9 of one rank at random moments of 20 runs that save every step (each started with
  --resume DIR --save DIR, the first one in an empty DIR; one more run for each killed before its first
  step, at most 40); after each, DIR/latest names a whole checkpoint and the next run resumes it on the
  same curve. A full disk (a tmpfs, else a file-size limit) fails the save with one message and leaves
  the previous checkpoint; under --async-save too (on a tmpfs), when the failing save is the last step's.
- Damaged, truncated and missing shard files are refused with a message naming the file.
- Memory: rank 0's peak RSS with a save is within a quarter of the model's full state of the run
  without one (gathering on rank 0 would add several full states).
- --async-save gives the same curve and checkpoints; --keep-last K keeps the K newest; a rerun into
  the same directory (--overwrite-save) replaces a step whole and leaves the earlier run's higher steps
  alone.
- transformers loads the export of a qwen2_moe saved under EP2 x PP2 (sharded index) with the logits
  origami computes from the sharded checkpoint.
"""
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import harness as h

RTOL = 1e-5
STEPS, HALF = 10, 5
LAYOUTS = [  # name, ranks (0: without mpirun), flags
    ("1 rank", 0, []),
    ("TP2", 2, ["--tp", "2"]),
    ("DP2 ZeRO-1", 2, ["--zero", "1"]),
    ("PP2 interleaved", 2, ["--pp", "2", "--vpp", "2"]),
    ("TP2xPP2 SP", 4, ["--tp", "2", "--pp", "2", "--sequence-parallel"]),
    ("EP2 folded", 2, ["--ep", "2"]),
    ("CP2", 2, ["--cp", "2"]),
    ("DP4 ZeRO-2", 4, ["--zero", "2"]),
    ("TP2xDP2xPP2 ZeRO-1", 8, ["--tp", "2", "--pp", "2", "--zero", "1"]),
]
failures = []


def check(ok, what, detail=""):
    print("%-4s %s" % ("ok" if ok else "FAIL", what), flush=True)
    if not ok:
        failures.append(what + (": " + detail if detail else ""))
    return ok


def base(cfg, data, steps, metrics):
    return ["train", "--config", cfg, "--data", data, "--steps", str(steps), "--micro-batch", "1", "--global-batch",
            "4", "--seq-len", "32", "--lr", "3e-3", "--lr-schedule", "constant", "--seed", "5", "--threads", "1",
            "--quiet", "--metrics", metrics]


def losses(path, tolerant=False):
    return {r["step"]: r["loss"] for r in h.read_metrics(path, tolerant)}


def worst(ref, got, steps):
    """The largest relative loss difference over `steps`: infinite where `got` lacks one of them."""
    return max((abs(ref[s] - got[s]) / abs(ref[s]) if s in got else float("inf") for s in steps), default=0.0)


def reshard_matrix(tmp, name, cfg, data):
    ref_m = os.path.join(tmp, name + "_ref.jsonl")
    rc, out, _ = h.run(0, base(cfg, data, STEPS, ref_m))
    if not check(rc == 0, "%s: the uninterrupted one-rank run" % name, out[-400:]):
        return
    ref = losses(ref_m)
    layouts = [l for l in LAYOUTS if name == "mixtral" or not l[0].startswith("EP")]
    saved = {}
    for lname, ranks, flags in layouts:
        m, ck = os.path.join(tmp, "%s_save_%s.jsonl" % (name, len(saved))), os.path.join(tmp, "%s_ck_%d" % (name, len(saved)))
        rc, out, _ = h.run(ranks, base(cfg, data, HALF, m) + flags + ["--save", ck])
        w = worst(ref, losses(m), range(1, HALF + 1)) if rc == 0 else float("inf")
        if check(rc == 0 and w <= RTOL, "%s: saved under %-20s (steps 1-5 vs one rank: %.1e)" % (name, lname, w),
                 out[-400:]):
            saved[lname] = ck
    t0 = time.time()
    rows = []
    for src, ck in saved.items():
        for lname, ranks, flags in layouts:
            if lname == src:
                continue
            m = os.path.join(tmp, "%s_resume.jsonl" % name)
            if os.path.exists(m):
                os.remove(m)
            rc, out, _ = h.run(ranks, base(cfg, data, STEPS, m) + flags + ["--resume", ck])
            got = losses(m) if rc == 0 else {}
            w = worst(ref, got, range(HALF + 1, STEPS + 1))
            ok = rc == 0 and "resuming from" in out and sorted(got) == list(range(HALF + 1, STEPS + 1)) and w <= RTOL
            rows.append(w)
            if not ok:
                check(False, "%s: %s checkpoint resumed under %s (%.1e)" % (name, src, lname, w), out[-400:])
    check(len(rows) == len(saved) * (len(layouts) - 1) and all(w <= RTOL for w in rows),
          "%s: %d pairs (saved under one layout, resumed under another): steps 6-10 within %.1e of one rank "
          "(worst %.1e, %.0f s)" % (name, len(rows), RTOL, max(rows, default=0), time.time() - t0))
    return ref


def files_of(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def byte_identical(tmp, cfg, data):
    a, b = os.path.join(tmp, "ident_a"), os.path.join(tmp, "ident_b")
    flags = ["--tp", "2", "--pp", "2", "--sequence-parallel"]
    m = os.path.join(tmp, "ident.jsonl")
    r1 = h.run(4, base(cfg, data, STEPS, m) + flags + ["--save", a, "--save-every", str(HALF)])
    r2 = h.run(4, base(cfg, data, STEPS, m) + flags + ["--resume", os.path.join(a, "step-5"), "--save", b])
    if not check(r1[0] == 0 and r2[0] == 0, "byte-identity runs", (r1[1] + r2[1])[-400:]):
        return
    fa, fb = files_of(os.path.join(a, "step-10")), files_of(os.path.join(b, "step-10"))
    differ = [f for f in fa if fa[f] != fb.get(f)] + [f for f in fb if f not in fa]
    check(not differ and len(fa) >= 7, "save -> load -> save under TP2xPP2 SP: step-10's %d files byte-identical to "
          "the uninterrupted run's" % len(fa), "differ: %s" % differ)


def rank_pids(tag):
    """The origami rank processes whose command line contains `tag` (not mpirun)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            argv = open("/proc/%s/cmdline" % p, "rb").read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0].decode(errors="replace")) == "origami" and \
                any(tag.encode() in a for a in argv):
            out.append(int(p))
    return out


def committed_ok(ck):
    """DIR/latest names a step-N whose metadata lists files of the recorded sizes; no other step-N dir
    is partial. Returns (ok, latest step or None, detail)."""
    if not os.path.exists(os.path.join(ck, "latest")):
        return not any(d.startswith("step-") for d in os.listdir(ck)) if os.path.isdir(ck) else True, None, "no latest"
    for d in os.listdir(ck):
        if not d.startswith("step-"):
            continue
        meta = os.path.join(ck, d, "metadata.json")
        if not os.path.exists(meta):
            return False, None, "%s has no metadata.json" % d
        for f in json.load(open(meta))["files"]:
            p = os.path.join(ck, d, f["name"])
            if not os.path.exists(p) or os.path.getsize(p) != f["bytes"]:
                return False, None, "%s/%s missing or of the wrong size" % (d, f["name"])
    latest = open(os.path.join(ck, "latest")).read().strip()
    return os.path.isdir(os.path.join(ck, latest)), int(latest.split("-")[1]), latest


def kill_tests(tmp, cfg, data):
    ck = os.path.join(tmp, "killed")
    rng = random.Random(11)
    seen = {}  # step -> loss, from every run (all follow one curve)
    bad, resumed_checked, kills_in_save, killed_early = [], 0, 0, 0
    total = 100000  # never reached: every run is killed
    # 20 runs, and one more for each run killed before its first step (at most 40), so that 19 resumes are
    # compared however slow the host's startup is.
    for i in range(40):
        if i >= 20 + killed_early:
            break
        m = os.path.join(tmp, "kill_%d.jsonl" % i)
        ok, latest, _ = committed_ok(ck) if os.path.isdir(ck) else (True, None, "")
        # The restart idiom: the same --resume and --save directory every time (the first run, before it
        # holds a checkpoint, starts at step 0).
        args = base(cfg, data, total, m) + ["--ep", "2", "--save", ck, "--save-every", "1", "--resume", ck]
        p = subprocess.Popen(h.command(2, args), env=h.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.6, 1.8))
        pids = rank_pids(ck)
        if pids:
            victim = rng.choice(pids)
            tmp_dirs = [d for d in os.listdir(ck) if d.startswith(".step-")] if os.path.isdir(ck) else []
            kills_in_save += bool(tmp_dirs)
            os.kill(victim, signal.SIGKILL)
        try:
            out = p.communicate(timeout=60)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            p.kill()
            bad.append("run %d hung after the kill" % i)
            continue
        got = losses(m, tolerant=True)
        if latest is None and (min(got, default=1) != 1 or "no checkpoint in" not in out):
            bad.append("run %d did not start at step 1 in an empty directory: %s" % (i, out[-300:]))
        said = re.search(r"resuming from '[^']*' at step (\d+)", out)
        if latest is not None and said and int(said.group(1)) != latest:
            bad.append("run %d resumed at step %s, not at the latest step %d" % (i, said.group(1), latest))
        # A kill at a random moment can land before the run's first step (startup took longer than the
        # 0.6 s minimum on a loaded host): it has no row to compare, and the next run resumes the same
        # checkpoint. Every run that reached a step is compared.
        if latest is not None and got:
            if min(got) != latest + 1 or not said:
                bad.append("run %d did not resume at step %s: %s" % (i, latest + 1, out[-300:]))
            resumed_checked += 1
        elif latest is not None:
            killed_early += 1
        for s, l in got.items():
            if s in seen and abs(seen[s] - l) > RTOL * abs(seen[s]):
                bad.append("step %d: loss %.6f after a resume, %.6f before" % (s, l, seen[s]))
            seen[s] = l
        ok, latest, detail = committed_ok(ck)
        if not ok:
            bad.append("after kill %d: %s" % (i, detail))
    # (kills_in_save: about 13 of the 20 land while a save's temporary directory exists; none would leave
    # the atomic commit untested)
    check(not bad and resumed_checked >= 15 and kills_in_save >= 1,
          "kill -9 of one rank at random moments of %d runs saving every step (%d kills while a save's temporary "
          "directory existed): each time DIR/latest names a whole checkpoint and the next run resumes it on the same "
          "curve (%d resumes, %d steps compared; %d runs killed before their first step)"
          % (min(40, 20 + killed_early), kills_in_save, resumed_checked, len(seen), killed_early),
          "; ".join(bad[:3]))


def disk_full(tmp, cfg, data):
    mnt = os.path.join(tmp, "small_disk")
    os.makedirs(mnt)
    ck = os.path.join(mnt, "ck")
    # One checkpoint's size, measured on the normal disk.
    probe = os.path.join(tmp, "probe_ck")
    h.run(2, base(cfg, data, 1, os.path.join(tmp, "probe.jsonl")) + ["--ep", "2", "--save", probe])
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(probe) for f in fs)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dk" % (size * 3 // 2048 + 64), "tmpfs", mnt],
                             capture_output=True).returncode == 0
    try:
        first = h.run(2, base(cfg, data, 6, os.path.join(tmp, "full1.jsonl")) + ["--ep", "2", "--save", ck,
                                                                                  "--save-every", "3"]) if mounted else None
        if not mounted:  # no tmpfs here: a file-size limit makes the rank files' writes fail instead
            h.run(0, base(cfg, data, 3, os.path.join(tmp, "full1.jsonl")) + ["--save", ck])
            limit = max(os.path.getsize(os.path.join(ck, "step-3", f)) for f in os.listdir(os.path.join(ck, "step-3"))) // 2

            # One rank without mpirun (MPI's shared-memory files would hit the limit too); SIGXFSZ ignored,
            # so a write past the limit fails with EFBIG as a full disk fails with ENOSPC.
            wrap = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                    "resource.setrlimit(resource.RLIMIT_FSIZE, (%d, %d)); os.execv(sys.argv[1], sys.argv[1:])" % (limit, limit))
            args = ["-c", wrap, h.BIN] + base(cfg, data, 6, os.path.join(tmp, "full2.jsonl")) + ["--save", ck, "--resume", ck]
            p = subprocess.run(h.command(0, args, binary=sys.executable), env=h.env(), capture_output=True, text=True)
            first = (p.returncode, p.stdout + p.stderr, 0)
        rc, out, _ = first
        ok, latest, _ = committed_ok(ck)
        leftovers = [d for d in os.listdir(ck) if d.startswith(".")]
        msg = [l for l in out.splitlines() if "cannot save checkpoint step 6" in l]
        check(rc not in (0, None) and len(msg) == 1 and "step-3 is intact" in msg[0] and ok and latest == 3 and
              not leftovers, "a full disk (%s) during the step-6 save: one message, exit %s, step-3 still latest, no "
              "temporary directory left" % ("tmpfs of 1.5 checkpoints" if mounted else "file-size limit", rc),
              out[-500:])
        rc, out, _ = h.run(2, base(cfg, data, 4, os.path.join(tmp, "full3.jsonl")) + ["--ep", "2", "--resume", ck])
        check(rc == 0 and "at step 3" in out, "... and step-3 resumes", out[-300:])
        if mounted:  # the same with --async-save: the last step's save fails in the background, found at its commit
            shutil.rmtree(ck)
            rc, out, _ = h.run(2, base(cfg, data, 6, os.path.join(tmp, "full4.jsonl")) + [
                "--ep", "2", "--save", ck, "--save-every", "3", "--async-save"])
            ok, latest, _ = committed_ok(ck)
            msg = [l for l in out.splitlines() if "cannot save checkpoint step 6" in l]
            check(rc == 1 and len(msg) == 1 and "step-3 is intact" in msg[0] and ok and latest == 3 and
                  not [d for d in os.listdir(ck) if d.startswith(".")], "--async-save: a full disk during the last "
                  "step's save: one message, exit %s, step-3 still latest, no temporary directory left" % rc, out[-500:])
    finally:
        if mounted:
            subprocess.run(["umount", mnt], capture_output=True)


def damaged(tmp, cfg, data):
    src = os.path.join(tmp, "dmg_src")
    h.run(2, base(cfg, data, 2, os.path.join(tmp, "dmg.jsonl")) + ["--tp", "2", "--save", src])
    cases = []
    for what in ("damaged", "truncated", "missing", "empty"):
        d = os.path.join(tmp, "dmg_" + what)
        shutil.copytree(src, d)
        f = os.path.join(d, "step-2", "rank-00001.safetensors")
        if what == "damaged":
            b = bytearray(open(f, "rb").read())
            b[len(b) // 2] ^= 0x40
            open(f, "wb").write(bytes(b))
            want = "rank-00001.safetensors' is damaged"
        elif what == "truncated":
            b = open(f, "rb").read()
            open(f, "wb").write(b[:len(b) - 100])
            want = "rank-00001.safetensors' has %d bytes but the metadata says %d" % (len(b) - 100, len(b))
        elif what == "missing":
            os.remove(f)
            want = "rank-00001.safetensors' is missing"
        else:
            shutil.rmtree(d)
            os.makedirs(d)
            want = "holds no checkpoint"
        rc, out, _ = h.run(2, base(cfg, data, 3, os.path.join(tmp, "dmg2.jsonl")) + ["--resume", d])
        errors = [l for l in out.splitlines() if "error" in l]
        check(rc not in (0, None) and len(errors) == 1 and want in errors[0],
              "a %s shard file is refused on resume with one message naming it" % what if what != "empty" else
              "--resume of a directory without a checkpoint is refused", out[-400:])
        if what in ("damaged", "truncated", "missing"):  # ckpt info checks sizes, and with --verify the checksums
            rc, out, _ = h.run(0, ["ckpt", "info", d])
            rc_v, out_v, _ = h.run(0, ["ckpt", "info", d, "--verify"])
            found = (rc == 0 and "files: each there with its recorded size" in out) if what == "damaged" else \
                (rc == 1 and want in out)
            check(found and rc_v == 1 and want in out_v, "ckpt info finds a %s shard file (%s)" % (
                what, "with --verify" if what == "damaged" else "by its size"), out[-300:] + out_v[-300:])
        if what == "damaged":  # ... and by the commands that read weights only
            for cmd in (["generate", "--checkpoint", d, "--prompt", "a", "--max-new-tokens", "2"],
                        ["dump", "--init-from", d, "--data", data, "--seq-len", "16", "--out", os.path.join(tmp, "x")]):
                rc, out, _ = h.run(0, cmd)
                check(rc == 1 and want in out and "-> " not in out, "%s refuses a damaged shard file" % cmd[0], out[-400:])
    # A rank's file given for the checkpoint, and a latest naming a removed step (the newest step opens, with a warning).
    shard = os.path.join(src, "step-2", "rank-00001.safetensors")
    for cmd in (["ckpt", "info", shard], ["ckpt", "export", shard, "--hf", os.path.join(tmp, "dmg_hf")]):
        rc, out, _ = h.run(0, cmd)
        check(rc == 1 and "'%s' is a file of the sharded checkpoint '%s', not a checkpoint of its own: give that "
              "directory" % (shard, os.path.dirname(shard)) in out, "ckpt %s of a rank's shard file names the "
              "checkpoint it belongs to" % cmd[1], out[-400:])
    with open(os.path.join(src, "latest"), "w") as f:
        f.write("step-7\n")
    rc, out, _ = h.run(0, ["ckpt", "info", src])
    check(rc == 0 and "warning: '%s': its latest names 'step-7', which is not a committed step (no step-7/metadata.json):"
          " opening the newest committed step, step-2" % src in out and "step: 2" in out,
          "a latest naming a removed step: the newest step opens, with a warning", out[-400:])


def memory(tmp, data):
    cfg = h.write_json(os.path.join(tmp, "gpt2_mem.json"), h.load_config("gpt2_tiny", n_embd=256, n_layer=4, n_head=4))
    rss = {}
    for save in (False, True):
        m = os.path.join(tmp, "mem_%d.jsonl" % save)
        args = base(cfg, data, 3, m) + ["--tp", "2", "--pp", "2"] + (["--save", os.path.join(tmp, "mem_ck")] if save else [])
        rc, out, _ = h.run(4, args)
        rss[save] = h.read_metrics(m)[-1]["rss_peak_bytes"] if rc == 0 else None
    meta = json.load(open(os.path.join(tmp, "mem_ck", "step-3", "metadata.json")))
    state = sum(3 * 4 * (lambda s: __import__("math").prod(s))(t["shape"]) for t in meta["tensors"].values())
    own = meta["files"][0]["bytes"]
    ok = None not in rss.values() and rss[True] - rss[False] <= state // 4
    check(ok, "memory: rank 0's peak RSS with a save %.1f MB vs %.1f MB without (+%.1f MB; it wrote %.1f MB; the "
          "model's full state is %.1f MB, bound a quarter of it)" % (
              (rss[True] or 0) / 1e6, (rss[False] or 0) / 1e6, ((rss[True] or 0) - (rss[False] or 0)) / 1e6, own / 1e6,
              state / 1e6, ), str(rss))


def async_and_keep(tmp, cfg, data, ref):
    ck, m = os.path.join(tmp, "async_ck"), os.path.join(tmp, "async.jsonl")
    rc, out, _ = h.run(2, base(cfg, data, STEPS, m) + ["--ep", "2", "--save", ck, "--save-every", "2", "--async-save",
                                                       "--keep-last", "2"])
    got = losses(m) if rc == 0 else {}
    blocked = [r.get("save_blocked_s") for r in h.read_metrics(m)] if rc == 0 else []
    steps = sorted(d for d in os.listdir(ck) if d.startswith("step-")) if rc == 0 else []
    check(rc == 0 and worst(ref, got, range(1, STEPS + 1)) <= RTOL and steps == ["step-10", "step-8"] and
          open(os.path.join(ck, "latest")).read().strip() == "step-10" and all(b is not None for b in blocked[1::2]),
          "--async-save --save-every 2 --keep-last 2: the one-rank curve, step-8 and step-10 kept, latest step-10, "
          "save_blocked_s reported", out[-400:] + str(steps))
    m2 = os.path.join(tmp, "async2.jsonl")
    rc, out, _ = h.run(0, base(cfg, data, STEPS, m2) + ["--resume", os.path.join(ck, "step-8")])
    check(rc == 0 and worst(ref, losses(m2), range(9, STEPS + 1)) <= RTOL,
          "an asynchronously written checkpoint resumes on one rank", out[-300:])


def rerun_same_dir(tmp, cfg, data):
    """A second run saving into a directory an earlier run filled (--overwrite-save; without it an error):
    the same step is replaced whole
    (the directories are exchanged atomically), --keep-last removes only older steps up to the new
    one (a higher step of the earlier run stays), and ckpt export refuses a directory with weights."""
    ck = os.path.join(tmp, "rerun_ck")
    first = base(cfg, data, 8, os.path.join(tmp, "rerun1.jsonl")) + ["--save", ck, "--save-every", "2"]
    second = base(cfg, data, 5, os.path.join(tmp, "rerun2.jsonl"))
    second[second.index("--seed") + 1] = "6"
    r1 = h.run(0, first)
    r2 = h.run(0, second + ["--save", ck, "--save-every", "1", "--keep-last", "2", "--overwrite-save"])
    steps = sorted(d for d in os.listdir(ck) if d.startswith("step-")) if r1[0] == 0 and r2[0] == 0 else []
    leftovers = [d for d in os.listdir(ck) if d.startswith(".")] if os.path.isdir(ck) else []
    seed = json.load(open(os.path.join(ck, "step-4", "trainer_state.json")))["options"]["seed"] if steps else None
    check(steps == ["step-4", "step-5", "step-6", "step-8"] and seed == 6 and not leftovers and
          open(os.path.join(ck, "latest")).read().strip() == "step-5",
          "a rerun into the same --save directory: step-4 replaced by the rerun's (seed %s), --keep-last 2 keeps "
          "step-4 and step-5 (its step-2 and step-3 removed) and the earlier run's step-6 and step-8, latest step-5, nothing left over (%s)" % (seed, steps),
          (r1[1] + r2[1])[-400:])
    out = os.path.join(tmp, "rerun_hf")
    rc1, _, _ = h.run(0, ["ckpt", "export", ck, "--hf", out])
    rc2, msg, _ = h.run(0, ["ckpt", "export", ck, "--hf", out])
    check(rc1 == 0 and rc2 == 1 and "already holds model weights" in msg,
          "ckpt export refuses an output directory that already holds weights", msg[-300:])


def qwen_export(tmp, data):
    cfg = os.path.join(h.CONFIGS, "qwen2_moe_8e.json")
    ck, out_dir = os.path.join(tmp, "qwen_ck"), os.path.join(tmp, "qwen_hf")
    rc, out, _ = h.run(4, base(cfg, data, 3, os.path.join(tmp, "qwen.jsonl")) + ["--ep", "2", "--pp", "2", "--save", ck])
    if not check(rc == 0, "qwen2_moe saved under EP2 x PP2", out[-400:]):
        return
    rc, out, _ = h.run(0, ["ckpt", "info", ck])
    check(rc == 0 and "step: 3" in out and "saved by: 4 ranks" in out, "ckpt info prints the step and the layout", out[-300:])
    rc, out, _ = h.run(0, ["ckpt", "export", ck, "--hf", out_dir, "--max-shard-gb", "0.0005"])
    shards = [f for f in os.listdir(out_dir) if f.startswith("model-")] if rc == 0 else []
    if not check(rc == 0 and len(shards) > 1 and os.path.exists(os.path.join(out_dir, "model.safetensors.index.json")),
                 "ckpt export writes %d weight shards and model.safetensors.index.json" % len(shards), out[-300:]):
        return
    dump = os.path.join(tmp, "qwen_dump.safetensors")
    rc, out, _ = h.run(0, ["dump", "--init-from", ck, "--data", data, "--micro-batch", "1", "--seq-len", "16",
                           "--out", dump])
    if not check(rc == 0, "origami dump from the sharded checkpoint", out[-300:]):
        return
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        check(False, "transformers is importable", str(e))
        return
    d = h.read_safetensors(dump)
    model, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True, torch_dtype=torch.float64)
    missing = info["missing_keys"] + info["unexpected_keys"] + info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor(d["tokens"][:, :16].astype("int64"))).logits.numpy()
    rel = float(abs(logits - d["logits"]).max() / abs(logits).max())
    check(not missing and rel <= 1e-4, "transformers loads the sharded export of the EP2 x PP2 qwen2_moe: logits "
          "within %.1e of origami's from the checkpoint" % rel, str(missing[:4]))


def main():
    tmp = h.tmpdir("origami_ckpt_")
    data = h.prepare_data(tmp)
    gpt2 = h.write_json(os.path.join(tmp, "gpt2_4l.json"), h.load_config("gpt2_tiny", n_layer=4))
    mixtral = h.write_json(os.path.join(tmp, "mixtral_4l.json"), h.load_config("mixtral_8e", num_hidden_layers=4))
    reshard_matrix(tmp, "gpt2", gpt2, data)
    ref = reshard_matrix(tmp, "mixtral", mixtral, data)
    byte_identical(tmp, mixtral, data)
    kill_tests(tmp, mixtral, data)
    disk_full(tmp, mixtral, data)
    damaged(tmp, mixtral, data)
    memory(tmp, data)
    if ref:
        async_and_keep(tmp, mixtral, data, ref)
    rerun_same_dir(tmp, gpt2, data)
    qwen_export(tmp, data)
    shutil.rmtree(tmp, ignore_errors=True)
    h.report(failures, "all universal-checkpoint checks passed")


if __name__ == "__main__":
    main()
