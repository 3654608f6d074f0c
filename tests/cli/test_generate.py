"""`origami generate` runs the model as the run trained it, from the checkpoint's own record of the run
(trainer_state.json), not from config.json alone:
  - a mixtral trained with sigmoid router scores (--moe-router-score sigmoid) and aux-loss-free balancing
    (--moe-router-bias-update-rate: learned selection biases) samples the same text from a copy of its
    checkpoint, and other text from a copy whose record says softmax, or has no biases (before the fix
    both edits changed nothing: generate routed with softmax and no biases whatever the run did);
  - a llama trained with --attention-mask document, generating from an empty prompt (a new document after
    the end-of-document token), samples other text from a copy whose record says causal; so does one
    trained with --batching documents (each document alone) refuses an empty prompt (its model never
    predicted a document's first token), which a record of windows accepts, and stops at the end of a
    document;
  - a prompt that encodes to no token (a tokenizer of letters without an unknown token given "123") is
    an error, not a generation from nothing;
  - a copy whose record says --seq-len 8 samples other text (the window slides at the trained length);
    on whole documents the window is --seq-len - 1 (a sequence's last position never predicts), and an
    export without a trainer state says it predicts from all of the model's positions;
  - --top-k beyond the vocabulary (even beyond 32 bits) samples among all tokens, as --top-k 0 does;
  - the KV cache (every new token through the layers alone, attending to the cached keys and values)
    samples the same text as --no-kv-cache (the whole window through the model for every token): the
    mixtral in fp32 and bf16 past its window, the document-masked llama from an empty prompt, and the
    whole-documents one;
  - text that cannot be written (stdout on /dev/full) exits 1 with the reason;
  - `ckpt export --hf` of the mixtral warns that transformers will route the weights without the sigmoid
    scores and the biases (a Hugging Face config holds neither).
Sampling is at temperature 1 with a fixed seed on one thread, so any change of the logits shows in the text.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import LLAMA_TINY, ORIGAMI, byte_dataset, check, expect_error, run  # noqa: E402

ROOT = os.environ.get("ORIGAMI_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
MIXTRAL = os.path.join(ROOT, "tests", "parallel", "configs", "mixtral_8e.json")


def edited(ck, dst, change):
    """A copy of checkpoint step directory `ck` whose trainer_state.json `change` edits."""
    shutil.copytree(ck, dst)
    path = os.path.join(dst, "trainer_state.json")
    state = json.load(open(path))
    change(state)
    json.dump(state, open(path, "w"))
    return dst


def sample(ck, prompt, *extra):
    return run("generate", "--checkpoint", ck, "--prompt", prompt, "--max-new-tokens", "60", "--temperature", "1",
               "--top-k", "0", "--seed", "3", "--threads", "1", *extra).stdout


def train(tmp, name, config, data, *flags):
    save = os.path.join(tmp, name)
    run("train", "--config", config, "--data", data, "--seq-len", "32", "--micro-batch", "4", "--steps", "30",
        "--lr", "1e-2", "--threads", "1", "--quiet", "--save", save, *flags)
    return os.path.join(save, "step-30")


def main():
    tmp = tempfile.mkdtemp(prefix="origami_generate_")
    try:
        data = byte_dataset(tmp, 200)
        moe = train(tmp, "moe", MIXTRAL, data, "--moe-aux-loss", "none", "--moe-router-score", "sigmoid",
                    "--moe-router-bias-update-rate", "0.05")
        state = json.load(open(os.path.join(moe, "trainer_state.json")))
        check(state["options"]["moe_router_score"] == "sigmoid" and any(b != 0 for row in state["router_bias"] for b in row),
              "the mixtral checkpoint records sigmoid scores and non-zero router biases")
        prompt = "fortune number 7"
        text = sample(moe, prompt)
        same = sample(edited(moe, os.path.join(tmp, "same"), lambda s: None), prompt)
        softmax = sample(edited(moe, os.path.join(tmp, "softmax"),
                                lambda s: s["options"].update(moe_router_score="softmax")), prompt)
        no_bias = sample(edited(moe, os.path.join(tmp, "no_bias"), lambda s: s.pop("router_bias")), prompt)
        check(text == same, f"an unchanged copy samples the same text:\n{text!r}\n{same!r}")
        # The KV cache (each new token through the layers alone) samples what the whole window does, in
        # fp32 and bf16, before and after the window (32 trained positions) fills and slides.
        for precision in ("fp32", "bf16"):
            cached = sample(moe, prompt, "--precision", precision)
            whole = sample(moe, prompt, "--precision", precision, "--no-kv-cache")
            check(cached == whole and len(cached) > len(prompt) + 32,
                  f"{precision}: the KV cache samples what the whole window does:\n{cached!r}\n{whole!r}")
        print("ok   generate's KV cache samples the whole window's text (mixtral, fp32 and bf16, past the window)")
        check(softmax != text, f"a record of softmax scores samples other text (the routers' score is read): {text!r}")
        check(no_bias != text, f"a record without biases samples other text (the biases are read): {text!r}")
        print("ok   generate routes as trained: sigmoid scores and the learned selection biases")

        # A model of one step on the byte tokenizer samples bytes nearly at random: lead bytes the next token
        # does not continue and lone continuation bytes, which the output prints as U+FFFD (it wrote them raw
        # mid-stream, so stdout was not UTF-8; only a character cut at the end became U+FFFD).
        run("train", "--config", MIXTRAL, "--data", data, "--seq-len", "32", "--micro-batch", "4", "--steps", "1",
            "--threads", "1", "--quiet", "--save", os.path.join(tmp, "random"))
        p = subprocess.run([ORIGAMI, "generate", "--checkpoint", os.path.join(tmp, "random", "step-1"), "--prompt", "a",
                            "--max-new-tokens", "300", "--temperature", "1", "--top-k", "0", "--seed", "3",
                            "--threads", "1"], capture_output=True)
        try:
            streamed, valid = p.stdout.decode("utf-8"), True
        except UnicodeDecodeError as e:
            streamed, valid = str(e), False
        check(p.returncode == 0 and valid and "\ufffd" in streamed,
              f"random bytes stream as UTF-8 with U+FFFD for what cannot be a character: exit {p.returncode}, {streamed[:200]!r}")
        print("ok   generate's output stays UTF-8: bytes that cannot make a character are U+FFFD as they come")

        # 16 prompt tokens and 60 new ones pass the 32 trained positions: the window slides at seq_len
        short = sample(edited(moe, os.path.join(tmp, "short"), lambda s: s["options"].update(seq_len=8)), prompt)
        check(short != text, f"a record of --seq-len 8 samples other text (the trained length is read): {text!r}")
        print("ok   generate slides a window of the trained sequence length")

        top = [run("generate", "--checkpoint", moe, "--prompt", prompt, "--max-new-tokens", "60", "--temperature", "1",
                   "--top-k", k, "--seed", "3", "--threads", "1").stdout for k in ("0", "257", "4294967297")]
        check(top[0] == top[1] == top[2], f"--top-k 0, 257 (the vocabulary) and 4294967297 sample alike: {top}")
        print("ok   --top-k beyond the vocabulary (and beyond 32 bits) samples among all tokens")
        for drawn, value in (("--top-k", "5"), ("--seed", "9")):  # (taken without a word before: no draw to shape)
            expect_error(drawn + " at temperature 0", ["generate", "--checkpoint", moe, "--prompt", "x", "--temperature",
                                                       "0", drawn, value],
                         "%s shapes the random draw, and --temperature 0 takes the likeliest token without one: drop %s "
                         "or give a temperature above 0" % (drawn, drawn))

        err = run("ckpt", "export", moe, "--hf", os.path.join(tmp, "hf")).stderr
        check("warning: the run scored its routers with sigmoid" in err and "learned router selection biases" in err,
              f"ckpt export --hf says the export routes otherwise under transformers: {err!r}")
        print("ok   ckpt export --hf warns that transformers routes without the sigmoid scores and biases")
        # Text that cannot be written (a full disk) is an error: exit 1, where it was 0 with nothing said.
        with open("/dev/full", "w") as full:
            p = subprocess.run([ORIGAMI, "generate", "--checkpoint", moe, "--prompt", prompt, "--max-new-tokens", "4"],
                               stdout=full, stderr=subprocess.PIPE, text=True)
        check(p.returncode == 1 and "origami generate: error: writing the standard output failed: No space left on "
              "device" in p.stderr, f"generate into /dev/full: exit {p.returncode}, {p.stderr!r}")
        print("ok   generate into a full disk exits 1 and says so")
        # An export without --optimizer has no record of the run: generate says what it assumes.
        p = run("generate", "--checkpoint", os.path.join(tmp, "hf"), "--prompt", prompt, "--max-new-tokens", "2")
        check("has no trainer state (an export without --optimizer): predicting from up to the model's 64 positions"
              in p.stderr, f"generate from an export says it has no record of the trained length: {p.stderr!r}")
        print("ok   generate from an export without a trainer state says what it assumes")

        cfg = os.path.join(tmp, "llama.json")
        json.dump(LLAMA_TINY, open(cfg, "w"))
        doc = train(tmp, "doc", cfg, data, "--attention-mask", "document")
        text = sample(doc, "")
        check(text == sample(doc, "", "--no-kv-cache"),
              f"under document masking the KV cache samples the whole window's text: {text!r}")
        causal = sample(edited(doc, os.path.join(tmp, "causal"), lambda s: s["options"].update(attention_mask="causal")), "")
        check(causal != text, f"a record of causal attention samples other text (document masking is read): {text!r}")
        packed = train(tmp, "packed", cfg, data, "--batching", "documents", "--tokens-per-step", "128")
        # Whole documents never predict a document's first token: an empty prompt is refused (the record
        # of windows samples from it), and generation ends at the first end of document.
        expect_error("generate from an empty prompt on a --batching documents checkpoint",
                     ["generate", "--checkpoint", packed, "--prompt", ""],
                     f"'{packed}' trained on whole documents (--batching documents), which never predicts a "
                     "document's first token: give --prompt with the start of the text")
        windows = sample(edited(packed, os.path.join(tmp, "windows"), lambda s: s["options"].update(batching="windows")), "")
        check(len(windows) > 0, "the same weights with a record of windows sample from an empty prompt")
        text = sample(packed, "fortune", "--max-new-tokens", "400")
        check(0 < len(text) < len("fortune") + 400, f"generation on whole documents stops at the end of one: {text!r}")
        check(text == sample(packed, "fortune", "--max-new-tokens", "400", "--no-kv-cache"),
              f"on whole documents the KV cache samples the whole window's text: {text!r}")
        print("ok   generate masks documents as trained (--attention-mask document, --batching documents)")
        # On whole documents a sequence of --seq-len 32 predicts from its first 31 positions only: the window
        # slides at 31, as a record of windows of 31 with document masking does (it slid at 32, where the
        # last position had never predicted).
        long_prompt = "fortune number 12 is a long prompt of more than 32 bytes"
        at31 = edited(packed, os.path.join(tmp, "at31"),
                      lambda s: s["options"].update(batching="windows", attention_mask="document", seq_len=31))
        text = sample(packed, long_prompt, "--stop-at-eod")
        check(text == sample(at31, long_prompt, "--stop-at-eod"),
              f"on whole documents of --seq-len 32 the window is 31 positions: {text!r}")
        print("ok   generate on whole documents slides a window of --seq-len - 1 positions")

        # A prompt whose characters the tokenizer drops (a vocabulary of letters, no unknown token, no
        # byte fallback, as the library encodes) is an error, not a generation from nothing.
        letters = edited(doc, os.path.join(tmp, "letters"), lambda s: None)
        vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}
        vocab["</s>"] = len(vocab)
        json.dump({"version": "1.0", "added_tokens": [{"id": vocab["</s>"], "content": "</s>", "special": True}],
                   "model": {"type": "BPE", "vocab": vocab, "merges": []}},
                  open(os.path.join(letters, "tokenizer.json"), "w"))
        text = sample(letters, "a")
        check(text.startswith("a") and len(text) > 1, f"a tokenizer of letters generates after the prompt 'a': {text!r}")
        expect_error("a prompt that encodes to no token", ["generate", "--checkpoint", letters, "--prompt", "123"],
                     "--prompt '123' encodes to no token: the checkpoint's tokenizer drops its characters (not in its "
                     "vocabulary, which has no unknown token or byte fallback, or removed by its normalizer)")
    finally:
        shutil.rmtree(tmp)
    print("generate runs the model as the run trained it")


if __name__ == "__main__":
    main()
