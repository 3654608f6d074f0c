"""Shared by the tests in tests/cli/: the binary under test, and stop-at-the-first-failure checks."""
import os
import subprocess
import sys

ORIGAMI = os.environ.get("ORIGAMI_BIN", os.path.join(os.path.dirname(__file__), "../../build/origami"))


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def run(*args, expect_ok=True):
    """`origami ARGS`, output decoded as UTF-8 (invalid bytes replaced); a failure ends the test
    unless expect_ok is False."""
    p = subprocess.run([ORIGAMI, *args], capture_output=True, text=True, encoding="utf-8", errors="replace")
    if expect_ok and p.returncode != 0:
        fail(f"origami {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p
