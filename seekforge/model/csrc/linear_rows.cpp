// Linear layers over a few rows on a CPU with AVX-512 (seekforge/model/kernels.py builds and loads them), fp32 or
// bf16: y = x · Wᵀ (+ b) for x (M, K) with M small (a decode step's one token) and W (N, K), and the grouped
// forms MLA's absorbed attention needs, x (G, M, K) against G weights (G, N, K) or, untransposed, (G, K, N),
// which may be views with gaps between the groups, and a token's chosen experts: x (G, M, K) against the weights
// index[g] of a stack (E, N, K).
//
// At one row a linear layer is a stream over its weight: every weight value is read once and used once. The
// kernels read the weight in memory order (W's rows front to back; for an untransposed W, 64-128 columns of
// each row in turn), widen bf16 to fp32 as loaded, hold up to four query rows in fp32, and split the weight
// over the threads; all arithmetic is fp32. oneDNN's and MKL's GEMM kernels pack and block for reuse that one
// row does not have, and oneDNN copies a grouped view into a contiguous one first (see kernels.py for the
// measurements). More than four query rows run four at a time, each group reading the weight again.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "c_shims.h"
#include "vectors.h"

namespace {

using seekforge_vectors::columns;
using seekforge_vectors::load16;

// A thread's weight stream is requested PREFETCH_BYTES ahead of its reads. The hardware prefetchers alone
// start each small weight cold and fall behind: the row kernel read a `small` expert's 0.26 MB at 16-24 GB/s
// and 4 MB at 29-30, against 25-28 and 34-37 with 8 KiB requested ahead (bf16, 1 thread, each weight from
// memory, 5-9 alternating rounds; 4 KiB ahead gained less, 16 KiB no more). The stream is the rows of one
// weight, then the next weight the thread reads (a token's next expert), if any.
constexpr int64_t PREFETCH_BYTES = 8192;

struct Stream {
  const char* end = nullptr;   // where the weight being read ends
  const char* next = nullptr;  // the next weight the thread reads, or none
  int64_t next_bytes = 0;
};

// request the line `ahead` bytes past p in the stream
inline void prefetch_ahead(const void* p, const Stream& s) {
  const char* a = static_cast<const char*>(p) + PREFETCH_BYTES;
  if (a < s.end) {
    _mm_prefetch(a, _MM_HINT_T0);
  } else if (a - s.end < s.next_bytes) {
    _mm_prefetch(s.next + (a - s.end), _MM_HINT_T0);
  }
}

// request `bytes` from p on
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// request the first PREFETCH_BYTES of a stream starting at p, of which `bytes` exist (a thread's first read)
inline void prefetch_head(const void* p, int64_t bytes) { prefetch_bytes(p, std::min(bytes, PREFETCH_BYTES)); }

// out[m, n] = x[m] · W[n] for MB query rows (fp32, K wide) and the weight rows n0 … n1-1 (row stride K, ldo
// the output's): each weight row is read front to back, U vectors of 16 at a time into U accumulators per
// query row, the next row right after it — one sequential stream per thread (reading four rows side by side
// measured 1.5-2x slower here), requested ahead (see PREFETCH_BYTES).
template <int MB, int U, typename T>
void row_dots(const float* x, const T* w, int64_t K, int64_t n0, int64_t n1, float* out, int64_t ldo,
              const Stream& stream) {
  static_assert(16 * U * sizeof(T) >= 64, "a step of the row loop reads at least one cache line");
  for (int64_t n = n0; n < n1; ++n) {
    const T* wr = w + n * K;
    __m512 acc[MB][U];
    for (int m = 0; m < MB; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 * U <= K; d += 16 * U) {
      for (int64_t b = 0; b < 16 * U * int64_t(sizeof(T)); b += 64)
        prefetch_ahead(reinterpret_cast<const char*>(wr + d) + b, stream);
      for (int u = 0; u < U; ++u) {
        const __m512 wv = load16(wr + d + 16 * u, 0xFFFF);
        for (int m = 0; m < MB; ++m) acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + d + 16 * u), acc[m][u]);
      }
    }
    for (; d < K; d += 16) {  // the last columns, fewer than 16·U
      const __mmask16 k = columns(d, K);
      const __m512 wv = load16(wr + d, k);
      for (int m = 0; m < MB; ++m) acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(k, x + m * K + d), acc[m][0]);
    }
    for (int m = 0; m < MB; ++m) {
      __m512 total = acc[m][0];
      for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][u]);
      out[m * ldo + n] = _mm512_reduce_add_ps(total);
    }
  }
}

template <typename T>
void rows_range(int mb, const float* x, const T* w, int64_t K, int64_t n0, int64_t n1, float* out, int64_t ldo,
                const Stream& s) {
  switch (mb) {
    case 1: return row_dots<1, 4>(x, w, K, n0, n1, out, ldo, s);
    case 2: return row_dots<2, 2>(x, w, K, n0, n1, out, ldo, s);
    case 3: return row_dots<3, 2>(x, w, K, n0, n1, out, ldo, s);
    default: return row_dots<4, 2>(x, w, K, n0, n1, out, ldo, s);
  }
}

// out[m, c … c+16U-1] = Σ_k x[m, k] · W[k, c … c+16U-1] for MB query rows (fp32, K wide) and the columns of W
// (K × N, row stride ldw) that exist: the product with an untransposed weight, 16U columns of each row in turn.
// The rows PREFETCH_BYTES ahead are requested as each is read, past the last one into `next`: the chunk the
// thread reads next (the same columns of another weight of this shape), if any. In a decode step of `small`
// (MLA's absorbed keys: 64 × 128 per head, 16 KiB) these products read a byte at a fifth of the row kernel's
// rate without.
template <int MB, int U, typename T>
void column_chunk(const float* x, const T* w, int64_t K, int64_t ldw, int64_t c, int64_t N, float* out, int64_t ldo,
                  const T* next) {
  const int64_t width = std::min<int64_t>(16 * U, N - c) * int64_t(sizeof(T));  // bytes of a row in this chunk
  const int64_t ahead = std::max<int64_t>(1, PREFETCH_BYTES / (16 * U * int64_t(sizeof(T))));  // rows
  __m512 acc[MB][U];
  __mmask16 k[U];
  for (int u = 0; u < U; ++u) {
    k[u] = c + 16 * u < N ? columns(c + 16 * u, N) : __mmask16(0);
    for (int m = 0; m < MB; ++m) acc[m][u] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < K; ++d) {
    // the chunk's row `ahead` rows on, continuing into `next` past the last (GCC 12 drops a prefetch written in
    // a lambda here)
    if (const int64_t a = d + ahead; a < K) {
      prefetch_bytes(w + a * ldw + c, width);
    } else if (next != nullptr && a - K < K) {
      prefetch_bytes(next + (a - K) * ldw, width);
    }
    const T* row = w + d * ldw + c;
    __m512 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_set1_ps(x[m * K + d]);
    for (int u = 0; u < U; ++u) {
      if (!k[u]) break;
      const __m512 wv = load16(row + 16 * u, k[u]);
      for (int m = 0; m < MB; ++m) acc[m][u] = _mm512_fmadd_ps(wv, xv[m], acc[m][u]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < U && k[u]; ++u) _mm512_mask_storeu_ps(out + m * ldo + c + 16 * u, k[u], acc[m][u]);
}

// the columns a work item of column_chunk covers for mb query rows: 128 (8 accumulators a row) up to two rows,
// else 64 (the accumulators stay within the 32 vector registers)
inline int64_t chunk_columns(int mb) { return mb <= 2 ? 128 : 64; }

template <typename T>
void column_chunk_any(int mb, const float* x, const T* w, int64_t K, int64_t ldw, int64_t c, int64_t N, float* out,
                      int64_t ldo, const T* next) {
  switch (mb) {
    case 1: return column_chunk<1, 8>(x, w, K, ldw, c, N, out, ldo, next);
    case 2: return column_chunk<2, 8>(x, w, K, ldw, c, N, out, ldo, next);
    case 3: return column_chunk<3, 4>(x, w, K, ldw, c, N, out, ldo, next);
    default: return column_chunk<4, 4>(x, w, K, ldw, c, N, out, ldo, next);
  }
}

// The operands of a product: G groups of M query rows K wide (x: see widen_rows) against G weights of N rows K wide
// (or, `transposed`, K rows N wide) with contiguous rows, the weights `group` values apart, or, given `index`, the
// weights index[g] of a stack.
struct Operands {
  const at::Tensor& x;
  const at::Tensor& weight;
  int64_t G, M, K, N, group;
  bool transposed = false;
  const int64_t* index = nullptr;
};

// → fp32 out (G × M × N): groups and blocks of 16 weight rows (or of chunk_columns columns) split over the
// threads, the query rows four at a time.
template <typename T>
void run(const Operands& o, float* out) {
  const int64_t G = o.G, M = o.M, K = o.K, N = o.N;
  // the query rows in fp32, in this thread's buffer (kept: a decode step makes ~100 of these calls); the workers
  // read it through `xs` (a thread_local named in the lambda would be each worker's own)
  thread_local std::vector<float> xf;
  seekforge_vectors::widen_rows_any(o.x, G, M, K, xf);
  const float* xs = xf.data();
  const T* wp = o.weight.data_ptr<T>();
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int mb = int(std::min<int64_t>(4, M - m0));
    const int64_t width = o.transposed ? chunk_columns(mb) : 16;  // a work item: columns of W, or 16 rows
    const int64_t items = (N + width - 1) / width;
    // a thread takes at least ~64 KB of weight (smaller layers run on fewer threads)
    const int64_t grain = std::max<int64_t>(1, 65536 / (width * K * int64_t(sizeof(T))));
    auto weight = [&](int64_t g) { return wp + (o.index ? o.index[g] : g) * o.group; };
    const int64_t bytes = N * K * int64_t(sizeof(T));  // one group's weight
    at::parallel_for(0, G * items, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t g = i / items, n = (i % items) * width;
        const float* xg = xs + (g * M + m0) * K;
        float* og = out + (g * M + m0) * N;
        const T* wg = weight(g);
        if (o.transposed) {
          const int64_t j = i + 1;  // the chunk this thread reads next, if any
          const T* next = j < e ? weight(j / items) + (j % items) * width : nullptr;
          if (i == b) {  // the chunk's first rows, which column_chunk requests no further
            for (int64_t d = 0; d < std::min<int64_t>(K, PREFETCH_BYTES / (width * int64_t(sizeof(T)))); ++d)
              prefetch_bytes(wg + d * N + n, std::min(width, N - n) * int64_t(sizeof(T)));
          }
          column_chunk_any<T>(mb, xg, wg, K, N, n, N, og, N, next);
          continue;
        }
        const bool more = (g + 1) * items < e;  // this thread reads the next group's weight too
        const Stream s{reinterpret_cast<const char*>(wg + N * K),
                       more ? reinterpret_cast<const char*>(weight(g + 1)) : nullptr, more ? bytes : 0};
        if (i == b) prefetch_head(wg + n * K, (N - n) * K * int64_t(sizeof(T)));
        rows_range<T>(mb, xg, wg, K, n, std::min(n + width, N), og, N, s);
      }
    });
  }
}

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), op, ": x and weight differ in dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": fp32 or bf16 only");
}

// The product → a tensor of `shape` (G·M·N values) in x's dtype, plus bias (N) if given
at::Tensor product(const Operands& o, at::IntArrayRef shape, const c10::optional<at::Tensor>& bias) {
  const int64_t size = o.G * o.M * o.N;
  thread_local std::vector<float> acc;
  acc.resize(size);
  if (o.x.scalar_type() == at::kFloat) {
    run<float>(o, acc.data());
  } else {
    run<c10::BFloat16>(o, acc.data());
  }
  at::Tensor out = at::empty(shape, o.x.options());
  auto store = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    for (int64_t i = 0; i < size; ++i) op[i] = static_cast<T>(acc[i] + (bp ? static_cast<float>(bp[i % o.N]) : 0.f));
  };
  if (o.x.scalar_type() == at::kFloat) {
    store(out.data_ptr<float>());
  } else {
    store(out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// F.linear over a few rows: x (..., K), weight (N, K) with contiguous rows, bias (N) or none → (..., N); or, with
// a weight (G, N, K) whose rows are contiguous (any group stride), x (G, M, K) → (G, M, N) (bmm(x, weightᵀ))
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_inputs("linear_rows", x, weight);
  TORCH_CHECK((weight.dim() == 2 || weight.dim() == 3) && weight.stride(-1) == 1 && weight.stride(-2) == weight.size(-1),
              "linear_rows: weight must be (N, K) or (G, N, K) with contiguous rows");
  const int64_t K = weight.size(-1), N = weight.size(-2);
  TORCH_CHECK(x.size(-1) == K, "linear_rows: x has ", x.size(-1), " columns, the weight ", K);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                                    bias->scalar_type() == weight.scalar_type()),
              "linear_rows: bias must be a contiguous (N) vector of the weight's dtype");
  if (weight.dim() == 3) {
    TORCH_CHECK(x.dim() == 3 && x.size(0) == weight.size(0), "linear_rows: x must be (G, M, K) for a (G, N, K) weight");
    return product({x, weight, x.size(0), x.size(1), K, N, weight.stride(0)}, {x.size(0), x.size(1), N}, bias);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  // the rows as one group against the one weight (read once for every four rows): a view is copied first
  return product({x.contiguous(), weight, 1, x.numel() / K, K, N, 0}, shape, bias);
}

// x (G, M, K) against the weights index[g] of a stack (E, N, K) with contiguous rows → (G, M, N): a decoding token
// through its chosen experts, whose weights are read in place (indexing the stack first would copy them)
at::Tensor linear_rows_indexed(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& index) {
  check_inputs("linear_rows_indexed", x, weight);
  TORCH_CHECK(weight.dim() == 3 && weight.stride(2) == 1 && weight.stride(1) == weight.size(2),
              "linear_rows_indexed: weight must be (E, N, K) with contiguous rows");
  TORCH_CHECK(x.dim() == 3 && x.size(2) == weight.size(2), "linear_rows_indexed: x must be (G, M, K), K = ",
              weight.size(2));
  TORCH_CHECK(index.dim() == 1 && index.size(0) == x.size(0) && index.scalar_type() == at::kLong && index.is_cpu(),
              "linear_rows_indexed: index must be G int64 ids on the CPU");
  const at::Tensor ids = index.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t g = 0; g < ids.size(0); ++g)
    TORCH_CHECK(ip[g] >= 0 && ip[g] < weight.size(0), "linear_rows_indexed: index ", ip[g], " outside the ",
                weight.size(0), " weights");
  return product({x, weight, x.size(0), x.size(1), x.size(2), weight.size(1), weight.stride(0), false, ip},
                 {x.size(0), x.size(1), weight.size(1)}, c10::nullopt);
}

// bmm over a few rows with an untransposed weight: x (G, M, K), weight (G, K, N) with contiguous rows (any group
// stride) → (G, M, N)
at::Tensor rows_times(const at::Tensor& x, const at::Tensor& weight) {
  check_inputs("rows_times", x, weight);
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3 && x.size(0) == weight.size(0) && x.size(2) == weight.size(1),
              "rows_times: x (G, M, K) and weight (G, K, N) expected");
  TORCH_CHECK(weight.stride(2) == 1 && weight.stride(1) == weight.size(2),
              "rows_times: the weight's rows must be contiguous");
  return product({x, weight, x.size(0), x.size(1), x.size(2), weight.size(2), weight.stride(0), true},
                 {x.size(0), x.size(1), weight.size(2)}, c10::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seekforge, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rows_times(Tensor x, Tensor weight) -> Tensor");
  m.def("linear_rows_indexed(Tensor x, Tensor weight, Tensor index) -> Tensor");
}
TORCH_LIBRARY_IMPL(seekforge, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("rows_times", &rows_times);
  m.impl("linear_rows_indexed", &linear_rows_indexed);
}

extern "C" {
using seekforge_shims::tensor;
AOTITorchError aoti_torch_cpu_linear_rows(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                          AtenTensorHandle* ret0) {
  return seekforge_shims::returning(ret0, [&] {
    return linear_rows(tensor(x), tensor(weight), seekforge_shims::optional_tensor(bias));
  });
}
AOTITorchError aoti_torch_cpu_rows_times(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* ret0) {
  return seekforge_shims::returning(ret0, [&] { return rows_times(tensor(x), tensor(weight)); });
}
AOTITorchError aoti_torch_cpu_linear_rows_indexed(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle index,
                                                  AtenTensorHandle* ret0) {
  return seekforge_shims::returning(ret0, [&] { return linear_rows_indexed(tensor(x), tensor(weight), tensor(index)); });
}
}
