"""origami's whole-model oracle: an independent PyTorch implementation.

Plain functional torch (no transformers in the model code). Model types gpt2, llama,
mixtral and qwen2_moe. A model is (config dict, ordered dict {HF parameter name: tensor});
`forward` returns logits and the router logits of every MoE layer; `losses` turns those into
lm_loss / aux_loss / z_loss / loss exactly as DESIGN.md and the engine spec define.
MoE routing options (origami's --moe-* flags: capacity and drop policy, aux-loss variant,
sigmoid scores, balancing biases) are a dict, see ROUTING_DEFAULTS and `route`.

Also here: safetensors load/save with Hugging Face names, a reader of Megatron
indexed datasets (.bin/.idx), the byte tokenizer's document split, the sequential window sampler, AdamW + global-norm
clipping + LR schedule, and thin wrappers that run the `origami` binary.

Everything is written to run in float64 (the strong oracle) or float32.
`gemm_precision("bf16")` rounds the linear-layer GEMMs as origami's --precision bf16 does.

Size legend: B batch rows, T sequence, N = B*T tokens, C hidden, H query heads,
KV key/value heads, D head dim, V vocab, E experts, K experts per token, I MLP width.
"""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import tempfile
from collections import OrderedDict

import numpy as np
import torch

# --------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------


def load_config(path):
    with open(path) as f:
        return json.load(f)


def model_type(cfg):
    mt = cfg.get("model_type")
    if mt not in ("gpt2", "llama", "mixtral", "qwen2_moe"):
        raise ValueError(f"unsupported model_type {mt!r}")
    return mt


# Hugging Face's defaults for fields a llama-like config leaves out: (kv heads or None for as many as the
# heads, rms_norm_eps, rope_theta) of LlamaConfig, MixtralConfig and Qwen2MoeConfig.
_LLAMA_LIKE_DEFAULTS = {"llama": (None, 1e-6, 10000.0), "mixtral": (8, 1e-5, 1e6), "qwen2_moe": (16, 1e-6, 10000.0)}


def _default(cfg, key):
    kv, eps, theta = _LLAMA_LIKE_DEFAULTS[model_type(cfg)]
    return cfg.get(key, {"num_key_value_heads": kv, "rms_norm_eps": eps, "rope_theta": theta}[key])


def _dims(cfg):
    """(C, H, KV, D, L) for any supported model type."""
    if model_type(cfg) == "gpt2":
        C, H = cfg["n_embd"], cfg["n_head"]
        return C, H, H, C // H, cfg["n_layer"]
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    KV = _default(cfg, "num_key_value_heads") or H
    D = cfg.get("head_dim") or C // H
    return C, H, KV, D, cfg["num_hidden_layers"]


def tied(cfg):
    # HF default: GPT-2 ties, Llama/Mixtral configs carry tie_word_embeddings explicitly,
    # Qwen2-MoE defaults to untied
    return bool(cfg.get("tie_word_embeddings", model_type(cfg) == "gpt2"))


def num_experts(cfg):
    """E of the MoE layers (0 for dense models)."""
    mt = model_type(cfg)
    if mt == "mixtral":
        return cfg["num_local_experts"]
    if mt == "qwen2_moe":
        return cfg.get("num_experts", 0)
    return 0


def moe_layers(cfg):
    """Indices of the layers whose MLP is a sparse MoE block."""
    mt = model_type(cfg)
    L = _dims(cfg)[4]
    if mt == "mixtral":
        return list(range(L))
    if mt == "qwen2_moe":
        only = cfg.get("mlp_only_layers") or []
        step = cfg.get("decoder_sparse_step", 1)
        E = num_experts(cfg)
        return [l for l in range(L) if l not in only and E > 0 and (l + 1) % step == 0]
    return []


def moe_prefix(cfg):
    """Name of the MoE block inside a layer: Mixtral `block_sparse_moe.`, Qwen2-MoE `mlp.`."""
    return "block_sparse_moe." if model_type(cfg) == "mixtral" else "mlp."


def renormalise_topk(cfg, score="softmax"):
    """Whether the K selected weights are divided by their sum."""
    if score == "sigmoid" or model_type(cfg) == "mixtral":
        return True
    return bool(cfg.get("norm_topk_prob", False))


# --------------------------------------------------------------------------------------
# parameter table (HF names, HF shapes)
# --------------------------------------------------------------------------------------


def param_shapes(cfg):
    """OrderedDict {HF name: shape}. GPT-2 names carry no `transformer.` prefix."""
    mt = model_type(cfg)
    C, H, KV, D, L = _dims(cfg)
    V = cfg["vocab_size"]
    s = OrderedDict()
    if mt == "gpt2":
        I = cfg.get("n_inner") or 4 * C
        s["wte.weight"] = (V, C)
        s["wpe.weight"] = (cfg["n_positions"], C)
        for l in range(L):
            p = f"h.{l}."
            s[p + "ln_1.weight"] = (C,)
            s[p + "ln_1.bias"] = (C,)
            s[p + "attn.c_attn.weight"] = (C, 3 * C)   # Conv1D: [in, out]
            s[p + "attn.c_attn.bias"] = (3 * C,)
            s[p + "attn.c_proj.weight"] = (C, C)
            s[p + "attn.c_proj.bias"] = (C,)
            s[p + "ln_2.weight"] = (C,)
            s[p + "ln_2.bias"] = (C,)
            s[p + "mlp.c_fc.weight"] = (C, I)
            s[p + "mlp.c_fc.bias"] = (I,)
            s[p + "mlp.c_proj.weight"] = (I, C)
            s[p + "mlp.c_proj.bias"] = (C,)
        s["ln_f.weight"] = (C,)
        s["ln_f.bias"] = (C,)
        if not tied(cfg):
            s["lm_head.weight"] = (V, C)
        return s
    I = cfg["intermediate_size"]
    qkv_bias = mt == "qwen2_moe"
    moe = set(moe_layers(cfg))
    s["model.embed_tokens.weight"] = (V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        s[p + "input_layernorm.weight"] = (C,)
        s[p + "self_attn.q_proj.weight"] = (H * D, C)   # nn.Linear: [out, in]
        if qkv_bias:
            s[p + "self_attn.q_proj.bias"] = (H * D,)
        s[p + "self_attn.k_proj.weight"] = (KV * D, C)
        if qkv_bias:
            s[p + "self_attn.k_proj.bias"] = (KV * D,)
        s[p + "self_attn.v_proj.weight"] = (KV * D, C)
        if qkv_bias:
            s[p + "self_attn.v_proj.bias"] = (KV * D,)
        s[p + "self_attn.o_proj.weight"] = (C, H * D)
        s[p + "post_attention_layernorm.weight"] = (C,)
        if l not in moe:
            s[p + "mlp.gate_proj.weight"] = (I, C)
            s[p + "mlp.up_proj.weight"] = (I, C)
            s[p + "mlp.down_proj.weight"] = (C, I)
        elif mt == "mixtral":
            E = cfg["num_local_experts"]
            s[p + "block_sparse_moe.gate.weight"] = (E, C)
            for e in range(E):
                q = p + f"block_sparse_moe.experts.{e}."
                s[q + "w1.weight"] = (I, C)
                s[q + "w2.weight"] = (C, I)
                s[q + "w3.weight"] = (I, C)
        else:   # qwen2_moe sparse block: routed experts + sigmoid-gated shared expert
            E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]
            Is = cfg["shared_expert_intermediate_size"]
            s[p + "mlp.gate.weight"] = (E, C)
            for e in range(E):
                q = p + f"mlp.experts.{e}."
                s[q + "gate_proj.weight"] = (Im, C)
                s[q + "up_proj.weight"] = (Im, C)
                s[q + "down_proj.weight"] = (C, Im)
            s[p + "mlp.shared_expert.gate_proj.weight"] = (Is, C)
            s[p + "mlp.shared_expert.up_proj.weight"] = (Is, C)
            s[p + "mlp.shared_expert.down_proj.weight"] = (C, Is)
            s[p + "mlp.shared_expert_gate.weight"] = (1, C)
    s["model.norm.weight"] = (C,)
    if not tied(cfg):
        s["lm_head.weight"] = (V, C)
    return s


def exact_zero_grad_mask(cfg, name, shape):
    """Elements whose gradient is identically zero in exact arithmetic, or None.
    GPT-2's key bias: q·(k + b) adds the same q·b to every score of a query, and softmax is
    shift-invariant, so d loss / d b_k = 0. An engine's fp32 round-off there is pure noise
    that Adam (update ~ g/(|g|+eps)) turns into visible steps, so weight comparisons after
    optimizer steps must leave these elements out."""
    if model_type(cfg) == "gpt2" and name.endswith("attn.c_attn.bias"):
        C = cfg["n_embd"]
        m = torch.zeros(shape, dtype=torch.bool)
        m[C:2 * C] = True
        return m
    return None


def init_params(cfg, seed=1234, dtype=torch.float32):
    """Seeded init chosen to make the oracle sensitive: activations of unit scale reach the
    non-linear part of GELU/SiLU and attention is far from uniform (with GPT-2's 0.02 init,
    erf-GELU vs tanh-GELU or a wrong attention scale would hide under 1e-4).
    Matrices N(0, 1/fan_in); embeddings N(0, 0.3); Mixtral's router N(0, 4/C) so top-k routing
    is decisive (Qwen2-MoE's router and shared-expert gate are plain N(0, 1/C) matrices);
    norm weights N(1, 0.1) and biases N(0, 0.1) so their gradients are tested."""
    g = torch.Generator().manual_seed(seed)
    out = OrderedDict()
    gpt2 = model_type(cfg) == "gpt2"
    for name, shape in param_shapes(cfg).items():
        r = torch.randn(shape, generator=g, dtype=torch.float64)
        if len(shape) == 1 and ("ln_" in name or "norm" in name) and name.endswith("weight"):
            t = 1.0 + 0.1 * r
        elif len(shape) == 1:
            t = 0.1 * r
        elif name in ("wte.weight", "wpe.weight", "model.embed_tokens.weight"):
            t = 0.3 * r
        elif name.endswith("block_sparse_moe.gate.weight"):
            t = 2.0 / math.sqrt(shape[1]) * r
        else:
            fan_in = shape[0] if gpt2 else shape[1]   # Conv1D [in, out]; Linear [out, in]
            t = r / math.sqrt(fan_in)
        out[name] = t.to(dtype).contiguous()
    return out


def save_params(params, path):
    from safetensors.torch import save_file
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in params.items()}, path,
              metadata={"format": "pt"})  # HF from_pretrained requires the format tag


def load_safetensors(path):
    from safetensors.torch import load_file
    return OrderedDict(load_file(path))


def load_params(cfg, path, dtype=torch.float64):
    """Loads a checkpoint and checks it holds exactly the parameter table (shapes too).
    A `transformer.` prefix (HF's GPT-2 save format) is stripped; a tied lm_head is dropped."""
    raw = load_safetensors(path)
    shapes = param_shapes(cfg)
    params = OrderedDict()
    fixed = {}
    for k, v in raw.items():
        if model_type(cfg) == "gpt2" and k.startswith("transformer."):
            k = k[len("transformer."):]
        if k == "lm_head.weight" and tied(cfg):
            continue
        fixed[k] = v
    missing = [k for k in shapes if k not in fixed]
    extra = [k for k in fixed if k not in shapes]
    if missing or extra:
        raise ValueError(f"{path}: missing {missing[:5]} extra {extra[:5]}")
    for k, shape in shapes.items():
        if tuple(fixed[k].shape) != tuple(shape):
            raise ValueError(f"{path}: {k} has shape {tuple(fixed[k].shape)}, expected {shape}")
        params[k] = fixed[k].to(dtype).contiguous()
    return params


def write_hf_dir(cfg, params, directory):
    """config.json + model.safetensors, loadable by transformers' from_pretrained."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_params(params, os.path.join(directory, "model.safetensors"))


# --------------------------------------------------------------------------------------
# model math
# --------------------------------------------------------------------------------------


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)   # biased variance
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x * torch.sigmoid(x)


def document_layout(tok_BT, eod):
    """Document masking (Megatron's reset_attention_mask + reset_position_ids): the token after each
    `eod` starts a new document. Returns (doc [B,T] document index of each position, pos [B,T]
    position id counted from its document's first token); eod None: one document, pos = t."""
    B, T = tok_BT.shape
    if eod is None:
        return torch.zeros(B, T, dtype=torch.long), torch.arange(T).expand(B, T)
    starts = torch.zeros(B, T, dtype=torch.long)
    starts[:, 1:] = (tok_BT[:, :-1] == eod).long()
    doc = starts.cumsum(1)
    t = torch.arange(T).expand(B, T)
    first = torch.zeros(B, T, dtype=torch.long)  # each position's document start
    for b in range(B):
        for i in range(1, T):
            first[b, i] = i if starts[b, i] else first[b, i - 1]
    return doc, t - first


def attention_mask(T, doc_BT=None):
    """[T, T] (or [B, 1, T, T] with documents): key j visible to query i."""
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if doc_BT is not None:
        mask = mask & (doc_BT[:, None, :, None] == doc_BT[:, None, None, :])
    return mask


def causal_attention(q_BHTD, k_BHTD, v_BHTD, doc_BT=None):
    """Softmax attention of each query over the keys at or before it (and, with doc_BT, in the
    same document: a block-diagonal causal mask). In bf16 mode with origami's rounding points
    (Bf16Attention)."""
    mask = attention_mask(q_BHTD.shape[-2], doc_BT)
    if _GEMM_PRECISION == "bf16":
        return Bf16Attention.apply(q_BHTD, k_BHTD, v_BHTD, mask)
    return softmax_attention(q_BHTD, k_BHTD, v_BHTD, mask)


def softmax_attention(q_BHTD, k_BHTD, v_BHTD, mask):
    """softmax(q kᵀ / √D, keys where mask) v in the working dtype."""
    att = q_BHTD @ k_BHTD.transpose(-1, -2) / math.sqrt(q_BHTD.shape[-1])
    att = att.masked_fill(~mask, float("-inf"))
    return torch.softmax(att, dim=-1) @ v_BHTD


class Bf16Attention(torch.autograd.Function):
    """The attention core as origami's --precision bf16 computes it (model/layers/attention.h),
    FlashAttention-2's rounding points: q, k, v rounded to bf16; scores, softmax and log-sum-exp in
    the working dtype; the probabilities rounded for P·V, relative to c = ln2·ceil(rowmax/ln2), a
    power of two (bf16 rounding commutes with 2^n, so origami's running reference, whichever keys
    it has seen, rounds them alike); the output normalised by the sum of the rounded
    probabilities. Backward: P = exp(S - lse) unrounded, dv = bf16(P)^T bf16(do),
    dP = bf16(do) v^T, dS = P∘(dP - Σ do∘o) with do unrounded there, dq = bf16(dS) k / √D,
    dk = bf16(dS)^T q / √D. Rounding is the identity for the gradients' flow (as Bf16Matmul)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        scale = 1.0 / math.sqrt(q.shape[-1])
        qb, kb, vb = bf16_round(q), bf16_round(k), bf16_round(v)
        s = (qb @ kb.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        c = math.log(2.0) * torch.ceil(s.amax(-1, keepdim=True) / math.log(2.0))
        p = bf16_round(torch.exp(s - c))
        rows = p.sum(-1, keepdim=True)
        o = (p @ vb) / rows
        lse = c + torch.log(rows)
        ctx.save_for_backward(qb, kb, vb, o, lse, mask)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        qb, kb, vb, o, lse, mask = ctx.saved_tensors
        scale = ctx.scale
        dob = bf16_round(do)
        s = (qb @ kb.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        P = torch.exp(s - lse)
        dv = bf16_round(P).transpose(-1, -2) @ dob
        dP = dob @ vb.transpose(-1, -2)
        dS = P * (dP - (do * o).sum(-1, keepdim=True))
        dSb = bf16_round(dS)
        return dSb @ kb * scale, dSb.transpose(-1, -2) @ qb * scale, dv, None


def rope_cos_sin(T, D, theta, dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))   # [D/2]
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]      # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)                                          # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x_BHTD, cos, sin):
    return x_BHTD * cos + rotate_half(x_BHTD) * sin


# --------------------------------------------------------------------------------------
# linear-layer GEMMs and their precision (origami's --precision)
# --------------------------------------------------------------------------------------

# "fp32": every GEMM exact in the working dtype (float64 or float32). "bf16": the linear-layer
# GEMMs (those that go through `gemm`) round as origami's --precision bf16 does, see Bf16Matmul,
# and so does the output of a dense MLP's (and the shared expert's) up projection, which origami
# keeps for backward in bf16 (`kept`), and the attention core's products (Bf16Attention).
# Everything else (embedding lookup, norms, RoPE, the softmax, activations, router and
# shared-expert gate, losses, optimizer) stays in the working dtype.
# Set with `gemm_precision`.
_GEMM_PRECISION = "fp32"


class gemm_precision:
    """Context manager: `with gemm_precision("bf16"): ...` (restores the previous mode)."""

    def __init__(self, precision):
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r}")
        self.precision = precision

    def __enter__(self):
        global _GEMM_PRECISION
        self.saved, _GEMM_PRECISION = _GEMM_PRECISION, self.precision

    def __exit__(self, *exc):
        global _GEMM_PRECISION
        _GEMM_PRECISION = self.saved


def bf16_round(t):
    """bf16(t): round to nearest even bfloat16, back in t's dtype. torch takes float64 to bf16
    through float32; that double rounding differs from a direct one only within half a float32
    ulp of a bf16 tie, well inside the engine's own float32 difference from the float64 value."""
    return t.to(torch.bfloat16).to(t.dtype)


class Bf16Matmul(torch.autograd.Function):
    """y = bf16(x) @ bf16(w), products exact, accumulated in the working dtype.
    Backward rounds the whole output gradient once, g = bf16(dy) (a bias added after the GEMM
    gets the unrounded dy through autograd), then dx = g @ bf16(w)^T and dw = bf16(x)^T g.
    x [..., K], w [K, M] (may be a transposed view; autograd transposes dw back)."""

    @staticmethod
    def forward(ctx, x, w):
        xb, wb = bf16_round(x), bf16_round(w)
        ctx.save_for_backward(xb, wb)
        # As torch's own mm backward: a column-major w (a transposed nn.Linear weight) gets dw as
        # (gᵀ x)ᵀ, so with the rounding off this mode repeats autograd's sums exactly, whichever
        # summation order the BLAS gives each form.
        ctx.w_column_major = w.dim() == 2 and w.stride(0) == 1 and w.size(0) > 1
        return xb @ wb

    @staticmethod
    def backward(ctx, dy):
        xb, wb = ctx.saved_tensors
        g = bf16_round(dy)
        dx = g @ wb.t() if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:   # sum over every leading (batch) dimension of x
            x2, g2 = xb.reshape(-1, xb.shape[-1]), g.reshape(-1, g.shape[-1])
            dw = (g2.t() @ x2).t() if ctx.w_column_major else x2.t() @ g2
        return dx, dw


class Bf16Kept(torch.autograd.Function):
    """bf16(x) forward, the gradient unchanged: an activation kept for backward in bf16, which the
    math after it reads (forward and backward alike) as rounded."""

    @staticmethod
    def forward(ctx, x):
        return bf16_round(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def kept(x):
    """An MLP up projection's output as origami keeps it: rounded to bf16 in bf16 mode."""
    return Bf16Kept.apply(x) if _GEMM_PRECISION == "bf16" else x


def gemm(x, w):
    """x @ w for every linear layer (qkv, attention out, MLP / expert up, gate and down, LM head):
    w is [in, out] (pass W.t() for nn.Linear weights); rounds per the current gemm_precision."""
    return Bf16Matmul.apply(x, w) if _GEMM_PRECISION == "bf16" else x @ w


def _gpt2_forward(cfg, P, tok_BT, eod=None):
    B, T = tok_BT.shape
    C, H, _, D, L = _dims(cfg)
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    doc, pos = document_layout(tok_BT, eod)
    x = P["wte.weight"][tok_BT] + P["wpe.weight"][pos]
    for l in range(L):
        p = f"h.{l}."
        h = layer_norm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
        qkv = gemm(h, P[p + "attn.c_attn.weight"]) + P[p + "attn.c_attn.bias"]    # [B,T,3C]
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v, doc if eod is not None else None).transpose(1, 2).reshape(B, T, C)
        x = x + gemm(y, P[p + "attn.c_proj.weight"]) + P[p + "attn.c_proj.bias"]
        h = layer_norm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
        h = gelu_tanh(kept(gemm(h, P[p + "mlp.c_fc.weight"]) + P[p + "mlp.c_fc.bias"]))
        x = x + gemm(h, P[p + "mlp.c_proj.weight"]) + P[p + "mlp.c_proj.bias"]
    x = layer_norm(x, P["ln_f.weight"], P["ln_f.bias"], eps)
    head = P["wte.weight"] if tied(cfg) else P["lm_head.weight"]
    return gemm(x, head.t()), []


def _linear(P, name, x):
    """x @ W^T (+ b when the table holds `<name>.bias`)."""
    y = gemm(x, P[name + ".weight"].t())
    b = P.get(name + ".bias")
    return y if b is None else y + b


def _llama_attention(cfg, P, p, h, cos, sin, doc=None):
    B, T, _ = h.shape
    C, H, KV, D, _ = _dims(cfg)
    q = _linear(P, p + "self_attn.q_proj", h).reshape(B, T, H, D).transpose(1, 2)
    k = _linear(P, p + "self_attn.k_proj", h).reshape(B, T, KV, D).transpose(1, 2)
    v = _linear(P, p + "self_attn.v_proj", h).reshape(B, T, KV, D).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # GQA: query head h reads kv head h // (H / KV)
    rep = H // KV
    kv_of_head = torch.arange(H) // rep
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    y = causal_attention(q, k, v, doc).transpose(1, 2).reshape(B, T, H * D)
    return gemm(y, P[p + "self_attn.o_proj.weight"].t())


def swiglu(x, w_gate, w_up, w_down, keep=lambda t: t):
    """down(silu(x gate^T) * (x up^T)), nn.Linear weights; keep: how the up projections' outputs
    are kept (`kept` for the dense MLPs and the shared expert, not the routed experts)."""
    return gemm(silu(keep(gemm(x, w_gate.t()))) * keep(gemm(x, w_up.t())), w_down.t())


# --------------------------------------------------------------------------------------
# MoE routing
# --------------------------------------------------------------------------------------

# Options of the MoE layers (origami's --moe-* flags). The defaults are the plain
# dropless top-K softmax routing with the per-micro-batch aux loss.
ROUTING_DEFAULTS = {
    "capacity_factor": 0.0,     # F > 0: cap = ceil((N*K/E)*F) in floats (Megatron's); 0 dropless
    "drop_policy": "probs",     # probs: keep the highest p[n,e] (ties: lower n); position: lowest n
    "pad_to_capacity": False,   # no effect on the math
    "aux": "micro",             # none | micro | seq | global
    "aux_coef": None,           # None: the config's router_aux_loss_coef
    "score": "softmax",         # softmax | sigmoid
    "bias_update_rate": 0.0,    # R > 0: aux-free balancing biases (selection only), train only
}


def routing_options(cfg, routing=None):
    """The routing dict completed with the defaults (and checked). Idempotent."""
    o = dict(ROUTING_DEFAULTS)
    if routing:
        bad = [k for k in routing if k not in ROUTING_DEFAULTS]
        if bad:
            raise ValueError(f"unknown routing options {bad}")
        o.update(routing)
    if o["aux_coef"] is None:
        o["aux_coef"] = cfg.get("router_aux_loss_coef", 0.0)
    if o["drop_policy"] not in ("probs", "position"):
        raise ValueError(f"drop_policy {o['drop_policy']!r}")
    if o["aux"] not in ("none", "micro", "seq", "global"):
        raise ValueError(f"aux {o['aux']!r}")
    if o["score"] not in ("softmax", "sigmoid"):
        raise ValueError(f"score {o['score']!r}")
    if o["capacity_factor"] < 0 or o["bias_update_rate"] < 0:
        raise ValueError("capacity_factor and bias_update_rate must be >= 0")
    return o


def expert_capacity(opts, N, K, E):
    """Megatron's get_capacity: ceil((N*K/E) * F) in floats, or None (dropless)."""
    F = opts["capacity_factor"]
    if not F or F <= 0:
        return None
    return math.ceil((N * K / E) * F)


def router_scores(logits_NE, score):
    return torch.softmax(logits_NE, dim=-1) if score == "softmax" else torch.sigmoid(logits_NE)


def route(cfg, opts, logits_NE, bias_E=None):
    """Routing decisions of one MoE layer on one routing group of N tokens.
    Returns a dict:
      logits [N,E], p [N,E] (score, differentiable), top_i [N,K] (selection of p + bias,
      ties to the lower expert), w [N,K] (routing weights, differentiable; renormalised
      per renormalise_topk), kept [N,K] bool (capacity), counts [E] (assignments before
      dropping), dropped (int), cap (int or None)."""
    N, E = logits_NE.shape
    K = cfg["num_experts_per_tok"]
    p = router_scores(logits_NE, opts["score"])
    sel = p.detach().clone()
    if bias_E is not None:
        sel = sel + torch.as_tensor(bias_E, dtype=sel.dtype)
    top_i = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :K]
    w = p.gather(1, top_i)
    if renormalise_topk(cfg, opts["score"]):
        w = w / (w.sum(-1, keepdim=True) + SCORE_SUM_FLOOR)
    counts = torch.bincount(top_i.reshape(-1), minlength=E)
    kept = torch.ones(N, K, dtype=torch.bool)
    cap = expert_capacity(opts, N, K, E)
    if cap is not None:
        pd = p.detach()
        for e in range(E):
            n_idx, k_idx = torch.nonzero(top_i == e, as_tuple=True)   # n ascending
            if n_idx.numel() <= cap:
                continue
            if opts["drop_policy"] == "probs":
                order = torch.sort(pd[n_idx, e], descending=True, stable=True).indices
            else:
                order = torch.arange(n_idx.numel())
            drop = order[cap:]
            kept[n_idx[drop], k_idx[drop]] = False
    return {"logits": logits_NE, "p": p, "top_i": top_i, "w": w, "kept": kept,
            "counts": counts, "dropped": int((~kept).sum()), "cap": cap}


def _moe(cfg, P, p, h_BTC, opts=None, bias_E=None):
    """Sparse MoE block (Mixtral, or Qwen2-MoE with its shared expert).
    Returns (output [B,T,C], route dict of `route` plus B and T)."""
    opts = routing_options(cfg, opts)
    B, T, C = h_BTC.shape
    E = num_experts(cfg)
    mix = model_type(cfg) == "mixtral"
    q0 = p + moe_prefix(cfg)
    x = h_BTC.reshape(B * T, C)
    # the router (here) and the shared-expert gate (below) are plain @: origami keeps them fp32
    r = route(cfg, opts, x @ P[q0 + "gate.weight"].t(), bias_E)
    top_i, w = r["top_i"], r["w"]
    out = torch.zeros_like(x)
    for e in range(E):
        rows, slot = torch.nonzero((top_i == e) & r["kept"], as_tuple=True)
        if rows.numel() == 0:
            continue
        q = q0 + f"experts.{e}."
        if mix:
            ye = swiglu(x[rows], P[q + "w1.weight"], P[q + "w3.weight"], P[q + "w2.weight"])
        else:
            ye = swiglu(x[rows], P[q + "gate_proj.weight"], P[q + "up_proj.weight"], P[q + "down_proj.weight"])
        out = out.index_add(0, rows, ye * w[rows, slot][:, None])
    if not mix:
        q = q0 + "shared_expert."
        shared = swiglu(x, P[q + "gate_proj.weight"], P[q + "up_proj.weight"], P[q + "down_proj.weight"], kept)
        out = out + torch.sigmoid(x @ P[q0 + "shared_expert_gate.weight"].t()) * shared
    r["B"], r["T"] = B, T
    return out.reshape(B, T, C), r


def _llama_forward(cfg, P, tok_BT, opts=None, router_bias=None, eod=None):
    B, T = tok_BT.shape
    C, H, KV, D, L = _dims(cfg)
    eps = _default(cfg, "rms_norm_eps")
    x = P["model.embed_tokens.weight"][tok_BT]
    cos, sin = rope_cos_sin(T, D, _default(cfg, "rope_theta"), x.dtype)
    doc = None
    if eod is not None:  # per-token positions: tables [B, 1, T, D] broadcast over heads
        doc, pos = document_layout(tok_BT, eod)
        cos, sin = cos[pos][:, None], sin[pos][:, None]
    moe = set(moe_layers(cfg))
    routes = []
    for l in range(L):
        p = f"model.layers.{l}."
        x = x + _llama_attention(cfg, P, p, rms_norm(x, P[p + "input_layernorm.weight"], eps), cos, sin, doc)
        h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
        if l not in moe:
            x = x + swiglu(h, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                           P[p + "mlp.down_proj.weight"], kept)
        else:
            y, r = _moe(cfg, P, p, h, opts, None if router_bias is None else router_bias[l])
            r["layer"] = l
            routes.append(r)
            x = x + y
    x = rms_norm(x, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if tied(cfg) else P["lm_head.weight"]
    return gemm(x, head.t()), routes


def forward_routes(cfg, params, tok_BT, routing=None, router_bias=None, eod=None):
    """(logits [B,T,V], list of route dicts, one per MoE layer). router_bias: indexable by
    layer index ([L][E]; rows of dense layers unused) or None (zeros). eod: document masking's
    end-of-document id (document_layout), None: causal over the whole row."""
    if model_type(cfg) == "gpt2":
        return _gpt2_forward(cfg, params, tok_BT, eod)
    return _llama_forward(cfg, params, tok_BT, routing_options(cfg, routing), router_bias, eod)


def forward(cfg, params, tok_BT, routing=None, router_bias=None, eod=None):
    """Returns (logits [B,T,V], list of router logits [N,E] per MoE layer)."""
    logits, routes = forward_routes(cfg, params, tok_BT, routing, router_bias, eod)
    return logits, [r["logits"] for r in routes]


# Added to a sum of router scores before dividing by it, as origami does (DeepSeek-V3's 1e-20): sigmoid
# scores of logits below about -88 are exactly 0 in fp32.
SCORE_SUM_FLOOR = 1e-20


def _aux_probs(p_NE, score):
    """Probabilities entering the aux loss: softmax as is, sigmoid scores normalised per token."""
    return p_NE if score == "softmax" else p_NE / (p_NE.sum(-1, keepdim=True) + SCORE_SUM_FLOOR)


def router_losses(cfg, routes, routing=None, prev_counts=None, micro_index=0):
    """(aux_loss, z_loss) summed over MoE layers and scaled by their coefficients.
    micro:  aux_l = E * sum_e f_e * P_e, f_e = c_e / (N*K) (no gradient), P_e = mean_n pa_ne;
    seq:    E * (1/B) sum_b sum_e f_be P_be over each row's T tokens;
    global: f_e replaced by the running average over the step's micro-batches 0..m
            ((prev_counts[l] + c_e) / ((m+1) N K), prev_counts [L][E] summed over 0..m-1);
    z_l = mean_n logsumexp_e(logits_ne)^2.
    `routes` may also be a plain list of router logits (default routing)."""
    if not routes:
        return None, None
    opts = routing_options(cfg, routing)
    if not isinstance(routes[0], dict):
        routes = [route(cfg, opts, rl) for rl in routes]
        for r in routes:
            r["B"], r["T"] = 1, r["logits"].shape[0]
    E, K = num_experts(cfg), cfg["num_experts_per_tok"]
    aux = 0.0
    z = 0.0
    for i, r in enumerate(routes):
        p = r["p"]
        N = p.shape[0]
        pa = _aux_probs(p, opts["score"])
        c = r["counts"].to(p.dtype)
        if opts["aux"] == "micro":
            aux = aux + E * (c / (N * K) * pa.mean(0)).sum()
        elif opts["aux"] == "seq":
            B, T = r["B"], r["T"]
            onehot = torch.nn.functional.one_hot(r["top_i"], E).sum(1).to(p.dtype)   # [N,E]
            c_BE = onehot.reshape(B, T, E).sum(1)
            P_BE = pa.reshape(B, T, E).mean(1)
            aux = aux + E * (c_BE / (T * K) * P_BE).sum() / B
        elif opts["aux"] == "global":
            prev = 0.0
            if prev_counts is not None:
                prev = torch.as_tensor(prev_counts[r.get("layer", i)], dtype=p.dtype)
            fbar = (prev + c) / ((micro_index + 1) * N * K)
            aux = aux + E * (fbar * pa.mean(0)).sum()
        z = z + (torch.logsumexp(r["logits"], dim=-1) ** 2).mean()
    if opts["aux"] == "none":
        aux = torch.zeros((), dtype=routes[0]["p"].dtype)
    return opts["aux_coef"] * aux, cfg.get("router_z_loss_coef", 0.0) * z


def losses(cfg, params, inp_BT, tgt_BT, routing=None, router_bias=None, prev_counts=None,
           micro_index=0, eod=None):
    """dict: logits, lm_loss, aux_loss, z_loss, loss (tensors, differentiable), router_logits,
    routes, expert_tokens [L,E] (assignments before dropping), expert_dropped [L]."""
    logits, routes = forward_routes(cfg, params, inp_BT, routing, router_bias, eod)
    V = logits.shape[-1]
    lm = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt_BT.reshape(-1))
    aux, z = router_losses(cfg, routes, routing, prev_counts, micro_index)
    if aux is None:
        aux = torch.zeros((), dtype=lm.dtype)
        z = torch.zeros((), dtype=lm.dtype)
    L, E = _dims(cfg)[4], num_experts(cfg)
    tokens = torch.zeros(L, E, dtype=torch.long)
    dropped = [0] * L
    for r in routes:
        tokens[r["layer"]] = r["counts"]
        dropped[r["layer"]] = r["dropped"]
    return {"logits": logits, "lm_loss": lm, "aux_loss": aux, "z_loss": z,
            "loss": lm + aux + z, "router_logits": [r["logits"] for r in routes], "routes": routes,
            "expert_tokens": tokens, "expert_dropped": dropped}


def _bias_rows(cfg, router_logits, router_bias):
    layers = moe_layers(cfg)
    return [None if router_bias is None else router_bias[l] for l in layers[:len(router_logits)]]


def min_topk_gap(cfg, router_logits, routing=None, router_bias=None):
    """Smallest gap between the K-th and (K+1)-th selection score (score p, plus the
    balancing bias) over all tokens and MoE layers: if tiny, fp32 and fp64 may legitimately
    route differently. router_logits: one [N,E] per MoE layer (as `forward` returns)."""
    if not router_logits:
        return float("inf")
    opts = routing_options(cfg, routing)
    K = cfg["num_experts_per_tok"]
    gaps = []
    for rl, b in zip(router_logits, _bias_rows(cfg, router_logits, router_bias)):
        sel = router_scores(rl.detach(), opts["score"])
        if b is not None:
            sel = sel + torch.as_tensor(b, dtype=sel.dtype)
        sel = sel.sort(-1, descending=True).values
        if sel.shape[1] > K:
            gaps.append((sel[:, K - 1] - sel[:, K]).min().item())
    return min(gaps) if gaps else float("inf")


def min_capacity_gap(cfg, router_logits, routing=None, router_bias=None):
    """Capacity decisions far from ties: with the `probs` drop policy, the smallest gap
    between the cap-th and (cap+1)-th p[n,e] among an over-full expert's candidates, over
    all experts and MoE layers (inf when nothing is dropped or policy `position`, which
    cannot tie)."""
    opts = routing_options(cfg, routing)
    if not router_logits or opts["drop_policy"] != "probs":
        return float("inf")
    gap = float("inf")
    for rl, b in zip(router_logits, _bias_rows(cfg, router_logits, router_bias)):
        r = route(cfg, opts, rl.detach(), b)
        if r["cap"] is None:
            continue
        cap = r["cap"]
        for e in range(rl.shape[1]):
            n_idx = torch.nonzero(r["top_i"] == e, as_tuple=True)[0]
            if n_idx.numel() > cap:
                v = r["p"][n_idx, e].sort(descending=True).values
                gap = min(gap, float(v[cap - 1] - v[cap]))
    return gap


def routing_gap(cfg, router_logits, routing=None, router_bias=None):
    """min(top-k gap, capacity gap): the distance of every discrete routing decision from a tie."""
    return min(min_topk_gap(cfg, router_logits, routing, router_bias),
               min_capacity_gap(cfg, router_logits, routing, router_bias))


def loss_and_grads(cfg, params, inp_BT, tgt_BT, routing=None, router_bias=None, prev_counts=None,
                   micro_index=0, eod=None):
    """Evaluates losses and the gradient of `loss` with respect to every parameter."""
    leaves = OrderedDict((k, v.detach().clone().requires_grad_(True)) for k, v in params.items())
    out = losses(cfg, leaves, inp_BT, tgt_BT, routing, router_bias, prev_counts, micro_index, eod)
    grads = torch.autograd.grad(out["loss"], list(leaves.values()), allow_unused=True)
    out["grads"] = OrderedDict(
        (k, (g if g is not None else torch.zeros_like(leaves[k])).detach())
        for k, g in zip(leaves.keys(), grads))
    for k in ("logits", "lm_loss", "aux_loss", "z_loss", "loss"):
        out[k] = out[k].detach()
    out["router_logits"] = [r.detach() for r in out["router_logits"]]
    out["routes"] = [{k: (v.detach() if torch.is_tensor(v) else v) for k, v in r.items()}
                     for r in out["routes"]]
    return out


# --------------------------------------------------------------------------------------
# data: Megatron indexed dataset and the sequential window sampler
# --------------------------------------------------------------------------------------

MMIDIDX_MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float64, 8: np.uint16}


def read_indexed_dataset(prefix):
    """Returns (list of per-sequence token arrays, document indices)."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    if idx[:9] != MMIDIDX_MAGIC:
        raise ValueError(f"{prefix}.idx: bad magic {idx[:9]!r}")
    off = 9
    (version,) = struct.unpack_from("<Q", idx, off); off += 8
    if version != 1:
        raise ValueError(f"{prefix}.idx: version {version}, expected 1")
    (code,) = struct.unpack_from("<B", idx, off); off += 1
    (num_seq,) = struct.unpack_from("<Q", idx, off); off += 8
    (num_doc,) = struct.unpack_from("<Q", idx, off); off += 8
    lengths = np.frombuffer(idx, dtype="<i4", count=num_seq, offset=off); off += 4 * num_seq
    pointers = np.frombuffer(idx, dtype="<i8", count=num_seq, offset=off); off += 8 * num_seq
    docs = np.frombuffer(idx, dtype="<i8", count=num_doc, offset=off); off += 8 * num_doc
    if off != len(idx):
        raise ValueError(f"{prefix}.idx: {len(idx) - off} trailing bytes")
    dt = np.dtype(DTYPES[code]).newbyteorder("<")
    with open(prefix + ".bin", "rb") as f:
        binary = f.read()
    seqs = []
    for n, p in zip(lengths, pointers):
        if p + n * dt.itemsize > len(binary):
            raise ValueError(f"{prefix}.bin: sequence at byte {p} of length {n} runs past the end")
        seqs.append(np.frombuffer(binary, dtype=dt, count=int(n), offset=int(p)).astype(np.int64))
    return seqs, docs


def write_indexed_dataset(prefix, sequences, dtype_code=8):
    """Writer (one document per sequence), used only to self-test the reader."""
    dt = np.dtype(DTYPES[dtype_code]).newbyteorder("<")
    lengths, pointers, pos = [], [], 0
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            a = np.asarray(s, dtype=dt)
            f.write(a.tobytes())
            lengths.append(len(a)); pointers.append(pos); pos += a.nbytes
    with open(prefix + ".idx", "wb") as f:
        f.write(MMIDIDX_MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(sequences) + 1))
        f.write(np.asarray(lengths, "<i4").tobytes())
        f.write(np.asarray(pointers, "<i8").tobytes())
        f.write(np.arange(len(sequences) + 1, dtype="<i8").tobytes())


def byte_documents(data):
    """Documents of one file as `origami data prepare --split auto` cuts them: a file with a
    line holding only '%' is a fortune(6) file whose records (their lines, line breaks kept)
    are the documents; any other file is one document. Empty / whitespace-only documents
    are skipped."""
    lines = data.split(b"\n")
    lines = [l + b"\n" for l in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    if not any(l.rstrip(b"\r\n") == b"%" for l in lines):
        docs = [data]
    else:
        docs, cur = [], []
        for l in lines:
            if l.rstrip(b"\r\n") == b"%":
                docs.append(b"".join(cur))
                cur = []
            else:
                cur.append(l)
        docs.append(b"".join(cur))
    return [d for d in docs if d.strip()]


def prepare_byte_dataset(text_path, prefix, eod=256):
    """What `origami data prepare --tokenizer byte` writes for one text file (the token
    stream: each document's bytes, then end-of-document 256), without the binary."""
    with open(text_path, "rb") as f:
        docs = byte_documents(f.read())
    write_indexed_dataset(prefix, [np.append(np.frombuffer(d, dtype=np.uint8).astype(np.int64), eod)
                                   for d in docs], dtype_code=8)
    return prefix


class WindowSampler:
    """Sequential windows: window i = tokens[i*T, i*T+T+1); step s, row r of a global
    batch of G rows reads window (s*G + r) mod num_windows."""

    def __init__(self, prefix, seq_len):
        seqs, _ = read_indexed_dataset(prefix)
        self.tokens = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
        self.T = seq_len
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{prefix}: {len(self.tokens)} tokens is too few for seq_len {seq_len}")

    def window(self, i):
        i %= self.num_windows
        w = self.tokens[i * self.T: i * self.T + self.T + 1]
        return w[:-1], w[1:]

    def batch(self, step, rows):
        """(inputs [rows,T], targets [rows,T]) for global batch `step` of `rows` rows."""
        ins, tgts = zip(*(self.window(step * rows + r) for r in range(rows)))
        return torch.from_numpy(np.stack(ins)), torch.from_numpy(np.stack(tgts))


class BlendSampler(WindowSampler):
    """A blend of datasets by the greedy rule of Megatron's blending with (i+1) for its max(i, 1):
    sample i goes to the dataset d with the largest w_d*(i+1) - n_d (the first on ties; n_d =
    samples d gave so far) and reads that dataset's sequential window n_d. parts: [(weight,
    prefix)], weights normalised here."""

    def __init__(self, parts, seq_len):
        total = sum(w for w, _ in parts)
        self.weights = [w / total for w, _ in parts]
        self.samplers = [WindowSampler(prefix, seq_len) for _, prefix in parts]
        self.choices = []  # (dataset, its sample index) of samples 0, 1, ...
        self.given = [0] * len(parts)

    def dataset_of(self, i):
        while len(self.choices) <= i:
            n = len(self.choices) + 1
            errors = [w * n - g for w, g in zip(self.weights, self.given)]
            d = errors.index(max(errors))
            self.choices.append((d, self.given[d]))
            self.given[d] += 1
        return self.choices[i]

    def window(self, i):
        d, j = self.dataset_of(i)
        return self.samplers[d].window(j)


# --------------------------------------------------------------------------------------
# optimizer, clipping, schedule
# --------------------------------------------------------------------------------------


class DocumentSampler:
    """--batching documents (data/documents.h), sequential order: every document with its
    end-of-document token is a sequence, one longer than L cut into pieces of L (the last shorter);
    step s takes the next sequences while the step's tokens stay <= N; the documents repeat.
    `data` is a prefix or a blend [(weight, prefix), ...]: each next document then comes from the
    dataset d maximising w_d (T + 1) - T_d (T_d its tokens so far, T their sum; the first on ties)."""

    def __init__(self, data, max_len, step_tokens):
        blend = [(1.0, data)] if isinstance(data, str) else data
        total = sum(w for w, _ in blend)
        self.weights = [w / total for w, _ in blend]
        self.docs = []  # per dataset: its documents, each a list of pieces
        for _, prefix in blend:
            seqs, doc_index = read_indexed_dataset(prefix)
            docs = []
            for d in range(len(doc_index) - 1):
                doc = np.concatenate(seqs[doc_index[d]:doc_index[d + 1]]) if doc_index[d + 1] > doc_index[d] else []
                if len(doc):
                    docs.append([doc[i:i + max_len] for i in range(0, len(doc), max_len)])
            self.docs.append(docs)
        self.taken = [0] * len(blend)  # tokens per dataset
        self.next_doc = [0] * len(blend)
        self.pending = []  # pieces of the document under way, as (dataset, piece)
        self.N = step_tokens
        self.steps = []
        self.dataset_tokens = []  # per step: tokens from each dataset

    def _peek(self):
        if not self.pending:
            T = sum(self.taken)
            due = [w * (T + 1) - t for w, t in zip(self.weights, self.taken)]
            d = due.index(max(due))
            docs = self.docs[d]
            self.pending = [(d, piece) for piece in docs[self.next_doc[d] % len(docs)]]
            self.next_doc[d] += 1
        return self.pending[0]

    def step(self, s):
        """The sequences of step s (int64 token tensors)."""
        while len(self.steps) <= s:
            out, tokens, per = [], 0, [0] * len(self.docs)
            while tokens + len(self._peek()[1]) <= self.N:
                d, piece = self.pending.pop(0)
                out.append(torch.from_numpy(piece.astype(np.int64)))
                tokens += len(piece)
                self.taken[d] += len(piece)
                per[d] += len(piece)
            self.steps.append(out)
            self.dataset_tokens.append(per)
        return self.steps[s]


def document_loss(cfg, params, sequences, routing=None, router_bias=None):
    """The loss of a document-batching step, each sequence run through the model alone (positions from
    0): the mean LM loss over every predicted token (a sequence of n tokens predicts its last n - 1),
    plus the router losses over every token of the step (a sequence's last token too, which the model
    reads though it predicts nothing), each divided by the step's tokens:
      seq aux: coef * E * sum_b sum_e f_be * sum_{t in b} pa_te, f_be = c_be / (n_b K) over b's own tokens;
      z:       z_coef * sum_t logsumexp_e(logits_te)^2.
    Returns dict: loss, lm_loss, aux_loss, z_loss (tensors), predicted, expert_tokens [L,E] (the step's
    assignments, for bias balancing)."""
    routing = {"aux": "seq", **(routing or {})}  # origami's default under document batching
    opts = routing_options(cfg, routing) if num_experts(cfg) else None
    E, L = num_experts(cfg), _dims(cfg)[4]
    lm, aux, z = (torch.zeros((), dtype=torch.float64) for _ in range(3))
    predicted, tokens = 0, 0
    load = torch.zeros(L, E, dtype=torch.long)
    for q in sequences:
        logits, routes = forward_routes(cfg, params, q[None, :], routing, router_bias)
        tokens += len(q)
        if len(q) > 1:
            lm = lm + torch.nn.functional.cross_entropy(logits[0, :-1], q[1:], reduction="sum")
            predicted += len(q) - 1
        for r in routes:
            K = cfg["num_experts_per_tok"]
            load[r["layer"]] += r["counts"]
            if opts["aux"] == "seq":
                f = r["counts"].to(r["p"].dtype) / (len(q) * K)
                aux = aux + E * (f * _aux_probs(r["p"], opts["score"]).sum(0)).sum()
            z = z + (torch.logsumexp(r["logits"], dim=-1) ** 2).sum()
    if opts is not None and opts["aux"] not in ("seq", "none"):
        raise ValueError("document batching takes aux seq or none")
    aux = (opts["aux_coef"] if opts else 0.0) * aux / max(tokens, 1)
    z = cfg.get("router_z_loss_coef", 0.0) * z / max(tokens, 1)
    lm = lm / max(predicted, 1)
    return {"loss": lm + aux + z, "lm_loss": lm, "aux_loss": aux, "z_loss": z, "predicted": predicted,
            "expert_tokens": load}


def train_documents(cfg, params, sampler, steps, lr, min_lr, warmup, schedule, weight_decay, grad_clip,
                    routing=None, eval_sampler=None, eval_iters=1):
    """Reference training under document batching (document_loss; MoE: aux seq or none, the z-loss,
    bias balancing from the step's loads). `params` is updated in place; per step: loss, lm_loss,
    aux_loss, z_loss, grad_norm, lr, tokens, sequences, expert_tokens, router_bias (after the step's
    update), and after the last step val_loss (the mean over eval_iters steps' predicted tokens)."""
    opt = AdamW(params, weight_decay=weight_decay)
    opts = routing_options(cfg, {"aux": "seq", **(routing or {})}) if num_experts(cfg) else None
    L, E = _dims(cfg)[4], num_experts(cfg)
    bias = torch.zeros(L, E, dtype=torch.float64)
    metrics = []
    for s in range(steps):
        seqs = sampler.step(s)
        leaves = OrderedDict((k, v.detach().clone().requires_grad_(True)) for k, v in params.items())
        out = document_loss(cfg, leaves, seqs, routing, bias)
        grads = torch.autograd.grad(out["loss"], list(leaves.values()), allow_unused=True)
        acc = OrderedDict((k, (g if g is not None else torch.zeros_like(leaves[k])).detach())
                          for k, g in zip(leaves.keys(), grads))
        norm = clip_grads(acc, grad_clip)
        lr_s = lr_at(s, lr, min_lr, warmup, steps, schedule)
        with torch.no_grad():
            opt.step(params, acc, lr_s)
        if opts is not None and opts["bias_update_rate"] > 0:
            for l in moe_layers(cfg):
                bias[l] += router_bias_update(out["expert_tokens"][l], opts["bias_update_rate"])
        metrics.append(dict(step=s, grad_norm=norm, lr=lr_s, tokens=sum(len(q) for q in seqs), sequences=len(seqs),
                            expert_tokens=out["expert_tokens"].tolist(), router_bias=bias.tolist(),
                            **{k: float(out[k]) for k in ("loss", "lm_loss", "aux_loss", "z_loss")}))
    if eval_sampler is not None:
        with torch.no_grad():
            total, n = 0.0, 0
            for k in range(eval_iters):
                out = document_loss(cfg, params, eval_sampler.step(k), routing, bias)
                total, n = total + float(out["lm_loss"]) * out["predicted"], n + out["predicted"]
        metrics[-1]["val_loss"] = total / max(n, 1)
    return metrics


def lr_at(step, lr, min_lr, warmup, total_steps, schedule):
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def clip_grads(grads, max_norm):
    """In place, like torch.nn.utils.clip_grad_norm_. Returns the norm before clipping."""
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    if max_norm and max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads.values():
                g.mul_(coef)
    return norm


class AdamW:
    """PyTorch AdamW semantics; weight decay only on parameters with ndim >= 2."""

    def __init__(self, params, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0):
        self.b1, self.b2, self.eps, self.wd = beta1, beta2, eps, weight_decay
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def step(self, params, grads, lr):
        self.t += 1
        bc1 = 1.0 - self.b1 ** self.t
        bc2 = 1.0 - self.b2 ** self.t
        for k, p in params.items():
            g = grads[k]
            if p.ndim >= 2 and self.wd:
                p.mul_(1.0 - lr * self.wd)
            self.m[k].mul_(self.b1).add_(g, alpha=1.0 - self.b1)
            self.v[k].mul_(self.b2).addcmul_(g, g, value=1.0 - self.b2)
            denom = (self.v[k] / bc2).sqrt_().add_(self.eps)
            p.addcdiv_(self.m[k] / bc1, denom, value=-lr)


def router_bias_update(load_E, rate):
    """Aux-loss-free balancing: R * sign(mean load - load_e) (sign(0) = 0), from one optimizer
    step's expert loads (assignments before dropping, summed over the micro-batches)."""
    ld = torch.as_tensor(load_E).to(torch.float64)
    return rate * torch.sign(ld.sum() / ld.numel() - ld)


def evaluate(cfg, params, sampler, iters, global_batch, micro_batch, eod=None):
    """Validation loss: the mean per-token LM loss (no router losses) over windows
    0 .. iters*global_batch-1 of `sampler`, forward only."""
    total, n = 0.0, 0
    with torch.no_grad():
        for k in range(iters):
            inp, tgt = sampler.batch(k, global_batch)
            for m in range(0, global_batch, micro_batch):
                total += float(losses(cfg, params, inp[m:m + micro_batch], tgt[m:m + micro_batch], eod=eod)["lm_loss"])
                n += 1
    return total / n


def train(cfg, params, sampler, steps, micro_batch, global_batch, lr, min_lr, warmup,
          schedule, weight_decay, grad_clip, routing=None, eod=None, eval_every=0, eval_sampler=None,
          eval_iters=1):
    """Reference training loop. `params` is updated in place; returns per-step metrics
    (loss etc. are means over the micro-batches, evaluated before the update).
    MoE routing options (see ROUTING_DEFAULTS): aux `global` uses the running average of the
    step's expert counts up to each micro-batch; with bias_update_rate R > 0 every MoE layer's
    selection bias moves after each optimizer step by R * sign(mean load - load_e), loads
    summed over the step's micro-batches. Per step also: expert_tokens [L][E] (summed over
    the micro-batches, before dropping), expert_dropped [L], router_bias [L][E] (after the
    step's update; zero rows for dense layers), min_topk_gap (top-k and capacity decisions)."""
    if global_batch % micro_batch:
        raise ValueError("global batch must be a multiple of the micro-batch")
    opts = routing_options(cfg, routing)
    num_micro = global_batch // micro_batch
    opt = AdamW(params, weight_decay=weight_decay)
    L, E = _dims(cfg)[4], num_experts(cfg)
    moe = moe_layers(cfg)
    bias = torch.zeros(L, E, dtype=torch.float64)
    metrics = []
    for s in range(steps):
        inp, tgt = sampler.batch(s, global_batch)
        acc = {k: torch.zeros_like(v) for k, v in params.items()}
        sums = {"loss": 0.0, "lm_loss": 0.0, "aux_loss": 0.0, "z_loss": 0.0}
        gap = float("inf")
        load = torch.zeros(L, E, dtype=torch.long)
        dropped = [0] * L
        for m in range(num_micro):
            rows = slice(m * micro_batch, (m + 1) * micro_batch)
            out = loss_and_grads(cfg, params, inp[rows], tgt[rows], opts, bias, load.clone(), m, eod)
            gap = min(gap, routing_gap(cfg, out["router_logits"], opts, bias))
            load += out["expert_tokens"]
            dropped = [d + x for d, x in zip(dropped, out["expert_dropped"])]
            for k in sums:
                sums[k] += float(out[k]) / num_micro
            for k, g in out["grads"].items():
                acc[k] += g / num_micro
        norm = clip_grads(acc, grad_clip)
        lr_s = lr_at(s, lr, min_lr, warmup, steps, schedule)
        with torch.no_grad():
            opt.step(params, acc, lr_s)
        if opts["bias_update_rate"] > 0:
            for l in moe:
                bias[l] += router_bias_update(load[l], opts["bias_update_rate"])
        metrics.append(dict(step=s, grad_norm=norm, lr=lr_s, min_topk_gap=gap, **sums,
                            expert_tokens=load.tolist(), expert_dropped=dropped,
                            router_bias=bias.tolist()))
        if eval_sampler is not None and (s + 1 == steps or (eval_every and (s + 1) % eval_every == 0)):
            metrics[-1]["val_loss"] = evaluate(cfg, params, eval_sampler, eval_iters, global_batch,
                                               micro_batch, eod)
    return metrics


# --------------------------------------------------------------------------------------
# the origami binary
# --------------------------------------------------------------------------------------


def origami_bin():
    b = os.environ.get("ORIGAMI_BIN")
    if not b:
        root = os.environ.get("ORIGAMI_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
        b = os.path.join(root, "build", "origami")
    if not os.path.isfile(b):
        raise RuntimeError(f"origami binary not found at {b!r} (set ORIGAMI_BIN)")
    return b


def run_origami(args, timeout=600):
    cmd = [origami_bin()] + [str(a) for a in args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"origami failed (exit {r.returncode}): {' '.join(cmd)}\n"
                           f"--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-3000:]}")
    return r


def origami_prepare_data(text_path, prefix):
    run_origami(["data", "prepare", "--input", text_path, "--output", prefix, "--tokenizer", "byte"])
    return prefix


def routing_cli_args(routing, train=False):
    """origami's --moe-* flags for the keys present in `routing` (absent keys: the binary's
    defaults are exercised). bias_update_rate is a train-only flag."""
    if not routing:
        return []
    bad = [k for k in routing if k not in ROUTING_DEFAULTS]
    if bad:
        raise ValueError(f"unknown routing options {bad}")
    args = []
    if "capacity_factor" in routing:
        args += ["--moe-capacity-factor", repr(float(routing["capacity_factor"]))]
    if "drop_policy" in routing:
        args += ["--moe-drop-policy", routing["drop_policy"]]
    if routing.get("pad_to_capacity"):
        args += ["--moe-pad-to-capacity"]
    if "aux" in routing:
        args += ["--moe-aux-loss", routing["aux"]]
    if routing.get("aux_coef") is not None:
        args += ["--moe-aux-loss-coef", repr(float(routing["aux_coef"]))]
    if "score" in routing:
        args += ["--moe-router-score", routing["score"]]
    if "bias_update_rate" in routing:
        if not train:
            raise ValueError("bias_update_rate is a train option")
        args += ["--moe-router-bias-update-rate", repr(float(routing["bias_update_rate"]))]
    return args


def origami_dump(config, init, data, micro_batch, seq_len, out, step=0, routing=None, extra=()):
    run_origami(["dump", "--config", config, "--init-from", init, "--data", data,
                 "--micro-batch", micro_batch, "--seq-len", seq_len, "--step", step, "--out", out]
                + routing_cli_args(routing) + list(extra))
    return load_safetensors(out)


def origami_train(config, init, data, metrics, steps, micro_batch, global_batch, seq_len, lr,
                  min_lr, warmup, schedule, weight_decay, grad_clip, save=None, threads=2,
                  routing=None, precision=None, extra=()):
    """precision: "fp32" | "bf16" as --precision (None: the flag left out, the binary's default)."""
    args = ["train", "--config", config, "--init-from", init, "--data", data, "--steps", steps,
            "--micro-batch", micro_batch, "--global-batch", global_batch, "--seq-len", seq_len,
            "--lr", repr(float(lr)), "--warmup", warmup,
            "--lr-schedule", schedule, "--weight-decay", repr(float(weight_decay)),
            "--grad-clip", repr(float(grad_clip)), "--data-order", "sequential",
            "--metrics", metrics, "--threads", threads]
    if schedule == "cosine":  # (the constant schedule has no floor: origami refuses --min-lr beside it)
        args += ["--min-lr", repr(float(min_lr))]
    if save:
        args += ["--save", save]  # writes save/step-<steps>/ (one shard file per rank), save/latest
    if precision:
        args += ["--precision", precision]
    run_origami(args + routing_cli_args(routing, train=True) + list(extra))
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def origami_export(checkpoint, out, optimizer=False):
    """`origami ckpt export CHECKPOINT --hf OUT`: a --save directory (its newest step) as a Hugging
    Face directory, OUT/config.json + OUT/model.safetensors (+ tokenizer.json; with optimizer also
    optimizer.safetensors and trainer_state.json). Returns OUT."""
    run_origami(["ckpt", "export", checkpoint, "--hf", out] + (["--optimizer"] if optimizer else []))
    return out


# --------------------------------------------------------------------------------------
# helpers for tests
# --------------------------------------------------------------------------------------

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
MODELS = ("gpt2", "llama", "mixtral", "qwen2_moe")


def config_path(name):
    return os.path.join(CONFIG_DIR, f"{name}_tiny.json")


def seeded_model(name, tmp, seed, tag=""):
    """configs/<name>_tiny.json with weights from init_params(seed) saved to tmp for origami:
    (config path, config, weights file, the weights as float64 tensors for the reference)."""
    cfg_path = config_path(name)
    cfg = load_config(cfg_path)
    init = os.path.join(tmp, f"{name}{tag}.safetensors")
    save_params(init_params(cfg, seed=seed), init)
    return cfg_path, cfg, init, load_params(cfg, init, torch.float64)


def rel_err(a, b):
    """max|a-b| / max(max|b|, tiny); b is the reference."""
    def as64(x):  # python floats must not pass through float32
        return x.detach().double().reshape(-1) if torch.is_tensor(x) else \
            torch.as_tensor(np.asarray(x, dtype=np.float64)).reshape(-1)
    a, b = as64(a), as64(b)
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def sample_text(path, num_bytes, offset=0):
    """A few KB of text (fortunes if installed, else a deterministic fallback)."""
    src = "/usr/share/games/fortunes/fortunes"
    if os.path.exists(src):
        with open(src, "rb") as f:
            data = f.read()[offset:offset + num_bytes]
    else:
        rng = np.random.default_rng(0)
        words = [b"origami", b"fold", b"paper", b"crane", b"tensor", b"pipe", b"expert", b"\n"]
        data = b" ".join(words[i] for i in rng.integers(0, len(words), num_bytes // 4))[:num_bytes]
    with open(path, "wb") as f:
        f.write(data)
    return path


class Report:
    """Collects (what, error, tolerance) rows, prints a table, and gives the exit code."""

    def __init__(self, title):
        self.title = title
        self.rows = []

    def check(self, what, err, tol):
        ok = err <= tol
        self.rows.append((what, err, tol, ok))
        return ok

    def fail(self, what, message):
        self.rows.append((what, message, None, False))

    def finish(self):
        print(f"== {self.title}")
        w = max([len(r[0]) for r in self.rows] + [10])
        for what, err, tol, ok in self.rows:
            if tol is None:
                print(f"  {'FAIL':4}  {what:<{w}}  {err}")
            else:
                print(f"  {'ok' if ok else 'FAIL':4}  {what:<{w}}  rel_err {err:.3e}  (tol {tol:.0e})")
        bad = [r for r in self.rows if not r[3]]
        print(f"== {self.title}: {len(self.rows) - len(bad)}/{len(self.rows)} checks passed")
        if bad:
            print("FAILED:", ", ".join(r[0] for r in bad[:20]) + (" ..." if len(bad) > 20 else ""))
        return 1 if bad else 0


def run_model_checks(title, check, variants=(None,), models=MODELS):
    """The main() of an engine test: prepares a small byte dataset with origami, then runs
    check(name, report, tmp, data) — or check(name, variant, report, tmp, data) for each variant —
    for every model type, turning an exception into a failed check. Returns the exit status."""
    report = Report(title)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            text = sample_text(os.path.join(tmp, "text.txt"), 4000)
            data = origami_prepare_data(text, os.path.join(tmp, "data"))
        except Exception as e:
            report.fail("origami data prepare", f"{type(e).__name__}: {e}")
            return report.finish()
        for name in models:
            for variant in variants:
                label = name if variant is None else f"{name}/{variant}"
                try:
                    if variant is None:
                        check(name, report, tmp, data)
                    else:
                        check(name, variant, report, tmp, data)
                except Exception as e:
                    report.fail(label, f"{type(e).__name__}: {e}")
    return report.finish()

