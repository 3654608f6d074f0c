#!/usr/bin/python3
"""Mutation fuzzer of origami's inputs (issue 35): every input a user can hand origami, mutated where it
matters, run through the command that reads it; no crash, hang, sanitizer report or bare library
exception is allowed (tests/fuzz/outcome.py says what passes).

  /usr/bin/python3 tests/fuzz/mutate.py --bin build-asan/origami --cases 300        # the bounded run (ctest)
  /usr/bin/python3 tests/fuzz/mutate.py --bin build-asan/origami --cases 10000 --out runs/fuzz   # long
  bash scripts/fuzz_long.sh                                                          # the long run

Seeds are made at the start with the binary under test (tests/fuzz/seeds.py); the kinds of case and
their mutations are in tests/fuzz/cases.py and mutators.py. Case i of seed S is a function of (S, i)
only: the same seed gives the same inputs, whatever --jobs. A failing case keeps its directory under
OUT/cases/ with the mutated input, repro.sh (the exact command), what was mutated and the output;
passing cases are removed (--keep-all keeps them). The summary groups failures by signature (a
sanitizer's location, a signal and command, a normalised message) with the first reproducer of each.

Exit status: 0 when every case passed (warnings allowed), 1 when any failed, 2 on a setup problem.
With --skip-missing, a missing binary prints SKIPPED and exits 0 (ctest without the ASan build).
"""
import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cases as kinds  # noqa: E402
import outcome  # noqa: E402
from seeds import ROOT, SeedError, Seeds  # noqa: E402

MPIRUN = shutil.which("mpirun")


def base_env(asan):
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive",
              "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,vader",
              "OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMPI_MCA_mpi_yield_when_idle": "1",
              # Open MPI's own leaks are not ours; a sanitizer report exits 77 (never 1, the user-error code);
              # memory that grows past 3 GB is a finding (rss_limit), not a reason to bring the machine down.
              "ASAN_OPTIONS": "detect_leaks=0:exitcode=77:rss_limit_mb=3072:allocator_may_return_null=1:"
                              "abort_on_error=0:detect_odr_violation=0",
              "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=77"})
    sym = shutil.which("llvm-symbolizer")
    if sym:
        e.setdefault("ASAN_SYMBOLIZER_PATH", sym)
    return e


def is_asan(binary):
    with open(binary, "rb") as f:
        return b"__asan_init" in f.read()


class Runner:
    def __init__(self, binary, timeout):
        self.bin = binary
        self.timeout = timeout
        self.asan = is_asan(binary)
        self.env = base_env(self.asan)

    def limits(self):
        # The release build gets an address-space limit instead of ASan's RSS limit: a runaway allocation
        # fails (and is reported as one) rather than taking the machine's memory.
        if not self.asan:
            resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def __call__(self, argv, cwd, mpi=False, timeout=None):
        """(rc, stdout, stderr, timed_out, seconds); rc None on a timeout."""
        if mpi:
            argv = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2", *argv]
        limit = timeout or (self.timeout * (2 if mpi else 1))
        t0 = time.time()
        p = subprocess.Popen(argv, cwd=cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True, preexec_fn=self.limits)
        timed_out = False
        try:
            out, err = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = p.communicate()
        dec = lambda b: b.decode("utf-8", "replace")  # noqa: E731
        return (None if timed_out else p.returncode), dec(out), dec(err), timed_out, time.time() - t0


def pick_kind(rng, names):
    return rng.choices(names, [kinds.KINDS[n][1] for n in names])[0]


def shell_quote(a):
    import shlex
    return shlex.quote(a)


def run_case(index, args, seeds, runner, names, mpi_ok):
    """Case `index` (an int), or probe `index` (its name in cases.PROBES)."""
    if isinstance(index, str):
        kind, make = "probe", (lambda rng, c: kinds.PROBES[index](c))
        d = os.path.join(args.out, "cases", "probe-%02d" % list(kinds.PROBES).index(index))
        rng = None
    else:
        rng = random.Random("%d:%d" % (args.seed, index))
        kind = pick_kind(rng, names)
        make = kinds.KINDS[kind][0]
        d = os.path.join(args.out, "cases", "%05d-%s" % (index, kind))
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    c = kinds.Case(index, kind, d, seeds, runner.bin, mpi_ok)
    if isinstance(index, str):
        c.m.note("probe: " + index)
    try:
        make(rng, c)
        c.argv = [a.split("\0")[0] for a in c.argv]  # what a C argv can hold
        rc, out, err, timed_out, secs = runner(c.argv, d, mpi=c.mpi)
        if timed_out:  # once more: a loaded machine can stall a process; a hang hangs twice
            rc2, out2, err2, timed_out2, secs2 = runner(c.argv, d, mpi=c.mpi)
            if not timed_out2:  # judged on the second run; passing, it is a warning
                o = outcome.judge(c, rc2, out2, err2, False, secs2)
                if o.status == "ok":
                    o = outcome.Outcome("warn", "flaky-timeout", "over the time limit once (%.1f s), then exit %s in "
                                        "%.1f s" % (secs, rc2, secs2), "flaky timeout: %s" % c.command())
                return finish(c, o, args, runner, d, rc2, out2, err2, False, secs2)
    except Exception as e:  # a bug of the harness, not of origami: reported as such
        import traceback
        return c, outcome.Outcome("fail", "harness-error", traceback.format_exc()[-800:], "harness error: %r" % e), 0
    o = outcome.judge(c, rc, out, err, timed_out, secs)
    return finish(c, o, args, runner, d, rc, out, err, timed_out, secs)


def finish(c, o, args, runner, d, rc, out, err, timed_out, secs):
    """Keeps the case directory with its reproducer unless it passed; returns (case, outcome, seconds)."""
    if o.status != "ok" or args.keep_all:
        argv = ([MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2"] if c.mpi else []) + c.argv
        env = " ".join("%s=%s" % (k, shell_quote(runner.env[k])) for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS",
                                                                           "OMP_NUM_THREADS") if k in runner.env)
        with open(os.path.join(d, "repro.sh"), "w") as f:
            f.write("#!/bin/sh\n# %s case %s of seed %d: %s\n# outcome: %s %s\n"
                    "# (2-rank cases need OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 as root)\n"
                    "cd %s && %s timeout %d %s\n" % (c.kind, c.index, args.seed, c.m.describe()[:2000], o.category,
                                                     o.detail.replace("\n", " ")[:300], shell_quote(d), env,
                                                     int(args.timeout * 3), " ".join(shell_quote(a) for a in argv)))
        with open(os.path.join(d, "output.txt"), "w") as f:
            f.write("exit %s%s after %.1f s\n--- stdout (last 20000 chars)\n%s\n--- stderr (last 20000 chars)\n%s\n" % (
                rc, " (timed out)" if timed_out else "", secs, out[-20000:], err[-20000:]))
    else:
        shutil.rmtree(d, ignore_errors=True)
    return c, o, secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--bin", default=os.environ.get("ORIGAMI_FUZZ_BIN", os.path.join(ROOT, "build-asan", "origami")),
                    help="the origami binary (default: build-asan/origami, the ASan+UBSan build)")
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--first", type=int, default=0, help="index of the first case (cases FIRST..FIRST+CASES-1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="output directory (default: a new one under $TMPDIR)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10, help="seconds per case (x2 under mpirun)")
    ap.add_argument("--kinds", default="", help="comma-separated kinds to draw from (default: all): " +
                    ", ".join(kinds.KINDS))
    ap.add_argument("--time-budget", type=float, default=0,
                    help="start no case after this many seconds (0: none); the summary says how many were left")
    ap.add_argument("--keep-all", action="store_true", help="keep passing cases' directories too")
    ap.add_argument("--no-probes", action="store_true", help="skip the probes (the inputs of issue 35, run first)")
    ap.add_argument("--no-mpi", action="store_true", help="no 2-rank checkpoint or mpirun cases")
    ap.add_argument("--seeds-only", action="store_true", help="make the seeds under OUT/seeds and stop (libFuzzer corpora)")
    ap.add_argument("--skip-missing", action="store_true", help="exit 0 with a SKIPPED line if --bin does not exist")
    args = ap.parse_args()

    args.bin = os.path.abspath(args.bin)
    if not os.path.exists(args.bin):
        msg = "binary %s does not exist (build it: see scripts/test.sh, build-asan)" % args.bin
        if args.skip_missing:
            print("SKIPPED: " + msg)
            return 0
        print("error: " + msg)
        return 2
    args.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="origami-fuzz-%d-" % args.seed))
    shutil.rmtree(os.path.join(args.out, "cases"), ignore_errors=True)  # a previous run's reproducers
    os.makedirs(os.path.join(args.out, "cases"))
    names = [n for n in (args.kinds.split(",") if args.kinds else kinds.KINDS)]
    for n in names:
        if n not in kinds.KINDS:
            print("error: unknown kind %r (kinds: %s)" % (n, ", ".join(kinds.KINDS)))
            return 2
    runner = Runner(args.bin, args.timeout)
    mpi_ok = MPIRUN is not None and not args.no_mpi

    t0 = time.time()
    seeds = Seeds(args.out, lambda argv, cwd, mpi=False: runner(argv, cwd, mpi=mpi, timeout=300)[:3])
    try:
        seeds.make(args.bin, mpi_ok, print)
    except SeedError as e:
        print("error:", e)
        return 2
    t_seeds = time.time() - t0
    if args.seeds_only:
        print("seeds made in %.1f s: %s" % (t_seeds, seeds.dir))
        return 0
    print("origami fuzz: %s (%s), seed %d, cases %d..%d, %d jobs, %.0f s per case; seeds made in %.1f s under %s" % (
        args.bin, "ASan+UBSan" if runner.asan else "no sanitizer", args.seed, args.first, args.first + args.cases - 1,
        args.jobs, args.timeout, t_seeds, args.out), flush=True)

    results = {}
    lock = threading.Lock()
    started = [0]

    def one(i):
        if args.time_budget and time.time() - t0 > args.time_budget:
            return None
        with lock:
            started[0] += 1
        c, o, secs = run_case(i, args, seeds, runner, names, mpi_ok)
        with lock:
            results[i] = (c, o, secs)
            if o.status != "ok":
                print("  case %s %-13s %-4s %s: %s" % (i, c.kind, o.status.upper(), o.category, o.detail[:200].replace(
                    "\n", " ")), flush=True)
            done = len(results)
            if done % 100 == 0 and isinstance(i, int):
                print("  ... %d cases, %.0f s" % (done, time.time() - t0), flush=True)
        return i

    todo = ([] if args.no_probes else list(kinds.PROBES)) + list(range(args.first, args.first + args.cases))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, todo))
    elapsed = time.time() - t0
    return report(args, results, elapsed, t_seeds, runner)


def report(args, results, elapsed, t_seeds, runner):
    by_kind, outcomes, groups = {}, {}, {}
    order = sorted(results, key=lambda i: (isinstance(i, int), i if isinstance(i, int) else list(kinds.PROBES).index(i)))
    probes = [i for i in order if isinstance(i, str)]
    for i in order:
        c, o, secs = results[i]
        k = by_kind.setdefault(c.kind, {"cases": 0, "fail": 0, "warn": 0, "seconds": 0.0})
        k["cases"] += 1
        k["seconds"] += secs
        if o.status != "ok":
            k[o.status] += 1
            g = groups.setdefault((o.status, o.signature), {"cases": [], "first": None})
            g["cases"].append(i)
            if g["first"] is None:
                g["first"] = {"case": i, "kind": c.kind, "dir": c.dir, "mutation": c.m.describe()[:600],
                              "command": " ".join(c.argv)[:600], "detail": o.detail[:600], "category": o.category}
        outcomes[o.category] = outcomes.get(o.category, 0) + 1
    n = len(results)
    n_random = n - len(probes)
    fails = sum(1 for _, o, _ in results.values() if o.status == "fail")
    warns = sum(1 for _, o, _ in results.values() if o.status == "warn")
    print()
    print("origami fuzz summary: %d probes + %d cases (seed %d) in %.1f s (seeds %.1f s) against %s%s" % (
        len(probes), n_random, args.seed, elapsed, t_seeds, args.bin, " [ASan+UBSan]" if runner.asan else ""))
    if n_random < args.cases:
        print("  %d cases not run: the time budget (%.0f s) ran out" % (args.cases - n_random, args.time_budget))
    for i in probes:
        c, o, secs = results[i]
        print("  probe %-45s %-4s %s %s" % (i, o.status.upper(), o.category, o.detail[:110].replace("\n", " ")))
    print("  passed %d, failed %d, warnings %d; %d distinct failures, %d distinct warnings" % (
        n - fails - warns, fails, warns, sum(1 for s, _ in groups if s == "fail"),
        sum(1 for s, _ in groups if s == "warn")))
    print("  outcomes: " + ", ".join("%s %d" % kv for kv in sorted(outcomes.items(), key=lambda kv: -kv[1])))
    print("  by kind:  " + ", ".join("%s %d (%d failed, %.1f s mean)" % (k, v["cases"], v["fail"], v["seconds"] / v["cases"])
                                     for k, v in sorted(by_kind.items())))
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0] != "fail", -len(kv[1]["cases"])))
    for (status, sig), g in ordered:
        f = g["first"]
        print()
        print("%s [%d case%s] %s" % (status.upper(), len(g["cases"]), "" if len(g["cases"]) == 1 else "s", sig))
        print("    first: case %s (%s): %s" % (f["case"], f["kind"], f["mutation"][:300]))
        print("    outcome: %s" % f["detail"][:300].replace("\n", " "))
        print("    command: %s" % f["command"][:300])
        print("    reproduce: sh %s/repro.sh" % f["dir"])
        if len(g["cases"]) > 1:
            print("    cases: %s" % " ".join(str(x) for x in g["cases"][:20]) + (" ..." if len(g["cases"]) > 20 else ""))
    summary = {"seed": args.seed, "first": args.first, "cases": n_random, "probes": len(probes), "seconds": round(elapsed, 1), "binary": args.bin,
               "asan": runner.asan, "failed": fails, "warnings": warns, "outcomes": outcomes, "by_kind": by_kind,
               "groups": [{"status": s, "signature": sig, "count": len(g["cases"]), "cases": g["cases"], **g["first"]}
                          for (s, sig), g in ordered]}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\nsummary: %s" % os.path.join(args.out, "summary.json"))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
