"""Communication volume of one training step, checked exactly against the analytic formula for
each layout (DESIGN.md: "Communication volume is checked against the analytic formula for each
layout, exactly").

`origami train --metrics` writes, per step, "comm_bytes": {"tp": x, "dp": y, "world": z}: the
bytes rank 0 sent in that step on each communicator, under the ring-algorithm accounting of
src/comm/comm.h (an all-reduce of S bytes over n ranks counts 2·(n−1)/n·S, a reduce-scatter or
all-gather whose full buffer is S bytes counts (n−1)/n·S). For one step (--steps 1) of the gpt2,
llama and mixtral test models under TP2, TP4+SP, TP2+SP, DP2 (ZeRO 0, 1, and 2 with 2
micro-batches), DP2×TP2 and DP2×TP2+SP ZeRO-1, the tp and dp entries must equal the formulas
below after rounding to an integer, and so must "world" (formula at the end, read from the
implementation).

Notation: t = TP degree, d = DP degree, B micro-batch, T sequence length, N = B·T tokens per
micro-batch, C hidden size, L layers, K experts per token, m = micro-batches per DP rank per step
(= G/(d·B)), 4 = bytes of an fp32 element.
    AR_t(x) = 2·(t−1)/t·4·x   (ring all-reduce of x floats over t ranks)
    AG_t(x) = RS_t(x) = (t−1)/t·4·x  (x = floats of the full, gathered buffer)

TP (Megatron tensor parallelism; every TP rank sends the same amount, so rank 0 is representative):
  Per micro-batch, per layer (gpt2, llama), 4 all-reduces of the N×C activation:
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
  + MoE layers (mixtral: every layer) are split by tokens, not features (MoE parallel folding):
    f2 and b2 are gone; each TP rank routes its share of N/t tokens and, without SP, the expert
    outputs (forward) and the input gradients (backward) are all-gathered:     L_moe·2·AG_t(N·C)
    (with SP the shares are the sequence shards the rank already holds: nothing), and the per-
    expert routed counts (E int64) are all-reduced in forward for the load-balancing loss:
                                                                          L_moe·2·(t−1)/t·8·E
    So mixtral's layers give L·2·AR_t(N·C) for attention plus those.
  per step: m · (that sum).
  With sequence parallelism each all-reduce of N·C becomes an all-gather + reduce-scatter pair
  (AG_t(N·C) + RS_t(N·C) = AR_t(N·C): the same bytes): f1/f2 become reduce-scatters into the
  sequence-sharded residual stream, b1/b2 the reduce-scatters of the backward, and the matching
  all-gathers sit before the QKV / MLP inputs (forward) and after the o_proj / down projection
  (backward); the embedding output is reduce-scattered in forward and all-gathered in backward;
  the LM head input is all-gathered in forward and reduce-scattered in backward. So that sum is
  unchanged; in addition each layer keeps its two norm outputs as sequence shards (no [N, C]
  activation is kept) and all-gathers them again in backward for the weight gradients of QKV and
  the MLP up/gate (or the router and experts):                                  L·2·AG_t(N·C)
  per micro-batch (mixtral: the attention norm's only, L·AG_t(N·C): the MoE works on the shard).
  Once per step the gradients of parameters that act on the sequence-sharded stream — every
  LayerNorm/RMSNorm weight and bias — are partial sums over the sequence shards and are
  all-reduced over tp:                                                        AR_t(norm elements)
  and, with or without SP, so are the MoE routers' (each TP rank routes its own tokens):
                                                                            AR_t(router elements)
  The norm gradients reduced are those this rank updates: all of them with ZeRO-0; with ZeRO ≥ 1
  only those inside its DP shard of each bucket (the optimizer and the gradient norm read only the
  shard; data_parallel.cpp finish_gradients), so for rank 0
      norm elements = Σ over LayerNorm/RMSNorm tensors of |tensor ∩ rank 0's shards|,
  derived below from the parameter table in buffer order (local, TP-sharded sizes) and the bucket
  rule of params.h. All norms: gpt2 (ln_1, ln_2 weight+bias per layer, ln_f) (4L+2)·C;
  llama / mixtral (input_layernorm, post_attention_layernorm, model.norm) (2L+1)·C.
  (gpt2's row-parallel output biases and wpe need no reduction: the biases are added after the
  reduce-scatter, but their gradient is taken from the all-gathered full gradient; wpe is added on
  TP rank 0 before the reduction and also gets the full gradient.)

DP (gradient buffer of the rank's local parameters in table order, cut into buckets from the end
of the table — a bucket closes once it holds ≥ bucket_floats = --bucket-mb·2^20/4 floats, never
splitting a tensor — each padded at its end to a multiple of d; P_padded = Σ padded bucket sizes):
  ZeRO-0: one all-reduce of every bucket per step:                     AR_d(P_padded)
  ZeRO-1: reduce-scatter of every bucket, then all-gather of the updated parameters, per step:
                                                           RS_d(P_padded) + AG_d(P_padded)
  ZeRO-2: the reduce-scatter after every micro-batch, the all-gather once per step:
                                                           m·RS_d(P_padded) + AG_d(P_padded)
  Local parameters under TP t (Megatron sharding, params.cpp): vocab-parallel embedding and LM
  head ceil(V/t)·C; column-parallel QKV / c_attn / c_fc / gate / up / w1 / w3 (weights and
  biases) /t; row-parallel o_proj / c_proj / down / w2 weights /t, their biases replicated; norms,
  gpt2 wpe and the MoE router replicated. The routed experts are not in this buffer: they have
  their own, reduced over EDP = t·d (the MoE mesh ETP1 × EP1 × EDP by default: each expert whole
  on every rank), by the same rules — that is the "edp" entry. The test models' tensors are all multiples of 4
  elements, so their buckets need no padding; the "pad" case (gpt2 with n_embd 42 and 0.02 MiB
  buckets under DP4) exercises padding and several buckets.

world (read from trainer.cpp / data_parallel.cpp): per step one all-reduce of the squared gradient
norm and the count of ranks whose loss is not finite (the non-finite guard: 2 doubles) and one of the step metrics (lm, aux, z, cpu_s, stop flag, the L·E expert token
counts and for MoE the L dropped counts and L near ties, 7 figures per pipeline stage — activation peak
measured and computed, busy and schedule time, pp bytes, peak resident memory, message buffers — and,
for MoE, the expert-side rows of each rank and its EP group's busiest rows summed over the calls:
5 + L·E (+ 2L) + 7·PP (+ 2n) doubles), over all n ranks: AR_n(8·(2 + 5 + L·E (+ 2L) + 7·PP (+ 2n))) bytes.

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

# name, ranks, tp, sp, zero, micro-batches per DP rank, extra flags, config changes (None: the test config)
LAYOUTS = [
    ("TP2", 2, 2, False, 0, 1, [], None),
    ("TP2+SP", 2, 2, True, 0, 1, [], None),
    ("TP4+SP", 4, 4, True, 0, 1, [], None),
    ("TP2 (2 micro)", 2, 2, False, 0, 2, [], None),
    ("DP2 z0", 2, 1, False, 0, 1, [], None),
    ("DP2 z1", 2, 1, False, 1, 1, [], None),
    ("DP2 z2 (2 micro)", 2, 1, False, 2, 2, [], None),
    ("DP4 z2 (2 micro)", 4, 1, False, 2, 2, [], None),
    ("DP2xTP2", 4, 2, False, 0, 1, [], None),
    ("DP2xTP2+SP z1", 4, 2, True, 1, 1, [], None),
    ("DP2xTP2+SP z2 (2 micro)", 4, 2, True, 2, 2, [], None),
]
# Padding and several buckets (gpt2 only): n_embd 42 makes 42-element tensors (not multiples of 4).
PAD_CASES = [
    ("DP4 z1 pad, 0.02 MiB buckets", 4, 1, False, 1, 1, ["--bucket-mb", "0.02"], {"n_embd": 42, "n_head": 6}),
    ("DP2xTP2+SP z1 pad, 0.02 MiB", 4, 2, True, 1, 1, ["--bucket-mb", "0.02"], {"n_embd": 42, "n_head": 6}),
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


def local_table(cfg, t, experts=False):
    """[(name, local elements, kind)] of one TP rank, in buffer (Hugging Face table) order; kind is
    "norm", "router" or "". experts: the routed experts' own buffer (whole experts, ETP1 EP1) instead."""
    if experts:
        V, C, L, H, KV, D, F, E, K, P, gpt2, tied = dims(cfg)
        return [(w, F * C, "") for l in range(L) for e in range(E) for w in ("w1", "w3", "w2")]
    V, C, L, H, KV, D, F, E, K, P, gpt2, tied = dims(cfg)
    Vl = -(-V // t)  # the vocabulary is padded to a multiple of t
    out = []
    add = lambda name, n, norm=False: out.append((name, n, "norm" if norm else ""))
    if gpt2:
        add("wte", Vl * C)
        add("wpe", P * C)
        for l in range(L):
            add("ln_1.w", C, True), add("ln_1.b", C, True)
            add("c_attn.w", C * 3 * C // t), add("c_attn.b", 3 * C // t)      # column-parallel (q|k|v)
            add("attn.c_proj.w", C // t * C), add("attn.c_proj.b", C)           # row-parallel, bias replicated
            add("ln_2.w", C, True), add("ln_2.b", C, True)
            add("c_fc.w", C * F // t), add("c_fc.b", F // t)                    # column-parallel
            add("mlp.c_proj.w", F // t * C), add("mlp.c_proj.b", C)             # row-parallel
        add("ln_f.w", C, True), add("ln_f.b", C, True)
        return out
    add("embed_tokens", Vl * C)
    for l in range(L):
        add("input_layernorm", C, True)
        add("q_proj", H * D // t * C), add("k_proj", KV * D // t * C), add("v_proj", KV * D // t * C)
        add("o_proj", C * H * D // t)
        add("post_attention_layernorm", C, True)
        if E:
            out.append(("router", E * C, "router"))  # replicated, token-partial; experts: their own buffer
        else:
            add("gate_proj", F // t * C), add("up_proj", F // t * C), add("down_proj", C * F // t)
    add("norm", C, True)
    if not tied:
        add("lm_head", Vl * C)
    return out


def buffer_layout(table, d, bucket_floats):
    """(offsets, buckets) of the gradient buffer (params.h): buckets formed from the end of the
    table, each closing once it holds >= bucket_floats (never splitting a tensor), laid out in
    table order, each padded at its end to a multiple of d."""
    firsts, filled = [], 0
    for i in reversed(range(len(table))):
        filled += table[i][1]
        if i == 0 or (bucket_floats > 0 and filled >= bucket_floats):
            firsts.append(i)
            filled = 0
    starts = sorted(firsts)
    offsets, buckets, off = [0] * len(table), [], 0
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(table)
        begin = off
        for i in range(s, e):
            offsets[i] = off
            off += table[i][1]
        off = begin + -(-(off - begin) // d) * d
        buckets.append((begin, off))
    return offsets, buckets


def local_params(cfg, t, experts=False):
    return sum(n for _, n, _ in local_table(cfg, t, experts))


def dp_terms(table, d, zero, m, bucket_floats):
    """Bytes of the gradient reduction of one buffer over d ranks, and rank 0's owned elements of
    each kind (the TP-partial gradients it reduces over tp)."""
    AR = lambda n, x: 2.0 * (n - 1) / n * F32 * x
    AG = lambda n, x: (n - 1) / n * F32 * x
    offsets, buckets = buffer_layout(table, d, bucket_floats)
    P_pad = sum(e - b for b, e in buckets)
    P = sum(n for _, n, _ in table)
    # rank 0's shard of every bucket: its first (length / d) elements
    shards = [(b, b + (e - b) // d) for b, e in buckets] if zero > 0 else [(0, P_pad)]
    owned = lambda kind: sum(max(0, min(o + n, se) - max(o, sb)) for (_, n, k), o in zip(table, offsets) if k == kind
                             for sb, se in shards)
    pad = " (%d buckets, padded from %d)" % (len(buckets), P) if P_pad != P or len(buckets) > 1 else ""
    if zero == 0:
        terms = [("AR(P=%d)%s" % (P_pad, pad), AR(d, P_pad))]
    elif zero == 1:
        terms = [("RS(P=%d)%s" % (P_pad, pad), AG(d, P_pad)), ("AG(P)", AG(d, P_pad))]
    else:
        terms = [("%d x RS(P=%d)%s" % (m, P_pad, pad), m * AG(d, P_pad)), ("AG(P)", AG(d, P_pad))]
    return terms, owned("norm"), owned("router")


def expected(cfg, tp, dp, sp, zero, m, bucket_mb=16.0):
    """{communicator: (bytes, [(term, bytes), ...])} for one step on rank 0."""
    V, C, L, H, KV, D, F, E, K, P, gpt2, tied = dims(cfg)
    N = MICRO * SEQ
    AR = lambda n, x: 2.0 * (n - 1) / n * F32 * x
    AG = lambda n, x: (n - 1) / n * F32 * x  # x: floats of the full buffer (also RS)
    bucket_floats = int(bucket_mb * 1024 * 1024 / 4)
    dense_terms, norm_elems, router_elems = dp_terms(local_table(cfg, tp), dp, zero, m, bucket_floats)
    out = {}
    if tp > 1:
        if E:
            terms = [("attention: L*2*AR(N*C)", m * L * 2 * AR(tp, N * C))]
            if not sp:
                terms.append(("MoE shares gathered fwd+bwd L*2*AG(N*C)", m * L * 2 * AG(tp, N * C)))
            terms.append(("MoE counts L*AR(E int64)", m * L * 2.0 * (tp - 1) / tp * 8 * E))
        else:
            terms = [("layers: L*4*AR(N*C)", m * L * 4 * AR(tp, N * C))]
        terms += [("embedding fwd AR(N*C)", m * AR(tp, N * C)),
                  ("LM-head bwd AR(N*C)", m * AR(tp, N * C)),
                  ("CE stats AG(t*3N)", m * AG(tp, tp * 3 * N))]
        if sp:
            terms.append(("SP norm outputs re-gathered in bwd L*%d*AG(N*C)" % (1 if E else 2),
                          m * L * (1 if E else 2) * AG(tp, N * C)))
        partial = (norm_elems if sp else 0) + router_elems
        if partial:
            terms.append(("TP-partial grads (%snorms) AR(%d)" % ("routers, " if router_elems else "", partial),
                          AR(tp, partial)))
        out["tp"] = terms
    if dp > 1:
        out["dp"] = dense_terms
    if E and tp * dp > 1:  # the experts' buffer over EDP = t·d
        out["edp"] = dp_terms(local_table(cfg, tp, True), tp * dp, zero, m, bucket_floats)[0]
    n = tp * dp
    if n > 1:
        out["world"] = [("AR_n(8*(2+5+L*E%s+7*PP%s))" % ("+2L" if E else "", "+2n" if E else ""),
                         2.0 * (n - 1) / n * 8 * (2 + 5 + L * E + (2 * L if E else 0) + 7 * 1 + (2 * n if E else 0)))]
    return {k: (sum(b for _, b in v), v) for k, v in out.items()}


def main():
    models = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else MODELS
    tmp = h.tmpdir()
    rows, failures = [], []
    try:
        data = h.prepare_data(tmp)
        for model in models:
            cases = LAYOUTS + (PAD_CASES if model == "gpt2" else [])
            for name, ranks, tp, sp, zero, m, extra, changes in cases:
                cfg = h.load_config(model + "_tiny", **(changes or {}))
                cfg_path = h.write_json(os.path.join(tmp, "%s_%s.json" % (model, "pad" if changes else "cfg")), cfg)
                dp = ranks // tp
                G = dp * MICRO * m
                mpath = os.path.join(tmp, "%s_%s.jsonl" % (model, "".join(c if c.isalnum() else "_" for c in name)))
                flags = ["--tp", str(tp)] + (["--sequence-parallel"] if sp else []) + ["--zero", str(zero)] + extra
                args = ["train", "--config", cfg_path, "--data", data, "--steps", "1", "--seq-len", str(SEQ),
                        "--micro-batch", str(MICRO), "--global-batch", str(G), "--threads", "1", "--quiet",
                        "--metrics", mpath, *flags]
                rc, out, wall = h.run(ranks, args, timeout=120)
                bucket_mb = float(extra[extra.index("--bucket-mb") + 1]) if "--bucket-mb" in extra else 16.0
                exp = expected(cfg, tp, dp, sp, zero, m, bucket_mb)
                # The formula's global parameter count is the one origami prints.
                printed = [int(w) for line in out.splitlines() if line.startswith("origami train:")
                           for w, nxt in zip(line.split(), line.split()[1:]) if nxt.startswith("parameters")]
                total = local_params(cfg, 1) + local_params(cfg, 1, True)
                if rc == 0 and printed != [total]:
                    failures.append("%s %s: origami printed %s parameters, the table here gives %d"
                                    % (model, name, printed, total))
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
                    print("FAIL  %-8s %-30s exit %s: %s" % (model, name, rc, err), flush=True)
                    continue
                bad = False
                for comm in sorted(set(exp) | set(got)):
                    e_bytes, terms = exp.get(comm, (0.0, []))
                    g_bytes = got.get(comm, 0)
                    ok = round(e_bytes) == round(g_bytes)
                    bad |= not ok
                    detail = " + ".join("%s %.0f" % (n, b) for n, b in terms)
                    rows.append((model, name, comm, "%.0f" % e_bytes, "%.0f" % g_bytes,
                                 "ok" if ok else "FAIL (diff %+.0f)" % (g_bytes - e_bytes), detail))
                    if not ok:
                        failures.append("%s %s %s: expected %.0f bytes (%s), metrics say %.0f (diff %+.0f)"
                                        % (model, name, comm, e_bytes, detail, g_bytes, g_bytes - e_bytes))
                print("%-5s %-8s %-30s %s  (%.1f s)" % ("FAIL" if bad else "ok", model, name, json.dumps(got), wall),
                      flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("comm_bytes of one step on rank 0 vs the analytic formula (N = B*T = %d tokens per micro-batch):"
          % (MICRO * SEQ))
    print(h.fmt_table(("model", "layout", "comm", "expected", "metrics", "status", "terms"), rows))
    h.report(failures, "all tp, dp and world byte counts equal the formulas exactly")


if __name__ == "__main__":
    main()
