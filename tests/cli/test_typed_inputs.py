#!/usr/bin/python3
"""Every JSON input read by its field types (issue 35, core/json_fields.h): a field of the wrong type
or out of its range, in any file origami reads, ends the command with exit 1 and exactly one error line

    origami CMD: error: FILE: field 'NAME': expected WHAT, got VALUE

(VALUE as the file gives it), within a second, and never with "unexpected error: [json.exception...]".
One case per reader: the model config (train and plan), the run config, the plan file, the cluster
file, trainer_state.json (--resume, generate), metadata.json (ckpt info), model.safetensors.index.json, a
safetensors header (--init-from), the dataset tokenizer file, a Hub tokenizer.json; and a regex that
fails at match time (PCRE2's match limit) names the file and the pattern.

Run by ctest with ORIGAMI_BIN (build/origami); exits non-zero on the first failed check.
"""
import json
import os
import shutil
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import LLAMA_TINY, byte_dataset, check, expect_error, run  # noqa: E402

LLAMA = LLAMA_TINY


def member(parent, key):
    """The path of member `key` of the field `parent`, as messages write it: a plain word after a dot,
    any other key as a JSON string in brackets."""
    if key and key.replace("_", "").replace("-", "").isascii() and key.replace("_", "").replace("-", "").isalnum():
        return f"{parent}.{key}" if parent else key
    return f"{parent}[{json.dumps(key, ensure_ascii=False)}]"


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    return path


def edit_json(path, mutate):
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    mutate(obj)
    write_json(path, obj)


def byte_level_hf_tokenizer(split_regex):
    """A Hub tokenizer.json of GPT-2's byte-level kind: the 256 byte symbols, <|endoftext|>, no merges;
    a Split pre-tokenizer with `split_regex` before ByteLevel."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): i for i, c in enumerate(cs)}
    vocab["<|endoftext|>"] = 256
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split_regex}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None, "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                      "merges": []}}


def main():
    tmp = tempfile.mkdtemp()
    try:
        data = byte_dataset(tmp, 40)
        corpus = data + ".txt"  # the documents it was made from
        cfg = write_json(os.path.join(tmp, "config.json"), LLAMA)
        common = ["--data", data, "--micro-batch", "2", "--seq-len", "16", "--threads", "1"]
        cluster_src = os.path.join(os.environ.get("ORIGAMI_ROOT", os.path.join(os.path.dirname(__file__), "../..")),
                                   "configs", "clusters", "cpu-2core.json")
        cluster = os.path.join(tmp, "cluster.json")
        shutil.copy(cluster_src, cluster)
        plan_args = ["plan", "--config", cfg, "--cluster", cluster, "--global-batch", "8", "--seq-len", "16"]

        # ---- the model config: the value as given (never wrapped to 32 bits), the limits of model/config.h
        layers = write_json(os.path.join(tmp, "layers.json"), {**LLAMA, "num_hidden_layers": 2147483648})
        expect_error("model config: num_hidden_layers 2^31", ["train", "--config", layers, *common],
                     f"{layers}: field 'num_hidden_layers': expected an integer in [1, 10000], got 2147483648")
        hidden = write_json(os.path.join(tmp, "hidden.json"), {**LLAMA, "hidden_size": "48"})
        expect_error("model config: hidden_size \"48\"", ["train", "--config", hidden, *common],
                     f"{hidden}: field 'hidden_size': expected an integer in [1, 1048576], got \"48\"")
        ffn = write_json(os.path.join(tmp, "ffn.json"), {**LLAMA, "intermediate_size": 2305843009213693952})
        expect_error("model config: intermediate_size 2^61", ["train", "--config", ffn, *common],
                     f"{ffn}: field 'intermediate_size': expected an integer in [1, 16777216], "
                     "got 2305843009213693952")
        experts = write_json(os.path.join(tmp, "experts.json"),
                             {**LLAMA, "model_type": "mixtral", "num_local_experts": 2147483648})
        expect_error("model config under plan: num_local_experts 2^31",
                     ["plan", "--config", experts, "--cluster", cluster, "--global-batch", "8", "--seq-len", "16"],
                     f"{experts}: field 'num_local_experts': expected an integer in [1, 65536], got 2147483648")

        # ---- the run config and the plan file
        run_cfg = write_json(os.path.join(tmp, "run.json"), {"steps": "x"})
        expect_error("run config: steps \"x\"", ["train", "--config", cfg, *common, "--run-config", run_cfg],
                     f"{run_cfg}: field 'steps': expected an integer, got \"x\"")
        run_flag = write_json(os.path.join(tmp, "run_flag.json"), {"quiet": "yes"})
        expect_error("run config: a switch given \"yes\"", ["train", "--config", cfg, *common, "--run-config", run_flag],
                     f"{run_flag}: field 'quiet': expected true or false, got \"yes\"")
        plan = write_json(os.path.join(tmp, "plan.json"), {"layout": {"tp": 1}, "devices": "1"})
        expect_error("plan file: devices \"1\"", ["train", "--config", cfg, *common, "--plan", plan],
                     f"{plan}: field 'devices': expected a positive integer, got \"1\"")
        plan_layout = write_json(os.path.join(tmp, "plan_layout.json"), {"layout": {"tp": [1]}, "devices": 1})
        expect_error("plan file: layout.tp [1]", ["train", "--config", cfg, *common, "--plan", plan_layout],
                     f"{plan_layout}: field 'layout.tp': expected a string or a number, got [1]")

        # ---- the cluster file
        edit_json(cluster, lambda c: c.update(source=5))
        expect_error("cluster file: source 5", plan_args, f"{cluster}: field 'source': expected a string, got 5")
        shutil.copy(cluster_src, cluster)
        edit_json(cluster, lambda c: c.update(nodes=2.5))
        expect_error("cluster file: nodes 2.5", plan_args,
                     f"{cluster}: field 'nodes': expected an integer in [1, 1048576], got 2.5")

        # ---- checkpoints: trainer_state.json on --resume, metadata.json under ckpt info
        ck = os.path.join(tmp, "ck")
        run("train", "--config", cfg, *common, "--steps", "2", "--save", ck)
        step = os.path.join(ck, "step-2")
        saved = {name: open(os.path.join(step, name)).read() for name in ("trainer_state.json", "metadata.json")}

        def damaged(name, mutate):
            with open(os.path.join(step, name), "w") as f:
                f.write(saved[name])
            edit_json(os.path.join(step, name), mutate)
            return os.path.join(step, name)

        state = damaged("trainer_state.json", lambda s: s.update(step="x"))
        expect_error("trainer_state.json: step \"x\" on --resume", ["train", "--resume", ck, *common, "--steps", "4"],
                     f"{state}: field 'step': expected a non-negative integer, got \"x\"")
        state = damaged("trainer_state.json", lambda s: s.update(router_bias=[[0.5, "b"]]))
        expect_error("trainer_state.json: router_bias[0][1] \"b\"", ["train", "--resume", ck, *common, "--steps", "4"],
                     f"{state}: field 'router_bias[0][1]': expected a number in [-3.40282e+38, 3.40282e+38], got \"b\"")
        state = damaged("trainer_state.json", lambda s: s.update(data_sizes=[1]))
        expect_error("trainer_state.json: data_sizes [1]", ["train", "--resume", ck, *common, "--steps", "4"],
                     f"{state}: field 'data_sizes[0]': expected an object, got 1")
        state = damaged("trainer_state.json", lambda s: s["data_sizes"][0].update(tokens=-3))
        expect_error("trainer_state.json: data_sizes[0].tokens -3", ["train", "--resume", ck, *common, "--steps", "4"],
                     f"{state}: field 'data_sizes[0].tokens': expected a non-negative integer, got -3")
        state = damaged("trainer_state.json", lambda s: s["options"].update(seq_len=0))
        expect_error("trainer_state.json: options.seq_len 0 under generate",
                     ["generate", "--checkpoint", ck, "--prompt", "fortune", "--max-new-tokens", "2"],
                     f"{state}: field 'options.seq_len': expected a positive integer, got 0")
        damaged("trainer_state.json", lambda s: None)
        meta = damaged("metadata.json", lambda m: m["layout"].update(description=5))
        expect_error("metadata.json: layout.description 5 under ckpt info", ["ckpt", "info", ck],
                     f"{meta}: field 'layout.description': expected a string, got 5")
        meta = damaged("metadata.json", lambda m: m["files"][0].update(checksum=7))
        expect_error("metadata.json: files[0].checksum 7 under ckpt info", ["ckpt", "info", ck],
                     f"{meta}: field 'files[0].checksum': expected a string, got 7")
        first = json.loads(saved["metadata.json"])["pieces"][0]
        meta = damaged("metadata.json", lambda m: m["pieces"][0].__setitem__(1, 5))
        expect_error("metadata.json: pieces[0][1] 5 on --resume", ["train", "--resume", ck, *common, "--steps", "4"],
                     f"{meta}: field 'pieces[0][1]': expected a string, got 5")
        meta = damaged("metadata.json", lambda m: m["tensors"][first[1]]["shape"].__setitem__(0, 1e300))
        expect_error("metadata.json: a tensor's shape 1e300 under ckpt info", ["ckpt", "info", ck],
                     f"{meta}: field '{member('tensors', first[1])}.shape[0]': expected a non-negative integer, "
                     "got 1e+300")
        damaged("metadata.json", lambda m: None)

        # ---- a Hugging Face directory: model.safetensors.index.json, and a safetensors header
        hf = os.path.join(tmp, "hf")
        run("ckpt", "export", ck, "--hf", hf)
        st_path = os.path.join(hf, "model.safetensors")
        index = write_json(os.path.join(hf, "model.safetensors.index.json"),
                           {"metadata": {}, "weight_map": {"model.norm.weight": 5}})
        expect_error("model.safetensors.index.json: a shard named 5", ["ckpt", "info", hf],
                     f"{index}: field '{member('weight_map', 'model.norm.weight')}': expected a string, got 5")
        os.remove(index)
        raw = open(st_path, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        header["model.norm.weight"]["dtype"] = 32
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        bad_st = os.path.join(tmp, "bad.safetensors")
        open(bad_st, "wb").write(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
        expect_error("safetensors header: dtype 32 on --init-from",
                     ["train", "--config", cfg, *common, "--init-from", bad_st],
                     f"{bad_st}: field '{member('', 'model.norm.weight')}.dtype': expected a string, got 32")

        # ---- tokenizer files: the dataset's (origami's own kinds) and a Hub tokenizer.json
        with open(data + ".tokenizer.json", "w") as f:
            json.dump({"type": 5}, f)
        expect_error("dataset tokenizer file: type 5", ["data", "decode", "--data", data],
                     f"{data}.tokenizer.json: field 'type': expected a string, got 5")
        gpt2 = write_json(os.path.join(tmp, "gpt2.json"), {"type": "gpt2", "vocab": {"a": "x"}, "merges": []})
        expect_error("gpt2 tokenizer file: an id \"x\"", ["data", "prepare", "--input", corpus, "--output",
                                                          os.path.join(tmp, "g"), "--tokenizer", gpt2],
                     f"{gpt2}: field 'vocab.a': expected an integer in [0, 268435455], got \"x\"")
        hub = byte_level_hf_tokenizer(" ?\\w+|\\s+")
        out = os.path.join(tmp, "hub")
        good = write_json(os.path.join(tmp, "hub_good.json"), hub)
        run("data", "prepare", "--input", corpus, "--output", out, "--tokenizer", good)
        hub["added_tokens"][0]["special"] = "yes"
        bad = write_json(os.path.join(tmp, "hub_bad.json"), hub)
        expect_error("Hub tokenizer.json: added_tokens[0].special \"yes\"",
                     ["data", "prepare", "--input", corpus, "--output", out, "--tokenizer", bad],
                     f"{bad}: field 'added_tokens[0].special': expected true or false, got \"yes\"")
        hub = byte_level_hf_tokenizer(" ?\\w+|\\s+")
        hub["pre_tokenizer"]["pretokenizers"][0]["behavior"] = 3
        bad = write_json(os.path.join(tmp, "hub_bad2.json"), hub)
        expect_error("Hub tokenizer.json: a Split's behavior 3",
                     ["data", "prepare", "--input", corpus, "--output", out, "--tokenizer", bad],
                     f"{bad}: field 'pre_tokenizer.pretokenizers[0].behavior': expected a string, got 3")
        # A pattern that backtracks past PCRE2's match limit on this input: the file and the pattern.
        cat = write_json(os.path.join(tmp, "hub_cat.json"), byte_level_hf_tokenizer("(a+)+c"))
        aaa = os.path.join(tmp, "aaa.txt")
        with open(aaa, "w") as f:
            f.write("a" * 40 + "b c\n")
        expect_error("a catastrophic regex at match time",
                     ["data", "prepare", "--input", aaa, "--output", out, "--tokenizer", cat],
                     f"{cat}: pre_tokenizer Split: the regex '(a+)+c' failed on the input "
                     "(PCRE2 error -47: match limit exceeded)")
        print("all typed-input checks passed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
