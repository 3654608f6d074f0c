"""Shared helpers of the tests in tests/parallel/ (and bench/parallel_bench.py): the environment
for oversubscribed mpirun runs, a small byte-level dataset, the test model configs, running
`origami train` under a layout, reading metrics and safetensors files (numpy only), and finding
and exporting the checkpoints that `--save` writes.

Every run gets OMP_WAIT_POLICY=passive and --threads 1 per rank: on a 2-core machine shared by
up to 8 ranks, spin-waiting OpenMP threads collapse throughput.
"""
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("ORIGAMI_ROOT", os.path.dirname(os.path.dirname(HERE)))
BIN = os.environ.get("ORIGAMI_BIN", os.path.join(ROOT, "build", "origami"))
CONFIGS = os.path.join(HERE, "configs")
MPIRUN = shutil.which("mpirun") or "mpirun"


def env(single_copy="none"):
    """The environment of every mpirun here. single_copy: Open MPI's shared-memory single-copy
    mechanism for large messages ("none" works in every container; the benchmarks use "cma")."""
    e = dict(os.environ)
    e.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_WAIT_POLICY": "passive",
              "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              # Open MPI: no warnings about missing high-speed transports in a container.
              "OMPI_MCA_btl": "self,vader", "OMPI_MCA_btl_vader_single_copy_mechanism": single_copy,
              # oversubscribed ranks yield the core while they wait in MPI
              "OMPI_MCA_mpi_yield_when_idle": "1"})
    return e


def given_once(args):
    """args with an option given again (a case's flag over a base list's) kept at its last value only, as
    the tests' lists mean it: origami refuses an option given twice with two values. Launch's options and
    train's (after "--") each apart."""
    if "--" in args:
        k = args.index("--")
        return given_once(args[:k]) + ["--"] + given_once(args[k + 1:])
    groups, j = [], 0
    while j < len(args):
        pair = args[j].startswith("--") and j + 1 < len(args) and not args[j + 1].startswith("--")
        groups.append(args[j:j + 2] if pair else args[j:j + 1])
        j += 2 if pair else 1
    kept, seen = [], set()
    for g in reversed(groups):
        if len(g) == 2 and g[0] in seen:
            continue
        seen.add(g[0])
        kept.append(g)
    return [a for g in reversed(kept) for a in g]


def command(np_, args, binary=None, once=True):
    """The command line of `origami ARGS` on np_ ranks; np_ == 0 runs the binary without mpirun
    (the one-rank reference). once: each option given once (given_once)."""
    b = [binary or BIN, *(given_once(args) if once else args)]
    if np_ == 0:
        return b
    return [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(np_), *b]


def run(np_, args, timeout=300, binary=None, extra_env=None):
    """Runs and returns (returncode, combined output, wall seconds). Never raises on failure.
    extra_env: variables set on top of env()."""
    t0 = time.time()
    try:
        p = subprocess.run(command(np_, args, binary), capture_output=True, text=True, timeout=timeout,
                           env={**env(), **(extra_env or {})},
                           stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout + p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, out + err + "\n[timed out after %ds]" % timeout, time.time() - t0


def why(rc, out, n=600):
    """A failed run in words: "exit RC: " and origami's own error lines, else the output's last n characters
    (mpirun's closing text would otherwise hide the message)."""
    errors = [l for l in out.splitlines() if "error" in l.lower() and "mpirun" not in l.lower()]
    return "exit %s: %s" % (rc, " | ".join(errors)[:n] if errors else out[-n:])


def check_error(name, np_, args, names_rule, timeout=60, extra_env=None):
    """One user mistake on np_ ranks: the job exits 1 with exactly one "error:" line (every rank
    exits, one speaks), and names_rule(line) holds (it names the value and the rule). Prints an
    ok/FAIL row; returns (ok, the line, a failure description or None)."""
    rc, out, _ = run(np_, args, timeout=timeout, extra_env=extra_env)
    lines = [l.strip() for l in out.splitlines() if "error:" in l]
    line = lines[0] if lines else ""
    ok = rc == 1 and len(lines) == 1 and names_rule(line)
    print("%-4s error: %-36s %d ranks, exit %s, %d 'error:' line(s): %s" % (
        "ok" if ok else "FAIL", name, np_, rc, len(lines), line[:200] or out[-200:]), flush=True)
    return ok, line, None if ok else "error case %s (%s): exit %s, %d 'error:' lines: %s" % (
        name, " ".join(args[-6:]), rc, len(lines), line[:200] or out[-300:])


def check_error_cases(data, cases):
    """check_error for each (name, config, ranks, flags, wanted text) on a 1-step run of `data`:
    the one error line must contain the wanted text. Returns the failures."""
    failures = []
    for name, cfg, ranks, flags, want in cases:
        args = ["train", "--config", cfg, "--data", data, "--steps", "1", "--seq-len", "16", "--micro-batch", "2"]
        _, _, failure = check_error(name, ranks, args + flags, lambda line, want=want: want in line)
        failures += [failure] if failure else []
    return failures


_TMPDIRS = []  # made by tmpdir(): removed when the test passes, kept (to look into) when it fails


def report(failures, success):
    """A test's end: the failures and exit 1, or the success line (and its temporary directories removed)."""
    if failures:
        print("\nFAILED:")
        for x in failures:
            print("  " + x)
        sys.exit(1)
    for d in _TMPDIRS:
        shutil.rmtree(d, ignore_errors=True)
    print("\n" + success)


def load_config(name, **changes):
    with open(os.path.join(CONFIGS, name + ".json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    return cfg


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path


WORDS = ("the quick brown fox jumps over lazy dog and cat while a bird sings of rivers mountains "
         "stars code tensor rank gradient loss step parallel data model layer head expert token").split()


def train_flags(layout):
    """`origami train` flags of a layout in `origami plan`'s words ("tp2 cp1 dp1 pp2 vpp2 ep2 etp1 zero1 mb2 sp
    cp-comm=a2a recompute=full fssdp fssdp-keep vocab"; nosp: no sequence parallelism; dp is derived, so dropped)."""
    flags = []
    for w in layout.split():
        if w.startswith("recompute="):
            flags += ["--recompute", w.split("=")[1]]
        elif w.startswith("cp-comm="):
            flags += ["--cp-comm", w.split("=")[1]]
        elif w == "sp":
            flags += ["--sequence-parallel"]
        elif w == "fssdp":
            flags += ["--expert-sharding", "fssdp"]
        elif w == "fssdp-keep":
            flags += ["--expert-sharding", "fssdp", "--fssdp-keep"]
        elif w == "vocab":
            flags += ["--vocab-parallel"]
        elif w not in ("nosp", "nofssdp", "novocab"):
            key = w.rstrip("0123456789")
            if key != "dp":
                flags += [{"mb": "--micro-batch"}.get(key, "--" + key), w[len(key):]]
    return flags


def prepare_data(tmp, name="corpus", n_docs=120, seed=3, words=(20, 80)):
    """A byte-level dataset (256 bytes + end-of-document = 257 tokens) of ~40 KB of seeded
    pseudo-text (documents of `words` words, about 6 bytes each), made with `origami data
    prepare`. Returns the prefix."""
    rng = random.Random(seed)
    text = os.path.join(tmp, name + ".txt")
    with open(text, "w") as f:
        for i in range(n_docs):
            n = rng.randrange(*words)
            f.write("doc %d: " % i + " ".join(rng.choice(WORDS) for _ in range(n)) + ".\n%\n")
    prefix = os.path.join(tmp, name)
    p = subprocess.run([BIN, "data", "prepare", "--input", text, "--output", prefix, "--tokenizer", "byte"],
                       capture_output=True, text=True, env=env())
    if p.returncode != 0:
        sys.exit("data prepare failed:\n" + p.stdout + p.stderr)
    return prefix


def read_metrics(path, tolerant=False):
    """The JSON objects of a metrics file; a line that is not JSON raises ValueError naming it
    (tolerant: skipped, e.g. the last line of a killed run)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for i, l in enumerate(f):
            if l.strip():
                try:
                    out.append(json.loads(l))
                except ValueError:
                    if tolerant:
                        continue
                    raise ValueError("%s line %d is not JSON: %r" % (path, i + 1, l[:200]))
    return out


# ----------------------------------------------------------------------------------------------
# safetensors (the format: u64 little-endian header length, JSON header, raw little-endian data)
# ----------------------------------------------------------------------------------------------

_DT = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8", "F16": "<f2", "U16": "<u2"}


def read_safetensors(path):
    """{name: numpy array} of a .safetensors file."""
    import numpy as np
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(raw[base + a:base + b], dtype=_DT[h["dtype"]]).reshape(h["shape"])
    return out


def compare_tensors(ref, got):
    """Deviation of the tensors `got` from `ref` (both {name: array}). Returns a dict:
      rel: (max over tensors of max|got − ref| / max|ref|, tensor)   (all-zero ref tensor: absolute)
      abs: (max over all elements of |got − ref|, tensor, element index, ref value, got value)
      problems: missing / extra names, shape mismatches, non-finite values."""
    import numpy as np
    problems = []
    for k in sorted(set(ref) ^ set(got)):
        problems.append(("missing " if k in ref else "extra ") + k)
    rel, ab = (0.0, "-"), (0.0, "-", (), 0.0, 0.0)
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        if a.shape != b.shape:
            problems.append("%s: shape %s vs %s" % (k, list(a.shape), list(b.shape)))
            continue
        if a.size == 0:
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        if not np.all(np.isfinite(b64)):
            problems.append("%s: non-finite values" % k)
            continue
        diff = np.abs(a64 - b64)
        i = np.unravel_index(int(np.argmax(diff)), diff.shape)
        d = float(diff[i])
        scale = float(np.max(np.abs(a64)))
        r = d / scale if scale > 0 else d
        if r > rel[0] or rel[1] == "-":
            rel = (r, k)
        if d > ab[0] or ab[1] == "-":
            ab = (d, k, tuple(int(x) for x in i), float(a64[i]), float(b64[i]))
    return {"rel": rel, "abs": ab, "problems": problems}


# ----------------------------------------------------------------------------------------------
# checkpoints: `--save DIR` commits DIR/step-N (one rank-RRRRR.safetensors per rank, metadata.json,
# config.json, trainer_state.json, tokenizer.json), then DIR/latest names the newest step-N.
# ----------------------------------------------------------------------------------------------

def latest_step_dir(save):
    """The step-N directory that SAVE/latest names, or None when nothing was committed."""
    p = os.path.join(save, "latest")
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return os.path.join(save, f.read().strip())


def step_entries(save):
    """The names in SAVE that a reader takes for steps (step-*), sorted; a save in progress or
    refused is hidden (.step-N.tmp) until its commit renames it to step-N."""
    return sorted(n for n in os.listdir(save) if n.startswith("step-")) if os.path.isdir(save) else []


def export_checkpoint(ck, out=None, optimizer=True, timeout=300):
    """`origami ckpt export CK --hf OUT [--optimizer]`: the single-file form of any checkpoint
    (a --save directory, one step-N in it, ...): OUT/model.safetensors (global tensors, Hugging Face
    names), config.json, tokenizer.json when there is one, and with optimizer also
    optimizer.safetensors (exp_avg.<name>, exp_avg_sq.<name>) and trainer_state.json. OUT defaults
    to CK + "_export" (for CK = DIR/step-N: DIR_step-N_export, outside DIR). Returns OUT; raises
    RuntimeError with the command's output when it fails."""
    if out is None:
        ck_n = os.path.normpath(ck)
        base = os.path.basename(ck_n)
        if base.startswith("step-") and base[5:].isdigit():
            ck_n = os.path.dirname(ck_n) + "_" + base
        out = ck_n + "_export"
    if os.path.isdir(out):
        shutil.rmtree(out)
    rc, text, _ = run(0, ["ckpt", "export", ck, "--hf", out] + (["--optimizer"] if optimizer else []), timeout=timeout)
    if rc != 0:
        raise RuntimeError("origami ckpt export %s --hf %s%s exited %s: %s"
                           % (ck, out, " --optimizer" if optimizer else "", rc, text.strip()[-600:]))
    return out


def tmpdir(prefix="origami_par_"):
    d = tempfile.mkdtemp(prefix=prefix)
    _TMPDIRS.append(d)
    return d


def fmt_table(header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(str(s).ljust(w) for s, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def run_wrapped(tmp, label, np_, args, extra_env=None, timeout=120, keep_ranks=False):
    """Runs `origami ARGS` on np_ ranks (0: without mpirun), each rank under sh (and /usr/bin/time,
    for its peak RSS). Returns (mpirun's exit code, output, {rank: exit code}, {rank: peak RSS bytes}).
    keep_ranks: mpirun does not end the other ranks when one exits non-zero (each rank's own exit code
    is then always recorded, and mpirun's own status is 0)."""
    d = os.path.join(tmp, re.sub(r"\W", "_", label))
    os.makedirs(d)
    rank = "${OMPI_COMM_WORLD_RANK:-0}"
    script = ('/usr/bin/time -f %%M -o %s/rss.%s "$0" "$@"; rc=$?; echo $rc > %s/rc.%s; exit $rc'
              % (d, rank, d, rank))
    cmd = ["sh", "-c", script, BIN, *args]
    if np_ > 0:
        keep = ["--mca", "orte_abort_on_non_zero_status", "0"] if keep_ranks else []
        cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", *keep, "-np", str(np_), *cmd]
    e = env()
    e.update(extra_env or {})
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the wrapper, mpirun and every rank: nothing outlives the test
        out, _ = p.communicate()
        rc, out = None, (out or "") + "\n[timed out]"
    codes, rss = {}, {}
    for r in range(max(np_, 1)):
        f = os.path.join(d, "rc.%d" % r)
        codes[r] = int(open(f).read()) if os.path.exists(f) and open(f).read().strip() else None
        f = os.path.join(d, "rss.%d" % r)
        if os.path.exists(f):
            m = re.findall(r"^\d+$", open(f).read(), re.M)  # the last line; earlier ones say how it exited
            rss[r] = int(m[-1]) * 1024 if m else None
    return rc, out, codes, rss
