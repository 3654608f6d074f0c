#!/usr/bin/env python3
"""`origami plan` against published large-GPU training runs: the calibration set.

Each row is a run a paper or vendor table printed with its model, GPU count and layout. The layout
is fixed as published (`--layout` with every axis given, `--precision bf16`, `--nodes` sized to the
GPUs) and the predicted step time is compared with the published one:
  - a published iteration time directly;
  - a published TFLOP/s per GPU (Megatron's count: 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) for these
    GPT models) or MFU (Llama 3: origami's own count of model FLOPs, 6 per parameter of a matmul plus
    causal attention, against the 989 TFLOP/s BF16 peak) converted to the step time it implies.
error = predicted / published step time − 1 (positive: the planner is too slow).

Sources (the rows below; what a source does not print is stated as an assumption in the row):
  K22  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
       (arXiv 2205.05198), Tables 3 and 5 and section 6: A100 80GB (Selene), sequence 2048, vocab
       51200, TP 8, no data parallelism except the 530B row on 2240 GPUs; "full" rows recompute
       every layer without SP, "sel" rows use selective recomputation with SP; FFN 4h assumed.
  MS24 Jiang et al. 2024, "MegaScale" (NSDI'24), Table 2: the Megatron-LM baseline's 175B runs
       (96 layers, h 12288, 128 heads, vocab 64000, sequence 2048, TP 8, PP 8, VPP 6, A100-class).
       Not printed, assumed: micro-batch 1, selective recomputation with SP, the distributed
       optimizer (zero1).
  MLM24 The Megatron-LM README's weak-scaling table on H100 (Megatron-Core r0.8.0, July 2024):
       GPT models, vocab 131072, sequence 4096, DP 48, --overlap-grad-reduce, --overlap-param-gather,
       --tp-comm-overlap. Not printed, assumed: BF16, micro-batch 1, no recomputation, SP with TP,
       FFN 4h, zero1 (the param gather it overlaps), gradients reduced in bf16.
  L3   "The Llama 3 Herd of Models" (2024), Tables 3 and 4: 405B (126 layers, 16384, FFN 53248,
       128 heads, 8 KV heads, vocab 128000) on H100 at 8192 tokens, 16M tokens a step, BF16 MFU.
       Stages of 8 layers, the first and last 7 (the paper removes one layer from each), in an
       interleaved schedule. Not printed, assumed: VPP 2 (virtual stages of 4 layers, the first and
       last 3), zero1 for their FSDP without resharding after forward, micro-batch 1.
       (Table 4's third row, CP 16, is left out: its degrees multiply to 8192, not its 16384 GPUs.)
  AM   NVIDIA NeMo AutoModel (PyTorch FSDP2 backend) docs/performance-summary.md (2025-10-02),
       DGX-H100, BF16, sequence 4096, routing forced to balance, step time: Qwen3-30B-A3B (48 layers,
       2048, 32 heads of 128, 4 KV heads, 128 experts top-8 of FFN 768, vocab 151936; planned as a
       mixtral, without Qwen3's q/k norms) on 8 GPUs, EP 8, FSDP 8 (planned as zero3), GBS 512, MBS 4;
       recomputation not printed, assumed none.

Looked at and left out: GPT-OSS 120B rows (Megatron-Bridge 25.11 and 26.02, AutoModel), a model
origami cannot describe — every other layer attends over a 128-token window, with attention sinks —
so its attention kernels are not the ones planned (as a mixtral of its sizes the planner came out
21-32% fast on the Megatron-Bridge rows; the AutoModel row's layout does not say how experts are
placed); Qwen3-235B rows of the Megatron-Core MoE team's model zoo (94 layers over more virtual
stages than origami splits evenly, recomputation of norms and activations origami does not have).

Held out, and never used here: Narayanan et al. 2021 (Megatron-LM PTD-P) Table 1 and the MoE
Parallel Folding paper's tables — the independent check of the same code and cluster files.

Usage: /usr/bin/python3 bench/plan_published.py [--origami BUILD/origami] [--json OUT.json] [--markdown]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def gpt(layers, hidden, heads, vocab, positions):
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab, "n_positions": positions,
            "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_inner": 4 * hidden,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 0}


def llama(layers, hidden, heads, kv, ffn, vocab, positions):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "hidden_act": "silu", "max_position_embeddings": positions,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 0,
            "eos_token_id": 0}


def moe(layers, hidden, heads, kv, head_dim, experts, top_k, ffn, vocab, positions):
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "num_local_experts": experts,
            "num_experts_per_tok": top_k, "hidden_act": "silu", "max_position_embeddings": positions,
            "rms_norm_eps": 1e-5, "rope_theta": 1e6, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
            "sliding_window": None, "bos_token_id": 0, "eos_token_id": 0}


def megatron_flops(cfg, batch, seq):
    """Megatron's model FLOPs of a step for a GPT model (the count its TFLOP/s figures use)."""
    L, h, V = cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"]
    return 72 * batch * seq * L * h * h * (1 + seq / (6 * h) + V / (12 * L * h))


def origami_flops(cfg, batch, seq):
    """origami's model FLOPs of a step (train_flops_per_token) for a llama model."""
    C, F, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    D = C // cfg["num_attention_heads"]
    attn = C * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * D + cfg["num_attention_heads"] * D * C
    params = L * (attn + 3 * C * F) + C * V
    return batch * seq * (6 * params + 6 * L * seq * cfg["num_attention_heads"] * D)


K22 = {"22B": (gpt(48, 6144, 64, 51200, 2048), 8, 4, "tp8 pp1 mb4"),
       "175B": (gpt(96, 12288, 96, 51200, 2048), 64, 64, "tp8 pp8 vpp3 mb1"),
       "530B": (gpt(105, 20480, 128, 51200, 2048), 280, 280, "tp8 pp35 vpp3 mb1"),
       "1T": (gpt(128, 25600, 160, 51200, 2048), 512, 512, "tp8 pp64 vpp1 mb1")}
K22_TIMES = {"22B": (1.42, 1.10), "175B": (18.13, 13.75), "530B": (49.05, 37.83), "1T": (94.42, 71.49)}


def rows():
    out = []
    for name, (cfg, gpus, batch, layout) in K22.items():
        full, sel = K22_TIMES[name]
        base = dict(source="K22 T5", model="GPT " + name, cfg=cfg, cluster="dgx-a100", gpus=gpus, batch=batch, seq=2048)
        out.append(dict(base, layout=layout + " zero0 nosp recompute=full", published=("s", full)))
        out.append(dict(base, layout=layout + " zero0 sp recompute=selective", published=("s", sel)))
    out.append(dict(source="K22 s6", model="GPT 530B", cfg=K22["530B"][0], cluster="dgx-a100", gpus=2240, batch=2240,
                    seq=2048, layout="tp8 pp35 vpp3 mb1 zero0 sp recompute=selective", published=("s", 39.15)))
    ms175 = gpt(96, 12288, 128, 64000, 2048)
    for gpus, batch, seconds in [(256, 768, 40.0), (512, 768, 21.2), (768, 768, 15.2), (1024, 768, 11.9),
                                 (3072, 6144, 29.02), (6144, 6144, 14.78), (8192, 6144, 12.24), (12288, 6144, 8.57)]:
        out.append(dict(source="MS24 T2", model="GPT 175B", cfg=ms175, cluster="dgx-a100", gpus=gpus, batch=batch,
                        seq=2048, layout="tp8 pp8 vpp6 mb1 zero1 sp recompute=selective", published=("s", seconds)))
    for name, L, h, heads, tp, pp, batch, tflops in [
            ("1.7B", 24, 2048, 16, 1, 1, 192, 408.8), ("7.1B", 30, 4096, 32, 2, 1, 192, 465.9),
            ("16B", 32, 6144, 48, 4, 1, 192, 489.1), ("32B", 48, 7168, 56, 8, 1, 192, 459.6),
            ("70B", 84, 8192, 64, 8, 2, 384, 419.7), ("119B", 92, 10240, 80, 8, 4, 768, 420.5),
            ("177B", 96, 12288, 96, 8, 6, 1152, 432.8), ("314B", 96, 16384, 128, 8, 8, 1536, 474.4),
            ("462B", 112, 18432, 144, 8, 16, 3072, 459.9)]:
        cfg = gpt(L, h, heads, 131072, 4096)
        gpus = tp * pp * 48
        seconds = megatron_flops(cfg, batch, 4096) / (tflops * 1e12 * gpus)
        sp = " sp" if tp > 1 else " nosp"
        out.append(dict(source="MLM24", model="GPT " + name, cfg=cfg, cluster="dgx-h100", gpus=gpus, batch=batch,
                        seq=4096, layout=f"tp{tp} pp{pp} vpp1 mb1 zero1{sp} recompute=none", published=("s", seconds),
                        grad_reduce="bf16",
                        note=f"{tflops} TFLOP/s/GPU"))
    l405 = llama(126, 16384, 128, 8, 53248, 128000, 8192)
    for gpus, dp, mfu in [(8192, 64, 0.43), (16384, 128, 0.41)]:
        batch = 16 * 1024 * 1024 // 8192
        seconds = origami_flops(l405, batch, 8192) / (mfu * 989e12 * gpus)
        out.append(dict(source="L3 T4", model="Llama 3 405B", cfg=l405, cluster="dgx-h100", gpus=gpus, batch=batch,
                        seq=8192, layout="tp8 pp16 vpp2 mb1 zero1 sp recompute=none pp-layers=3," + "4," * 30 + "3",
                        published=("s", seconds), note=f"MFU {mfu:.0%}"))
    qwen3 = moe(48, 2048, 32, 4, 128, 128, 8, 768, 151936, 4096)
    out.append(dict(source="AM", model="Qwen3-30B-A3B", cfg=qwen3, cluster="dgx-h100", gpus=8, batch=512, seq=4096,
                    layout="tp1 pp1 ep8 mb4 zero3 nosp recompute=none", published=("s", 21.773)))
    return out


def predict(origami, row, tmp, clusters):
    path = os.path.join(tmp, "model.json")
    with open(path, "w") as f:
        json.dump(row["cfg"], f)
    cmd = [origami, "plan", "--config", path, "--cluster", os.path.join(clusters, row["cluster"] + ".json"),
           "--nodes", str(math.ceil(row["gpus"] / 8)), "--devices", str(row["gpus"]), "--global-batch", str(row["batch"]),
           "--seq-len", str(row["seq"]), "--layout", "cp1 etp1 novocab nofssdp " + ("" if " ep" in row["layout"] else "ep1 ") + row["layout"], "--precision", "bf16",
           "--top", "1", "--json", "--any-memory", "--grad-reduce-dtype", row.get("grad_reduce", "fp32")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{r.stderr}")
    return json.loads(r.stdout)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--origami", default=os.path.join(ROOT, "build", "origami"))
    ap.add_argument("--clusters", default=os.path.join(ROOT, "configs", "clusters"),
                    help="the folder of the cluster files (dgx-a100.json, dgx-h100.json)")
    ap.add_argument("--json", help="write the rows with their predictions here")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (the README's form)")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows():
            p = predict(args.origami, row, tmp, args.clusters)
            published = row["published"][1]
            err = p["step_time_s"] / published - 1
            parts = sorted(p["breakdown"].items(), key=lambda kv: -kv[1])[:3]
            results.append(dict(source=row["source"], model=row["model"], gpus=row["gpus"], layout=row["layout"],
                                cluster=row["cluster"], published_s=published, predicted_s=p["step_time_s"], error=err,
                                note=row.get("note", ""), mfu=p["mfu"],
                                largest=", ".join(f"{k} {v / p['step_time_s']:.0%}" for k, v in parts)))
    if args.markdown:
        print("| source | model | GPUs | layout | published s | predicted s | error | largest parts |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            pub = f"{r['published_s']:.3g}" + (f" ({r['note']})" if r["note"] else "")
            print(f"| {r['source']} | {r['model']} | {r['gpus']} | {r['layout']} | {pub} | {r['predicted_s']:.3g} | "
                  f"{100 * r['error']:+.1f}% | {r['largest']} |")
    else:
        for r in results:
            print(f"{r['source']:8} {r['model']:13} {r['gpus']:6} {r['cluster']:8} {r['layout']:52} published "
                  f"{r['published_s']:8.3f} s predicted {r['predicted_s']:8.3f} s  {100 * r['error']:+6.1f}%  {r['largest']}")
    errors = [abs(r["error"]) for r in results]
    print(f"\n{len(errors)} runs: median |error| {100 * statistics.median(errors):.1f}%, worst {100 * max(errors):.1f}% "
          "(targets: median <= 10%, worst <= 20%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
