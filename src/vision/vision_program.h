// The Qwen3-VL vision tower (transformers' Qwen3VLVisionModel, ../shared/docs/qwen3-spec.md 4.2),
// written once as a sequence of ops, forward and backward, like model/layer_program.h for the
// text layers: the CPU reference runs it over VisionCpuOps (vision/vision_cpu_ops.h, fp32); a GPU
// back end would bring its own Ops. tests/vision/reference_vision.h is an independent fp64 oracle.
//
//   x0   = pixels W_patch^T + b_patch + interp(pos_embed)               [N, hv]
//   block b (b < depth), x = xs[b]:
//     a    = attention_per_frame(rope2d(q), rope2d(k), v) of qkv = LN1(x) W_qkv^T + b   [N, hv]
//     mid  = x + a W_proj^T + b_proj
//     xs[b + 1] = mid + fc2(gelu_tanh(fc1(LN2(mid))))
//     if b is deepstack_visual_indexes[j]: deepstack[j] = fc2(gelu_erf(fc1(LN_4hv(view(xs[b+1])))))
//   merged = fc2(gelu_erf(fc1(view(LN_hv(xs[depth])))))                 [N/4, out]
// view: [N, hv] as [N/4, 4 hv], each 4 consecutive rows (one 2x2 merge block) one row.
// N = the batch's patches (all images, frames and merge blocks in the order of vision_config.h).
// Pixels have no gradient; the backward gives every parameter's, accumulated (+=) in fp32.
//
// The op contract. Ops::Act the activations' type, Ops::Weight the weights'; Ops::Buffer<T> a
// resizable buffer of T (resize zero-fills; data()); gradients are fp32 (float*).
//   set_batch(batch)                                  the grids' tables (taps, rope, frames)
//   linear(y, x, w, b, N, in, out)                    y[N, out] = x w^T + b
//   linear_backward(dx, dw, db, dy, x, w, N, in, out) dx written (skipped when null); dw, db +=
//   layernorm(y, mean, rstd, x, w, b, N, C, eps)      mean, rstd [N]
//   layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C)   dx written (may alias dy); dw, db +=
//   gelu_tanh / gelu_erf(y, x, n); *_backward(dx, dy, x, n)      dx written (may alias dy)
//   add_position_embedding(x, table, hv)              x[N, hv] += the taps' weighted rows
//   position_embedding_backward(dtable, dx, hv)       dtable [side^2, hv] +=
//   split_qkv_rope(q, k, v, qkv, heads, hd)           qkv [N, 3 hv] -> q, k (rotated), v [N, hv]
//   split_qkv_rope_backward(dqkv, dq, dk, dv, heads, hd)          dq, dk clobbered; dqkv written
//   attention(out, lse, q, k, v, heads, hd)           within each frame; lse [heads, N]
//   attention_backward(dq, dk, dv, dout, q, k, v, out, lse, heads, hd)   written
//   add(y, x, n)                                      y += x
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "qtrain/error.h"
#include "vision/vision_config.h"
#include "vision/vision_positions.h"

namespace qt {

template <class Ops>
class VisionProgram {
 public:
  using A = typename Ops::Act;
  using W = typename Ops::Weight;
  template <class T>
  using Buf = typename Ops::template Buffer<T>;

  VisionProgram(const VisionConfig& cfg, Ops& ops)
      : c_(cfg), ops_(ops), layout_(vision_param_layout(cfg)), off_(vision_offsets(cfg, layout_)) {}

  const ParamLayout& layout() const { return layout_; }

  // pixels [N, patch_dim] (rows as batch.grids say; kept until backward); params: the flat
  // buffer of layout(). batch must outlive the backward.
  void forward(const A* pixels, const VisionBatch& batch, const W* params) {
    ops_.set_batch(batch);
    pixels_ = pixels;
    P_ = params;
    N_ = batch.patches;
    QT_CHECK(N_ % c_.merge_rows() == 0, "{} patches are not whole merge blocks", N_);
    const int hv = c_.hidden_size, heads = c_.num_heads, hd = c_.head_dim();
    blocks_.resize(c_.depth);
    xs_.resize(c_.depth + 1);
    fill(xs_[0], N_ * hv);
    ops_.linear(xs_[0].data(), pixels, P_ + off_.patch_w, P_ + off_.patch_b, N_, c_.patch_dim(),
                hv);
    ops_.add_position_embedding(xs_[0].data(), P_ + off_.pos_embed, hv);
    deepstack_.resize(c_.deepstack_visual_indexes.size());
    for (int b = 0; b < c_.depth; ++b) {
      block_forward(b, heads, hd);
      for (std::size_t j = 0; j < deepstack_.size(); ++j)
        if (c_.deepstack_visual_indexes[j] == b)
          merger_forward(deepstack_[j], off_.deepstack[j], xs_[b + 1].data(), true);
    }
    merger_forward(merger_, off_.merger, xs_[c_.depth].data(), false);
  }

  int merged_rows() const { return N_ / c_.merge_rows(); }
  const A* merged() const { return merger_.out.data(); }  // [N/4, out_hidden]
  const A* deepstack(std::size_t j) const { return deepstack_[j].out.data(); }
  std::size_t num_deepstack() const { return deepstack_.size(); }

  // d_merged [N/4, out]; d_deepstack[j] [N/4, out] (null: no gradient from it). grads: the flat
  // gradient buffer of layout(), added into.
  void backward(const A* d_merged, const std::vector<const A*>& d_deepstack, float* grads) {
    G_ = grads;
    const int hv = c_.hidden_size;
    Buf<A> dx;
    fill(dx, N_ * hv);
    merger_backward(dx.data(), merger_, off_.merger, xs_[c_.depth].data(), d_merged, false, false);
    for (int b = c_.depth - 1; b >= 0; --b) {
      for (std::size_t j = 0; j < deepstack_.size(); ++j)
        if (c_.deepstack_visual_indexes[j] == b && j < d_deepstack.size() && d_deepstack[j])
          merger_backward(dx.data(), deepstack_[j], off_.deepstack[j], xs_[b + 1].data(),
                          d_deepstack[j], true, true);
      block_backward(b, dx.data());
    }
    ops_.linear_backward(nullptr, G_ + off_.patch_w, G_ + off_.patch_b, dx.data(), pixels_,
                         P_ + off_.patch_w, N_, c_.patch_dim(), hv);
    ops_.position_embedding_backward(G_ + off_.pos_embed, dx.data(), hv);
  }

 private:
  struct BlockActs {
    Buf<A> ln1, q, k, v, attn, lse, mid, ln2, fc1, act;  // [N, hv] .. [N, iv]; lse [heads, N]
    Buf<A> mean1, rstd1, mean2, rstd2;                   // [N]
  };
  struct MergerActs {
    Buf<A> ln, mean, rstd, fc1, act, out;  // ln [N, hv]; fc1, act [N/4, 4hv]; out [N/4, out]
  };

  template <class T>
  static void fill(Buf<T>& b, std::size_t n) {
    b.resize(0);
    b.resize(n);
  }

  void block_forward(int b, int heads, int hd) {
    const int hv = c_.hidden_size, iv = c_.intermediate_size, N = N_;
    const VisionBlockOffsets& o = off_.blocks[b];
    BlockActs& a = blocks_[b];
    const A* x = xs_[b].data();
    for (Buf<A>* t : {&a.ln1, &a.q, &a.k, &a.v, &a.attn, &a.mid, &a.ln2}) fill(*t, N * hv);
    for (Buf<A>* t : {&a.fc1, &a.act}) fill(*t, static_cast<std::size_t>(N) * iv);
    for (Buf<A>* t : {&a.mean1, &a.rstd1, &a.mean2, &a.rstd2}) fill(*t, N);
    fill(a.lse, static_cast<std::size_t>(heads) * N);
    ops_.layernorm(a.ln1.data(), a.mean1.data(), a.rstd1.data(), x, P_ + o.norm1_w,
                   P_ + o.norm1_b, N, hv, c_.layer_norm_eps);
    Buf<A> qkv;
    fill(qkv, static_cast<std::size_t>(N) * 3 * hv);
    ops_.linear(qkv.data(), a.ln1.data(), P_ + o.qkv_w, P_ + o.qkv_b, N, hv, 3 * hv);
    ops_.split_qkv_rope(a.q.data(), a.k.data(), a.v.data(), qkv.data(), heads, hd);
    ops_.attention(a.attn.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), heads, hd);
    ops_.linear(a.mid.data(), a.attn.data(), P_ + o.proj_w, P_ + o.proj_b, N, hv, hv);
    ops_.add(a.mid.data(), x, static_cast<std::size_t>(N) * hv);
    ops_.layernorm(a.ln2.data(), a.mean2.data(), a.rstd2.data(), a.mid.data(), P_ + o.norm2_w,
                   P_ + o.norm2_b, N, hv, c_.layer_norm_eps);
    ops_.linear(a.fc1.data(), a.ln2.data(), P_ + o.fc1_w, P_ + o.fc1_b, N, hv, iv);
    ops_.gelu_tanh(a.act.data(), a.fc1.data(), static_cast<std::size_t>(N) * iv);
    fill(xs_[b + 1], N * hv);
    ops_.linear(xs_[b + 1].data(), a.act.data(), P_ + o.fc2_w, P_ + o.fc2_b, N, iv, hv);
    ops_.add(xs_[b + 1].data(), a.mid.data(), static_cast<std::size_t>(N) * hv);
  }

  // dx: the gradient of xs[b + 1] on entry, of xs[b] on return.
  void block_backward(int b, A* dx) {
    const int hv = c_.hidden_size, iv = c_.intermediate_size, N = N_, heads = c_.num_heads;
    const int hd = c_.head_dim();
    const std::size_t nh = static_cast<std::size_t>(N) * hv;
    const VisionBlockOffsets& o = off_.blocks[b];
    BlockActs& a = blocks_[b];
    Buf<A> dact, dln, dq, dk, dv, dattn, dqkv;
    fill(dact, static_cast<std::size_t>(N) * iv);
    fill(dln, nh);
    // MLP: xs[b+1] = mid + fc2(gelu(fc1(ln2)))
    ops_.linear_backward(dact.data(), G_ + o.fc2_w, G_ + o.fc2_b, dx, a.act.data(),
                         P_ + o.fc2_w, N, iv, hv);
    ops_.gelu_tanh_backward(dact.data(), dact.data(), a.fc1.data(),
                            static_cast<std::size_t>(N) * iv);
    ops_.linear_backward(dln.data(), G_ + o.fc1_w, G_ + o.fc1_b, dact.data(), a.ln2.data(),
                         P_ + o.fc1_w, N, hv, iv);
    ops_.layernorm_backward(dln.data(), G_ + o.norm2_w, G_ + o.norm2_b, dln.data(), a.mid.data(),
                            P_ + o.norm2_w, a.mean2.data(), a.rstd2.data(), N, hv);
    ops_.add(dx, dln.data(), nh);  // dx = d mid
    // Attention: mid = x + proj(attn)
    for (Buf<A>* t : {&dq, &dk, &dv, &dattn}) fill(*t, nh);
    fill(dqkv, 3 * nh);
    ops_.linear_backward(dattn.data(), G_ + o.proj_w, G_ + o.proj_b, dx, a.attn.data(),
                         P_ + o.proj_w, N, hv, hv);
    ops_.attention_backward(dq.data(), dk.data(), dv.data(), dattn.data(), a.q.data(),
                            a.k.data(), a.v.data(), a.attn.data(), a.lse.data(), heads, hd);
    ops_.split_qkv_rope_backward(dqkv.data(), dq.data(), dk.data(), dv.data(), heads, hd);
    ops_.linear_backward(dln.data(), G_ + o.qkv_w, G_ + o.qkv_b, dqkv.data(), a.ln1.data(),
                         P_ + o.qkv_w, N, hv, 3 * hv);
    ops_.layernorm_backward(dln.data(), G_ + o.norm1_w, G_ + o.norm1_b, dln.data(),
                            xs_[b].data(), P_ + o.norm1_w, a.mean1.data(), a.rstd1.data(), N, hv);
    ops_.add(dx, dln.data(), nh);  // dx = d xs[b]
  }

  // postshuffle (deepstack): view to [N/4, 4hv] first, then LN(4hv); else LN(hv), then view.
  void merger_forward(MergerActs& m, const VisionMergerOffsets& o, const A* x, bool postshuffle) {
    const int hv = c_.hidden_size, md = c_.merged_dim(), R = merged_rows();
    const int ln_rows = postshuffle ? R : N_, ln_dim = postshuffle ? md : hv;
    fill(m.ln, static_cast<std::size_t>(N_) * hv);
    fill(m.mean, ln_rows);
    fill(m.rstd, ln_rows);
    fill(m.fc1, static_cast<std::size_t>(R) * md);
    fill(m.act, static_cast<std::size_t>(R) * md);
    fill(m.out, static_cast<std::size_t>(R) * c_.out_hidden_size);
    ops_.layernorm(m.ln.data(), m.mean.data(), m.rstd.data(), x, P_ + o.norm_w, P_ + o.norm_b,
                   ln_rows, ln_dim, c_.layer_norm_eps);
    ops_.linear(m.fc1.data(), m.ln.data(), P_ + o.fc1_w, P_ + o.fc1_b, R, md, md);
    ops_.gelu_erf(m.act.data(), m.fc1.data(), static_cast<std::size_t>(R) * md);
    ops_.linear(m.out.data(), m.act.data(), P_ + o.fc2_w, P_ + o.fc2_b, R, md, c_.out_hidden_size);
  }

  // dx [N, hv]: the merger's input gradient is written (accumulate = false) or added.
  void merger_backward(A* dx, MergerActs& m, const VisionMergerOffsets& o, const A* x,
                       const A* dout, bool postshuffle, bool accumulate) {
    const int hv = c_.hidden_size, md = c_.merged_dim(), R = merged_rows();
    const int ln_rows = postshuffle ? R : N_, ln_dim = postshuffle ? md : hv;
    const std::size_t n = static_cast<std::size_t>(R) * md;  // = N hv
    Buf<A> dact, dln;
    fill(dact, n);
    fill(dln, n);
    ops_.linear_backward(dact.data(), G_ + o.fc2_w, G_ + o.fc2_b, dout, m.act.data(),
                         P_ + o.fc2_w, R, md, c_.out_hidden_size);
    ops_.gelu_erf_backward(dact.data(), dact.data(), m.fc1.data(), n);
    ops_.linear_backward(dln.data(), G_ + o.fc1_w, G_ + o.fc1_b, dact.data(), m.ln.data(),
                         P_ + o.fc1_w, R, md, md);
    ops_.layernorm_backward(accumulate ? dact.data() : dx, G_ + o.norm_w, G_ + o.norm_b,
                            dln.data(), x, P_ + o.norm_w, m.mean.data(), m.rstd.data(), ln_rows,
                            ln_dim);
    if (accumulate) ops_.add(dx, dact.data(), n);
  }

  VisionConfig c_;
  Ops& ops_;
  ParamLayout layout_;
  VisionOffsets off_;
  const A* pixels_ = nullptr;
  const W* P_ = nullptr;
  float* G_ = nullptr;
  int N_ = 0;
  std::vector<Buf<A>> xs_;  // [depth + 1] residual stream, [N, hv] each
  std::vector<BlockActs> blocks_;
  MergerActs merger_;
  std::vector<MergerActs> deepstack_;
};

}  // namespace qt
