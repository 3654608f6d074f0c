"""Communication volume of one training step, checked exactly against the analytic formula for
each layout (DESIGN.md: "Communication volume is checked against the analytic formula for each
layout, exactly").

`origami train --metrics` writes, per step, "comm_bytes": {"tp": x, "dp": y, "world": z}: the
bytes rank 0 sent in that step on each communicator, under the ring-algorithm accounting of
src/comm/comm.h (an all-reduce of S bytes over n ranks counts 2·(n−1)/n·S, a reduce-scatter or
all-gather whose full buffer is S bytes counts (n−1)/n·S). For one step (--steps 1) of the gpt2,
llama and mixtral test models under TP2, TP4+SP, TP2+SP, DP2 (ZeRO 0, 1, and 2 with 2
micro-batches), DP2×TP2 and DP2×TP2+SP ZeRO-1, the tp and dp entries must equal the formulas
below after rounding to an integer. "world" (small scalar all-reduces: grad norm, metrics) is
printed, not asserted.

Notation: t = TP degree, d = DP degree, B micro-batch, T sequence length, N = B·T tokens per
micro-batch, C hidden size, L layers, K experts per token, m = micro-batches per DP rank per step
(= G/(d·B)), 4 = bytes of an fp32 element.
    AR_t(x) = 2·(t−1)/t·4·x   (ring all-reduce of x floats over t ranks)
    AG_t(x) = RS_t(x) = (t−1)/t·4·x  (x = floats of the full, gathered buffer)

TP (Megatron tensor parallelism; every TP rank sends the same amount, so rank 0 is representative):
  Per micro-batch, per layer, 4 all-reduces of the N×C activation:
    forward  f1: after the attention output projection (row-parallel o_proj/c_proj: partial sums)
    forward  f2: after the MLP down projection, or the MoE combine (row-parallel w2: partial sums)
    backward b1: input grad of the QKV projection (column-parallel: each rank holds the grad from
                 its heads only)
    backward b2: input grad of the MLP up/gate (or the experts' w1|w3): partial over F shards
  = L·4·AR_t(N·C)
  + the vocab-parallel embedding: each rank looks up only its vocabulary rows, the others give
    zeros, so the forward output is an all-reduce:                                AR_t(N·C)
  + the vocab-parallel LM head: its input grad is a partial sum over vocab shards, all-reduced
    in backward:                                                                    AR_t(N·C)
  + the vocab-parallel cross-entropy: per token the local max, local sum of exp and the target
    logit (0 when the target is not in this rank's shard) are all-gathered, 3 floats per token:
    all_gather of 3·N floats per rank, full buffer t·3·N floats:          AG_t(t·3·N) = (t−1)·3·N·4
  + MoE layers (mixtral: every layer): each rank's expert outputs are partial (F-sharded
    experts), so the gradient of the top-k routing weights (dL/dw_k = <dy, expert_k(x)>) is
    partial and all-reduced in backward, N·K floats per MoE layer:              L_moe·AR_t(N·K)
  per step: m · (that sum).
  With sequence parallelism each all-reduce of N·C becomes an all-gather + reduce-scatter pair
  (AG_t(N·C) + RS_t(N·C) = AR_t(N·C): the same bytes): f1/f2 become reduce-scatters into the
  sequence-sharded residual stream, b1/b2 the reduce-scatters of the backward, and the matching
  all-gathers sit before the QKV / MLP inputs (forward) and after the o_proj / down projection
  (backward); the embedding output is reduce-scattered in forward and all-gathered in backward;
  the LM head input is all-gathered in forward and reduce-scattered in backward. So the per
  micro-batch sum is unchanged, and once per step the gradients of parameters that act on the
  sequence-sharded stream — every LayerNorm/RMSNorm weight and bias — are partial sums over the
  sequence shards and are all-reduced over tp:                                AR_t(norm elements)
  norm elements: gpt2 (ln_1, ln_2 weight+bias per layer, ln_f weight+bias) = (4L+2)·C;
                 llama / mixtral (input_layernorm, post_attention_layernorm, model.norm) = (2L+1)·C.
  [SP_EXTRA below lists any further sequence-sharded parameters the implementation all-reduces
   with them, e.g. gpt2's row-parallel output biases if they are added after the reduce-scatter.]

DP (gradient buffer of the rank's local parameters, P elements, each bucket padded to a multiple
of d; the test models are sized so that every tensor, hence every bucket, is a multiple of 4
elements, so P_padded = P for d ∈ {2, 4}):
  ZeRO-0: one all-reduce of the gradient buffer per step:              AR_d(P) = 2·(d−1)/d·4·P
  ZeRO-1: reduce-scatter of the gradients, then all-gather of the updated parameters, per step:
                                                           RS_d(P) + AG_d(P) = 2·(d−1)/d·4·P
  ZeRO-2: the reduce-scatter after every micro-batch, the all-gather once per step:
                                                           m·RS_d(P) + AG_d(P) = (m+1)·(d−1)/d·4·P
  P (local parameters under TP t; Megatron sharding): vocab-parallel embedding and LM head V·C/t;
  column-parallel QKV / c_attn / c_fc / gate|up / w1|w3 (weights and biases) /t; row-parallel
  o_proj / c_proj / down / w2 weights /t, their biases replicated; norms, gpt2 wpe and the MoE
  router replicated.

Usage: python3 tests/parallel/test_comm_bytes.py [gpt2,llama,mixtral]
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

SEQ = 16
MICRO = 2
F32 = 4

# name, ranks, tp, sp, zero, micro-batches per DP rank
LAYOUTS = [
    ("TP2", 2, 2, False, 0, 1),
    ("TP2+SP", 2, 2, True, 0, 1),
    ("TP4+SP", 4, 4, True, 0, 1),
    ("TP2 (2 micro)", 2, 2, False, 0, 2),
    ("DP2 z0", 2, 1, False, 0, 1),
    ("DP2 z1", 2, 1, False, 1, 1),
    ("DP2 z2 (2 micro)", 2, 1, False, 2, 2),
    ("DP4 z2 (2 micro)", 4, 1, False, 2, 2),
    ("DP2xTP2", 4, 2, False, 0, 1),
    ("DP2xTP2+SP z1", 4, 2, True, 1, 1),
]
MODELS = ["gpt2", "llama", "mixtral"]


def dims(cfg):
    """(V, C, L, H, KV, D, F, E, K, positions, gpt2?, tied?) of a test config."""
    if cfg["model_type"] == "gpt2":
        C, H = cfg["n_embd"], cfg["n_head"]
        return (cfg["vocab_size"], C, cfg["n_layer"], H, H, C // H, cfg.get("n_inner") or 4 * C, 0, 0,
                cfg["n_positions"], True, True)
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    E = cfg.get("num_local_experts", 0) if cfg["model_type"] == "mixtral" else 0
    return (cfg["vocab_size"], C, cfg["num_hidden_layers"], H, cfg.get("num_key_value_heads", H),
            cfg.get("head_dim") or C // H, cfg["intermediate_size"], E, cfg.get("num_experts_per_tok", 2) if E else 0,
            cfg["max_position_embeddings"], False, cfg.get("tie_word_embeddings", False))


def local_params(cfg, t):
    """Parameters one TP rank holds (see the docstring for the sharding)."""
    V, C, L, H, KV, D, F, E, K, P, gpt2, tied = dims(cfg)
    if gpt2:
        layer = (2 * C                       # ln_1 weight, bias (replicated)
                 + C * 3 * C // t + 3 * C // t  # c_attn (column-parallel) weight, bias
                 + C * C // t + C            # attn c_proj (row-parallel) weight; bias replicated
                 + 2 * C                     # ln_2
                 + C * F // t + F // t       # c_fc (column-parallel)
                 + F * C // t + C)           # mlp c_proj (row-parallel); bias replicated
        return V * C // t + P * C + L * layer + 2 * C   # wte (vocab-parallel), wpe, layers, ln_f
    attn = (H + 2 * KV) * D * C // t + C * H * D // t
    mlp = (C * E + E * 3 * F * C // t) if E else 3 * F * C // t  # router replicated, experts F-sharded
    return V * C // t + L * (2 * C + attn + mlp) + C + (0 if tied else V * C // t)


def norm_elements(cfg):
    V, C, L, H, KV, D, F, E, K, P, gpt2, tied = dims(cfg)
    return (4 * L + 2) * C if gpt2 else (2 * L + 1) * C


def expected(cfg, tp, dp, sp, zero, m):
    """{communicator: (bytes, [(term, bytes), ...])} for one step on rank 0."""
    V, C, L, H, KV, D, F, E, K, P, gpt2, tied = dims(cfg)
    N = MICRO * SEQ
    AR = lambda n, x: 2.0 * (n - 1) / n * F32 * x
    AG = lambda n, x: (n - 1) / n * F32 * x  # x: floats of the full buffer (also RS)
    out = {}
    if tp > 1:
        terms = [("layers: L*4*AR(N*C)", m * L * 4 * AR(tp, N * C)),
                 ("embedding fwd AR(N*C)", m * AR(tp, N * C)),
                 ("LM-head bwd AR(N*C)", m * AR(tp, N * C)),
                 ("CE stats AG(t*3N)", m * AG(tp, tp * 3 * N))]
        if E:
            terms.append(("MoE routing-weight grad L*AR(N*K)", m * L * AR(tp, N * K)))
        if sp:
            terms.append(("SP norm grads AR(%d)" % norm_elements(cfg), AR(tp, norm_elements(cfg))))
        out["tp"] = terms
    if dp > 1:
        Pl = local_params(cfg, tp)
        if zero == 0:
            terms = [("AR(P=%d)" % Pl, AR(dp, Pl))]
        elif zero == 1:
            terms = [("RS(P=%d)" % Pl, AG(dp, Pl)), ("AG(P)", AG(dp, Pl))]
        else:
            terms = [("%d x RS(P=%d)" % (m, Pl), m * AG(dp, Pl)), ("AG(P)", AG(dp, Pl))]
        out["dp"] = terms
    return {k: (sum(b for _, b in v), v) for k, v in out.items()}


def main():
    models = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else MODELS
    tmp = h.tmpdir()
    rows, failures = [], []
    try:
        data = h.prepare_data(tmp)
        for model in models:
            cfg_path = os.path.join(h.CONFIGS, model + "_tiny.json")
            cfg = h.load_config(model + "_tiny")
            # Sizes are chosen so that no bucket needs padding (see the docstring).
            for t in (1, 2, 4):
                assert local_params(cfg, t) % 4 == 0, (model, t)
            if True:  # the formula's unsharded count is the count origami prints for one rank
                rc, out, _ = h.run(0, ["train", "--config", cfg_path, "--data", data, "--steps", "1", "--seq-len",
                                       str(SEQ), "--micro-batch", str(MICRO), "--threads", "1", "--quiet"])
                printed = [int(w) for line in out.splitlines() if line.startswith("origami train:")
                           for w, nxt in zip(line.split(), line.split()[1:]) if nxt.startswith("parameters")]
                if rc != 0 or printed != [local_params(cfg, 1)]:
                    failures.append("%s: one-rank run printed %s parameters, the formula gives %d (exit %s)"
                                    % (model, printed, local_params(cfg, 1), rc))
            for name, ranks, tp, sp, zero, m in LAYOUTS:
                dp = ranks // tp
                G = dp * MICRO * m
                mpath = os.path.join(tmp, "%s_%s.jsonl" % (model, name.replace(" ", "_")))
                flags = ["--tp", str(tp)] + (["--sequence-parallel"] if sp else []) + ["--zero", str(zero)]
                args = ["train", "--config", cfg_path, "--data", data, "--steps", "1", "--seq-len", str(SEQ),
                        "--micro-batch", str(MICRO), "--global-batch", str(G), "--threads", "1", "--quiet",
                        "--metrics", mpath, *flags]
                rc, out, wall = h.run(ranks, args, timeout=120)
                exp = expected(cfg, tp, dp, sp, zero, m)
                try:
                    recs = h.read_metrics(mpath)
                except ValueError as e:
                    recs = []
                    out += "\n" + str(e)
                got = recs[0].get("comm_bytes") if recs else None
                if rc != 0 or not isinstance(got, dict):
                    err = " | ".join(l for l in out.splitlines() if "error" in l.lower())[:300] or out[-300:]
                    failures.append("%s %s: exit %s, comm_bytes %r: %s" % (model, name, rc, got, err))
                    rows.append((model, name, "-", "-", "-", "FAIL (no result)", ""))
                    print("FAIL  %-8s %-18s exit %s: %s" % (model, name, rc, err), flush=True)
                    continue
                for comm in sorted(set(exp) | set(k for k in got if k != "world")):
                    e_bytes, terms = exp.get(comm, (0.0, []))
                    g_bytes = got.get(comm, 0)
                    ok = round(e_bytes) == round(g_bytes)
                    detail = " + ".join("%s %.0f" % (n, b) for n, b in terms)
                    rows.append((model, name, comm, "%.0f" % e_bytes, "%.0f" % g_bytes,
                                 "ok" if ok else "FAIL (diff %+.0f)" % (g_bytes - e_bytes), detail))
                    if not ok:
                        failures.append("%s %s %s: expected %.0f bytes (%s), metrics say %.0f (diff %+.0f)"
                                        % (model, name, comm, e_bytes, detail, g_bytes, g_bytes - e_bytes))
                rows.append((model, name, "world", "-", "%.0f" % got.get("world", 0), "(not asserted)", ""))
                print("%-5s %-8s %-18s %s  (%.1f s)" % ("ok" if not any(r[5].startswith("FAIL") for r in rows
                                                                         if r[0] == model and r[1] == name) else "FAIL",
                                                      model, name, json.dumps(got), wall), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("comm_bytes of one step on rank 0 vs the analytic formula (N=%d tokens per micro-batch):" % (MICRO * SEQ))
    print(h.fmt_table(("model", "layout", "comm", "expected", "metrics", "status", "terms"), rows))
    if failures:
        print("\nFAILED:")
        for x in failures:
            print("  " + x)
        sys.exit(1)
    print("\nall tp and dp byte counts equal the formulas")


if __name__ == "__main__":
    main()
