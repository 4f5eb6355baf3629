// Weight matrix products on the CPU for few rows (decode), as XLA FFI handlers: the dense layers of a
// model whose parameters are `jpaged.device.quant.QuantizedWeight`s (int8 with scales, or 16-bit
// without), where XLA's CPU dot would first widen the whole int8 matrix to float32 in memory, or reads
// a bfloat16 matrix at a fraction of the memory's speed.
//
// JpagedInt8Matmul, operands (see jpaged/device/quant.py, which flattens a parameter's logical layout
// to these):
//   x       f32[M, K]            activations, M rows
//   values  s8[N, K]             the weight, one output channel per row (GGUF's / torch's [out, in])
//   scales  f32 or f16 [N, K/G]  one scale per group of G consecutive input columns of a channel
//                                (G = K: per output channel; G = 32: GGUF's Q8_0 blocks)
// Result: f32[M, N], y[m, n] = sum_g scales[n, g] * sum_{k in group g} values[n, k] * x[m, k].
//
// JpagedWeight16Matmul, operands:
//   x       f32[M, K]            activations, M rows
//   values  u16 or bf16 [N, K]   bfloat16 weights (u16: their bit patterns, the CPU storage form), or
//           f16 [N, K]           float16 weights; one output channel per row, no scales
// Result: f32[M, N], y[m, n] = sum_k float(values[n, k]) * x[m, k] (float32 products and sums).
//
// Each weight is read once per call from memory: kLanes at a time (one register: lanes.h), widened to
// float32 (and scaled) in registers (bfloat16: a 16-bit shift), then multiplied into up to 8 rows of x
// (float32 accumulation). Output channels are split in tiles between the calling thread and XLA's
// intra-op threads; inside a tile, rows go in chunks of up to 8, so a tile's weights are reused from
// cache by every chunk.
//
// Built into the same per-instruction-set libraries as paged_attention.cc (setup.py), with GCC's
// vector extensions: the variants differ only in their vector width and the instructions the
// compiler may use.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
// GCC 12 warns of the "undefined" source register inside _mm512_cvtepi8_epi32 (a known false positive)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "lanes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;   // rows of x per pass over a tile's weights
constexpr int64_t kTile = 32; // output channels per work item

struct Bf16 {  // a bfloat16 weight, as its bit pattern
  uint16_t bits;
};
struct NoScale {};  // the scale type of unscaled (16-bit) weights

inline VF LoadF(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kLanes int8 weights widened to float32: one sign extension and one conversion per register (GCC's
// generic conversion of a char vector goes lane by lane).
inline VF Widen(const int8_t* p) {
  VF f;
#if defined(__AVX512F__)
  static_assert(kLanes == 16);
  const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__)
  static_assert(kLanes == 8);
  const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&f, &x, sizeof f);
#else
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
#endif
  return f;
}

// kLanes bfloat16 weights: zero-extended to 32 bits and shifted into a float's upper half (one
// zero-extending load and one shift per register: GCC's generic conversion of the AVX-512 build
// widens the two halves apart and joins them).
inline VF Widen(const Bf16* p) {
  VF f;
#if defined(__AVX512F__)
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  std::memcpy(&f, &u, sizeof f);
#elif defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  std::memcpy(&f, &u, sizeof f);
#else
  VH h;
  std::memcpy(&h, p, sizeof h);
  const VU u = __builtin_convertvector(h, VU) << 16;
  std::memcpy(&f, &u, sizeof f);
#endif
  return f;
}

// kLanes float16 weights (F16C's conversion where the build has it).
inline VF Widen(const _Float16* p) {
  VF f;
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&f, &x, sizeof f);
#else
  VHF h;
  std::memcpy(&h, p, sizeof h);
  f = __builtin_convertvector(h, VF);
#endif
  return f;
}

inline float WidenOne(int8_t w) { return static_cast<float>(w); }
inline float WidenOne(_Float16 w) { return static_cast<float>(w); }
inline float WidenOne(Bf16 w) {
  const uint32_t u = static_cast<uint32_t>(w.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename S>
inline float Scale(const S* s) {
  return static_cast<float>(*s);
}

struct Problem {
  const float* x;
  const void* w;       // int8_t, Bf16 or _Float16 [N, K]
  const void* scales;  // [N, K / G] (unscaled weights: unused, G = K)
  int64_t M, N, K, G;
  float* y;
};

// Rows [m0, m0 + R) by output channels [n0, n0 + NO): R * NO independent accumulators. W: the weights'
// type; S: their scales' (NoScale: none).
template <typename W, typename S, int R, int NO>
inline void Block(const Problem& p, int64_t m0, int64_t n0) {
  constexpr bool kScaled = !std::is_same_v<S, NoScale>;
  const int64_t K = p.K, G = p.G, groups = K / G;
  const W* w = static_cast<const W*>(p.w);
  // The next NO channels' weights (contiguous, NO * K of them) are prefetched while these are read, as
  // many bytes an iteration as it reads: NO rows of K weights each are too short a stream for the
  // hardware prefetchers, and a decode step's weights come from memory. Measured on an Intel Xeon (2
  // cores), bfloat16 [1536 x 576] weights of 60 layers, one row: 23 -> 35 GB/s as independent products,
  // 15 -> 21 GB/s as a chain of dependent ones. (Reading each channel whole, one sequential stream,
  // was slower, with or without prefetches.) Prefetches past the matrix's end never fault.
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + NO) * K);
  VF acc[R][NO] = {};
  float tail[R][NO] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float s[NO];
    if constexpr (kScaled)
      for (int o = 0; o < NO; ++o) s[o] = Scale(static_cast<const S*>(p.scales) + (n0 + o) * groups + g);
    const int64_t k1 = (g + 1) * G;
    int64_t k = g * G;
    for (; k + kLanes <= k1; k += kLanes) {
      for (int b = 0; b < static_cast<int>(NO * kLanes * sizeof(W)); b += 64) __builtin_prefetch(ahead + b, 0, 3);
      ahead += NO * kLanes * sizeof(W);
      VF xv[R];
      for (int r = 0; r < R; ++r) xv[r] = LoadF(p.x + (m0 + r) * K + k);
      for (int o = 0; o < NO; ++o) {
        VF wv = Widen(w + (n0 + o) * K + k);
        if constexpr (kScaled) wv *= s[o];
        for (int r = 0; r < R; ++r) acc[r][o] += wv * xv[r];
      }
    }
    for (; k < k1; ++k)  // a group that is not a multiple of kLanes columns
      for (int o = 0; o < NO; ++o) {
        float wk = WidenOne(w[(n0 + o) * K + k]);
        if constexpr (kScaled) wk *= s[o];
        for (int r = 0; r < R; ++r) tail[r][o] += wk * p.x[(m0 + r) * K + k];
      }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NO; ++o) p.y[(m0 + r) * p.N + n0 + o] = AddLanes(acc[r][o]) + tail[r][o];
}

// Rows [m0, m0 + R) by the channels [n0, n1): NO at a time (8 accumulators or so), the rest one by one.
template <typename W, typename S, int R>
void Rows(const Problem& p, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int NO = R >= 8 ? 1 : R >= 4 ? 2 : R >= 2 ? 4 : 8;
  int64_t n = n0;
  for (; n + NO <= n1; n += NO) Block<W, S, R, NO>(p, m0, n);
  for (; n < n1; ++n) Block<W, S, R, 1>(p, m0, n);
}

template <typename W, typename S>
void Tile(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.M; m += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, p.M - m)) {
      case 1: Rows<W, S, 1>(p, m, n0, n1); break;
      case 2: Rows<W, S, 2>(p, m, n0, n1); break;
      case 3: Rows<W, S, 3>(p, m, n0, n1); break;
      case 4: Rows<W, S, 4>(p, m, n0, n1); break;
      case 5: Rows<W, S, 5>(p, m, n0, n1); break;
      case 6: Rows<W, S, 6>(p, m, n0, n1); break;
      case 7: Rows<W, S, 7>(p, m, n0, n1); break;
      default: Rows<W, S, 8>(p, m, n0, n1); break;
    }
  }
}

// The tiles, claimed by the calling thread and XLA's intra-op threads; threads that start after the
// last tile was claimed return without touching the buffers (which live only until the handler returns).
struct Work {
  Problem problem;
  void (*tile)(const Problem&, int64_t, int64_t);  // Tile<W, S>
  int64_t tiles;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void Drain() {
    for (int64_t t = next.fetch_add(1); t < tiles; t = next.fetch_add(1)) {
      const int64_t n0 = t * kTile, n1 = std::min(problem.N, n0 + kTile);
      tile(problem, n0, n1);
      if (done.fetch_add(1) + 1 == tiles) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

// Runs `work` (its problem and tile function set) on the calling thread and XLA's intra-op threads.
ffi::Error Run(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  const Problem& p = work->problem;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  work->tiles = (p.N + kTile - 1) / kTile;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->tiles) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  std::unique_lock<std::mutex> lock(work->mu);
  work->finished.wait(lock, [&] { return work->done.load() == work->tiles; });
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                      ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions();
  auto w_dims = values.dimensions();
  auto s_dims = scales.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || s_dims.size() != 2)
    return ffi::Error::InvalidArgument("int8 matmul: x must be [M, K], values [N, K], scales [N, K / G]");
  const int64_t M = x_dims[0], K = x_dims[1], N = w_dims[0];
  if (w_dims[1] != K || s_dims[0] != N || s_dims[1] < 1 || K % s_dims[1] != 0)
    return ffi::Error::InvalidArgument("int8 matmul: values must be [N, K] with x's K, and scales [N, K / G] "
                                       "with G dividing K");
  const auto type = scales.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("int8 matmul: scales must be float32 or float16");
  auto work = std::make_shared<Work>();
  work->problem = Problem{x.typed_data(), values.typed_data(), scales.untyped_data(), M, N, K,
                          K / s_dims[1], y->typed_data()};
  work->tile = type == ffi::DataType::F16 ? Tile<int8_t, _Float16> : Tile<int8_t, float>;
  return Run(pool, std::move(work));
}

ffi::Error Weight16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions();
  auto w_dims = values.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || w_dims[1] != x_dims[1])
    return ffi::Error::InvalidArgument("16-bit matmul: x must be [M, K] and values [N, K]");
  const auto type = values.element_type();
  if (type != ffi::DataType::U16 && type != ffi::DataType::BF16 && type != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("16-bit matmul: values must be bfloat16 (or its uint16 bits) or float16");
  const int64_t M = x_dims[0], K = x_dims[1], N = w_dims[0];
  auto work = std::make_shared<Work>();
  work->problem = Problem{x.typed_data(), values.untyped_data(), nullptr, M, N, K, K, y->typed_data()};
  work->tile = type == ffi::DataType::F16 ? Tile<_Float16, NoScale> : Tile<Bf16, NoScale>;
  return Run(pool, std::move(work));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // values
                                  .Arg<ffi::AnyBuffer>()         // scales
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedWeight16Matmul, Weight16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // values: u16 (bfloat16 bits), bf16 or f16
                                  .Ret<ffi::Buffer<ffi::F32>>());
