#include "model/model.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "model/layers/activation.h"
#include "model/layers/attention.h"
#include "model/layers/embedding.h"
#include "model/layers/linear.h"
#include "model/layers/lm_head.h"
#include "model/layers/norm.h"

namespace origami {

namespace {

int64_t qkv_width(const ModelConfig& c) { return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim; }

// Per-layer MLP activation floats per token: gpt2 keeps pre-activation and GELU output (2F),
// llama gate|up and SwiGLU output (3F); mixtral's MoE cache is sized by the routed rows.
int64_t mlp_floats_per_token(const ModelConfig& c) {
  if (c.is_gpt2()) return 2 * c.ffn;
  if (!c.is_moe()) return 3 * c.ffn;
  return c.top_k * (2 * c.hidden + 3 * c.ffn) + 2 * c.num_experts + 3 * c.top_k;
}

}  // namespace

int64_t activation_floats(const ModelConfig& c, int64_t B, int64_t T) {
  const int64_t N = B * T, C = c.hidden, L = c.num_layers;
  const int64_t per_layer_per_token = 4 * C             // residual mid, norm outputs ×2, (residual in: below)
                                      + qkv_width(c)    // qkv (after RoPE)
                                      + c.num_heads * c.head_dim  // attention output
                                      + c.num_heads + 4           // lse, norm statistics
                                      + mlp_floats_per_token(c);
  return N * (L * per_layer_per_token + (L + 1) * C + C + 2);  // + residual stream, final norm
}

double train_flops_per_token(const ModelConfig& c, int64_t T) {
  const double C = double(c.hidden), F = double(c.ffn), L = double(c.num_layers);
  const double attn = C * double(qkv_width(c)) + double(c.num_heads * c.head_dim) * C;
  double mlp = c.is_gpt2() ? 2 * C * F : 3 * C * F;
  if (c.is_moe()) mlp = double(c.top_k) * 3 * C * F + C * double(c.num_experts);
  const double matmul_params = L * (attn + mlp) + C * double(c.vocab_size);
  return 6 * matmul_params + 6 * L * double(T) * double(c.num_heads * c.head_dim);
}

struct Model::Activations {
  int64_t B = 0, T = 0;
  std::vector<int32_t> targets;  // [N]
  std::vector<float> resid;      // [(L+1), N, C] residual stream entering each layer (+ final)
  std::vector<float> resid_mid;  // [L, N, C] after the attention residual add
  std::vector<float> ln1, ln2;   // [L, N, C] norm outputs
  std::vector<float> mean1, rstd1, mean2, rstd2;  // [L, N]
  std::vector<float> qkv;        // [L, N, S]
  std::vector<float> att;        // [L, N, H·D]
  std::vector<float> lse;        // [L, B, H, T]
  std::vector<float> mlp_a, mlp_b;  // [L, N, ·] gpt2: pre-GELU, GELU out; llama: gate|up, SwiGLU out
  std::vector<float> lnf, meanf, rstdf;  // final norm
  // Backward scratch.
  std::vector<float> d_res, d_ln, d_att, d_qkv, d_mlp_a, d_mlp_b;
};

Model::Model(const ModelConfig& cfg, Params& params) : cfg_(cfg), params_(params), act_(std::make_shared<Activations>()) {
  auto off = [&](const std::string& name) {
    int64_t i = params_.index(name);
    return i < 0 ? int64_t(-1) : params_.offset(size_t(i));
  };
  auto need = [&](const std::string& name) {
    int64_t o = off(name);
    ORIGAMI_ASSERT(o >= 0);
    return o;
  };
  layers_.resize(size_t(cfg.num_layers));
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    LayerOffsets& o = layers_[size_t(l)];
    if (cfg.is_gpt2()) {
      const std::string p = "h." + std::to_string(l) + ".";
      o.ln1_w = need(p + "ln_1.weight"), o.ln1_b = need(p + "ln_1.bias");
      o.qkv_w = need(p + "attn.c_attn.weight"), o.qkv_b = need(p + "attn.c_attn.bias");
      o.o_w = need(p + "attn.c_proj.weight"), o.o_b = need(p + "attn.c_proj.bias");
      o.ln2_w = need(p + "ln_2.weight"), o.ln2_b = need(p + "ln_2.bias");
      o.fc_w = need(p + "mlp.c_fc.weight"), o.fc_b = need(p + "mlp.c_fc.bias");
      o.proj_w = need(p + "mlp.c_proj.weight"), o.proj_b = need(p + "mlp.c_proj.bias");
    } else {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      o.ln1_w = need(p + "input_layernorm.weight");
      o.qkv_w = need(p + "self_attn.q_proj.weight");  // q|k|v contiguous: one [S, C] matrix
      ORIGAMI_ASSERT(need(p + "self_attn.v_proj.weight") ==
                     o.qkv_w + (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim * cfg.hidden);
      o.o_w = need(p + "self_attn.o_proj.weight");
      o.ln2_w = need(p + "post_attention_layernorm.weight");
      if (cfg.is_moe()) {
        o.router = need(p + "block_sparse_moe.gate.weight");
        o.experts = need(p + "block_sparse_moe.experts.0.w1.weight");
        ORIGAMI_ASSERT(need(p + "block_sparse_moe.experts.1.w1.weight") - o.experts == 3 * cfg.ffn * cfg.hidden ||
                       cfg.num_experts == 1);
      } else {
        o.fc_w = need(p + "mlp.gate_proj.weight");  // gate|up contiguous: one [2F, C] matrix
        ORIGAMI_ASSERT(need(p + "mlp.up_proj.weight") == o.fc_w + cfg.ffn * cfg.hidden);
        o.proj_w = need(p + "mlp.down_proj.weight");
      }
    }
  }
  if (cfg.is_gpt2()) {
    wte_ = need("wte.weight"), wpe_ = need("wpe.weight");
    lnf_w_ = need("ln_f.weight"), lnf_b_ = need("ln_f.bias");
    head_ = wte_;
  } else {
    wte_ = need("model.embed_tokens.weight");
    lnf_w_ = need("model.norm.weight");
    head_ = cfg.tied_embeddings ? wte_ : need("lm_head.weight");
    rope_ = RopeTable(cfg.max_positions, cfg.head_dim, cfg.rope_theta);
  }
  if (cfg.is_moe()) moe_.resize(size_t(cfg.num_layers));
}

std::vector<std::vector<int64_t>> Model::expert_counts() const {
  std::vector<std::vector<int64_t>> counts;
  for (const MoeCache<float>& mc : moe_) counts.push_back(mc.count_E);
  return counts;
}

void Model::ensure_activations(int64_t B, int64_t T) {
  Activations& a = *act_;
  if (a.B == B && a.T == T) return;
  const ModelConfig& c = cfg_;
  const int64_t N = B * T, C = c.hidden, L = c.num_layers, S = qkv_width(c), HD = c.num_heads * c.head_dim;
  const int64_t fa = c.is_gpt2() ? c.ffn : 2 * c.ffn;  // width of mlp_a (pre-activation or gate|up)
  const int64_t fb = c.is_moe() ? 0 : c.ffn;
  a.B = B, a.T = T;
  a.targets.resize(size_t(N));
  a.resid.resize(size_t((L + 1) * N * C));
  a.resid_mid.resize(size_t(L * N * C));
  a.ln1.resize(size_t(L * N * C));
  a.ln2.resize(size_t(L * N * C));
  for (auto* v : {&a.mean1, &a.rstd1, &a.mean2, &a.rstd2}) v->resize(size_t(L * N));
  a.qkv.resize(size_t(L * N * S));
  a.att.resize(size_t(L * N * HD));
  a.lse.resize(size_t(L * B * c.num_heads * T));
  a.mlp_a.resize(c.is_moe() ? 0 : size_t(L * N * fa));
  a.mlp_b.resize(size_t(L * N * fb));
  a.lnf.resize(size_t(N * C));
  a.meanf.resize(size_t(N));
  a.rstdf.resize(size_t(N));
  a.d_res.resize(size_t(N * C));
  a.d_ln.resize(size_t(N * C));
  a.d_att.resize(size_t(N * HD));
  a.d_qkv.resize(size_t(N * S));
  a.d_mlp_a.resize(size_t(N * fa));
  a.d_mlp_b.resize(size_t(N * c.ffn));
}

Losses Model::forward_backward(const int32_t* tokens, int64_t B, int64_t T, float loss_scale, bool backward,
                               float* logits_out) {
  const ModelConfig& c = cfg_;
  ORIGAMI_CHECK(T <= c.max_positions, "sequence length ", T, " exceeds the model's maximum positions (",
                c.max_positions, ")");
  ensure_activations(B, T);
  Activations& a = *act_;
  const int64_t N = B * T, C = c.hidden, L = c.num_layers, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
  const int64_t S = qkv_width(c), HD = H * D, F = c.ffn, V = c.vocab_size;
  const bool gpt2 = c.is_gpt2();
  const WeightLayout lay = gpt2 ? WeightLayout::in_out : WeightLayout::out_in;
  const MoeSizes ms{N, C, F, c.num_experts, c.top_k};

  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t tok = tokens[b * (T + 1) + t], tgt = tokens[b * (T + 1) + t + 1];
      ORIGAMI_CHECK(tok >= 0 && tok < V && tgt >= 0 && tgt < V, "token id ", tok < 0 || tok >= V ? tok : tgt,
                    " is outside the model's vocabulary of ", V);
      a.targets[size_t(b * T + t)] = tgt;
    }

  // ---- forward ----
  embedding_forward(a.resid.data(), tokens, T + 1, w(wte_), w(wpe_), B, T, C);
  Losses out;
  for (int64_t l = 0; l < L; ++l) {
    const LayerOffsets& o = layers_[size_t(l)];
    float* res = a.resid.data() + l * N * C;
    float* mid = a.resid_mid.data() + l * N * C;
    float* ln1 = a.ln1.data() + l * N * C;
    float* ln2 = a.ln2.data() + l * N * C;
    float* qkv = a.qkv.data() + l * N * S;
    float* att = a.att.data() + l * N * HD;
    float* lse = a.lse.data() + l * B * H * T;
    float* next = a.resid.data() + (l + 1) * N * C;
    if (gpt2) layernorm_forward(ln1, a.mean1.data() + l * N, a.rstd1.data() + l * N, res, w(o.ln1_w), w(o.ln1_b), N, C, c.norm_eps);
    else rmsnorm_forward(ln1, a.rstd1.data() + l * N, res, w(o.ln1_w), N, C, c.norm_eps);
    linear_forward(qkv, ln1, w(o.qkv_w), w(o.qkv_b), N, C, S, lay);
    if (!gpt2) rope_forward(qkv, rope_, B, T, H, KV, D);
    attention_forward(att, lse, qkv, B, T, H, KV, D);
    linear_forward(mid, att, w(o.o_w), w(o.o_b), N, HD, C, lay);
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < N * C; ++i) mid[i] += res[i];
    if (gpt2) layernorm_forward(ln2, a.mean2.data() + l * N, a.rstd2.data() + l * N, mid, w(o.ln2_w), w(o.ln2_b), N, C, c.norm_eps);
    else rmsnorm_forward(ln2, a.rstd2.data() + l * N, mid, w(o.ln2_w), N, C, c.norm_eps);
    if (c.is_moe()) {
      MoeCache<float>& mc = moe_[size_t(l)];
      moe_forward(next, mc, ln2, w(o.router), w(o.experts), ms, c.aux_loss_coef, c.z_loss_coef);
      out.aux_loss += mc.aux;
      out.z_loss += mc.z;
    } else {
      float* ma = a.mlp_a.data() + l * N * (gpt2 ? F : 2 * F);
      float* mb = a.mlp_b.data() + l * N * F;
      if (gpt2) {
        linear_forward(ma, ln2, w(o.fc_w), w(o.fc_b), N, C, F, lay);
        gelu_forward(mb, ma, N * F);
      } else {
        linear_forward(ma, ln2, w(o.fc_w), static_cast<const float*>(nullptr), N, C, 2 * F, lay);
        swiglu_forward(mb, ma, N, F);
      }
      linear_forward(next, mb, w(o.proj_w), w(o.proj_b), N, F, C, lay);
    }
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < N * C; ++i) next[i] += mid[i];
  }
  const float* top = a.resid.data() + L * N * C;
  if (gpt2) layernorm_forward(a.lnf.data(), a.meanf.data(), a.rstdf.data(), top, w(lnf_w_), w(lnf_b_), N, C, c.norm_eps);
  else rmsnorm_forward(a.lnf.data(), a.rstdf.data(), top, w(lnf_w_), N, C, c.norm_eps);
  // The LM head's backward is fused into its forward: d_ln = ∂(loss_scale·lm_loss)/∂lnf.
  const double lm_sum = lm_head_loss(backward ? a.d_ln.data() : nullptr, g(head_), logits_out, a.lnf.data(), w(head_),
                                     a.targets.data(), N, C, V, loss_scale / float(N), head_scratch_);
  out.lm_loss = lm_sum / double(N);
  out.loss = out.lm_loss + out.aux_loss + out.z_loss;
  if (!backward) return out;

  // ---- backward ----
  float* d_res = a.d_res.data();  // ∂/∂(residual stream) at the current depth
  std::fill(a.d_res.begin(), a.d_res.end(), 0.f);
  if (gpt2) layernorm_backward(d_res, g(lnf_w_), g(lnf_b_), a.d_ln.data(), top, w(lnf_w_), a.meanf.data(), a.rstdf.data(), N, C);
  else rmsnorm_backward(d_res, g(lnf_w_), a.d_ln.data(), top, w(lnf_w_), a.rstdf.data(), N, C);
  for (int64_t l = L - 1; l >= 0; --l) {
    const LayerOffsets& o = layers_[size_t(l)];
    const float* res = a.resid.data() + l * N * C;
    const float* mid = a.resid_mid.data() + l * N * C;
    const float* ln1 = a.ln1.data() + l * N * C;
    const float* ln2 = a.ln2.data() + l * N * C;
    const float* qkv = a.qkv.data() + l * N * S;
    const float* att = a.att.data() + l * N * HD;
    const float* lse = a.lse.data() + l * B * H * T;
    // MLP branch: next = mid + mlp(norm2(mid)); d_res is ∂/∂next.
    if (c.is_moe()) {
      moe_backward(a.d_ln.data(), g(o.router), g(o.experts), d_res, moe_[size_t(l)], ln2, w(o.router), w(o.experts), ms,
                   c.aux_loss_coef, c.z_loss_coef, loss_scale);
    } else {
      const float* ma = a.mlp_a.data() + l * N * (gpt2 ? F : 2 * F);
      const float* mb = a.mlp_b.data() + l * N * F;
      linear_backward(a.d_mlp_b.data(), g(o.proj_w), g(o.proj_b), d_res, mb, w(o.proj_w), N, F, C, lay);
      if (gpt2) {
        gelu_backward(a.d_mlp_a.data(), a.d_mlp_b.data(), ma, N * F);
        linear_backward(a.d_ln.data(), g(o.fc_w), g(o.fc_b), a.d_mlp_a.data(), ln2, w(o.fc_w), N, C, F, lay);
      } else {
        swiglu_backward(a.d_mlp_a.data(), a.d_mlp_b.data(), ma, N, F);
        linear_backward(a.d_ln.data(), g(o.fc_w), static_cast<float*>(nullptr), a.d_mlp_a.data(), ln2, w(o.fc_w), N, C, 2 * F, lay);
      }
    }
    if (gpt2) layernorm_backward(d_res, g(o.ln2_w), g(o.ln2_b), a.d_ln.data(), mid, w(o.ln2_w), a.mean2.data() + l * N, a.rstd2.data() + l * N, N, C);
    else rmsnorm_backward(d_res, g(o.ln2_w), a.d_ln.data(), mid, w(o.ln2_w), a.rstd2.data() + l * N, N, C);
    // Attention branch: mid = res + o_proj(attn(qkv(norm1(res)))); d_res is now ∂/∂mid.
    linear_backward(a.d_att.data(), g(o.o_w), g(o.o_b), d_res, att, w(o.o_w), N, HD, C, lay);
    attention_backward(a.d_qkv.data(), a.d_att.data(), qkv, att, lse, B, T, H, KV, D);
    if (!gpt2) rope_backward(a.d_qkv.data(), rope_, B, T, H, KV, D);
    linear_backward(a.d_ln.data(), g(o.qkv_w), g(o.qkv_b), a.d_qkv.data(), ln1, w(o.qkv_w), N, C, S, lay);
    if (gpt2) layernorm_backward(d_res, g(o.ln1_w), g(o.ln1_b), a.d_ln.data(), res, w(o.ln1_w), a.mean1.data() + l * N, a.rstd1.data() + l * N, N, C);
    else rmsnorm_backward(d_res, g(o.ln1_w), a.d_ln.data(), res, w(o.ln1_w), a.rstd1.data() + l * N, N, C);
  }
  embedding_backward(g(wte_), g(wpe_), d_res, tokens, T + 1, B, T, C);
  return out;
}

}  // namespace origami
