// Causal attention output and the column sums (or column maxima) of its softmax weights, in one flash-style pass
// (CPU; float32 inputs, or bfloat16 inputs on CPUs that multiply bfloat16 natively).
//
// Why a kernel: an H2O prefill needs, besides the attention output, the sum over every query of its softmax
// weights per key. Built from torch operations, that pass streams each chunk's logits through memory several
// times (product, max, exp, sum, PV, column sums) and runs 1.2-1.4 x sdpa's flash kernel. Here a block of query
// rows walks the keys in blocks small enough to stay in cache, as flash attention does (running max, rescaled
// output); the exponentiated blocks are kept in a per-thread buffer, and once the rows' final maxima and sums
// are known the column sums are one weighted pass over that buffer. A decode step (one query) takes a short
// path: one row of logits per query head, no blocks.
//
// Precision: logits, softmax, scores and the output's accumulation are float32 in both input types. With bfloat16
// inputs the two products multiply bfloat16 with float32 accumulation (a prefill on oneDNN's AMX micro-kernel
// where the CPU has it, else and in decode steps MKL's bfloat16 GEMM): QKᵀ of the model's own bfloat16 queries
// and keys is then as exact as in float32, and the probabilities enter the PV product rounded to bfloat16, as
// torch's own flash attention does. Float32 copies of bfloat16 inputs ran the products at float32 speed: a 2k
// SmolLM2 reconstruction pass (KVzip) took 0.13 s a layer there against torch's bfloat16 flash attention's 0.04 s.
//
// Layouts (last dimension contiguous): queries (B, H, L, d), keys (B, H_kv, T, d), values (B, H_kv, T, dv);
// the last L slots are this forward's tokens, so row i sees slots [0, T - L + i]; `scale` multiplies the
// logits. key_bias (B, T), or (B, H_kv, T) where each KV head's slots are live apart (a folded layer's heads laid
// out as rows, kvcompress/ragged.py), adds 0 / -inf for dead slots to observed rows only; row_weight (B, L)
// weighs each row's contribution to the column sums (observed 1, else 0). Either may be empty.
// slot_head (B, T) int64, a decode step only, marks a folded layer (kvcompress/ragged.py): every KV head's slots
// share one row, keys and values come expanded to (B, H_kv, T, d) with a zero head stride, and the pair (b, kv)
// sees only the slots whose head is kv: it copies them contiguous and multiplies only them (a folded decode step
// costs what a per-head one does), and their scores go to one row per sequence, (B, 1, T). It may be empty.
// coded (a quantized layer, kvcompress/quantization.py): the codes, scales and minimums of its keys, then of its
// values, (B, H_kv, S, ...) with S >= coded_slots, each slot's row contiguous; the first coded_slots slots are
// read from them, dequantized as they are read (a decode step's chunk, a key block), and the keys and values given
// hold the slots after them: T counts both. No full-precision copy of the layer is made. It may be empty.
// Returns the column sums (B, H_kv, T), summed over the query heads of each KV group, and the output
// (B, L, H, dv), as transformers' attention functions lay it out. With `maximum`, the columns hold instead the
// most weight any observed row of any query head of the group gives the slot (KVzip's reconstruction scores):
// the same pass, a maximum where the sum was.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "quantized_slots.h"

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
// MKL's (torch's BLAS on x86); weak, so that a build against another BLAS leaves them null
extern "C" int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));  // mkl_service.h's C interface
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                       const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));  // mkl_cblas.h (enums passed as ints)

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Column-major BLAS on row-major operands (see the calls below for the mapping).
void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  const int ilda = static_cast<int>(lda), ildb = static_cast<int>(ldb), ildc = static_cast<int>(ldc);
  sgemm_(&transa, &transb, &im, &in, &ik, &alpha, a, &ilda, b, &ildb, &beta, c, &ildc);
}

// The same product of bfloat16 operands into float32 (CBLAS: column-major 102, no transpose 111, transpose 112).
void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a,
          int64_t lda, const at::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_gemm_bf16bf16f32(102, transa == 'T' ? 112 : 111, transb == 'T' ? 112 : 111, static_cast<int>(m),
                         static_cast<int>(n), static_cast<int>(k), alpha, reinterpret_cast<const uint16_t*>(a),
                         static_cast<int>(lda), reinterpret_cast<const uint16_t*>(b), static_cast<int>(ldb), beta, c,
                         static_cast<int>(ldc));
}

// Tasks handed out one at a time to torch's intra-op threads: each thread claims the next unclaimed task when it
// finishes one. With parallel_for's own static split every layer waited for its slowest thread, and a thread whose
// core another process shares is slow: H2O prefill took 2.5-4 x the uncompressed time with one busy process beside
// (1.3 x on an idle machine), while sdpa lost nothing. Claiming costs one atomic increment per task.
struct TaskQueue {
  explicit TaskQueue(int64_t count) : count(count) {}
  int64_t workers() const { return std::min<int64_t>(at::get_num_threads(), count); }
  bool claim(int64_t& task) {
    task = next.fetch_add(1, std::memory_order_relaxed);
    return task < count;
  }
  const int64_t count;
  std::atomic<int64_t> next{0};
};

// While alive, the products of the calling thread run on that thread alone. Each worker below makes many small
// products; MKL would give each of them threads of its own and oversubscribe the cores: the kernel ran 2 x sdpa's
// time on an idle 2-core machine and 25-40 x with one busy process beside (measured; spinning MKL threads
// fighting for the cores). Without MKL nothing changes.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() : previous_(MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous_);
  }

 private:
  int previous_;
};

// The larger of two vectors lane by lane, without NaN propagation (logits are finite or -inf): one instruction,
// where at::vec::maximum's NaN check made a 4 x longer dependency chain through the row's maximum (perf).
Vec larger(const Vec& a, const Vec& b) { return at::vec::clamp_min(a, b); }

// x = x * scale + bias over n entries, in place (a scale of 1 and a null bias skip their step); returns the
// maximum. One pass, four running maxima: the logits are read once before the exponentials.
float logits_max(float* x, int64_t n, float scale, const float* bias) {
  constexpr int64_t V = Vec::size();
  const bool transform = scale != 1.0f || bias != nullptr;
  const Vec vscale(scale);
  auto logit = [&](int64_t j, int64_t count) {  // count < V: a partial vector, its other lanes -inf
    Vec value = count == V ? Vec::loadu(x + j) : Vec::loadu(x + j, count);
    if (transform) {
      value = value * vscale;
      if (bias != nullptr) value = value + (count == V ? Vec::loadu(bias + j) : Vec::loadu(bias + j, count));
      value.store(x + j, count);
    }
    return count == V ? value : Vec::set(Vec(kNegInf), value, count);
  };
  Vec m0(kNegInf), m1(kNegInf), m2(kNegInf), m3(kNegInf);
  int64_t j = 0;
  for (; j + 4 * V <= n; j += 4 * V) {
    m0 = larger(m0, logit(j, V));
    m1 = larger(m1, logit(j + V, V));
    m2 = larger(m2, logit(j + 2 * V, V));
    m3 = larger(m3, logit(j + 3 * V, V));
  }
  for (; j < n; j += V) m0 = larger(m0, logit(j, std::min(V, n - j)));
  const Vec m = larger(larger(m0, m1), larger(m2, m3));
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return larger(a, b); }, m);
}

// x = exp(x - shift) in place over n entries, zero over the following `zeros`; returns the sum. exp_u20 is the
// exponential of torch's own flash kernel (relative error ~1e-6, well inside float32 attention's own error).
// For bfloat16 inputs the same values go, rounded, to `rounded` in the same pass: the PV product's operand (as
// in torch's flash attention); the floats stay for the column pass. A separate rounding pass cost 7 % of a 4k
// prefill's kernel time (perf).
template <typename T>
float exp_shifted_sum(float* x, int64_t n, int64_t zeros, float shift, T* rounded) {
  constexpr bool round = std::is_same_v<T, at::BFloat16>;
  constexpr int64_t V = Vec::size();
  const Vec vshift(shift);
  Vec vsum(0.0f);
  int64_t j = 0;
  for (; j + 2 * V <= n; j += 2 * V) {
    const Vec low = (Vec::loadu(x + j) - vshift).exp_u20();
    const Vec high = (Vec::loadu(x + j + V) - vshift).exp_u20();
    low.store(x + j);
    high.store(x + j + V);
    if constexpr (round) at::vec::convert_from_float<at::BFloat16>(low, high).store(rounded + j);
    vsum = vsum + low + high;
  }
  for (; j < n; j += V) {  // a last vector, or part of one (its other lanes out of the sum)
    const int64_t count = std::min(V, n - j);
    const Vec e = (Vec::loadu(x + j, count) - vshift).exp_u20();
    e.store(x + j, count);
    if constexpr (round) at::vec::convert_from_float<at::BFloat16>(e, Vec(0.0f)).store(rounded + j, count);
    vsum = vsum + (count == V ? e : Vec::set(Vec(0.0f), e, count));
  }
  std::fill(x + n, x + n + zeros, 0.0f);
  if constexpr (round) std::fill(rounded + n, rounded + n + zeros, at::BFloat16(0.0f));
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
}

// The PV product's operand: the float32 probabilities themselves, or their bfloat16 copy (exp_shifted_sum).
const float* probability_operand(const float* p, const float*) { return p; }
const at::BFloat16* probability_operand(const float*, const at::BFloat16* rounded) { return rounded; }

// acc = reduce(acc, x * w) over n entries: the column pass's one difference between sums and maxima.
void accumulate(float* acc, const float* x, float w, int64_t n, bool maximum) {
  if (maximum) {
    at::vec::map2([w](Vec a, Vec b) { return at::vec::maximum(a, b * Vec(w)); }, acc, acc, x, n);
  } else {
    at::vec::map2([w](Vec a, Vec b) { return a + b * Vec(w); }, acc, acc, x, n);
  }
}

// A run of columns (of a decode step's chunk, of a key block): `count` keys and values at `keys` / `values` (rows
// `key_stride` / `value_stride` apart), the columns [first, first + count) of the chunk's or block's logits.
template <typename T>
struct Columns {
  const T* keys;
  int64_t key_stride;
  const T* values;
  int64_t value_stride;
  int64_t first, count;
};

// The slots of a quantized layer that only codes hold (quantized_slots.h's grid), per (sequence, KV head).
struct CodedRows {
  const uint8_t* codes = nullptr;
  const at::Half *scales = nullptr, *minimums = nullptr;  // one layout for both
  int64_t bits = 0, groups = 0, cSB = 0, cSH = 0, cSN = 0, sSB = 0, sSH = 0, sSN = 0;

  // slots [n0, n0 + count) of (b, h), `dim` channels each, into out (count x dim)
  template <typename T>
  void read(int64_t b, int64_t h, int64_t n0, int64_t count, int64_t dim, T* out) const {
    const int64_t scale_at = b * sSB + h * sSH + n0 * sSN;
    dequantize_run_as(codes + b * cSB + h * cSH + n0 * cSN, scales + scale_at, minimums + scale_at, bits, dim,
                      groups, count, cSN, sSN, out);
  }
};

CodedRows coded_rows(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& minimums,
                     int64_t dim) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf &&
                  minimums.scalar_type() == at::kHalf && codes.dim() == 4 && scales.dim() == 4,
              "fused_attention: coded slots are uint8 codes, float16 scales and minimums, (B, H_kv, S, ...)");
  TORCH_CHECK(codes.stride(-1) == 1 && scales.stride(-1) == 1 && scales.strides() == minimums.strides(),
              "fused_attention: each coded slot's row contiguous, scales and minimums laid out alike");
  CodedRows rows;
  rows.codes = codes.data_ptr<uint8_t>();
  rows.scales = scales.data_ptr<at::Half>();
  rows.minimums = minimums.data_ptr<at::Half>();
  rows.bits = codes.size(-1) * 8 / dim;
  rows.groups = scales.size(-1);
  TORCH_CHECK((rows.bits == 8 || rows.bits == 4) && codes.size(-1) * 8 == rows.bits * dim && dim % rows.groups == 0,
              "fused_attention: coded slots of 8 or 4 bits per channel, whole groups");
  rows.cSB = codes.stride(0), rows.cSH = codes.stride(1), rows.cSN = codes.stride(2);
  rows.sSB = scales.stride(0), rows.sSH = scales.stride(1), rows.sSN = scales.stride(2);
  return rows;
}

// Pointers, sizes and strides of the operands, after the checks both passes share.
template <typename T>
struct Operands {
  const T *q, *k, *v;
  const float *bias, *weight;
  const int64_t* slot_head;  // a folded layer's KV head of each slot (B, T), else nullptr
  int64_t batch, heads, length, head_dim, kv_heads, total, value_dim, groups;
  int64_t qSB, qSH, qSM, kSB, kSH, kSN, vSB, vSH, vSN;
  int64_t biasSB, biasSH;  // key_bias strides: (B, T) is one row for every KV head (biasSH 0), (B, H_kv, T) one each
  int64_t coded = 0;       // the first slots, which only codes hold; k and v hold the slots after them
  CodedRows key_codes, value_codes;

  // slot n's key (value) row of pair (b, kv): where k (v) holds it, else dequantized into `scratch`
  const T* key_row(int64_t b, int64_t kv, int64_t n, T* scratch) const {
    if (n >= coded) return k + b * kSB + kv * kSH + (n - coded) * kSN;
    key_codes.read(b, kv, n, 1, head_dim, scratch);
    return scratch;
  }
  const T* value_row(int64_t b, int64_t kv, int64_t n, T* scratch) const {
    if (n >= coded) return v + b * vSB + kv * vSH + (n - coded) * vSN;
    value_codes.read(b, kv, n, 1, value_dim, scratch);
    return scratch;
  }

  // slots [n0, n0 + n) of pair (b, kv) as at most two runs: the coded ones dequantized into `buffer`, the held
  // ones where they lie; keys, values or both (the other's pointers null)
  std::vector<Columns<T>> columns(int64_t b, int64_t kv, int64_t n0, int64_t n, std::vector<T>& buffer,
                                  bool with_keys, bool with_values) const {
    std::vector<Columns<T>> runs;
    const int64_t decoded = std::clamp<int64_t>(coded - n0, 0, n);
    if (decoded > 0) {
      const int64_t key_width = with_keys ? head_dim : 0, value_width = with_values ? value_dim : 0;
      if (buffer.size() < static_cast<size_t>(decoded * (key_width + value_width))) {
        buffer.resize(decoded * (key_width + value_width));  // grows only: a thread's buffer is reused
      }
      T* keys = buffer.data();
      T* values = keys + decoded * key_width;
      if (with_keys) key_codes.read(b, kv, n0, decoded, head_dim, keys);
      if (with_values) value_codes.read(b, kv, n0, decoded, value_dim, values);
      runs.push_back({with_keys ? keys : nullptr, head_dim, with_values ? values : nullptr, value_dim, 0, decoded});
    }
    if (decoded < n) {
      const int64_t first = n0 + decoded - coded;
      runs.push_back({k + b * kSB + kv * kSH + first * kSN, kSN, v + b * vSB + kv * vSH + first * vSN, vSN, decoded,
                      n - decoded});
    }
    return runs;
  }
};

template <typename T>
Operands<T> operands(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& key_bias, const torch::Tensor& row_weight,
                     const torch::Tensor& slot_head, const std::vector<torch::Tensor>& coded,
                     int64_t coded_slots) {
  TORCH_CHECK(queries.stride(-1) == 1 && keys.stride(-1) == 1 && values.stride(-1) == 1,
              "fused_attention: the last dimension must be contiguous");
  Operands<T> o;
  o.q = queries.data_ptr<T>();
  o.k = keys.data_ptr<T>();
  o.v = values.data_ptr<T>();
  o.bias = key_bias.numel() > 0 ? key_bias.data_ptr<float>() : nullptr;
  TORCH_CHECK(o.bias == nullptr || (key_bias.stride(-1) == 1 && (key_bias.dim() == 2 || key_bias.dim() == 3)),
              "fused_attention: key_bias is (B, T) or (B, H_kv, T), its last dimension contiguous");
  o.biasSB = o.bias != nullptr ? key_bias.stride(0) : 0;
  o.biasSH = o.bias != nullptr && key_bias.dim() == 3 ? key_bias.stride(1) : 0;
  o.weight = row_weight.numel() > 0 ? row_weight.data_ptr<float>() : nullptr;
  o.slot_head = slot_head.numel() > 0 ? slot_head.data_ptr<int64_t>() : nullptr;
  o.batch = queries.size(0), o.heads = queries.size(1), o.length = queries.size(2), o.head_dim = queries.size(3);
  o.kv_heads = keys.size(1), o.coded = coded_slots, o.total = coded_slots + keys.size(2), o.value_dim = values.size(3);
  TORCH_CHECK(coded_slots == 0 || coded.size() == 6, "fused_attention: coded slots need their six tensors");
  if (coded_slots > 0) {
    o.key_codes = coded_rows(coded[0], coded[1], coded[2], o.head_dim);
    o.value_codes = coded_rows(coded[3], coded[4], coded[5], o.value_dim);
    TORCH_CHECK(coded[0].size(2) >= coded_slots && coded[3].size(2) >= coded_slots,
                "fused_attention: fewer coded slots stored than coded_slots");
  }
  o.groups = o.heads / o.kv_heads;
  o.qSB = queries.stride(0), o.qSH = queries.stride(1), o.qSM = queries.stride(2);
  o.kSB = keys.stride(0), o.kSH = keys.stride(1), o.kSN = keys.stride(2);
  o.vSB = values.stride(0), o.vSH = values.stride(1), o.vSN = values.stride(2);
  return o;
}

// Runs `work(queue)` on torch's threads (no more of them than tasks), each claiming tasks from one queue, its
// products on its own thread.
template <typename Work>
void parallel_tasks(int64_t count, const Work& work) {
  TaskQueue queue(count);
  at::parallel_for(0, queue.workers(), 1, [&](int64_t, int64_t) {
    SingleThreadedBlas blas;
    work(queue);
  });
}

// The two products of a multi-query pass on the operands as they are: sgemm, or MKL's bfloat16 GEMM. Each call
// is a whole product (MKL repacks both operands every time), so the scale is applied inside it.
template <typename T>
struct DirectProducts {
  const Operands<T>& o;
  float alpha;
  static constexpr float logit_scale = 1.0f;  // what the row pass still multiplies the logits by
  static constexpr int64_t granularity = 1;    // keys a product takes at a time

  // s (rows x cols, ld ld_s) = alpha * q (rows x d, ld qSM) . k[n0 : n0 + cols]ᵀ for sequence b, KV head kv
  // (coded keys dequantized block by block into the thread's buffer)
  void logits(int64_t b, int64_t kv, const T* q, int64_t rows, int64_t n0, int64_t cols, float* s,
              int64_t ld_s) const {
    thread_local std::vector<T> buffer;
    for (const auto& run : o.columns(b, kv, n0, cols, buffer, true, false)) {
      gemm('T', 'N', run.count, rows, o.head_dim, alpha, run.keys, run.key_stride, q, o.qSM, 0.0f, s + run.first,
           ld_s);
    }
  }
  // out (rows x dv, ld ld_out) (+)= p (rows x cols, ld ld_p) . v[n0 : n0 + cols]
  void weighted_values(int64_t b, int64_t kv, const T* p, int64_t rows, int64_t n0, int64_t cols, int64_t ld_p,
                       float* out, int64_t ld_out, bool add) const {
    thread_local std::vector<T> buffer;
    for (const auto& run : o.columns(b, kv, n0, cols, buffer, false, true)) {
      gemm('N', 'N', o.value_dim, rows, run.count, 1.0f, run.values, run.value_stride, p + run.first, ld_p,
           add || run.first > 0 ? 1.0f : 0.0f, out, ld_out);
    }
  }
  void release() const {}
};

// The same products of bfloat16 operands on oneDNN's batch-reduce GEMM (AMX, through torch's cpublas), keys and
// values copied once per call into the layout it multiplies (VNNI: pairs of reduced-dimension rows interleaved),
// as torch's own flash attention does: MKL's bfloat16 GEMM repacked both operands of every block product, a
// third of its time, and the products took 60 % of a 4k SmolLM2 prefill's kernel time against 35 % of sdpa's
// (perf). A key block's product is one call on a laid-out block of kᵀ (or rows of v), its columns taken in whole
// chunks: oneDNN compiles one kernel per shape and leading dimension, so a few shapes, none of them depending on
// the cache's length, cover every call.
struct PackedProducts {
  static constexpr int64_t granularity = 64;  // keys a product takes at a time: columns past the last seen one are
                                              // computed (logits) or multiplied by zero probabilities (values)
  using BF16 = at::BFloat16;
  const Operands<BF16>& o;
  float logit_scale;  // the products have no scale: the row pass applies it
  int64_t key_block, padded_total;  // padded_total: the slots rounded up to whole key blocks
  // per (sequence, KV head): kᵀ key block after key block (d x key_block each), v (padded_total x dv)
  torch::Tensor vnni_keys, vnni_values;

  static bool applies(const Operands<BF16>& o, int64_t key_block) {
    return at::native::cpublas::could_pack(at::kBFloat16) && o.head_dim % 2 == 0 && key_block % granularity == 0;
  }

  PackedProducts(const Operands<BF16>& o, float alpha, int64_t key_block, const torch::TensorOptions& options)
      : o(o), logit_scale(alpha), key_block(key_block),
        padded_total((o.total + key_block - 1) / key_block * key_block) {
    // zeros past the last key: the padded columns' logits stay finite and their values add nothing
    vnni_keys = torch::zeros({o.batch, o.kv_heads, o.head_dim * padded_total}, options.dtype(at::kBFloat16));
    vnni_values = torch::zeros({o.batch, o.kv_heads, padded_total * o.value_dim}, options.dtype(at::kBFloat16));
    parallel_tasks(o.batch * o.kv_heads, [&](TaskQueue& queue) {
      for (int64_t task; queue.claim(task);) {
        const int64_t b = task / o.kv_heads, kv = task % o.kv_heads;
        // kᵀ in VNNI, by key block: element (dimension c, key n) at (n / key_block) * d * key_block +
        // (c / 2) * 2 * key_block + 2 * (n % key_block) + c % 2: each key's pairs of dimensions, transposed
        // (a coded slot's row is dequantized into `scratch` first)
        std::vector<BF16> scratch(std::max(o.head_dim, o.value_dim));
        BF16* kt = keys(b, kv);
        for (int64_t n = 0; n < o.total; ++n) {
          const BF16* k = o.key_row(b, kv, n, scratch.data());
          for (int64_t c = 0; c < o.head_dim; c += 2) {
            BF16* pair = kt + (n / key_block) * o.head_dim * key_block + c * key_block + 2 * (n % key_block);
            pair[0] = k[c];
            pair[1] = k[c + 1];
          }
        }
        // v in VNNI: element (key n, column c) at (n / 2) * 2 * dv + 2 * c + n % 2
        BF16* vv = values(b, kv);
        for (int64_t n = 0; n < o.total; ++n) {
          const BF16* v = o.value_row(b, kv, n, scratch.data());
          BF16* pairs = vv + (n / 2) * 2 * o.value_dim + n % 2;
          for (int64_t c = 0; c < o.value_dim; ++c) pairs[2 * c] = v[c];
        }
      }
    });
  }

  BF16* keys(int64_t b, int64_t kv) const {
    return vnni_keys.data_ptr<BF16>() + (b * o.kv_heads + kv) * o.head_dim * padded_total;
  }
  BF16* values(int64_t b, int64_t kv) const {
    return vnni_values.data_ptr<BF16>() + (b * o.kv_heads + kv) * padded_total * o.value_dim;
  }
  // s = q . k[n0 : n0 + cols]ᵀ, unscaled (n0: where a key block starts; cols: a multiple of the granularity)
  void logits(int64_t b, int64_t kv, const BF16* q, int64_t rows, int64_t n0, int64_t cols, float* s,
              int64_t ld_s) const {
    at::native::cpublas::brgemm(rows, cols, o.head_dim, o.qSM, key_block, ld_s, false, q,
                                keys(b, kv) + n0 * o.head_dim, s);
  }
  // out (+)= p . v[n0 : n0 + cols]
  void weighted_values(int64_t b, int64_t kv, const BF16* p, int64_t rows, int64_t n0, int64_t cols, int64_t ld_p,
                       float* out, int64_t ld_out, bool add) const {
    at::native::cpublas::brgemm(rows, o.value_dim, cols, ld_p, o.value_dim, ld_out, add, p,
                                values(b, kv) + n0 * o.value_dim, out);
  }
  void release() const { at::native::cpublas::brgemm_release(); }  // the thread's AMX tile configuration
};

// A folded pair's own slots of the chunk from slot n0 (`index`, m of them, relative to n0) as runs of columns: a
// head's slots lie mostly in one stretch (a fold leaves them head-major), multiplied where they lie; the slots
// between such stretches (decoded tokens, one slot per head each) and coded slots are copied (dequantized) into
// `gathered` and multiplied together. Copying every slot cost as much again as the products: both read each key
// and value once from memory.
constexpr int64_t kDirectRun = 16;  // fewer consecutive slots are copied: one product for them all

template <typename T>
std::vector<Columns<T>> columns_of_own_slots(const Operands<T>& o, int64_t b, int64_t kv, int64_t n0,
                                             const int64_t* index, int64_t m, std::vector<T>& gathered) {
  auto held = [&](int64_t j) { return n0 + index[j] >= o.coded; };  // k and v hold column j's slot
  auto direct = [&](int64_t first, int64_t end) { return end - first >= kDirectRun && held(first); };
  std::vector<std::pair<int64_t, int64_t>> stretches;  // [first, end) columns of consecutive slots, coded or not
  int64_t copies = 0;
  for (int64_t j = 0; j < m;) {
    int64_t end = j + 1;
    while (end < m && index[end] == index[end - 1] + 1 && held(end) == held(j)) ++end;
    stretches.emplace_back(j, end);
    copies += direct(j, end) ? 0 : end - j;
    j = end;
  }
  if (gathered.size() < static_cast<size_t>(copies * (o.head_dim + o.value_dim))) {  // grows only (reused)
    gathered.resize(copies * (o.head_dim + o.value_dim));  // only what is copied: a fold's stretches are not
  }
  T* gathered_keys = gathered.data();
  T* gathered_values = gathered_keys + copies * o.head_dim;
  std::vector<Columns<T>> runs;
  int64_t copied = 0, pending = 0;  // slots copied so far; the column where the copies not yet in a run start
  auto flush = [&](int64_t column) {
    if (column > pending) {
      const int64_t count = column - pending, at = copied - count;
      runs.push_back({gathered_keys + at * o.head_dim, o.head_dim, gathered_values + at * o.value_dim, o.value_dim,
                      pending, count});
    }
  };
  for (const auto& [first, end] : stretches) {
    if (direct(first, end)) {
      flush(first);
      const int64_t slot = n0 + index[first];
      runs.push_back({o.key_row(b, kv, slot, nullptr), o.kSN, o.value_row(b, kv, slot, nullptr), o.vSN, first,
                      end - first});
      pending = end;
      continue;
    }
    if (!held(first)) {  // coded slots, consecutive: dequantized as one run
      o.key_codes.read(b, kv, n0 + index[first], end - first, o.head_dim, gathered_keys + copied * o.head_dim);
      o.value_codes.read(b, kv, n0 + index[first], end - first, o.value_dim, gathered_values + copied * o.value_dim);
      copied += end - first;
      continue;
    }
    for (int64_t j = first; j < end; ++j, ++copied) {
      std::copy_n(o.key_row(b, kv, n0 + index[j], nullptr), o.head_dim, gathered_keys + copied * o.head_dim);
      std::copy_n(o.value_row(b, kv, n0 + index[j], nullptr), o.value_dim, gathered_values + copied * o.value_dim);
    }
  }
  flush(m);
  return runs;
}

// A decode step (one query per sequence): per (sequence, KV head) the group's query heads are the rows of one
// product with the keys (float32), so keys and values are read once per group; a row of logits is small, so no
// blocks. Where the (sequence, KV head) pairs alone would leave threads idle (a 3-KV-head model on 2 threads ran
// its third pair on one thread while the other waited; a 1-KV-head model ran on one), each pair's slots are cut
// into chunks of at least `min_chunk` slots (a prefill's key block: below it the second pass costs more than the
// idle thread did), as flash-decoding splits the keys: a chunk's logits, their maximum and sum and its
// unnormalised output are one task; a second pass rescales every chunk to its pair's maximum and sum for the
// output and the scores. One chunk per pair is the same arithmetic in one pass.
template <typename T>
std::vector<torch::Tensor> single_query(const Operands<T>& o, float alpha, bool maximum, int64_t min_chunk,
                                        const torch::TensorOptions& options) {
  torch::Tensor output = torch::empty({o.batch, 1, o.heads, o.value_dim}, options);
  // a folded layer's slots each belong to one KV head: one row of scores per sequence
  torch::Tensor scores = torch::zeros({o.batch, o.slot_head != nullptr ? 1 : o.kv_heads, o.total}, options);
  float* out_data = output.data_ptr<float>();
  float* scores_data = scores.data_ptr<float>();
  const int64_t pairs = o.batch * o.kv_heads, threads = at::get_num_threads();
  const int64_t wanted = threads == 1 || pairs >= 4 * threads ? 1 : (4 * threads + pairs - 1) / pairs;
  const int64_t chunks = std::max<int64_t>(1, std::min(wanted, o.total / min_chunk));
  const int64_t chunk_len = (o.total + chunks - 1) / chunks;
  // per pair: the logits, then their exponentials (groups x total); per (pair, chunk, query head) the chunk's
  // maximum and sum, and its output before normalisation
  torch::Tensor exps_buffer = torch::empty({pairs * o.groups * o.total}, options);
  torch::Tensor partial_buffer = torch::empty({pairs * chunks * o.groups * o.value_dim}, options);
  float* exps = exps_buffer.data_ptr<float>();
  float* partial = partial_buffer.data_ptr<float>();
  std::vector<float> maxima(pairs * chunks * o.groups), sums(pairs * chunks * o.groups);
  std::vector<T> rounded(std::is_same_v<T, float> ? 0 : pairs * o.groups * o.total);  // (bfloat16 inputs)
  // MKL's bfloat16 GEMM copies both operands unless one of them is a single row, which it takes as a GEMV, as
  // sdpa's decode step does: the copies were 43 % of a 4k step (perf), so bfloat16 query heads go one by one
  const int64_t heads_per_product = std::is_same_v<T, float> ? o.groups : 1;
  auto observed = [&](int64_t b) { return o.weight == nullptr ? 1.0f : o.weight[b]; };

  // a folded layer: per (pair, chunk) the pair's own slots of the chunk (their indices, at the chunk's offset in
  // the pair's row, and their count), so that the products multiply only them and the scores go back to them
  const bool folded = o.slot_head != nullptr;
  std::vector<int64_t> own(folded ? pairs * o.total : 0), own_count(folded ? pairs * chunks : 0);

  auto chunk_pass = [&](int64_t pair, int64_t c) {  // logits, maximum, exponentials, sum, output of one chunk
    const int64_t b = pair / o.kv_heads, kv = pair % o.kv_heads, h0 = kv * o.groups;
    const int64_t n0 = c * chunk_len, n = std::min(chunk_len, o.total - n0);
    const float* bias = o.bias != nullptr && observed(b) != 0.0f ? o.bias + b * o.biasSB + kv * o.biasSH + n0
                                                                  : nullptr;
    float* s = exps + pair * o.groups * o.total;
    T* rounded_pair = rounded.empty() ? nullptr : rounded.data() + pair * o.groups * o.total;
    // the chunk's columns: its n slots (Operands::columns), or a folded pair's m own slots (columns_of_own_slots)
    thread_local std::vector<T> gathered;  // the chunk's copied or dequantized slots, reused by the thread
    std::vector<Columns<T>> columns;
    int64_t m = n;
    std::vector<float> own_bias;
    if (!folded) {
      columns = o.columns(b, kv, n0, n, gathered, true, true);
    } else {
      int64_t* index = own.data() + pair * o.total + n0;
      const int64_t* head = o.slot_head + b * o.total + n0;
      m = 0;
      for (int64_t j = 0; j < n; ++j) {
        if (head[j] == kv) index[m++] = j;
      }
      own_count[pair * chunks + c] = m;
      columns = columns_of_own_slots(o, b, kv, n0, index, m, gathered);
      if (bias != nullptr) {
        own_bias.resize(m);
        for (int64_t j = 0; j < m; ++j) own_bias[j] = bias[index[j]];
        bias = own_bias.data();
      }
    }
    float* out = partial + (pair * chunks + c) * o.groups * o.value_dim;
    if (m == 0) {  // a folded pair with no slot in this chunk: weight 0, as a chunk of dead slots
      for (int64_t g = 0; g < o.groups; ++g) {
        maxima[(pair * chunks + c) * o.groups + g] = kNegInf;
        sums[(pair * chunks + c) * o.groups + g] = 0.0f;
      }
      std::fill(out, out + o.groups * o.value_dim, 0.0f);
      return;
    }
    // s[:, n0 : n0 + m] (groups x m) = alpha * q_group (groups x d, ld qSH) . columnsᵀ
    for (int64_t g = 0; g < o.groups; g += heads_per_product) {
      for (const auto& part : columns) {
        gemm('T', 'N', part.count, heads_per_product, o.head_dim, alpha, part.keys, part.key_stride,
             o.q + b * o.qSB + (h0 + g) * o.qSH, o.qSH, 0.0f, s + g * o.total + n0 + part.first, o.total);
      }
    }
    for (int64_t g = 0; g < o.groups; ++g) {
      float* row = s + g * o.total + n0;
      const int64_t index = (pair * chunks + c) * o.groups + g;
      maxima[index] = logits_max(row, m, 1.0f, bias);
      T* rounded_row = rounded_pair == nullptr ? nullptr : rounded_pair + g * o.total + n0;
      if (maxima[index] == kNegInf) {  // every slot of the chunk dead: weight 0 (another chunk holds the live ones)
        sums[index] = exp_shifted_sum(row, 0, m, 0.0f, rounded_row);
      } else {
        sums[index] = exp_shifted_sum(row, m, 0, maxima[index], rounded_row);
      }
    }
    for (int64_t g = 0; g < o.groups; g += heads_per_product) {
      const float* p = s + g * o.total + n0;
      const T* p_rounded = rounded_pair == nullptr ? nullptr : rounded_pair + g * o.total + n0;
      for (size_t i = 0; i < columns.size(); ++i) {
        const auto& part = columns[i];
        gemm('N', 'N', o.value_dim, heads_per_product, part.count, 1.0f, part.values, part.value_stride,
             probability_operand(p + part.first, p_rounded == nullptr ? nullptr : p_rounded + part.first),
             o.total, i == 0 ? 0.0f : 1.0f, out + g * o.value_dim, o.value_dim);
      }
    }
  };

  auto finish = [&](int64_t pair, int64_t c) {  // chunk c's scores, and the pair's output with its first chunk
    const int64_t b = pair / o.kv_heads, kv = pair % o.kv_heads, h0 = kv * o.groups;
    const int64_t n0 = c * chunk_len, n = std::min(chunk_len, o.total - n0);
    for (int64_t g = 0; g < o.groups; ++g) {
      const float* chunk_max = maxima.data() + pair * chunks * o.groups + g;  // stride o.groups over the chunks
      const float* chunk_sum = sums.data() + pair * chunks * o.groups + g;
      float pair_max = kNegInf, pair_sum = 0.0f;
      for (int64_t k = 0; k < chunks; ++k) pair_max = std::max(pair_max, chunk_max[k * o.groups]);
      auto rescale = [&](int64_t k) {  // a chunk's exponentials to the pair's maximum
        return chunk_max[k * o.groups] == kNegInf ? 0.0f : std::exp(chunk_max[k * o.groups] - pair_max);
      };
      for (int64_t k = 0; k < chunks; ++k) pair_sum += chunk_sum[k * o.groups] * rescale(k);
      // a chunk's exponentials to probabilities (the step's own slot is live, so pair_sum > 0)
      auto weight = [&](int64_t k) { return rescale(k) / pair_sum; };
      const float w = observed(b) * weight(c);
      const float* chunk_exps = exps + (pair * o.groups + g) * o.total + n0;
      if (w != 0.0f && !folded) {
        accumulate(scores_data + pair * o.total + n0, chunk_exps, w, n, maximum);
      } else if (w != 0.0f) {  // a folded pair's own slots, in the sequence's one row of scores
        const int64_t* index = own.data() + pair * o.total + n0;
        float* column = scores_data + b * o.total + n0;
        for (int64_t j = 0; j < own_count[pair * chunks + c]; ++j) {
          const float x = chunk_exps[j] * w;
          column[index[j]] = maximum ? std::max(column[index[j]], x) : column[index[j]] + x;
        }
      }
      if (c == 0) {
        float* out = out_data + b * o.heads * o.value_dim + (h0 + g) * o.value_dim;
        std::fill(out, out + o.value_dim, 0.0f);
        for (int64_t k = 0; k < chunks; ++k) {
          const float r = weight(k);
          const float* part = partial + ((pair * chunks + k) * o.groups + g) * o.value_dim;
          at::vec::map2([r](Vec a, Vec x) { return a + x * Vec(r); }, out, out, part, o.value_dim);
        }
      }
    }
  };

  if (chunks == 1) {
    parallel_tasks(pairs, [&](TaskQueue& queue) {
      for (int64_t pair; queue.claim(pair);) {
        chunk_pass(pair, 0);
        finish(pair, 0);
      }
    });
  } else {
    parallel_tasks(pairs * chunks, [&](TaskQueue& queue) {
      for (int64_t task; queue.claim(task);) chunk_pass(task / chunks, task % chunks);
    });
    parallel_tasks(pairs * chunks, [&](TaskQueue& queue) {
      for (int64_t task; queue.claim(task);) finish(task / chunks, task % chunks);
    });
  }
  return {scores, output};
}

// A prefill (or any multi-query forward): blocks of query rows of one head walk the keys in blocks (above).
template <typename T, typename Products>
std::vector<torch::Tensor> causal_blocks(const Operands<T>& o, const Products& products, bool maximum,
                                         int64_t row_block, int64_t key_block, const torch::TensorOptions& options) {
  torch::Tensor output = torch::empty({o.batch, o.length, o.heads, o.value_dim}, options);
  float* out_data = output.data_ptr<float>();
  const int64_t oSB = o.length * o.heads * o.value_dim, oSM = o.heads * o.value_dim;
  const int threads = at::get_num_threads();
  torch::Tensor partial_sums = torch::zeros({threads, o.batch, o.kv_heads, o.total}, options);
  float* sums_data = partial_sums.data_ptr<float>();

  const int64_t row_blocks = (o.length + row_block - 1) / row_block;
  const int64_t key_blocks_max = (o.total + key_block - 1) / key_block;
  const int64_t base = o.total - o.length;  // slot of the forward's first token
  // how many slots of the key block from n0 on row m (of the forward) sees: causal, the same in both passes below
  // (never more than the columns its products computed: the block's last row sees them all)
  auto seen_from = [base, key_block](int64_t m, int64_t n0) {
    return std::clamp<int64_t>(base + m + 1 - n0, 0, key_block);
  };

  parallel_tasks(o.batch * o.heads * row_blocks, [&](TaskQueue& queue) {
    // the row block's exponentiated logits, key block after key block, each block contiguous (rows x key_block);
    // a torch allocation, so that memory profiling sees it (tests/test_memory_scaling.py)
    torch::Tensor exps_buffer = torch::empty({row_block * key_block * key_blocks_max}, options);
    float* exps = exps_buffer.data_ptr<float>();
    std::vector<T> rounded(std::is_same_v<T, float> ? 0 : row_block * key_block);  // one block's probabilities
    std::vector<float> block_max(row_block * key_blocks_max), running_max(row_block), running_sum(row_block);
    float* sums_thread = sums_data + at::get_thread_num() * o.batch * o.kv_heads * o.total;
    for (int64_t task; queue.claim(task);) {
      // the last row blocks first: they see the most keys, and the short ones left at the end even the threads out
      const int64_t rb = row_blocks - 1 - task / (o.batch * o.heads), b = (task / o.heads) % o.batch,
                    h = task % o.heads;
      const int64_t kv = h / o.groups, m0 = rb * row_block, rows = std::min(row_block, o.length - m0);
      const int64_t visible = base + m0 + rows;  // slots the block's last row sees
      const T* q = o.q + b * o.qSB + h * o.qSH + m0 * o.qSM;
      float* out = out_data + b * oSB + m0 * oSM + h * o.value_dim;
      const float* bias = o.bias != nullptr ? o.bias + b * o.biasSB + kv * o.biasSH : nullptr;
      const float* weight = o.weight != nullptr ? o.weight + b * o.length + m0 : nullptr;
      std::fill(running_max.begin(), running_max.end(), kNegInf);
      std::fill(running_sum.begin(), running_sum.end(), 0.0f);

      int64_t key_blocks = 0;
      for (int64_t n0 = 0; n0 < visible; n0 += key_block, ++key_blocks) {
        // the block's columns up to the last one the rows see, in whole chunks of the products' granularity
        const int64_t cols = std::min(key_block, (visible - n0 + Products::granularity - 1) / Products::granularity *
                                                     Products::granularity);
        float* s = exps + key_blocks * row_block * key_block;
        products.logits(b, kv, q, rows, n0, cols, s, key_block);
        for (int64_t i = 0; i < rows; ++i) {
          float* row = s + i * key_block;
          const int64_t seen = seen_from(m0 + i, n0);
          const bool biased = bias != nullptr && (weight == nullptr || weight[i] != 0.0f);
          const float previous = running_max[i];
          const float current = std::max(previous, logits_max(row, seen, products.logit_scale,
                                                              biased ? bias + n0 : nullptr));
          block_max[i * key_blocks_max + key_blocks] = current;
          T* rounded_row = rounded.empty() ? nullptr : rounded.data() + i * key_block;  // (bfloat16 inputs)
          if (current == kNegInf) {  // nothing live so far in this row
            exp_shifted_sum(row, 0, cols, 0.0f, rounded_row);  // all zeros
            continue;
          }
          if (previous != current && n0 > 0) {  // rescale what was accumulated under the old maximum
            const float factor = std::exp(previous - current);
            running_sum[i] *= factor;
            at::vec::map([factor](Vec x) { return x * Vec(factor); }, out + i * oSM, out + i * oSM, o.value_dim);
          }
          running_max[i] = current;
          running_sum[i] += exp_shifted_sum(row, seen, cols - seen, current, rounded_row);
        }
        products.weighted_values(b, kv, probability_operand(s, rounded.data()), rows, n0, cols,
                                 key_block, out, oSM, n0 > 0);
      }
      float* sums = sums_thread + (b * o.kv_heads + kv) * o.total;
      for (int64_t i = 0; i < rows; ++i) {
        const float inverse = 1.0f / running_sum[i];  // > 0: a row always sees its own (live) slot
        at::vec::map([inverse](Vec x) { return x * Vec(inverse); }, out + i * oSM, out + i * oSM, o.value_dim);
      }
      for (int64_t kb = 0; kb < key_blocks; ++kb) {
        const int64_t n0 = kb * key_block;
        for (int64_t i = 0; i < rows; ++i) {
          const float observed = weight == nullptr ? 1.0f : weight[i];
          const float seen_max = block_max[i * key_blocks_max + kb];
          if (observed == 0.0f || seen_max == kNegInf) continue;
          const int64_t seen = seen_from(m0 + i, n0);
          const float w = observed * std::exp(seen_max - running_max[i]) / running_sum[i];
          const float* row = exps + (kb * row_block + i) * key_block;
          accumulate(sums + n0, row, w, seen, maximum);
        }
      }
    }
    products.release();
  });
  // weights are >= 0, so the zeros a thread's buffer starts from leave every maximum as it is
  auto columns = threads == 1 ? partial_sums[0] : maximum ? partial_sums.amax(0) : partial_sums.sum(0);
  return {columns, output};
}

}  // namespace

// Whether bfloat16 inputs can be multiplied as they are (the build's BLAS has MKL's bfloat16 GEMM).
bool bfloat16_products() { return cblas_gemm_bf16bf16f32 != nullptr; }

// Whether multi-query bfloat16 passes run on oneDNN's packed products (this CPU has them; else MKL's GEMM).
bool bfloat16_packed_products() { return at::native::cpublas::could_pack(at::kBFloat16); }

std::vector<torch::Tensor> fused_attention(torch::Tensor queries, torch::Tensor keys, torch::Tensor values,
                                           double scale, torch::Tensor key_bias, torch::Tensor row_weight,
                                           bool maximum, int64_t row_block, int64_t key_block,
                                           torch::Tensor slot_head, std::vector<torch::Tensor> coded,
                                           int64_t coded_slots) {
  const float alpha = static_cast<float>(scale);
  const auto options = queries.options().dtype(at::kFloat);  // scores and output are float32 for every input
  const auto type = queries.scalar_type();
  TORCH_CHECK(keys.scalar_type() == type && values.scalar_type() == type,
              "fused_attention: queries, keys and values must share one dtype");
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "fused_attention: float32 or bfloat16 tensors only");
  TORCH_CHECK(type == at::kFloat || bfloat16_products(),
              "fused_attention: no bfloat16 GEMM in this build (pass float32 copies)");
  auto run = [&](auto element) {  // one decode step or a multi-query forward, for inputs of that element type
    using T = decltype(element);
    const auto o = operands<T>(queries, keys, values, key_bias, row_weight, slot_head, coded, coded_slots);
    TORCH_CHECK(o.slot_head == nullptr || (o.length == 1 && slot_head.is_contiguous()),
                "fused_attention: slot_head (a folded layer) is for a decode step, contiguous");
    if (o.length == 1) return single_query(o, alpha, maximum, key_block, options);
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (PackedProducts::applies(o, key_block)) {
        return causal_blocks(o, PackedProducts(o, alpha, key_block, options), maximum, row_block, key_block,
                             options);
      }
    }
    return causal_blocks(o, DirectProducts<T>{o, alpha}, maximum, row_block, key_block, options);
  };
  return type == at::kBFloat16 ? run(at::BFloat16()) : run(0.0f);
}

// How many threads the kernel's parallel loops run on: torch's thread count when the build has OpenMP (without
// -fopenmp, at::parallel_for's pragma is compiled out and every loop ran on the calling thread alone).
int64_t parallel_threads() {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { chunks += 1; });
  return chunks;
}

// quantized_slots.cpp
void dequantize_slots(torch::Tensor codes, torch::Tensor scales, torch::Tensor minimums, int64_t bits, int64_t slots,
                      torch::Tensor out);
std::vector<torch::Tensor> quantize_slots(torch::Tensor tensor, int64_t bits, int64_t group_size);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_slots", &dequantize_slots, "Quantized slots (kvcompress/quantization.py) into full precision");
  m.def("quantize_slots", &quantize_slots, "Slots (..., T, d) as codes, scales and minimums");
  m.def("fused_attention", &fused_attention, "Causal attention output and column sums (or maxima) of its weights");
  m.def("parallel_threads", &parallel_threads, "Threads the kernel's parallel loops run on");
  m.def("bfloat16_products", &bfloat16_products, "Whether bfloat16 inputs are multiplied without float32 copies");
  m.def("bfloat16_packed_products", &bfloat16_packed_products, "Whether bfloat16 prefills use oneDNN's brgemm");
}
