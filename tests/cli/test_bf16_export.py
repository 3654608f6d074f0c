"""`origami ckpt export CHECKPOINT --hf DIR --dtype bf16`: a Hugging Face export in bf16 (issue 28, item 4).

For gpt2, llama and mixtral test models, a checkpoint saved by `train --save` (fp32, 2 steps) is exported
as fp32 and as bf16 (single file, and sharded with model.safetensors.index.json). Checked:
  - the bf16 safetensors bytes equal torch's own bf16 rounding of the fp32 export's weights, bit for bit
    (`fp32_tensor.to(torch.bfloat16)`, round to nearest even), dtype "BF16" in the header; the data
    buffer is exactly half the fp32 one, the files about half; config.json's torch_dtype is "bfloat16"
    (fp32 export: "float32"); the index's total_size is the bf16 bytes;
  - transformers' AutoModelForCausalLM.from_pretrained(DIR, torch_dtype="auto") builds the model in
    torch.bfloat16 from config.json, single-file and sharded, with no missing or unexpected weights;
    its logits on 3 batches of 2 sequences EQUAL (bit for bit, bound 0) those of the fp32 export's model
    with its weights cast to bf16 by torch (from_pretrained(fp32 DIR, torch_dtype=torch.bfloat16)): same
    weights bit for bit, same computation. (`model.to(torch.bfloat16)` would also round the fp32 rotary
    buffer inv_freq, which from_pretrained keeps in fp32: llama's logits then differ by up to 6e-2.)
  - and they lie within bf16 tolerance of the fp32 export's fp32 logits: per token max|d| / max|logit|
    <= 0.05 (bf16 keeps 8 significant bits, unit roundoff u = 2^-8 = 3.9e-3; the weights and every
    activation are rounded, about 10 roundings in a row per layer of these 2-layer models; measured
    at most 1.2e-2 (gpt2) and 1.9e-2 (llama), median 0.9e-2 on mixtral). Every token for gpt2 and llama;
    for mixtral at most 1 token in 16 beyond it: where two router logits lie within bf16 rounding of each
    other the top-2 choice flips and that token's logits move by ~0.1 (measured: 1 token of 192);
  - `origami dump` of the bf16 export gives transformers' float64 logits on the same weights within 1e-4;
  - `ckpt info` reads the bf16 export; `train --init-from` the bf16 export runs and its losses equal,
    exactly, those of `train --init-from` an fp32 file of the same bf16 values (BF16 is read widened
    to fp32, which is exact), which for llama and mixtral also holds a RoPE inv_freq buffer (ignored,
    as older conversions save it); `ckpt info` of that bare file lists its tensors;
  - the edge cases of the rounding through the whole export (ties to even, subnormals, the largest
    finite bf16 and the overflow to inf, inf, -0, NaN stays NaN) against torch's rounding;
  - `--dtype fp16` is refused with one error line, as is `--dtype bf16 --optimizer` (a checkpoint to
    resume keeps fp32 weights), and an export into a directory holding an earlier export's optimizer
    state;
  - a config's "dtype" key (transformers >= 4.56 reads it before torch_dtype) is set to the export's dtype.
"""
import json
import os
import struct
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
import cli_util as cu  # noqa: E402
import origami_ref as ref  # noqa: E402

torch.set_num_threads(2)
MODELS = ("gpt2", "llama", "mixtral")
B, T = 2, 32
LOGITS_TOL = 0.05  # bf16 model vs fp32 model, max|d| / max|logit| (see above)


def header(path):
    """(header JSON, bytes of the data buffer) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    return h, os.path.getsize(path) - 8 - n


def export(ck, out, *extra):
    cu.run("ckpt", "export", ck, "--hf", out, *extra)
    return out


def bits_equal(a, b):
    return a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_bytes(name, hf32, hf16):
    w32 = ref.load_safetensors(os.path.join(hf32, "model.safetensors"))
    w16 = ref.load_safetensors(os.path.join(hf16, "model.safetensors"))
    cu.check(list(w16) == list(w32), f"{name}: the bf16 export has the fp32 export's tensors")
    bad = [k for k in w32 if not bits_equal(w16[k], w32[k].to(torch.bfloat16))]
    cu.check(not bad, f"{name}: bf16 bytes differ from torch's rounding of the fp32 weights in {bad[:5]}")
    h32, d32 = header(os.path.join(hf32, "model.safetensors"))
    h16, d16 = header(os.path.join(hf16, "model.safetensors"))
    dtypes = {v["dtype"] for k, v in h16.items() if k != "__metadata__"}
    cu.check(dtypes == {"BF16"} and h16.get("__metadata__") == {"format": "pt"}, f"{name}: header dtypes {dtypes}")
    s32, s16 = (os.path.getsize(os.path.join(d, "model.safetensors")) for d in (hf32, hf16))
    cu.check(2 * d16 == d32 and abs(s16 / s32 - 0.5) < 0.01,
             f"{name}: data {d16} vs {d32} bytes, file {s16} vs {s32} bytes: not half")
    print(f"ok   {name}: {len(w32)} tensors, bf16 bytes = torch's rounding bit for bit; data {d16} = {d32}/2 bytes, "
          f"file {s16} / {s32} = {s16 / s32:.4f}")
    return w16


def check_config(name, hf32, hf16):
    for d, want in ((hf32, "float32"), (hf16, "bfloat16")):
        got = ref.load_config(os.path.join(d, "config.json")).get("torch_dtype")
        cu.check(got == want, f"{name}: {d}/config.json torch_dtype {got!r}, expected {want!r}")
    c32, c16 = (ref.load_config(os.path.join(d, "config.json")) for d in (hf32, hf16))
    c32.pop("torch_dtype"), c16.pop("torch_dtype")
    cu.check(c32 == c16, f"{name}: the two exports' config.json differ besides torch_dtype")


def check_sharded(name, ck, hf16, tmp):
    """--max-shard-gb small enough for several shards: index total_size in bf16 bytes, the shards' tensors
    the single file's bit for bit."""
    out = export(ck, os.path.join(tmp, f"{name}_hf16_sharded"), "--dtype", "bf16", "--max-shard-gb", "0.00002")
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(idx["weight_map"].values()))
    single = ref.load_safetensors(os.path.join(hf16, "model.safetensors"))
    data, numel, got = 0, 0, {}
    for f in files:
        h, d = header(os.path.join(out, f))
        data += d
        numel += sum(torch.Size(v["shape"]).numel() for k, v in h.items() if k != "__metadata__")
        cu.check({v["dtype"] for k, v in h.items() if k != "__metadata__"} == {"BF16"}, f"{name}: shard {f} not BF16")
        got.update(ref.load_safetensors(os.path.join(out, f)))
    total = idx["metadata"]["total_size"]
    cu.check(len(files) > 1 and total == data == 2 * numel, f"{name}: sharded bf16 export: {len(files)} files, "
             f"total_size {total}, data {data} bytes, {numel} elements")
    cu.check(sorted(got) == sorted(single) and all(bits_equal(got[k], single[k]) for k in single),
             f"{name}: the shards' tensors differ from the single file's")
    print(f"ok   {name}: sharded bf16 export, {len(files)} files, total_size {total} = 2 x {numel} elements")
    return out


def logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(input_ids=inp).logits for inp in batches])


def load(d, **kw):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True, attn_implementation="eager", **kw)
    missing = [k for k in info["missing_keys"] if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    cu.check(not missing and not info["unexpected_keys"] and not info["mismatched_keys"],
             f"{d}: loading info {info}")
    return model.eval()


def check_transformers(name, hf32, hf16, sharded, batches):
    want32 = logits(load(hf32), batches)
    # The fp32 export's weights rounded to bf16 by torch as transformers loads them. Not model.to(bfloat16):
    # that would also round llama's and mixtral's fp32 rotary buffer inv_freq, which from_pretrained keeps.
    want = logits(load(hf32, torch_dtype=torch.bfloat16), batches)
    for d in (hf16, sharded):
        m16 = load(d, torch_dtype="auto")  # the dtype from config.json's torch_dtype
        dtypes = {p.dtype for p in m16.parameters()}
        cu.check(m16.dtype == torch.bfloat16 and dtypes == {torch.bfloat16} and m16.config.torch_dtype == torch.bfloat16,
                 f"{name}: from_pretrained({d}, torch_dtype='auto') gave {m16.dtype}, parameters {dtypes}")
        got = logits(m16, batches)
        cu.check(got.dtype == torch.bfloat16 and torch.equal(got, want),
                 f"{name}: {d}: logits differ from the fp32 export's model cast to bf16, max |d| "
                 f"{float((got.float() - want.float()).abs().max())}")
    # Per token (position): max|d| over the vocabulary / max|logit| over all.
    err_tok = ((got.double() - want32.double()).abs().amax(-1) / want32.double().abs().max()).flatten()
    beyond = int((err_tok > LOGITS_TOL).sum())
    allowed = len(err_tok) // 16 if name == "mixtral" else 0  # routing flips (see above)
    cu.check(beyond <= allowed, f"{name}: bf16 logits vs fp32 logits: {beyond} tokens beyond {LOGITS_TOL}: "
             f"{err_tok.sort().values[-8:].tolist()}")
    print(f"ok   {name}: transformers loads the bf16 export (single file and sharded) as torch.bfloat16; logits on "
          f"{len(batches)} x {B} sequences equal the fp32 export's loaded as bf16 exactly; vs fp32 logits: median "
          f"{float(err_tok.median()):.2e}, max {float(err_tok.max()):.2e}, {beyond} of {len(err_tok)} tokens beyond "
          f"{LOGITS_TOL}")


def check_dump(name, hf16, data, batches, tmp):
    """origami's logits of the bf16 export (dump, fp32 compute of the widened weights) equal transformers' in
    float64 on the same weights within 1e-4, the tolerance of tests/reference/test_hf_transformers.py."""
    d = ref.origami_dump(os.path.join(hf16, "config.json"), hf16, data, B, T, os.path.join(tmp, f"{name}_d16.safetensors"))
    want = logits(load(hf16, torch_dtype=torch.float64), batches[:1])
    err = ref.rel_err(d["logits"], want)
    cu.check(err <= 1e-4, f"{name}: origami dump of the bf16 export vs transformers (float64): {err:.3e} > 1e-4")
    print(f"ok   {name}: origami dump --init-from the bf16 export vs transformers on it (float64): {err:.2e} (bound 1e-4)")


def check_init_from(name, hf16, w16, data, tmp):
    """ckpt info and train --init-from of the bf16 export; its losses equal those from an fp32 copy of the bf16
    values (the widening is exact)."""
    info = cu.run("ckpt", "info", hf16).stdout
    cu.check("weights only (Hugging Face)" in info and "parameters:" in info, f"{name}: ckpt info of the bf16 export:\n{info}")
    # The fp32 copy also carries RoPE's inv_freq buffer, as older llama-family conversions do: not a
    # parameter, ignored. `ckpt info` of the bare file lists its tensors.
    widened = os.path.join(tmp, f"{name}_widened.safetensors")
    buffers = {} if name == "gpt2" else {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    ref.save_params({**{k: v.float() for k, v in w16.items()}, **buffers}, widened)
    info = cu.run("ckpt", "info", widened).stdout
    cu.check("no config.json to check them against" in info and all(k in info for k in list(w16) + list(buffers)),
             f"{name}: ckpt info of a bare .safetensors file lists its tensors:\n{info}")
    # The attention tiles' library is pinned: its timed choice (kernels/cpu/gemm.h) can differ between
    # two runs on a loaded host, and with it the last bits of the sums these exact losses compare.
    os.environ["ORIGAMI_TILE_GEMM"] = "onednn"
    losses = []
    for tag, init in (("bf16", hf16), ("widened", widened)):
        m = os.path.join(tmp, f"{name}_{tag}.jsonl")
        cu.run("train", "--config", os.path.join(hf16, "config.json"), "--init-from", init, "--data", data,
               "--steps", "3", "--micro-batch", "2", "--seq-len", "16", "--lr", "1e-3", "--metrics", m, "--threads", "2",
               "--quiet")
        losses.append([json.loads(line)["loss"] for line in open(m)])
    del os.environ["ORIGAMI_TILE_GEMM"]
    cu.check(len(losses[0]) == 3 and losses[0] == losses[1],
             f"{name}: train --init-from the bf16 export: losses {losses[0]}, from the widened fp32 file {losses[1]}")
    print(f"ok   {name}: ckpt info reads the bf16 export and a bare file; train --init-from it runs, losses "
          f"{losses[0]} = those from the fp32 file of the same values (with an inv_freq buffer, ignored)")


def check_model(name, data, tmp):
    cfg_path, cfg, init, _ = ref.seeded_model(name, tmp, seed=5)
    save = os.path.join(tmp, f"{name}_ck")
    cu.run("train", "--config", cfg_path, "--init-from", init, "--data", data, "--steps", "2", "--micro-batch", "2",
           "--seq-len", "16", "--lr", "3e-3", "--save", save, "--threads", "2", "--quiet")
    hf32 = export(save, os.path.join(tmp, f"{name}_hf32"))
    hf16 = export(save, os.path.join(tmp, f"{name}_hf16"), "--dtype", "bf16")
    w16 = check_bytes(name, hf32, hf16)
    check_config(name, hf32, hf16)
    sharded = check_sharded(name, save, hf16, tmp)
    sampler = ref.WindowSampler(data, T)
    batches = [sampler.batch(i, B)[0] for i in range(3)]
    check_transformers(name, hf32, hf16, sharded, batches)
    check_dump(name, hf16, data, batches, tmp)
    check_init_from(name, hf16, w16, data, tmp)
    return save


def check_edge_cases(tmp):
    """One gpt2 tensor holds the rounding's edge cases; exported through an HF directory (the reader's F32
    path), the BF16 bits equal torch's for every value but NaN, which must stay NaN (torch's NaN bits differ
    between its scalar and vector code)."""
    cfg_path, cfg, init, params = ref.seeded_model("gpt2", tmp, seed=6, tag="_edges")
    bits = [0x3f808000, 0x3f818000, 0x3f808001, 0x3f817fff,  # ties to even (down, up), just above / below a tie
            0x00000001, 0x00008000, 0x00018000, 0x007fffff, 0x807fffff,  # subnormals (ties among them)
            0x7f7f7fff, 0x7f7f8000, 0x7f7fffff, 0xff7f8000,  # largest finite bf16, the midpoint above: inf
            0x7f800000, 0xff800000, 0x80000000, 0x00000000, 0x7fc00000, 0xffc00001, 0x7f800001]  # inf, -0, 0, NaN
    edges = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    w = params["wte.weight"].float().reshape(-1).clone()
    w[:len(bits)] = edges
    params = {k: v.float() for k, v in params.items()}
    params["wte.weight"] = w.reshape(params["wte.weight"].shape)
    src = os.path.join(tmp, "gpt2_edges_src")
    ref.write_hf_dir(cfg, params, src)
    out = export(src, os.path.join(tmp, "gpt2_edges_hf16"), "--dtype", "bf16")
    got = ref.load_safetensors(os.path.join(out, "model.safetensors"))
    got = got.get("wte.weight", got.get("transformer.wte.weight")).reshape(-1)
    want = w.to(torch.bfloat16)
    nan = torch.isnan(w)
    cu.check(torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)) and bool(torch.isnan(got[nan]).all()),
             "edge cases: BF16 bits " + " ".join(f"{int(x) & 0xffff:04x}" for x in got[:len(bits)].view(torch.int16))
             + "\n  torch:   " + " ".join(f"{int(x) & 0xffff:04x}" for x in want[:len(bits)].view(torch.int16)))
    print(f"ok   edge cases of the rounding ({len(bits)} values: ties, subnormals, overflow, inf, -0, NaN) = torch's bits")


def check_dtype_key(data, tmp):
    """A config carrying transformers >= 4.56's "dtype" key (which it reads before torch_dtype): origami
    trains on it without a warning, and each export sets it to the export's dtype beside torch_dtype (it
    kept the config's "float32" in a bf16 export, which such a transformers would build in fp32)."""
    _, cfg, init, _ = ref.seeded_model("gpt2", tmp, seed=7, tag="_dtype")
    cfg_path = os.path.join(tmp, "gpt2_dtype.json")
    with open(cfg_path, "w") as f:
        json.dump(dict(cfg, dtype="float32"), f)
    save = os.path.join(tmp, "gpt2_dtype_ck")
    p = cu.run("train", "--config", cfg_path, "--init-from", init, "--data", data, "--steps", "1", "--micro-batch", "2",
               "--seq-len", "16", "--save", save, "--threads", "2", "--quiet")
    cu.check("dtype" not in p.stderr, f"a config's dtype key drew a warning: {p.stderr}")
    for dtype, want in (("fp32", "float32"), ("bf16", "bfloat16")):
        out = export(save, os.path.join(tmp, "gpt2_dtype_" + dtype), "--dtype", dtype)
        got = ref.load_config(os.path.join(out, "config.json"))
        cu.check(got.get("dtype") == got.get("torch_dtype") == want,
                 f"--dtype {dtype}: config.json dtype {got.get('dtype')!r}, torch_dtype {got.get('torch_dtype')!r}")
    print("ok   a config's dtype key: no warning, set to the export's dtype beside torch_dtype")


def check_stale_state(saved, tmp):
    """An export into a directory holding an earlier --optimizer export's state (its weights removed) is
    refused: a resume of it would take this export's weights with the earlier step's moments and step."""
    out = export(saved, os.path.join(tmp, "stale"), "--optimizer")
    os.remove(os.path.join(out, "model.safetensors"))
    cu.expect_error("ckpt export over an earlier export's optimizer state", ["ckpt", "export", saved, "--hf", out],
                    f"'{out}' already holds training state (optimizer.safetensors): export into a new directory")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        data = ref.origami_prepare_data(ref.sample_text(os.path.join(tmp, "text.txt"), 4000), os.path.join(tmp, "data"))
        saved = [check_model(name, data, tmp) for name in MODELS]
        check_edge_cases(tmp)
        out = os.path.join(tmp, "refused")
        cu.expect_error("ckpt export --dtype fp16", ["ckpt", "export", saved[0], "--hf", out, "--dtype", "fp16"],
                        "--dtype must be 'fp32' or 'bf16', got 'fp16'")
        cu.expect_error("ckpt export --dtype bf16 --optimizer",
                        ["ckpt", "export", saved[0], "--hf", out, "--dtype", "bf16", "--optimizer"],
                        "--optimizer writes a checkpoint to resume, whose weights stay fp32: export it without --dtype bf16")
        cu.check(not os.path.exists(out), "a refused export left its directory behind")
        check_dtype_key(data, tmp)
        check_stale_state(saved[0], tmp)
    print("all bf16 export checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
