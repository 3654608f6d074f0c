"""origami's whole-model oracle: an independent PyTorch implementation.

Plain functional torch (no transformers in the model code). A model is
(config dict, ordered dict {HF parameter name: tensor}); `forward` returns logits
and the router logits of every MoE layer; `losses` turns those into
lm_loss / aux_loss / z_loss / loss exactly as DESIGN.md and the engine spec define.

Also here: safetensors load/save with Hugging Face names, a reader of Megatron
indexed datasets (.bin/.idx) and the sequential window sampler, AdamW + global-norm
clipping + LR schedule, and thin wrappers that run the `origami` binary.

Everything is written to run in float64 (the strong oracle) or float32.

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
    if mt not in ("gpt2", "llama", "mixtral"):
        raise ValueError(f"unsupported model_type {mt!r}")
    return mt


def _dims(cfg):
    """(C, H, KV, D, L) for any supported model type."""
    if model_type(cfg) == "gpt2":
        C, H = cfg["n_embd"], cfg["n_head"]
        return C, H, H, C // H, cfg["n_layer"]
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads") or H
    D = cfg.get("head_dim") or C // H
    return C, H, KV, D, cfg["num_hidden_layers"]


def tied(cfg):
    # HF default: GPT-2 ties, Llama/Mixtral configs carry tie_word_embeddings explicitly
    return bool(cfg.get("tie_word_embeddings", model_type(cfg) == "gpt2"))


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
    s["model.embed_tokens.weight"] = (V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        s[p + "input_layernorm.weight"] = (C,)
        s[p + "self_attn.q_proj.weight"] = (H * D, C)   # nn.Linear: [out, in]
        s[p + "self_attn.k_proj.weight"] = (KV * D, C)
        s[p + "self_attn.v_proj.weight"] = (KV * D, C)
        s[p + "self_attn.o_proj.weight"] = (C, H * D)
        s[p + "post_attention_layernorm.weight"] = (C,)
        if mt == "llama":
            s[p + "mlp.gate_proj.weight"] = (I, C)
            s[p + "mlp.up_proj.weight"] = (I, C)
            s[p + "mlp.down_proj.weight"] = (C, I)
        else:
            E = cfg["num_local_experts"]
            s[p + "block_sparse_moe.gate.weight"] = (E, C)
            for e in range(E):
                q = p + f"block_sparse_moe.experts.{e}."
                s[q + "w1.weight"] = (I, C)
                s[q + "w2.weight"] = (C, I)
                s[q + "w3.weight"] = (I, C)
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
    Matrices N(0, 1/fan_in); embeddings N(0, 0.3); router N(0, 4/C) so top-k routing is
    decisive; norm weights N(1, 0.1) and biases N(0, 0.1) so their gradients are tested."""
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


def causal_attention(q_BHTD, k_BHTD, v_BHTD):
    T, D = q_BHTD.shape[-2], q_BHTD.shape[-1]
    att = q_BHTD @ k_BHTD.transpose(-1, -2) / math.sqrt(D)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    att = att.masked_fill(~mask, float("-inf"))
    att = torch.softmax(att, dim=-1)
    return att @ v_BHTD


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


def _gpt2_forward(cfg, P, tok_BT):
    B, T = tok_BT.shape
    C, H, _, D, L = _dims(cfg)
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    x = P["wte.weight"][tok_BT] + P["wpe.weight"][:T][None]
    for l in range(L):
        p = f"h.{l}."
        h = layer_norm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
        qkv = h @ P[p + "attn.c_attn.weight"] + P[p + "attn.c_attn.bias"]    # [B,T,3C]
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ P[p + "attn.c_proj.weight"] + P[p + "attn.c_proj.bias"]
        h = layer_norm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
        h = gelu_tanh(h @ P[p + "mlp.c_fc.weight"] + P[p + "mlp.c_fc.bias"])
        x = x + h @ P[p + "mlp.c_proj.weight"] + P[p + "mlp.c_proj.bias"]
    x = layer_norm(x, P["ln_f.weight"], P["ln_f.bias"], eps)
    head = P["wte.weight"] if tied(cfg) else P["lm_head.weight"]
    return x @ head.t(), []


def _llama_attention(cfg, P, p, h, cos, sin):
    B, T, _ = h.shape
    C, H, KV, D, _ = _dims(cfg)
    q = (h @ P[p + "self_attn.q_proj.weight"].t()).reshape(B, T, H, D).transpose(1, 2)
    k = (h @ P[p + "self_attn.k_proj.weight"].t()).reshape(B, T, KV, D).transpose(1, 2)
    v = (h @ P[p + "self_attn.v_proj.weight"].t()).reshape(B, T, KV, D).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # GQA: query head h reads kv head h // (H / KV)
    rep = H // KV
    kv_of_head = torch.arange(H) // rep
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, H * D)
    return y @ P[p + "self_attn.o_proj.weight"].t()


def _moe(cfg, P, p, h_BTC):
    """Sparse MoE. Returns (output, router logits [N, E])."""
    B, T, C = h_BTC.shape
    E, K = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    x = h_BTC.reshape(B * T, C)
    logits_NE = x @ P[p + "block_sparse_moe.gate.weight"].t()
    prob_NE = torch.softmax(logits_NE, dim=-1)
    top_p, top_i = torch.topk(prob_NE, K, dim=-1)              # [N, K]
    w_NK = top_p / top_p.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        rows, slot = torch.nonzero(top_i == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        q = p + f"block_sparse_moe.experts.{e}."
        xe = x[rows]
        ye = (silu(xe @ P[q + "w1.weight"].t()) * (xe @ P[q + "w3.weight"].t())) @ P[q + "w2.weight"].t()
        out = out.index_add(0, rows, ye * w_NK[rows, slot][:, None])
    return out.reshape(B, T, C), logits_NE


def _llama_forward(cfg, P, tok_BT):
    B, T = tok_BT.shape
    C, H, KV, D, L = _dims(cfg)
    eps = cfg.get("rms_norm_eps", 1e-6)
    x = P["model.embed_tokens.weight"][tok_BT]
    cos, sin = rope_cos_sin(T, D, cfg.get("rope_theta", 10000.0), x.dtype)
    router = []
    for l in range(L):
        p = f"model.layers.{l}."
        x = x + _llama_attention(cfg, P, p, rms_norm(x, P[p + "input_layernorm.weight"], eps), cos, sin)
        h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
        if model_type(cfg) == "llama":
            m = silu(h @ P[p + "mlp.gate_proj.weight"].t()) * (h @ P[p + "mlp.up_proj.weight"].t())
            x = x + m @ P[p + "mlp.down_proj.weight"].t()
        else:
            y, rl = _moe(cfg, P, p, h)
            router.append(rl)
            x = x + y
    x = rms_norm(x, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if tied(cfg) else P["lm_head.weight"]
    return x @ head.t(), router


def forward(cfg, params, tok_BT):
    """Returns (logits [B,T,V], list of router logits [N,E] per MoE layer)."""
    if model_type(cfg) == "gpt2":
        return _gpt2_forward(cfg, params, tok_BT)
    return _llama_forward(cfg, params, tok_BT)


def router_losses(cfg, router_logits):
    """(aux_loss, z_loss) summed over MoE layers and scaled by their coefficients.
    aux_l = E * sum_e f_e * P_e, f_e = count_e / (N*K) (no gradient), P_e = mean_n p_ne;
    z_l = mean_n logsumexp_e(logits_ne)^2."""
    if not router_logits:
        return None, None
    E, K = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    aux = 0.0
    z = 0.0
    for logits_NE in router_logits:
        N = logits_NE.shape[0]
        prob = torch.softmax(logits_NE, dim=-1)
        top_i = torch.topk(prob, K, dim=-1).indices
        count = torch.bincount(top_i.reshape(-1), minlength=E).to(prob.dtype)
        f = count / (N * K)
        Pm = prob.mean(0)
        aux = aux + E * (f * Pm).sum()
        z = z + (torch.logsumexp(logits_NE, dim=-1) ** 2).mean()
    return cfg.get("router_aux_loss_coef", 0.0) * aux, cfg.get("router_z_loss_coef", 0.0) * z


def losses(cfg, params, inp_BT, tgt_BT):
    """dict: logits, lm_loss, aux_loss, z_loss, loss (tensors, differentiable)."""
    logits, router = forward(cfg, params, inp_BT)
    V = logits.shape[-1]
    lm = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt_BT.reshape(-1))
    aux, z = router_losses(cfg, router)
    if aux is None:
        aux = torch.zeros((), dtype=lm.dtype)
        z = torch.zeros((), dtype=lm.dtype)
    return {"logits": logits, "lm_loss": lm, "aux_loss": aux, "z_loss": z,
            "loss": lm + aux + z, "router_logits": router}


def min_topk_gap(cfg, router_logits):
    """Smallest gap between the K-th and (K+1)-th router probability over all tokens
    and layers: if tiny, fp32 and fp64 may legitimately route differently."""
    if not router_logits:
        return float("inf")
    K = cfg["num_experts_per_tok"]
    gaps = []
    for rl in router_logits:
        p = torch.softmax(rl.detach(), -1).sort(-1, descending=True).values
        gaps.append((p[:, K - 1] - p[:, K]).min().item())
    return min(gaps)


def loss_and_grads(cfg, params, inp_BT, tgt_BT):
    """Evaluates losses and the gradient of `loss` with respect to every parameter."""
    leaves = OrderedDict((k, v.detach().clone().requires_grad_(True)) for k, v in params.items())
    out = losses(cfg, leaves, inp_BT, tgt_BT)
    grads = torch.autograd.grad(out["loss"], list(leaves.values()), allow_unused=True)
    out["grads"] = OrderedDict(
        (k, (g if g is not None else torch.zeros_like(leaves[k])).detach())
        for k, g in zip(leaves.keys(), grads))
    for k in ("logits", "lm_loss", "aux_loss", "z_loss", "loss"):
        out[k] = out[k].detach()
    out["router_logits"] = [r.detach() for r in out["router_logits"]]
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


# --------------------------------------------------------------------------------------
# optimizer, clipping, schedule
# --------------------------------------------------------------------------------------


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


def train(cfg, params, sampler, steps, micro_batch, global_batch, lr, min_lr, warmup,
          schedule, weight_decay, grad_clip):
    """Reference training loop. `params` is updated in place; returns per-step metrics
    (loss etc. are means over the micro-batches, evaluated before the update)."""
    if global_batch % micro_batch:
        raise ValueError("global batch must be a multiple of the micro-batch")
    num_micro = global_batch // micro_batch
    opt = AdamW(params, weight_decay=weight_decay)
    metrics = []
    for s in range(steps):
        inp, tgt = sampler.batch(s, global_batch)
        acc = {k: torch.zeros_like(v) for k, v in params.items()}
        sums = {"loss": 0.0, "lm_loss": 0.0, "aux_loss": 0.0, "z_loss": 0.0}
        gap = float("inf")
        for m in range(num_micro):
            rows = slice(m * micro_batch, (m + 1) * micro_batch)
            out = loss_and_grads(cfg, params, inp[rows], tgt[rows])
            gap = min(gap, min_topk_gap(cfg, out["router_logits"]))
            for k in sums:
                sums[k] += float(out[k]) / num_micro
            for k, g in out["grads"].items():
                acc[k] += g / num_micro
        norm = clip_grads(acc, grad_clip)
        lr_s = lr_at(s, lr, min_lr, warmup, steps, schedule)
        with torch.no_grad():
            opt.step(params, acc, lr_s)
        metrics.append(dict(step=s, grad_norm=norm, lr=lr_s, min_topk_gap=gap, **sums))
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


def origami_dump(config, init, data, micro_batch, seq_len, out, step=0):
    run_origami(["dump", "--config", config, "--init-from", init, "--data", data,
                 "--micro-batch", micro_batch, "--seq-len", seq_len, "--step", step, "--out", out])
    return load_safetensors(out)


def origami_train(config, init, data, metrics, steps, micro_batch, global_batch, seq_len, lr,
                  min_lr, warmup, schedule, weight_decay, grad_clip, save=None, threads=2):
    args = ["train", "--config", config, "--init-from", init, "--data", data, "--steps", steps,
            "--micro-batch", micro_batch, "--global-batch", global_batch, "--seq-len", seq_len,
            "--lr", repr(float(lr)), "--min-lr", repr(float(min_lr)), "--warmup", warmup,
            "--lr-schedule", schedule, "--weight-decay", repr(float(weight_decay)),
            "--grad-clip", repr(float(grad_clip)), "--data-order", "sequential",
            "--metrics", metrics, "--threads", threads]
    if save:
        args += ["--save", save]
    run_origami(args)
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------
# helpers for tests
# --------------------------------------------------------------------------------------

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
MODELS = ("gpt2", "llama", "mixtral")


def config_path(name):
    return os.path.join(CONFIG_DIR, f"{name}_tiny.json")


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


def run_model_checks(title, check, variants=(None,)):
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
        for name in MODELS:
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

