"""Judging one run of origami on a mutated input.

OK:   exit 0; or exit 1 with one line `origami <command>: error: <message>` on stderr (under mpirun also
      `origami train: error (rank R of N): ...`, and Open MPI's own lines); train may also exit 3 (a
      non-finite step stopped the run, with its error line) or 130 (stopped by a signal).
FAIL: a signal (SIGSEGV, SIGFPE, SIGABRT, ...), a sanitizer report, a hang (the time limit, before the
      run started its steps), "unexpected error:" (an exception origami did not turn into a message:
      a bare nlohmann::json or std:: exception), "internal error:" (an ORIGAMI_ASSERT), "out of memory
      (in an allocation outside the checked buffers)", std::terminate, exit 1 without an error line,
      any other exit code; and wrong results the output shows: a number wrapped to 32/64 bits in a
      message ("got -2147483648" for 2147483648), a plan with 0 B of memory, an MFU above 100% or a
      non-finite figure, a blend share of 0, `ckpt info` listing a negative dimension or a parameter
      count other than the shapes' sum; and an error message that is the JSON library's type or range
      error ("[json.exception.type_error.302] ...": it names neither the field nor what was expected;
      a JSON syntax error's parse_error message is fine).
WARN: the time limit after the run was accepted and started (a mutated count of work, not a hang;
      listed, not counted as a failure); a time limit passed once and not on a second try that passes
      (mutate.py runs a timed-out case again and judges the second run: a loaded machine can stall a
      process, a hang hangs twice).
"""
import json
import math
import re
import signal

ERROR_LINE = re.compile(r"^origami [a-z]+(?: [a-z]+)?: error(?: \(rank \d+ of \d+\))?: \S")
SAN_ASAN = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer|ThreadSanitizer): ([\w-]+(?: [\w-]+)?)")
SAN_UBSAN = re.compile(r"([\w./+-]+:\d+)(?::\d+)?: runtime error: (.*)")
FRAME = re.compile(r"#\d+ 0x[0-9a-f]+ in (\S+) (\S*/(?:src|apps)/[\w/.+-]+:\d+)")
# The JSON library's own words for a field of the wrong type or range (a syntax error's parse_error, and
# out_of_range.406, a number literal beyond double's range, are the file's syntax: fine in a message).
LIBRARY_MESSAGE = re.compile(r"\[json\.exception\.(?!parse_error|out_of_range\.406)(\w+)|std::|basic_string|stoi|stoll|stod")
MPI_SIGNAL = re.compile(r"exited on signal (\d+)")


def source_location(text):
    """The first stack frame in origami's own sources: 'function file:line'."""
    for m in FRAME.finditer(text):
        if "libsanitizer" in m.group(2) or m.group(2).startswith("/usr/"):
            continue
        loc = re.sub(r"^.*?/((?:src|apps)/)", r"\1", m.group(2))
        return "%s %s" % (m.group(1).split("(")[0], loc)
    return ""


def normalise(msg):
    """A message without its particulars (numbers, quoted names, paths), for grouping."""
    msg = re.sub(r"\[[^\]]*\]?$", "[…]", msg)  # std::filesystem's [path] at the end
    msg = re.sub(r"'[^']*'", "'…'", msg)
    msg = re.sub(r"\"[^\"]*\"", "\"…\"", msg)
    msg = re.sub(r"/[\w./-]+", "PATH", msg)
    msg = re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "N", msg)
    return msg[:160]


def wrapped(v, bits):
    m = 1 << bits
    w = v % m
    return w - m if w >= m // 2 else w


def mentions(text, n):
    """Whether `text` holds the number n whole: not inside a longer number, its decimals or exponent."""
    return re.search(r"(?<![\d.e+-])%s(?!\d|\.\d|[eE][+-]?\d)" % re.escape(str(n)), text) is not None


def wrapped_number(text, numbers):
    """A value written into the input that comes back wrapped to int32/int64 (or as the unsigned twin).
    A bound a message states ("at most 2147483647", "in [-2^63, 2^63 - 1]") is the rule, not a value;
    a number is whole with its exponent (-1e-05 is no -1)."""
    rules = text
    text = re.sub(r"\bat (?:most|least) -?\d+|\bin \[-?\d+, -?\d+\]", "BOUND", text)
    for v in numbers:
        for bits in (32, 64):
            w = wrapped(v, bits)
            if w == v or w in numbers or (abs(w) < 1000 and not (w < 0 < v)):  # (w itself given: an echo)
                continue
            if mentions(text, w) and not mentions(text, v):
                return "%d came back as %d (int%d)" % (v, w, bits)
    for v in numbers:  # strtoll saturates: a value beyond int64 taken as the largest one
        if v > 2**63 - 1 or v < -2**63:
            edge = str(2**63 - 1 if v > 0 else -2**63)
            if int(edge) in numbers:
                continue
            if mentions(text, edge) and str(v) not in text:
                return "%d came back as %s (saturated to int64)" % (v, edge)
    m = re.search(r"in \[1, (0|-\d+)\]", rules)
    if m:
        return "a range ends at %s" % m.group(1)
    return None


def plan_figures_problem(stdout, as_json):
    """Impossible figures in a plan's output: memory 0, MFU above 1, non-finite or negative values."""
    if as_json:
        try:
            rows = json.loads(stdout)
        except ValueError:
            return "plan --json printed no JSON"
        for r in rows if isinstance(rows, list) else []:
            mem = r.get("memory_bytes_per_rank", {}).get("total", 1)
            for name, v in (("step_time_s", r.get("step_time_s")), ("mfu", r.get("mfu")), ("memory", mem),
                            ("tokens_per_s", r.get("tokens_per_s"))):
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    return "%s is %r in layout '%s'" % (name, v, r.get("layout"))
            if r["mfu"] > 1:
                return "MFU %.3g above 100%% in layout '%s'" % (r["mfu"], r.get("layout"))
        return None
    for line in stdout.splitlines():
        if not line.startswith("| tp"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 5:
            continue
        if cells[4].startswith("0 B") or cells[4].startswith("-"):
            return "memory %s in layout '%s'" % (cells[4].split(" (")[0], cells[0])
        m = re.match(r"([\d.e+-]+|nan|inf|-nan)%", cells[3])
        if m and (m.group(1) in ("nan", "inf", "-nan") or float(m.group(1)) > 100):
            return "MFU %s in layout '%s'" % (cells[3], cells[0])
        if any(x in ("nan", "inf", "-nan", "-inf") or x.startswith("-") for x in cells[1:4]):
            return "figure %s in layout '%s'" % (cells[1:4], cells[0])
    return None


def ckpt_info_problem(stdout):
    """`ckpt info` listing a negative dimension, or a parameter count that is not the sum of the shapes."""
    total, seen = 0, False
    for m in re.finditer(r"^  \S+\s+\[([-\d, ]*)\]", stdout, re.M):
        dims = [int(x) for x in m.group(1).split(",") if x.strip()]
        if any(d < 0 for d in dims):
            return "a tensor listed with shape [%s]" % m.group(1)
        n = 1
        for d in dims:
            n *= d
        total, seen = total + n, True
    m = re.search(r"^parameters: (-?\d+)", stdout, re.M)
    if m and int(m.group(1)) < 0:
        return "parameters: " + m.group(1)
    if m and seen and int(m.group(1)) != total:
        return "parameters: %s, but the shapes listed hold %d" % (m.group(1), total)
    return None


def blend_problem(stdout):
    """A blend whose printed share of a dataset is 0 or not finite."""
    m = re.search(r"\| data (.*?) \| global batch", stdout)
    if not m:
        return None
    for part in m.group(1).split(" + "):
        w = part.split(" ", 1)[0]
        try:
            x = float(w)
        except ValueError:
            continue
        if not math.isfinite(x) or x <= 0:
            return "a blend share is %s: %s" % (w, part[:100])
    return None


class Outcome:
    def __init__(self, status, category, detail="", signature=""):
        self.status = status  # "ok", "fail" or "warn"
        self.category = category
        self.detail = detail
        self.signature = signature or category


def judge(case, rc, stdout, stderr, timed_out, seconds):
    """The outcome of one run of `case` (see the rule at the top); rc is None when it timed out."""
    text = stdout + stderr
    cmd = case.command()
    errors = [l for l in stderr.splitlines() if ERROR_LINE.match(l)]
    for check in (sanitizer_report, wrapped_output):
        o = check(case, text, stdout, errors, cmd)
        if o:
            return o
    if timed_out:
        return time_limit(case, stdout, seconds, cmd)
    o = crash(case, rc, text, cmd)
    if o:
        return o
    if rc == 0:
        return figures(case, stdout, cmd)
    if rc in (1, 3) or (rc == 130 and cmd == "origami train"):
        return error_exit(case, rc, stderr, errors, cmd)
    return Outcome("fail", "exit-code", "exit %s: %s" % (rc, text[-300:]), "exit %s from %s" % (rc, cmd))


def sanitizer_report(case, text, stdout, errors, cmd):
    """An ASan or UBSan report, or a deadly signal they caught."""
    m = SAN_ASAN.search(text)
    if m:
        loc = source_location(text[m.start():])
        kind = "out-of-memory" if m.group(2) == "allocator is" else m.group(2).split(" ")[0]
        return Outcome("fail", "asan", "%s %s" % (m.group(0), loc), "asan %s at %s" % (kind, loc or cmd))
    m = SAN_UBSAN.search(text)
    if m:
        loc = re.sub(r"^.*?/((?:src|apps)/)", r"\1", m.group(1))
        return Outcome("fail", "ubsan", "%s: %s" % (loc, m.group(2)[:200]),
                       "ubsan %s: %s" % (loc, normalise(m.group(2))[:80]))
    if "AddressSanitizer:DEADLYSIGNAL" in text or "UndefinedBehaviorSanitizer:DEADLYSIGNAL" in text:
        loc = source_location(text)
        return Outcome("fail", "signal", "deadly signal " + loc, "signal at %s" % (loc or cmd))
    return None


def wrapped_output(case, text, stdout, errors, cmd):
    """A number the case wrote that the output shows wrapped or saturated (also in a run stopped by the time limit)."""
    w = wrapped_number(text, case.m.numbers)
    if w:
        return Outcome("fail", "wrapped-number", "%s: %s" % (w, (errors or stdout.splitlines() or [""])[0][:300]),
                       "wrapped number: %s: %s" % (cmd, normalise((errors or [w])[0])[:120]))
    return None


def time_limit(case, stdout, seconds, cmd):
    """A hang, or a slow run: train or generate that had started its work when the time limit stopped it."""
    field = case.m.fields[-1] if case.m.fields else ""
    started = re.search(r"^memory: |^step \d+/|^validation: ", stdout, re.M) and cmd == "origami train"
    started = started or (cmd == "origami generate" and stdout.strip() != "")
    if started:
        return Outcome("warn", "slow-run", "the time limit (%.0f s) after the run started" % seconds,
                       "slow run: %s, %s" % (cmd, field))
    return Outcome("fail", "hang", "no exit within %.0f s" % seconds, "hang: %s, %s %s" % (cmd, case.kind, field))


def crash(case, rc, text, cmd):
    """A signal (of the process or of a rank under mpirun), or a message origami prints only for its own bugs."""
    if rc is not None and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        return Outcome("fail", "signal", name, "%s in %s (%s)" % (name, cmd, case.kind))
    m = MPI_SIGNAL.search(text)
    if m or rc in (134, 136, 137, 139):
        sig = int(m.group(1)) if m else rc - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return Outcome("fail", "signal", name + " (a rank)", "%s in %s (%s)" % (name, cmd, case.kind))
    for needle, category in (("unexpected error:", "bare-exception"), ("internal error:", "internal-assert"),
                             ("outside the checked buffers", "unchecked-allocation"),
                             ("terminate called", "terminate")):
        i = text.find(needle)
        if i >= 0:
            line = text[text.rfind("\n", 0, i) + 1:text.find("\n", i) if text.find("\n", i) >= 0 else len(text)]
            msg = line[i - text.rfind("\n", 0, i) - 1 + len(needle):].strip()
            return Outcome("fail", category, line.strip()[:300], "%s: %s: %s" % (category, cmd, normalise(msg)))
    return None


def figures(case, stdout, cmd):
    """Exit 0: the output's figures must be possible ones."""
    if case.plan_json or cmd == "origami plan":
        p = plan_figures_problem(stdout, case.plan_json)
        if p:
            return Outcome("fail", "wrong-result", p, "plan figures: %s (%s)" % (normalise(p)[:60], case.kind))
    if case.blend:
        p = blend_problem(stdout)
        if p:
            return Outcome("fail", "wrong-result", p, "blend share 0 or not finite")
    if cmd == "origami ckpt info":
        p = ckpt_info_problem(stdout)
        if p:
            return Outcome("fail", "wrong-result", p, "ckpt info: %s" % normalise(p)[:60])
    return Outcome("ok", "exit 0")


def error_exit(case, rc, stderr, errors, cmd):
    """Exit 1 (train also 3 and 130): one error line, in origami's words."""
    if rc != 1 and cmd != "origami train":
        return Outcome("fail", "exit-code", "exit %d" % rc, "exit %d from %s" % (rc, cmd))
    if not errors:
        return Outcome("fail", "no-message", "exit %d without an error line: %s" % (rc, stderr[-300:]),
                       "exit %d without a message: %s (%s)" % (rc, cmd, case.kind))
    if len(errors) > 1 and not case.mpi:
        return Outcome("fail", "several-messages", " / ".join(errors)[:300], "several error lines: %s" % cmd)
    m = LIBRARY_MESSAGE.search(errors[0])
    if m:  # a field of the wrong type or range, told in the JSON library's words instead of naming the field
        f = re.search(r"([\w.-]+\.json)\b", errors[0])
        return Outcome("fail", "library-message", errors[0][:300], "library message about %s: json %s (%s)" % (
            f.group(1) if f else "an input", m.group(1) or m.group(0), cmd))
    if case.expect and not case.expect[1](errors[0]):
        return Outcome("fail", "vague-message", "%s: not so: %s" % (case.expect[0], errors[0][:300]),
                       "vague message: %s: %s" % (cmd, normalise(errors[0])[:100]))
    return Outcome("ok", "error exit %d" % rc, errors[0][:300])
