/// \file gpu_transformer.cpp
/// GpuTransformer (gpu_transformer.hpp): device weights, cuBLAS GEMMs, the small kernels of
/// gpu_kernels.cu and ThinKV's device cache driven by its batched calls.

#include "gpu_transformer.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_cache.hpp"
#include "gpu_kernels.hpp"

namespace thinkv::decoder {
namespace {

using gpu::Elem;

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  (void)cudaGetLastError();
  if (e == cudaErrorMemoryAllocation) {
    return {StatusCode::kPoolExhausted, std::string("GPU decoder: ") + what + ": out of device memory"};
  }
  return {StatusCode::kCudaError, std::string("GPU decoder: ") + what + ": " + cudaGetErrorString(e)};
}
#define TKV_CUDA(call, what) THINKV_RETURN_IF_ERROR(cuda_status((call), (what)))

Status cublas_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return {StatusCode::kCudaError, std::string("GPU decoder: ") + what + ": cuBLAS status " + std::to_string(s) +
                                      (s == CUBLAS_STATUS_ALLOC_FAILED ? " (out of device memory)" : "")};
}

std::uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  std::uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// ForwardEngine (session.hpp) over a GpuTransformer of one sequence.
class GpuEngine final : public ForwardEngine, public ThinKvState {
 public:
  GpuEngine(std::unique_ptr<GpuTransformer> g, const GpuCache& c) : g_(std::move(g)), c_(c) { next_.resize(1); }
  Status forward(int token, std::span<float> logits) override {
    const int seq = 0;
    return g_->step(std::span<const int>(&seq, 1), std::span<const int>(&token, 1), next_, logits);
  }
  std::string method_name() const override { return c_.method_name(); }
  CacheReport report() const override { return c_.report(0); }
  std::int32_t position() const override { return c_.position(0); }
  const ThinKvState& state() const override { return *this; }
  std::int64_t live_tokens(int seq) const override { return c_.live_tokens(seq); }
  std::int32_t position(int seq) const override { return c_.position(seq); }
  std::span<const float> layer_sparsity(int seq) const override { return c_.layer_sparsity(seq); }
  const ThinKvStats& stats() const override { return c_.stats(); }
  MemoryUsage memory(int seq) const override { return c_.memory(seq); }
  BlockTableStats table_stats() const override { return c_.table_stats(); }
  ThoughtStats thought_stats(int seq) const override { return c_.thought_stats(seq); }
  std::vector<SegmentState> segments(int seq) const override { return c_.segments(seq); }

 private:
  std::unique_ptr<GpuTransformer> g_;
  const GpuCache& c_;
  std::vector<int> next_;
};

}  // namespace

struct GpuTransformer::Impl {
  ModelConfig cfg;
  Elem wt = Elem::kBF16;
  int max_batch = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  std::unique_ptr<GpuCache> cache;
  std::vector<TokenHint> hints;  // the step's tokens, for classifiers that read them

  // Weights: one device allocation, carved into these (element type wt unless noted).
  void* weights = nullptr;
  std::int64_t weight_bytes = 0;
  const void* embedding = nullptr;  // [vocab, dim]
  const void* output = nullptr;     // [vocab, dim]
  const float* final_norm = nullptr;
  const float* freqs = nullptr;  // [rope_dim / 2] FP32
  struct Layer {
    const float* attn_norm = nullptr;
    const float* ffn_norm = nullptr;
    const void* wqkv = nullptr;  // [q_dim + 2 kv_dim, dim]
    const void* wo = nullptr;    // [dim, q_dim]
    const void* w13 = nullptr;   // [2 hidden, dim]
    const void* w2 = nullptr;    // [dim, hidden]
  };
  std::vector<Layer> layers;

  // Step buffers, sized for max_batch (one allocation).
  void* acts = nullptr;
  std::int64_t act_bytes = 0;
  float *x = nullptr, *qkv = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *h13 = nullptr,
        *logits = nullptr;
  void *xb = nullptr, *attw = nullptr, *hh = nullptr;  // GEMM inputs in wt
  int *d_tokens = nullptr, *d_pos = nullptr, *d_next = nullptr;

  bool timing = false;
  GpuStepTimes times;

  // Tensor parallelism: this rank's slice (the whole model when tp is nullptr).
  Collective* tp = nullptr;
  int tp_size = 1, tp_rank = 0;
  int hq = 0, hkv = 0;                    // this rank's query and KV heads
  std::int64_t qd = 0, kvd = 0, hid = 0;  // this rank's q_dim, kv_dim, FFN hidden units
  float* partial = nullptr;               // [max_batch, dim]: a rank's share of wo's / w2's output

  ~Impl() {
    cache.reset();  // the backend's device state goes before the stream
    if (blas != nullptr) cublasDestroy(blas);
    for (Slot& sl : slots) {
      for (cudaEvent_t e : sl.ev) {
        if (e != nullptr) cudaEventDestroy(e);
      }
      if (sl.done != nullptr) cudaEventDestroy(sl.done);
      if (sl.h != nullptr) cudaFreeHost(sl.h);
    }
    if (weights != nullptr) cudaFree(weights);
    if (acts != nullptr) cudaFree(acts);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  [[nodiscard]] std::size_t wbytes(std::int64_t n) const { return static_cast<std::size_t>(n) * gpu::elem_bytes(wt); }

  /// Layout of the weight allocation: offsets in the order they are filled.
  struct Carve {
    std::size_t off = 0;
    std::size_t take(std::size_t bytes) {
      const std::size_t o = off;
      off += (bytes + 255) / 256 * 256;
      return o;
    }
  };

  Status setup(std::unique_ptr<GpuCache> cache_in, const GpuDecoderOptions& options) {
    const ModelConfig& c = cfg;
    if (!cache_in) return {StatusCode::kInvalidArgument, "GPU decoder: no cache given"};
    cache = std::move(cache_in);
    const ThinKvConfig& spec = cache->config();
    tp = options.tensor_parallel;
    tp_size = tp != nullptr ? tp->size() : 1;
    tp_rank = tp != nullptr ? tp->rank() : 0;
    if (c.n_kv_heads % tp_size != 0 || c.n_heads % tp_size != 0 || c.hidden_dim % tp_size != 0) {
      return {StatusCode::kInvalidArgument,
              "GPU decoder: tensor parallelism over " + std::to_string(tp_size) + " ranks needs the KV heads (" +
                  std::to_string(c.n_kv_heads) + "), query heads (" + std::to_string(c.n_heads) +
                  ") and FFN hidden units (" + std::to_string(c.hidden_dim) + ") to split evenly"};
    }
    hq = c.n_heads / tp_size;
    hkv = c.n_kv_heads / tp_size;
    qd = std::int64_t{hq} * c.head_dim;
    kvd = std::int64_t{hkv} * c.head_dim;
    hid = c.hidden_dim / tp_size;
    const int model_kv = spec.model_kv_heads == 0 ? spec.num_kv_heads : spec.model_kv_heads;
    if (spec.num_layers != c.n_layers || spec.num_kv_heads != hkv || spec.num_q_heads != hq ||
        spec.head_dim != c.head_dim || model_kv != c.n_kv_heads || spec.kv_head_offset != tp_rank * hkv) {
      return {StatusCode::kShapeMismatch,
              "GPU decoder: the cache is configured for layers=" + std::to_string(spec.num_layers) +
                  " kv_heads=" + std::to_string(spec.num_kv_heads) + " q_heads=" + std::to_string(spec.num_q_heads) +
                  " head_dim=" + std::to_string(spec.head_dim) + " (KV heads " + std::to_string(spec.kv_head_offset) +
                  ".. of " + std::to_string(model_kv) + "); the model has " + c.to_string() +
                  (tp_size > 1 ? ", of which tensor-parallel rank " + std::to_string(tp_rank) + " of " +
                                     std::to_string(tp_size) + " holds " + std::to_string(hkv) + " KV heads from " +
                                     std::to_string(tp_rank * hkv) + " and " + std::to_string(hq) +
                                     " query heads (tensor_parallel_slice)"
                               : std::string())};
    }
    if (tp != nullptr) {
      THINKV_RETURN_IF_ERROR(cache->set_signal_reduction(
          c.n_heads, [this](std::span<double> sums) { return tp->all_reduce_host(sums, stream); }));
    }
    max_batch = spec.num_sequences;
    TKV_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    THINKV_RETURN_IF_ERROR(cublas_status(cublasCreate(&blas), "cublasCreate"));
    THINKV_RETURN_IF_ERROR(cublas_status(cublasSetStream(blas, stream), "cublasSetStream"));
    // FP32 accumulation everywhere and no TF32: the GEMMs compute what the CPU decoder does, up to
    // the order of the sums.
    THINKV_RETURN_IF_ERROR(cublas_status(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
    THINKV_RETURN_IF_ERROR(cache->set_stream(stream));
    if (options.reserve) THINKV_RETURN_IF_ERROR(cache->reserve_storage());
    hints.resize(static_cast<std::size_t>(max_batch));
    // Step buffers.
    const std::size_t B = static_cast<std::size_t>(max_batch);
    const std::size_t qkv_w = static_cast<std::size_t>(qd + 2 * kvd);
    const std::size_t Q = static_cast<std::size_t>(qd), KV = static_cast<std::size_t>(kvd),
                      H = static_cast<std::size_t>(hid);
    Carve cv;
    const std::size_t o_x = cv.take(B * c.dim * 4), o_qkv = cv.take(B * qkv_w * 4), o_q = cv.take(B * Q * 4),
                      o_k = cv.take(B * KV * 4), o_v = cv.take(B * KV * 4), o_att = cv.take(B * Q * 4),
                      o_h13 = cv.take(B * 2 * H * 4), o_logits = cv.take(B * c.vocab_size * 4),
                      o_xb = cv.take(wbytes(B * c.dim)), o_attw = cv.take(wbytes(B * Q)), o_hh = cv.take(wbytes(B * H)),
                      o_partial = tp != nullptr ? cv.take(B * c.dim * 4) : 0, o_ints = cv.take(B * 5 * sizeof(int));
    act_bytes = static_cast<std::int64_t>(cv.off);
    TKV_CUDA(cudaMalloc(&acts, cv.off), "cudaMalloc of the step buffers");
    auto* base = static_cast<unsigned char*>(acts);
    x = reinterpret_cast<float*>(base + o_x);
    qkv = reinterpret_cast<float*>(base + o_qkv);
    q = reinterpret_cast<float*>(base + o_q);
    k = reinterpret_cast<float*>(base + o_k);
    v = reinterpret_cast<float*>(base + o_v);
    att = reinterpret_cast<float*>(base + o_att);
    h13 = reinterpret_cast<float*>(base + o_h13);
    logits = reinterpret_cast<float*>(base + o_logits);
    xb = base + o_xb;
    attw = base + o_attw;
    hh = base + o_hh;
    if (tp != nullptr) partial = reinterpret_cast<float*>(base + o_partial);
    d_tokens = reinterpret_cast<int*>(base + o_ints);  // tokens, positions, sequences: one upload
    d_pos = d_tokens + B;
    d_seqs = d_pos + B;
    d_next = d_seqs + B;
    d_last = d_next + B;
    TKV_CUDA(cudaMemset(d_last, 0, B * sizeof(int)), "cudaMemset");
    last_host.assign(B, 0);
    for (Slot& sl : slots) {
      TKV_CUDA(cudaMallocHost(reinterpret_cast<void**>(&sl.h), B * 4 * sizeof(int)), "cudaMallocHost");
      std::memset(sl.h, 0, B * 4 * sizeof(int));
      TKV_CUDA(cudaEventCreateWithFlags(&sl.done, cudaEventDisableTiming), "cudaEventCreate");
      for (cudaEvent_t& e : sl.ev) TKV_CUDA(cudaEventCreate(&e), "cudaEventCreate");
    }
    return Status::ok();
  }

  /// Offsets of every weight in the allocation; fill(name, ptr) places each.
  Status allocate_weights(std::vector<std::size_t>& offs) {
    const ModelConfig& c = cfg;
    const std::int64_t dim = c.dim, voc = c.vocab_size;  // qd, kvd, hid: this rank's slice
    Carve cv;
    offs.clear();
    offs.push_back(cv.take(wbytes(voc * dim)));                                 // embedding
    offs.push_back(cv.take(wbytes(voc * dim)));                                 // output
    offs.push_back(cv.take(static_cast<std::size_t>(dim) * 4));                 // final norm
    offs.push_back(cv.take(static_cast<std::size_t>(c.rope_dim / 2 + 1) * 4));  // freqs
    for (int l = 0; l < c.n_layers; ++l) {
      offs.push_back(cv.take(static_cast<std::size_t>(dim) * 4));  // attn norm
      offs.push_back(cv.take(static_cast<std::size_t>(dim) * 4));  // ffn norm
      offs.push_back(cv.take(wbytes((qd + 2 * kvd) * dim)));
      offs.push_back(cv.take(wbytes(dim * qd)));
      offs.push_back(cv.take(wbytes(2 * hid * dim)));
      offs.push_back(cv.take(wbytes(dim * hid)));
    }
    weight_bytes = static_cast<std::int64_t>(cv.off);
    TKV_CUDA(cudaMalloc(&weights, cv.off), "cudaMalloc of the weights");
    auto* base = static_cast<unsigned char*>(weights);
    std::size_t i = 0;
    embedding = base + offs[i++];
    output = base + offs[i++];
    final_norm = reinterpret_cast<const float*>(base + offs[i++]);
    freqs = reinterpret_cast<const float*>(base + offs[i++]);
    layers.resize(static_cast<std::size_t>(c.n_layers));
    for (Layer& L : layers) {
      L.attn_norm = reinterpret_cast<const float*>(base + offs[i++]);
      L.ffn_norm = reinterpret_cast<const float*>(base + offs[i++]);
      L.wqkv = base + offs[i++];
      L.wo = base + offs[i++];
      L.w13 = base + offs[i++];
      L.w2 = base + offs[i++];
    }
    return Status::ok();
  }

  Status upload_freqs(const std::vector<float>& factors) {
    std::vector<float> f(static_cast<std::size_t>(cfg.rope_dim / 2 + 1), 0.0f);
    for (int i = 0; i < cfg.rope_dim; i += 2) {  // transformer.hpp's frequencies, computed the same way
      float fr = 1.0f / std::pow(cfg.rope_theta, static_cast<float>(i) / static_cast<float>(cfg.rope_dim));
      if (!factors.empty()) fr /= factors[static_cast<std::size_t>(i / 2)];
      f[static_cast<std::size_t>(i / 2)] = fr;
    }
    TKV_CUDA(cudaMemcpy(const_cast<float*>(freqs), f.data(), f.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    return Status::ok();
  }

  /// A block of a matrix: rows [r0, r0 + rows), columns [c0, c0 + cols).
  struct Slice {
    const Matrix* m = nullptr;
    std::int64_t r0 = 0, rows = 0, c0 = 0, cols = 0;
  };
  static Slice rows_of(const Matrix& m, std::int64_t r0, std::int64_t rows) { return {&m, r0, rows, 0, m.cols}; }
  static Slice cols_of(const Matrix& m, std::int64_t c0, std::int64_t cols) { return {&m, 0, m.rows, c0, cols}; }

  /// Copies blocks of matrices (stacked row-wise, in order; all as wide) into `dst` in the
  /// weights' element type.
  Status upload_matrices(const void* dst, std::initializer_list<Slice> ms) {
    std::size_t rows = 0, cols = 0;
    for (const Slice& m : ms) {
      rows += static_cast<std::size_t>(m.rows);
      cols = static_cast<std::size_t>(m.cols);
    }
    std::vector<float> f(rows * cols);
    std::size_t r0 = 0;
    for (const Slice& m : ms) {
      std::vector<float> row(static_cast<std::size_t>(m.m->cols));
      for (std::int64_t r = 0; r < m.rows; ++r) {
        m.m->row(m.r0 + r, row.data());
        std::copy_n(row.begin() + m.c0, m.cols,
                    f.begin() + static_cast<std::ptrdiff_t>((r0 + static_cast<std::size_t>(r)) * cols));
      }
      r0 += static_cast<std::size_t>(m.rows);
    }
    void* d = const_cast<void*>(dst);
    if (wt == Elem::kF32) {
      TKV_CUDA(cudaMemcpy(d, f.data(), f.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy of a weight");
      return Status::ok();
    }
    std::vector<std::uint16_t> h(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) h[i] = f32_to_bf16(f[i]);
    TKV_CUDA(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy of a weight");
    return Status::ok();
  }
  Status upload_vector(const float* dst, const float* src, int n) {
    TKV_CUDA(cudaMemcpy(const_cast<float*>(dst), src, static_cast<std::size_t>(n) * 4, cudaMemcpyHostToDevice),
             "cudaMemcpy of a norm");
    return Status::ok();
  }

  /// Y[b] = W X[b] (+ Y[b] when accumulate): W [rows, cols] row-major in wt, X [batch, cols] in
  /// wt, Y [batch, rows] FP32. Column-major, that is Y^T = W^T' X^T with W^T' = op_T(W).
  Status gemm(const void* W, int rows, int cols, const void* X, int batch, float* Y, bool accumulate) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const cudaDataType_t t = wt == Elem::kF32 ? CUDA_R_32F : CUDA_R_16BF;
    return cublas_status(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, batch, cols, &alpha, W, t, cols, X, t, cols,
                                      &beta, Y, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                         "cublasGemmEx");
  }

  /// x += W in (W [dim, cols], this rank's columns of wo or w2): on one GPU the GEMM adds into
  /// x; under tensor parallelism each rank's partial product is summed over the ranks first.
  /// `ev` (two events, or nullptr): recorded around the all-reduce.
  Status project_out(const void* W, int cols, const void* in, int B, cudaEvent_t* ev) {
    if (tp == nullptr) return gemm(W, cfg.dim, cols, in, B, x, true);
    THINKV_RETURN_IF_ERROR(gemm(W, cfg.dim, cols, in, B, partial, false));
    const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(cfg.dim);
    if (ev != nullptr) TKV_CUDA(cudaEventRecord(ev[0], stream), "cudaEventRecord");
    THINKV_RETURN_IF_ERROR(tp->all_reduce(partial, n, stream));
    if (ev != nullptr) TKV_CUDA(cudaEventRecord(ev[1], stream), "cudaEventRecord");
    TKV_CUDA(gpu::add(x, partial, n, stream), "add");
    return Status::ok();
  }

  using Clock = std::chrono::steady_clock;
  static double ms(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double, std::milli>(to - from).count();
  }
  /// A launched step (pipelined decoding keeps two): its pinned host arrays, its events.
  struct Slot {
    int* h = nullptr;  // pinned [4 * max_batch]: tokens, positions, sequences, next tokens
    cudaEvent_t done = nullptr;
    // timing: layer 0's parts (0-3), the layers (0-4), the head (5-6), layer 0's two all-reduces
    // under tensor parallelism (7-8, 9-10)
    cudaEvent_t ev[11] = {};
    std::vector<int> seqs;
    bool in_flight = false;
    bool timed = false;
    Clock::time_point t_start;
  };
  Slot slots[2];
  int next_slot = 0;    // the slot the next launch takes
  int oldest_slot = 0;  // the slot the next collect reads
  int* d_seqs = nullptr;
  int* d_last = nullptr;       // [max_batch] each sequence's last greedy token (device)
  std::vector<int> last_host;  // the last collected greedy token of each sequence (hints)

  [[nodiscard]] int in_flight() const {
    return static_cast<int>(slots[0].in_flight) + static_cast<int>(slots[1].in_flight);
  }

  Status forward(std::span<const int> seqs, std::span<const int> tokens, std::span<int> next,
                 std::span<float> out_logits) {
    if (in_flight() != 0) {
      return {StatusCode::kInvalidArgument,
              "GPU decoder: step() while launched steps are not collected (collect them first)"};
    }
    if (tokens.size() != seqs.size() || next.size() != seqs.size()) {
      return {StatusCode::kShapeMismatch, "GPU decoder: " + std::to_string(seqs.size()) + " sequences, " +
                                              std::to_string(tokens.size()) + " tokens and " +
                                              std::to_string(next.size()) + " outputs (one each)"};
    }
    THINKV_RETURN_IF_ERROR(launch(seqs, tokens, out_logits, false));
    return collect(next, true);
  }

  Status launch(std::span<const int> seqs, std::span<const int> tokens, std::span<float> out_logits,
                bool device_ok = true) {
    const ModelConfig& c = cfg;
    const int B = static_cast<int>(seqs.size());
    if (B < 1 || B > max_batch) {
      return {StatusCode::kInvalidArgument,
              "GPU decoder: a step of " + std::to_string(B) + " sequences; allowed 1.." + std::to_string(max_batch)};
    }
    if (in_flight() == 2) {
      return {StatusCode::kInvalidArgument, "GPU decoder: two launched steps are not collected (collect one first)"};
    }
    if (!tokens.empty() && tokens.size() != seqs.size()) {
      return {StatusCode::kShapeMismatch, "GPU decoder: " + std::to_string(seqs.size()) + " sequences and " +
                                              std::to_string(tokens.size()) +
                                              " tokens (one each, or none to feed each its previous greedy token)"};
    }
    if (!out_logits.empty() && out_logits.size() != seqs.size() * static_cast<std::size_t>(c.vocab_size)) {
      return {StatusCode::kShapeMismatch, "GPU decoder: logits need " + std::to_string(seqs.size()) + " x " +
                                              std::to_string(c.vocab_size) + " floats"};
    }
    for (std::size_t b = 0; b < tokens.size(); ++b) {
      if (tokens[b] < (device_ok ? -1 : 0) || tokens[b] >= c.vocab_size) {
        return {StatusCode::kOutOfRange, "GPU decoder: token " + std::to_string(tokens[b]) + " of sequence " +
                                             std::to_string(seqs[b]) + " is outside the vocabulary 0.." +
                                             std::to_string(c.vocab_size - 1) +
                                             (device_ok ? " (or -1: its previous greedy token)" : "")};
      }
    }
    bool device_tokens = tokens.empty();
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const int sq = seqs[b];
      const int given = tokens.empty() ? -1 : tokens[b];
      device_tokens = device_tokens || given < 0;
      const int hint = given >= 0 ? given : (sq >= 0 && sq < max_batch) ? last_host[static_cast<std::size_t>(sq)] : 0;
      hints[b] = TokenHint{hint, {}};
    }
    Slot& sl = slots[next_slot];
    sl.t_start = Clock::now();
    // begin_step checks the sequences (range, duplicates, faults, room) before anything changes.
    THINKV_RETURN_IF_ERROR(cache->begin_step(seqs, std::span<const TokenHint>(hints.data(), seqs.size())));
    const auto t_begun = Clock::now();
    int* h = sl.h;
    for (int b = 0; b < B; ++b) {
      const int sq = seqs[static_cast<std::size_t>(b)];
      h[b] = tokens.empty() ? -1 : tokens[static_cast<std::size_t>(b)];
      h[max_batch + b] = cache->position(sq);
      h[2 * max_batch + b] = sq;
    }
    sl.seqs.assign(seqs.begin(), seqs.end());
    sl.timed = timing;
    Status s = run_layers(seqs, B, sl, device_tokens);
    const auto t_layers = Clock::now();
    if (s.is_ok()) s = cache->end_step(seqs);
    const auto t_ended = Clock::now();
    if (!s.is_ok()) {
      (void)cudaStreamSynchronize(stream);
      return s;
    }
    if (sl.timed) {
      times.host_begin_ms += ms(sl.t_start, t_begun);
      times.host_end_ms += ms(t_layers, t_ended);
      TKV_CUDA(cudaEventRecord(sl.ev[5], stream), "cudaEventRecord");
    }
    TKV_CUDA(gpu::rmsnorm(x, final_norm, B, c.dim, c.rms_eps, xb, wt, stream), "rmsnorm");
    THINKV_RETURN_IF_ERROR(gemm(output, c.vocab_size, c.dim, xb, B, logits, false));
    TKV_CUDA(gpu::argmax(logits, B, c.vocab_size, d_next, stream), "argmax");
    TKV_CUDA(gpu::scatter_tokens(d_next, d_seqs, B, d_last, stream), "scatter_tokens");
    TKV_CUDA(cudaMemcpyAsync(h + 3 * max_batch, d_next, static_cast<std::size_t>(B) * sizeof(int),
                             cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync of the next tokens");
    if (!out_logits.empty()) {
      TKV_CUDA(
          cudaMemcpyAsync(out_logits.data(), logits, out_logits.size() * sizeof(float), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync of the logits");
    }
    if (sl.timed) TKV_CUDA(cudaEventRecord(sl.ev[6], stream), "cudaEventRecord");
    TKV_CUDA(cudaEventRecord(sl.done, stream), "cudaEventRecord");
    sl.in_flight = true;
    next_slot ^= 1;
    return Status::ok();
  }

  /// Waits for the oldest launched step: its greedy tokens, in its batch order. `wait_faults`:
  /// wait for every fault report so far (synchronous steps); pipelined, a K/V fault may surface
  /// one collect later (faulted() then names the sequence).
  Status collect(std::span<int> next, bool wait_faults) {
    if (in_flight() == 0) return {StatusCode::kInvalidArgument, "GPU decoder: collect with no launched step"};
    Slot& sl = slots[oldest_slot];
    const int B = static_cast<int>(sl.seqs.size());
    if (static_cast<int>(next.size()) != B) {
      return {StatusCode::kShapeMismatch, "GPU decoder: collect of a step of " + std::to_string(B) +
                                              " sequences into " + std::to_string(next.size()) + " outputs"};
    }
    const auto t_wait = Clock::now();
    // Under tensor parallelism the wait is bounded: a rank that stopped is an error, not a hang.
    const Status waited =
        tp != nullptr ? tp->wait(sl.done) : cuda_status(cudaEventSynchronize(sl.done), "cudaEventSynchronize");
    sl.in_flight = false;
    oldest_slot ^= 1;
    THINKV_RETURN_IF_ERROR(waited);
    if (sl.timed) {
      const auto t_end = Clock::now();
      times.host_wait_ms += ms(t_wait, t_end);
      times.wall_ms += ms(sl.t_start, t_end);
      accumulate_times(sl);
    }
    THINKV_RETURN_IF_ERROR(cache->poll_faults(wait_faults));
    std::string bad;
    for (int b = 0; b < B; ++b) {
      next[static_cast<std::size_t>(b)] = sl.h[3 * max_batch + b];
      const int seq = sl.seqs[static_cast<std::size_t>(b)];
      last_host[static_cast<std::size_t>(seq)] = next[static_cast<std::size_t>(b)];
      if (cache->faulted(seq)) {
        bad += (bad.empty() ? "" : ", ") + std::to_string(seq) + " (a key or value)";
      } else if (next[static_cast<std::size_t>(b)] < 0) {
        bad += (bad.empty() ? "" : ", ") + std::to_string(seq) + " (its logits)";
      }
    }
    if (!bad.empty()) {
      return {StatusCode::kNonFinite,
              "GPU decoder: the forward pass produced values that are not finite for sequence " + bad +
                  ": the weights hold NaN or Inf or values that overflow; reset_sequence "
                  "frees the sequence"};
    }
    return Status::ok();
  }

  Status run_layers(std::span<const int> seqs, int B, Slot& sl, bool device_tokens) {
    const ModelConfig& c = cfg;
    const std::size_t Bs = static_cast<std::size_t>(B);
    cudaEvent_t* ev = sl.ev;
    const bool timing = sl.timed;
    if (timing) TKV_CUDA(cudaEventRecord(ev[0], stream), "cudaEventRecord");
    // One upload: tokens, positions and sequences (the pinned rows are max_batch apart).
    TKV_CUDA(cudaMemcpyAsync(d_tokens, sl.h, 3 * static_cast<std::size_t>(max_batch) * sizeof(int),
                             cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync");
    if (device_tokens) TKV_CUDA(gpu::gather_tokens(d_last, d_seqs, B, d_tokens, stream), "gather_tokens");
    TKV_CUDA(gpu::embed(embedding, wt, d_tokens, B, c.dim, x, stream), "embed");
    const int qkv_rows = static_cast<int>(qd + 2 * kvd);
    for (int l = 0; l < c.n_layers; ++l) {
      const Layer& L = layers[static_cast<std::size_t>(l)];
      TKV_CUDA(gpu::rmsnorm(x, L.attn_norm, B, c.dim, c.rms_eps, xb, wt, stream), "rmsnorm");
      THINKV_RETURN_IF_ERROR(gemm(L.wqkv, qkv_rows, c.dim, xb, B, qkv, false));
      TKV_CUDA(gpu::rope_split(qkv, d_pos, freqs, B, hq, hkv, c.head_dim, c.rope_dim, q, k, v, stream), "rope_split");
      if (timing && l == 0) TKV_CUDA(cudaEventRecord(ev[1], stream), "cudaEventRecord");
      THINKV_RETURN_IF_ERROR(
          cache->append_batch(l, seqs, TensorRef{k, ElementType::kF32}, TensorRef{v, ElementType::kF32}));
      THINKV_RETURN_IF_ERROR(
          cache->attend_batch(l, seqs, TensorRef{q, ElementType::kF32}, MutableTensorRef{att, ElementType::kF32}));
      if (timing && l == 0) TKV_CUDA(cudaEventRecord(ev[2], stream), "cudaEventRecord");
      const void* attin = att;
      if (wt != Elem::kF32) {
        TKV_CUDA(gpu::convert(att, Bs * static_cast<std::size_t>(qd), attw, wt, stream), "convert");
        attin = attw;
      }
      THINKV_RETURN_IF_ERROR(project_out(L.wo, static_cast<int>(qd), attin, B, timing && l == 0 ? ev + 7 : nullptr));
      TKV_CUDA(gpu::rmsnorm(x, L.ffn_norm, B, c.dim, c.rms_eps, xb, wt, stream), "rmsnorm");
      THINKV_RETURN_IF_ERROR(gemm(L.w13, static_cast<int>(2 * hid), c.dim, xb, B, h13, false));
      TKV_CUDA(gpu::silu_mul(h13, B, static_cast<int>(hid), hh, wt, stream), "silu_mul");
      THINKV_RETURN_IF_ERROR(project_out(L.w2, static_cast<int>(hid), hh, B, timing && l == 0 ? ev + 9 : nullptr));
      if (timing && l == 0) TKV_CUDA(cudaEventRecord(ev[3], stream), "cudaEventRecord");
    }
    if (timing) TKV_CUDA(cudaEventRecord(ev[4], stream), "cudaEventRecord");
    return Status::ok();
  }

  /// A prompt of `tokens` random K/V for `seq`, stored without attention (prefill, store only).
  Status fill(int seq, int tokens, std::uint64_t seed) {
    const ModelConfig& c = cfg;
    if (tokens < 1) return {StatusCode::kInvalidArgument, "GPU decoder: fill of " + std::to_string(tokens) + " tokens"};
    // (An out-of-range seq is begin_prompt's to refuse; position() does not check the range.)
    if (const std::int32_t at = seq >= 0 && seq < max_batch ? cache->position(seq) : 0; at != 0) {
      return {StatusCode::kInvalidArgument, "GPU decoder: fill gives a fresh sequence its prompt; sequence " +
                                                std::to_string(seq) + " is at position " + std::to_string(at) +
                                                " (reset_sequence it first)"};
    }
    const std::size_t n = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(kvd);
    void* kv = nullptr;
    TKV_CUDA(cudaMallocAsync(&kv, 2 * n * sizeof(float), stream), "cudaMallocAsync of the fill's K/V");
    auto* k = static_cast<float*>(kv);
    float* v = k + n;
    Status s = cache->begin_prompt(seq, tokens);
    for (int l = 0; s.is_ok() && l < c.n_layers; ++l) {
      // K then V of all KV heads, [2 tokens, kv_dim] as one GPU draws them: this rank's columns.
      s = cuda_status(gpu::fill_uniform_block(kv, Elem::kF32, 2 * std::int64_t{tokens}, kvd,
                                              seed * 1315423911ull + static_cast<std::uint64_t>(l), 1.0f, c.kv_dim(), 0,
                                              tp_rank * kvd, stream),
                      "fill_uniform_block");
      if (s.is_ok()) {
        s = cache->prefill(l, seq, TensorRef{nullptr, ElementType::kF32}, TensorRef{k, ElementType::kF32},
                           TensorRef{v, ElementType::kF32}, MutableTensorRef{nullptr, ElementType::kF32});
      }
    }
    if (s.is_ok()) s = cache->end_prompt(seq);
    (void)cudaFreeAsync(kv, stream);
    if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess && s.is_ok()) {
      s = cuda_status(e, "cudaStreamSynchronize");
    }
    return s;
  }

  /// Layer 0's parts (events 0-3) scaled to all layers (0-4); the head (5-6).
  void accumulate_times(const Slot& sl) {
    const cudaEvent_t* ev = sl.ev;
    float pre = 0, attn = 0, post = 0, all = 0, head = 0;
    cudaEventElapsedTime(&pre, ev[0], ev[1]);
    cudaEventElapsedTime(&attn, ev[1], ev[2]);
    cudaEventElapsedTime(&post, ev[2], ev[3]);
    cudaEventElapsedTime(&all, ev[0], ev[4]);
    cudaEventElapsedTime(&head, ev[5], ev[6]);
    if (tp != nullptr) {  // layer 0's two all-reduces, times the layers (alike)
      float a1 = 0, a2 = 0;
      cudaEventElapsedTime(&a1, ev[7], ev[8]);
      cudaEventElapsedTime(&a2, ev[9], ev[10]);
      times.allreduce_ms += (static_cast<double>(a1) + a2) * cfg.n_layers;
    }
    const double layer0 = static_cast<double>(pre) + attn + post;
    const double scale = layer0 > 0 ? static_cast<double>(all) / layer0 : 1.0;
    times.attention_ms += attn * scale;
    times.layers_ms += (static_cast<double>(pre) + post) * scale;
    times.head_ms += head;
    ++times.steps;
  }
};

GpuTransformer::GpuTransformer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuTransformer::~GpuTransformer() = default;

Status GpuTransformer::create(const Model& model, const ThinKvSpec& cache, const GpuDecoderOptions& options,
                              std::unique_ptr<GpuTransformer>& out) {
  ThinKvSpec mine = cache;  // under tensor parallelism, this rank's slice
  if (const Collective* tp = options.tensor_parallel; tp != nullptr) {
    THINKV_RETURN_IF_ERROR(tensor_parallel_slice(cache, tp->rank(), tp->size(), mine));
  }
  std::unique_ptr<GpuCache> c;
  THINKV_RETURN_IF_ERROR(make_gpu_cache(mine, c));
  return create(model, std::move(c), options, out);
}

Status GpuTransformer::create(const Model& model, std::unique_ptr<GpuCache> cache, const GpuDecoderOptions& options,
                              std::unique_ptr<GpuTransformer>& out) {
  auto impl = std::make_unique<Impl>();
  impl->cfg = model.config;
  impl->wt = options.weights == GpuWeightType::kF32 ? Elem::kF32 : Elem::kBF16;
  THINKV_RETURN_IF_ERROR(impl->setup(std::move(cache), options));
  std::vector<std::size_t> offs;
  THINKV_RETURN_IF_ERROR(impl->allocate_weights(offs));
  Impl& m = *impl;
  using S = Impl;
  const std::int64_t qd = m.qd, kvd = m.kvd, hid = m.hid, r = m.tp_rank;
  THINKV_RETURN_IF_ERROR(
      m.upload_matrices(m.embedding, {S::rows_of(model.tok_embeddings, 0, model.config.vocab_size)}));
  THINKV_RETURN_IF_ERROR(m.upload_matrices(m.output, {S::rows_of(model.output, 0, model.config.vocab_size)}));
  THINKV_RETURN_IF_ERROR(m.upload_vector(m.final_norm, model.final_norm, model.config.dim));
  THINKV_RETURN_IF_ERROR(m.upload_freqs(model.rope_freq_factors));
  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    const LayerWeights& w = model.layers[l];
    const Impl::Layer& L = m.layers[l];
    THINKV_RETURN_IF_ERROR(m.upload_vector(L.attn_norm, w.attn_norm, model.config.dim));
    THINKV_RETURN_IF_ERROR(m.upload_vector(L.ffn_norm, w.ffn_norm, model.config.dim));
    // This rank's heads (rows of wq, wk, wv; columns of wo) and hidden units (rows of w1, w3;
    // columns of w2): all of them on one GPU.
    THINKV_RETURN_IF_ERROR(m.upload_matrices(
        L.wqkv, {S::rows_of(w.wq, r * qd, qd), S::rows_of(w.wk, r * kvd, kvd), S::rows_of(w.wv, r * kvd, kvd)}));
    THINKV_RETURN_IF_ERROR(m.upload_matrices(L.wo, {S::cols_of(w.wo, r * qd, qd)}));
    THINKV_RETURN_IF_ERROR(m.upload_matrices(L.w13, {S::rows_of(w.w1, r * hid, hid), S::rows_of(w.w3, r * hid, hid)}));
    THINKV_RETURN_IF_ERROR(m.upload_matrices(L.w2, {S::cols_of(w.w2, r * hid, hid)}));
  }
  out.reset(new GpuTransformer(std::move(impl)));
  return Status::ok();
}

Status GpuTransformer::create_random(const ModelConfig& config, std::uint64_t seed, std::unique_ptr<GpuCache> cache,
                                     const GpuDecoderOptions& options, std::unique_ptr<GpuTransformer>& out) {
  THINKV_RETURN_IF_ERROR(config.validate("GPU decoder (random weights)"));
  auto impl = std::make_unique<Impl>();
  impl->cfg = config;
  impl->wt = options.weights == GpuWeightType::kF32 ? Elem::kF32 : Elem::kBF16;
  THINKV_RETURN_IF_ERROR(impl->setup(std::move(cache), options));
  std::vector<std::size_t> offs;
  THINKV_RETURN_IF_ERROR(impl->allocate_weights(offs));
  Impl& m = *impl;
  const ModelConfig& c = config;
  std::uint64_t s = seed;
  // fill(p, blocks, fan_in): the next matrix's seed; its blocks {rows, cols, whole matrix's
  // columns, first row, first column} written one after another at p. A rank's slice of a
  // matrix holds the values the whole matrix holds there.
  struct Block {
    std::int64_t rows, cols, src_cols, row0, col0;
  };
  auto fill = [&](const void* p, std::initializer_list<Block> blocks, std::int64_t fan_in) -> Status {
    const std::uint64_t sd = ++s * 0x100000001B3ull;
    auto* dst = static_cast<unsigned char*>(const_cast<void*>(p));
    for (const Block& b : blocks) {
      THINKV_RETURN_IF_ERROR(cuda_status(
          gpu::fill_uniform_block(dst, m.wt, b.rows, b.cols, sd, 1.0f / std::sqrt(static_cast<float>(fan_in)),
                                  b.src_cols, b.row0, b.col0, m.stream),
          "fill_uniform_block"));
      dst += m.wbytes(b.rows * b.cols);
    }
    return Status::ok();
  };
  const std::int64_t qd = m.qd, kvd = m.kvd, hid = m.hid, r = m.tp_rank;
  auto ones = [&](const float* p, int n) {
    return cuda_status(gpu::fill_f32(const_cast<float*>(p), static_cast<std::size_t>(n), 1.0f, m.stream), "fill_f32");
  };
  THINKV_RETURN_IF_ERROR(fill(m.embedding, {{c.vocab_size, c.dim, c.dim, 0, 0}}, 1));
  THINKV_RETURN_IF_ERROR(fill(m.output, {{c.vocab_size, c.dim, c.dim, 0, 0}}, c.dim));
  THINKV_RETURN_IF_ERROR(ones(m.final_norm, c.dim));
  for (const Impl::Layer& L : m.layers) {
    THINKV_RETURN_IF_ERROR(ones(L.attn_norm, c.dim));
    THINKV_RETURN_IF_ERROR(ones(L.ffn_norm, c.dim));
    // The whole wqkv is [q_dim + 2 kv_dim, dim], w13 [2 hidden, dim], wo [dim, q_dim], w2
    // [dim, hidden]: this rank's rows and columns of them.
    THINKV_RETURN_IF_ERROR(fill(L.wqkv,
                                {{qd, c.dim, c.dim, r * qd, 0},
                                 {kvd, c.dim, c.dim, c.q_dim() + r * kvd, 0},
                                 {kvd, c.dim, c.dim, c.q_dim() + c.kv_dim() + r * kvd, 0}},
                                c.dim));
    THINKV_RETURN_IF_ERROR(fill(L.wo, {{c.dim, qd, c.q_dim(), 0, r * qd}}, c.q_dim()));
    THINKV_RETURN_IF_ERROR(
        fill(L.w13, {{hid, c.dim, c.dim, r * hid, 0}, {hid, c.dim, c.dim, c.hidden_dim + r * hid, 0}}, c.dim));
    THINKV_RETURN_IF_ERROR(fill(L.w2, {{c.dim, hid, c.hidden_dim, 0, r * hid}}, c.hidden_dim));
  }
  TKV_CUDA(cudaStreamSynchronize(m.stream), "cudaStreamSynchronize");
  THINKV_RETURN_IF_ERROR(m.upload_freqs({}));
  out.reset(new GpuTransformer(std::move(impl)));
  return Status::ok();
}

const ModelConfig& GpuTransformer::config() const noexcept { return impl_->cfg; }
int GpuTransformer::max_batch() const noexcept { return impl_->max_batch; }
namespace {
/// Under tensor parallelism a rank's failure ends the group (a sequence's non-finite values
/// excepted: every rank sees the same logits, and the runtime resets the sequence on all).
Status abort_group_on_failure(Collective* tp, Status s) {
  if (tp != nullptr && !s.is_ok() && s.code() != StatusCode::kNonFinite) tp->abort(s.message());
  return s;
}
}  // namespace

Status GpuTransformer::step(std::span<const int> seqs, std::span<const int> tokens, std::span<int> next,
                            std::span<float> logits) {
  return abort_group_on_failure(impl_->tp, impl_->forward(seqs, tokens, next, logits));
}
Status GpuTransformer::launch(std::span<const int> seqs, std::span<const int> tokens) {
  return abort_group_on_failure(impl_->tp, impl_->launch(seqs, tokens, {}));
}
Status GpuTransformer::collect(std::span<int> next) {
  return abort_group_on_failure(impl_->tp, impl_->collect(next, false));
}
Status GpuTransformer::reset_sequence(int seq) {
  if (impl_->in_flight() != 0) {
    return {StatusCode::kInvalidArgument, "GPU decoder: reset_sequence while launched steps are not collected"};
  }
  THINKV_RETURN_IF_ERROR(impl_->cache->reset_sequence(seq));
  if (seq >= 0 && seq < impl_->max_batch) {  // its previous greedy token goes too
    impl_->last_host[static_cast<std::size_t>(seq)] = 0;
    if (cudaError_t e = cudaMemsetAsync(impl_->d_last + seq, 0, sizeof(int), impl_->stream); e != cudaSuccess) {
      return {StatusCode::kCudaError, std::string("GPU decoder: cudaMemsetAsync: ") + cudaGetErrorString(e)};
    }
  }
  return Status::ok();
}
Status GpuTransformer::fill(int seq, int tokens, std::uint64_t seed) {
  return abort_group_on_failure(impl_->tp, impl_->fill(seq, tokens, seed));
}
GpuCache& GpuTransformer::cache() noexcept { return *impl_->cache; }
Status GpuTransformer::settle() { return impl_->cache->settle(); }
std::int32_t GpuTransformer::position(int seq) const { return impl_->cache->position(seq); }
std::int64_t GpuTransformer::live_tokens(int seq) const { return impl_->cache->live_tokens(seq); }
MemoryUsage GpuTransformer::memory(int seq) const { return impl_->cache->memory(seq); }
MemoryUsage GpuTransformer::memory() const { return impl_->cache->memory(); }
const ThinKvStats& GpuTransformer::stats() const { return impl_->cache->stats(); }
std::int64_t GpuTransformer::weight_bytes() const noexcept { return impl_->weight_bytes; }
std::int64_t GpuTransformer::activation_bytes() const noexcept { return impl_->act_bytes; }
std::int64_t GpuTransformer::cache_device_bytes() const { return impl_->cache->device_bytes(); }
std::int64_t GpuTransformer::free_device_bytes() {
  std::size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return static_cast<std::int64_t>(free);
}
void GpuTransformer::set_timing(bool on) {
  impl_->timing = on;
  impl_->times = {};
}
GpuStepTimes GpuTransformer::times() const noexcept { return impl_->times; }

EngineFactory gpu_engine(const Model& model, GpuDecoderOptions options) {
  return [&model, options](const ThinKvSpec& spec, std::unique_ptr<ForwardEngine>& out) -> Status {
    ThinKvSpec one = spec;
    one.num_sequences = 1;
    std::unique_ptr<GpuTransformer> g;
    THINKV_RETURN_IF_ERROR(GpuTransformer::create(model, one, options, g));
    const GpuCache& c = *g->impl_->cache;
    out = std::make_unique<GpuEngine>(std::move(g), c);
    return Status::ok();
  };
}

}  // namespace thinkv::decoder
