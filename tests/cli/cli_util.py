"""Shared by the tests in tests/cli/: the binary under test, and stop-at-the-first-failure checks."""
import os
import subprocess
import sys
import time

ORIGAMI = os.environ.get("ORIGAMI_BIN", os.path.join(os.path.dirname(__file__), "../../build/origami"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "parallel"))
from harness import given_once  # noqa: E402  (each option given once: run)


# The tests' small llama: byte-level vocabulary (256 bytes + end-of-document), 2 layers.
LLAMA_TINY = {"model_type": "llama", "hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 40, "num_hidden_layers": 2, "vocab_size": 257, "max_position_embeddings": 64}


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def run(*args, expect_ok=True, once=True):
    """`origami ARGS`, output decoded as UTF-8 (invalid bytes replaced); a failure ends the test
    unless expect_ok is False. once: an option given again over a base list kept at its last value
    (harness.given_once)."""
    p = subprocess.run([ORIGAMI, *(given_once(args) if once else args)], capture_output=True, text=True,
                       encoding="utf-8", errors="replace")
    if expect_ok and p.returncode != 0:
        fail(f"origami {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def expect_error(what, args, message, once=True):
    """`origami ARGS` exits 1 within a second with one error line, `origami CMD: error: MESSAGE`."""
    t0 = time.time()
    p = run(*args, expect_ok=False, once=once)
    wall = time.time() - t0
    out = p.stdout + p.stderr
    lines = [l for l in out.splitlines() if "error" in l.lower()]
    want = f"origami {args[0]}: error: {message}"
    check(p.returncode == 1 and len(lines) == 1 and lines[0] == want and wall < 1.0,
          f"{what}: exit {p.returncode} in {wall:.2f} s, expected 1 within a second and the one line\n  {want}\n"
          f"got:\n{out}")
    print(f"ok   {what} ({wall:.2f} s): {lines[0]}")


def byte_dataset(tmp, docs, name="d"):
    """A byte-tokenized dataset of `docs` short documents in `tmp` (origami data prepare) made from the text
    file PREFIX.txt; returns PREFIX."""
    text = os.path.join(tmp, name + ".txt")
    with open(text, "w") as f:
        for i in range(docs):
            f.write(f"fortune number {i}: the quick brown fox jumps over the lazy dog.\n%\n")
    prefix = os.path.join(tmp, name)
    run("data", "prepare", "--input", text, "--output", prefix, "--tokenizer", "byte")
    return prefix
