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
  std::vector<float> resid;      // [(L+1), Nl, C] residual stream entering each layer (+ final)
  std::vector<float> resid_mid;  // [L, Nl, C] after the attention residual add
  std::vector<float> ln1, ln2;   // [L, N, C] norm outputs, all tokens (gathered under SP)
  std::vector<float> mean1, rstd1, mean2, rstd2;  // [L, Nl]
  std::vector<float> qkv;        // [L, N, Sl]
  std::vector<float> att;        // [L, N, Hl·D]
  std::vector<float> lse;        // [L, B, Hl, T]
  std::vector<float> mlp_a, mlp_b;  // [L, N, ·] gpt2: pre-GELU, GELU out; llama: gate|up, SwiGLU out
  std::vector<float> lnf, meanf, rstdf;  // final norm: output [N, C], statistics [Nl]
  // Region scratch under SP: a norm's output before the gather [Nl, C]; partial sums / gathered gradients [N, C].
  std::vector<float> loc, full;
  // Backward scratch.
  std::vector<float> d_res, d_ln, d_att, d_qkv, d_mlp_a, d_mlp_b, d_weight;
};

Model::Model(const ModelConfig& cfg, Params& params, TensorParallel tp)
    : cfg_(cfg), params_(params), tp_(std::move(tp)), act_(std::make_shared<Activations>()) {
  const int64_t t = tp_.size();
  ORIGAMI_ASSERT(params.layout().tp == t && params.layout().tp_rank == tp_.rank());
  ORIGAMI_ASSERT(cfg.num_heads % t == 0 && cfg.num_kv_heads % t == 0 && cfg.ffn % t == 0);
  Hl_ = cfg.num_heads / t, KVl_ = cfg.num_kv_heads / t, Fl_ = cfg.ffn / t;
  Vl_ = (cfg.vocab_size + t - 1) / t;  // rows per rank of the vocabulary padded to a multiple of t
  vocab_begin_ = tp_.rank() * Vl_;
  vocab_valid_ = std::clamp<int64_t>(cfg.vocab_size - vocab_begin_, 0, Vl_);
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
      o.qkv_w = need(p + "self_attn.q_proj.weight");  // q|k|v contiguous: one [Sl, C] matrix
      ORIGAMI_ASSERT(need(p + "self_attn.v_proj.weight") == o.qkv_w + (Hl_ + KVl_) * cfg.head_dim * cfg.hidden);
      o.o_w = need(p + "self_attn.o_proj.weight");
      o.ln2_w = need(p + "post_attention_layernorm.weight");
      if (cfg.is_moe()) {
        o.router = need(p + "block_sparse_moe.gate.weight");
        o.experts = need(p + "block_sparse_moe.experts.0.w1.weight");
        ORIGAMI_ASSERT(cfg.num_experts == 1 ||
                       need(p + "block_sparse_moe.experts.1.w1.weight") - o.experts == 3 * Fl_ * cfg.hidden);
      } else {
        o.fc_w = need(p + "mlp.gate_proj.weight");  // gate|up contiguous: one [2F, C] matrix
        ORIGAMI_ASSERT(need(p + "mlp.up_proj.weight") == o.fc_w + Fl_ * cfg.hidden);
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
  // Where each layer's parameters start in the buffer (for the gradient-ready hook).
  const std::string final_norm = cfg.is_gpt2() ? "ln_f.weight" : "model.norm.weight";
  layer_begin_.assign(size_t(cfg.num_layers), INT64_MAX);
  for (size_t i = 0; i < params_.table().size(); ++i) {
    const std::string& n = params_.table()[i].name;
    const std::string prefix = cfg.is_gpt2() ? "h." : "model.layers.";
    if (n.rfind(prefix, 0) == 0) {
      const size_t l = std::stoul(n.substr(prefix.size()));
      layer_begin_[l] = std::min(layer_begin_[l], params_.offset(i));
    }
  }
  head_begin_ = off(final_norm);
  ORIGAMI_ASSERT(head_begin_ >= 0 && (cfg.tied_embeddings || head_ >= head_begin_));
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
  const int64_t N = B * T, Nl = tp_.local_tokens(N), C = c.hidden, L = c.num_layers;
  const int64_t Sl = (Hl_ + 2 * KVl_) * c.head_dim, HDl = Hl_ * c.head_dim;
  const int64_t fa = c.is_gpt2() ? Fl_ : 2 * Fl_;  // width of mlp_a (pre-activation or gate|up)
  const int64_t fb = c.is_moe() ? 0 : Fl_;
  a.B = B, a.T = T;
  a.targets.resize(size_t(N));
  a.resid.resize(size_t((L + 1) * Nl * C));
  a.resid_mid.resize(size_t(L * Nl * C));
  a.ln1.resize(size_t(L * N * C));
  a.ln2.resize(size_t(L * N * C));
  for (auto* v : {&a.mean1, &a.rstd1, &a.mean2, &a.rstd2}) v->resize(size_t(L * Nl));
  a.qkv.resize(size_t(L * N * Sl));
  a.att.resize(size_t(L * N * HDl));
  a.lse.resize(size_t(L * B * Hl_ * T));
  a.mlp_a.resize(c.is_moe() ? 0 : size_t(L * N * fa));
  a.mlp_b.resize(size_t(L * N * fb));
  a.lnf.resize(size_t(N * C));
  a.meanf.resize(size_t(Nl));
  a.rstdf.resize(size_t(Nl));
  a.loc.resize(tp_.sp() ? size_t(Nl * C) : 0);
  a.full.resize(tp_.sp() ? size_t(N * C) : 0);
  a.d_res.resize(size_t(Nl * C));
  a.d_ln.resize(size_t(N * C));
  a.d_att.resize(size_t(N * HDl));
  a.d_qkv.resize(size_t(N * Sl));
  a.d_mlp_a.resize(size_t(N * fa));
  a.d_mlp_b.resize(size_t(N * Fl_));
  a.d_weight.resize(c.is_moe() ? size_t(N * c.top_k) : 0);
}

namespace {

// out[n, :] += res[n, :] (+ bias): a residual add, with the bias of the row-parallel layer that
// produced `out` (added once, after the TP reduction).
void residual_add(float* out, const float* res, const float* bias, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * C;
    const float* r = res + n * C;
    if (bias) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += r[c] + bias[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += r[c];
    }
  }
}

}  // namespace

Losses Model::forward_backward(const int32_t* tokens, int64_t B, int64_t T, float loss_scale, bool backward,
                               float* logits_out) {
  const ModelConfig& c = cfg_;
  ORIGAMI_CHECK(T <= c.max_positions, "sequence length ", T, " exceeds the model's maximum positions (",
                c.max_positions, ")");
  ORIGAMI_ASSERT(!tp_.sp() || T % tp_.size() == 0);
  ensure_activations(B, T);
  Activations& a = *act_;
  const int64_t N = B * T, Nl = tp_.local_tokens(N), C = c.hidden, L = c.num_layers, D = c.head_dim;
  const int64_t H = Hl_, KV = KVl_, F = Fl_, S = (H + 2 * KV) * D, HD = H * D, V = c.vocab_size;
  const bool gpt2 = c.is_gpt2();
  const WeightLayout lay = gpt2 ? WeightLayout::in_out : WeightLayout::out_in;
  const MoeSizes ms{N, C, F, c.num_experts, c.top_k};
  TensorParallel& tp = tp_;
  auto norm_forward = [&](float* y, float* mean, float* rstd, const float* x, int64_t w_off, int64_t b_off) {
    if (gpt2) layernorm_forward(y, mean, rstd, x, w(w_off), w(b_off), Nl, C, c.norm_eps);
    else rmsnorm_forward(y, rstd, x, w(w_off), Nl, C, c.norm_eps);
  };
  auto norm_backward = [&](float* dx, const float* dy, const float* x, const float* mean, const float* rstd,
                           int64_t w_off, int64_t b_off) {
    if (gpt2) layernorm_backward(dx, g(w_off), g(b_off), dy, x, w(w_off), mean, rstd, Nl, C);
    else rmsnorm_backward(dx, g(w_off), dy, x, w(w_off), rstd, Nl, C);
  };

  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t tok = tokens[b * (T + 1) + t], tgt = tokens[b * (T + 1) + t + 1];
      ORIGAMI_CHECK(tok >= 0 && tok < V && tgt >= 0 && tgt < V, "token id ", tok < 0 || tok >= V ? tok : tgt,
                    " is outside the model's vocabulary of ", V);
      a.targets[size_t(b * T + t)] = tgt;
    }

  // ---- forward ----
  // Vocab-parallel embedding: every rank looks up its vocabulary rows for all N tokens (positions
  // added on TP rank 0 only), and the region exit sums the partial embeddings.
  {
    float* x0 = a.resid.data();
    float* part = tp.full(x0, a.full.data());
    embedding_forward(part, tokens, T + 1, w(wte_), tp.rank() == 0 ? w(wpe_) : nullptr, B, T, C, vocab_begin_, Vl_);
    tp.exit(x0, part, B, T, C);
  }
  Losses out;
  for (int64_t l = 0; l < L; ++l) {
    const LayerOffsets& o = layers_[size_t(l)];
    float* res = a.resid.data() + l * Nl * C;
    float* mid = a.resid_mid.data() + l * Nl * C;
    float* ln1 = a.ln1.data() + l * N * C;
    float* ln2 = a.ln2.data() + l * N * C;
    float* qkv = a.qkv.data() + l * N * S;
    float* att = a.att.data() + l * N * HD;
    float* lse = a.lse.data() + l * B * H * T;
    float* next = a.resid.data() + (l + 1) * Nl * C;
    // Attention: column-parallel QKV (this rank's heads), row-parallel output projection.
    float* ln1_loc = tp.local(ln1, a.loc.data());  // SP: the norm's own tokens before the gather
    norm_forward(ln1_loc, a.mean1.data() + l * Nl, a.rstd1.data() + l * Nl, res, o.ln1_w, o.ln1_b);
    tp.enter(ln1, ln1_loc, B, T, C);
    linear_forward(qkv, ln1, w(o.qkv_w), w(o.qkv_b), N, C, S, lay);
    if (!gpt2) rope_forward(qkv, rope_, B, T, H, KV, D);
    attention_forward(att, lse, qkv, B, T, H, KV, D);
    float* part = tp.full(mid, a.full.data());
    linear_forward(part, att, w(o.o_w), static_cast<const float*>(nullptr), N, HD, C, lay);
    tp.exit(mid, part, B, T, C);
    residual_add(mid, res, w(o.o_b), Nl, C);
    // MLP or MoE: column-parallel up (gate|up, expert w1|w3), row-parallel down (expert w2).
    float* ln2_loc = tp.local(ln2, a.loc.data());
    norm_forward(ln2_loc, a.mean2.data() + l * Nl, a.rstd2.data() + l * Nl, mid, o.ln2_w, o.ln2_b);
    tp.enter(ln2, ln2_loc, B, T, C);
    part = tp.full(next, a.full.data());
    if (c.is_moe()) {
      MoeCache<float>& mc = moe_[size_t(l)];
      moe_forward(part, mc, ln2, w(o.router), w(o.experts), ms, c.aux_loss_coef, c.z_loss_coef);
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
      linear_forward(part, mb, w(o.proj_w), static_cast<const float*>(nullptr), N, F, C, lay);
    }
    tp.exit(next, part, B, T, C);
    residual_add(next, mid, w(o.proj_b), Nl, C);
  }
  const float* top = a.resid.data() + L * Nl * C;
  float* lnf_loc = tp.local(a.lnf.data(), a.loc.data());
  norm_forward(lnf_loc, a.meanf.data(), a.rstdf.data(), top, lnf_w_, lnf_b_);
  tp.enter(a.lnf.data(), lnf_loc, B, T, C);
  // Vocab-parallel LM head and cross-entropy; its backward is fused into its forward:
  // d_ln = this rank's part of ∂(loss_scale·lm_loss)/∂lnf.
  VocabShard<float> shard{vocab_begin_, vocab_valid_, nullptr};
  if (tp.size() > 1) shard.combine = [&tp](float* stats, int64_t n) { tp.combine_vocab_stats(stats, n); };
  const double lm_sum = lm_head_loss(backward ? a.d_ln.data() : nullptr, g(head_), logits_out, a.lnf.data(), w(head_),
                                     a.targets.data(), N, C, Vl_, loss_scale / float(N), head_scratch_, shard);
  out.lm_loss = lm_sum / double(N);
  out.loss = out.lm_loss + out.aux_loss + out.z_loss;
  if (!backward) return out;

  // ---- backward ----
  float* d_res = a.d_res.data();  // ∂/∂(residual stream) at the current depth, this rank's tokens
  std::fill(a.d_res.begin(), a.d_res.end(), 0.f);
  float* d_ln_loc = tp.local(a.d_ln.data(), a.loc.data());
  tp.enter_backward(d_ln_loc, a.d_ln.data(), B, T, C);
  norm_backward(d_res, d_ln_loc, top, a.meanf.data(), a.rstdf.data(), lnf_w_, lnf_b_);
  grads_ready(head_begin_);
  for (int64_t l = L - 1; l >= 0; --l) {
    const LayerOffsets& o = layers_[size_t(l)];
    const float* res = a.resid.data() + l * Nl * C;
    const float* mid = a.resid_mid.data() + l * Nl * C;
    const float* ln1 = a.ln1.data() + l * N * C;
    const float* ln2 = a.ln2.data() + l * N * C;
    const float* qkv = a.qkv.data() + l * N * S;
    const float* att = a.att.data() + l * N * HD;
    const float* lse = a.lse.data() + l * B * H * T;
    // MLP branch: next = mid + mlp(norm2(mid)); d_res is ∂/∂next.
    const float* d_out = tp.exit_backward(a.full.data(), d_res, B, T, C);  // all tokens
    if (c.is_moe()) {
      // Expert outputs are partial sums over TP, so is dweight: reduce it before the (replicated) router;
      // the router's input gradient is added on TP rank 0 only, so the region's reduction counts it once.
      const MoeCache<float>& mc = moe_[size_t(l)];
      moe_backward_experts(a.d_ln.data(), a.d_weight.data(), g(o.experts), d_out, mc, moe_scratch_, w(o.experts),
                           ms);
      tp.all_reduce(a.d_weight.data(), N * c.top_k);
      moe_backward_router(tp.rank() == 0 ? a.d_ln.data() : nullptr, g(o.router), a.d_weight.data(), mc, ln2,
                          w(o.router), ms, c.aux_loss_coef, c.z_loss_coef, loss_scale);
    } else {
      const float* ma = a.mlp_a.data() + l * N * (gpt2 ? F : 2 * F);
      const float* mb = a.mlp_b.data() + l * N * F;
      linear_backward(a.d_mlp_b.data(), g(o.proj_w), g(o.proj_b), d_out, mb, w(o.proj_w), N, F, C, lay);
      if (gpt2) {
        gelu_backward(a.d_mlp_a.data(), a.d_mlp_b.data(), ma, N * F);
        linear_backward(a.d_ln.data(), g(o.fc_w), g(o.fc_b), a.d_mlp_a.data(), ln2, w(o.fc_w), N, C, F, lay);
      } else {
        swiglu_backward(a.d_mlp_a.data(), a.d_mlp_b.data(), ma, N, F);
        linear_backward(a.d_ln.data(), g(o.fc_w), static_cast<float*>(nullptr), a.d_mlp_a.data(), ln2, w(o.fc_w), N,
                        C, 2 * F, lay);
      }
    }
    tp.enter_backward(d_ln_loc, a.d_ln.data(), B, T, C);
    norm_backward(d_res, d_ln_loc, mid, a.mean2.data() + l * Nl, a.rstd2.data() + l * Nl, o.ln2_w, o.ln2_b);
    // Attention branch: mid = res + o_proj(attn(qkv(norm1(res)))); d_res is now ∂/∂mid.
    d_out = tp.exit_backward(a.full.data(), d_res, B, T, C);
    linear_backward(a.d_att.data(), g(o.o_w), g(o.o_b), d_out, att, w(o.o_w), N, HD, C, lay);
    attention_backward(a.d_qkv.data(), a.d_att.data(), qkv, att, lse, B, T, H, KV, D);
    if (!gpt2) rope_backward(a.d_qkv.data(), rope_, B, T, H, KV, D);
    linear_backward(a.d_ln.data(), g(o.qkv_w), g(o.qkv_b), a.d_qkv.data(), ln1, w(o.qkv_w), N, C, S, lay);
    tp.enter_backward(d_ln_loc, a.d_ln.data(), B, T, C);
    norm_backward(d_res, d_ln_loc, res, a.mean1.data() + l * Nl, a.rstd1.data() + l * Nl, o.ln1_w, o.ln1_b);
    grads_ready(layer_begin_[size_t(l)]);
  }
  const float* d_out = tp.exit_backward(a.full.data(), d_res, B, T, C);
  embedding_backward(g(wte_), g(wpe_), d_out, tokens, T + 1, B, T, C, vocab_begin_, Vl_);
  grads_ready(0);
  return out;
}

}  // namespace origami
