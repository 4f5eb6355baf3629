// Weight matrix products on the CPU for few rows (decode), as XLA FFI handlers: the dense layers of a
// model whose parameters are `jpaged.device.quant.QuantizedWeight`s (int8 with scales, or float rows
// without), where XLA's CPU dot would first widen the whole int8 matrix to float32 in memory, or reads
// a bfloat16 matrix at a fraction of the memory's speed.
//
// JpagedInt8Matmul, operands (see jpaged/device/quant.py, which flattens a parameter's logical layout
// to these):
//   x       f32[M, K]            activations, M rows
//   layer   s32[]                which layer of a stack to use (0 for a 2-D weight; out of range: an
//                                error), the same layer of every weight. A layer scan hands the kernel the
//                                stack and its index: a slice of the stack would be a copy of the layer's
//                                weights on XLA's CPU backend.
//   then 1 to 4 weights, each two operands, their scales all of one dtype:
//   values  s8[(L,) N_i, K]      the weight, one output channel per row (GGUF's / torch's [out, in]),
//                                or a stack of L layers' weights
//   scales  f32 or f16 [(L,) N_i, K/G_i]  one scale per group of G_i consecutive input columns of a
//                                channel (G_i = K: per output channel; G_i = 32: GGUF's Q8_0 blocks)
// Results: f32[M, N_i] for each weight, y_i[m, n] = sum_g scales_i[n, g] * sum_{k in group g} values_i[n, k]
// * x[m, k]. Several weights of one x (q, k and v; gate and up) are one call, as for the float rows.
//
// JpagedFloatRowsMatmul, operands:
//   x       f32[M, K]            activations, M rows
//   layer   s32[]                as for JpagedInt8Matmul, the same layer of every weight
//   values  1 to 4 weights, each u16 or bf16 [(L,) N_i, K] (bfloat16 weights; u16: their bit patterns, the
//           CPU storage form), f16 [(L,) N_i, K] (float16) or f32 [(L,) N_i, K] (float32), all of one dtype;
//           one output channel per row, no scales
// Results: f32[M, N_i] for each weight, y_i[m, n] = sum_k float(values_i[n, k]) * x'[m, k] (float32 products
// and sums), where x' is x rounded to bfloat16 for bfloat16 weights (a bf16 x bf16 -> f32 dot, as on the
// AMX tiles), x itself for float16 and float32 ones. Several weights of one x (q, k and v; gate and up) are
// one call: one wait for the threads instead of several (`jpaged.device.quant.quantized_matmuls`).
// Both handlers check every operand and result shape against x and the layer before reading any.
//
// Each weight is read once per call from memory: kLanes at a time (one register: lanes.h), widened to
// float32 in registers (bfloat16: a 16-bit shift), then multiplied into up to 8 rows of x (float32
// accumulation; int8 scales multiply each register, each group's sums or each channel's: kScalesAfterGroups);
// bfloat16 weights on a CPU with AVX512-BF16 are not widened (Bf16DotBlock), and on one with AMX-BF16 they go
// through tiles (AmxBlock). Output channels are split in tiles between the calling thread and helper threads
// (work_list.h's Crew; int8 weights by one or two rows on AVX-512 off AMD Zen 4: the calling thread alone);
// inside a tile, rows go in chunks of up to 8 (4 for int8 weights outside the AVX-512 build), so a tile's
// weights are reused from cache by every chunk (int8 weights of grouped scales, more than 16 rows: widened
// once into a float32 scratch that every chunk reads, WidenedTile).
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
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__x86_64__)
#define JPAGED_AVX512_BF16 1  // the AVX-512 build also holds the AVX512-BF16 path, used where the CPU has it
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__)
#define JPAGED_AMX 1  // the AVX-512 build also holds the AMX bfloat16 path, used where the CPU and OS allow it
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
// GCC 12 warns of the "undefined" source register inside _mm512_cvtepi8_epi32 and the unpacks and shuffles
// (a known false positive: the intrinsics pass _mm512_undefined_* as their unused merge source)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include "lanes.h"
#include "work_list.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;   // calls of up to this many rows are few (kGuidedShare)
// Rows of x per pass over a block of channels, and channels per block at 4-7 rows (Rows). AVX-512's 32
// vector registers hold 4 rows x 6 channels of accumulators, 4 rows of x and a weight (29 registers): 2.4
// multiply-adds a load, where 8 rows x 1 channel made 0.9. AVX2's 16 keep 8 rows a pass, 1 or 2 channels.
// A row's sums do not depend on the block: each accumulator adds the same products in the same order.
// Measured on an AMD EPYC (2 cores, AVX-512; kernel alone, the default model's shapes, 30-layer stacks from
// memory, one library each, two rounds): float32 [576 x 49152] (an LM head) 6.0-6.2 -> 3.6-3.8 ms at 8 rows,
// 8.0-8.3 -> 4.8-5.0 at 16, 11.7 -> 7.6-8.1 at 32 (XLA's dot: 5.3, 6.3, 8.2); float32 [1536 x 576] 210-221
// -> 128-135 us at 8 rows, 351-370 -> 250-255 at 32; bfloat16, the head: 1.7-2.2 -> 1.4 ms at 8 rows,
// 7.1-7.4 -> 4.0-4.1 at 32; int8 3-25% faster at 8-32 rows; 1-2 rows even, 4 even to 25% faster.
#if defined(__AVX512F__)
constexpr int kPassRows = 4;
constexpr int kWideChannels = 6;
#else
constexpr int kPassRows = kMaxRows;
constexpr int kWideChannels = 2;
#endif
// Whether a Block of one channel prefetches float32 weights (Block; other weights always, one row always): in the
// AVX2 build, whose passes of 8 rows read one channel at a time and stalled on loading the weights (perf: 59% of
// the block's samples). Measured on an AMD EPYC Zen 4 (2 cores; the default model's 121 float32 products as a
// chain under XLA, alternating processes, medians of 3 x 9 calls, two rounds): the AVX2 library at 4 rows (a
// channel at a time: Channels) 22.9 / 21.3 -> 17.4 / 15.2 ms, 8 rows 37.7 / 36.9 -> 22.6 / 23.2, 16 rows 54.5 /
// 53.2 -> 40.7 / 40.4, 2 rows even; the AVX-512 library slower with them (4 rows 18.8 / 17.8 -> 24.7 / 24.3).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kPrefetchOneChannel = true;
#else
constexpr bool kPrefetchOneChannel = false;
#endif
constexpr int64_t kTile = 32; // output channels per work item
// A call of at most kMaxRows rows off the AMX tiles is bound by reading its weights: its threads share the
// output channels in guided runs (OpenMP's guided schedule; Work::DrainGuided): each claim takes the channels
// still unclaimed divided by kGuidedShare per thread (at least kMinRunChannels, never past a weight's end), so
// the first runs are long streams of weights, which the threads read faster long than short, and the last are
// short, so the threads finish together. Uniform items had been 256 channels (the default model's 121
// bfloat16 products of one row as a chain of dependent calls, 7.7-7.9 ms with 32 channels an item, 6.2-6.5 with
// 256, 6.8-8.0 with 512: items too few to share evenly; AMD EPYC, 2 cores, AVX-512), which left one thread idle
// at the end of the calls whose channels are few items (576 output channels: 256, 256, 64). Guided runs
// against them, measured on an AMD EPYC Zen 4 (2 cores; one stream's decode step of the default model in the
// engine, synchronous, the two alternating in one process, medians of 4-8 rounds): bfloat16 9.53 -> 9.00 and
// 8.39 -> 8.30 ms, float32 17.19 -> 17.03 and 18.07 -> 17.44, int8 4.89 -> 4.83, four streams bfloat16 14.50
// -> 14.13; a quarter of the channels left per thread (kGuidedShare 4) 9.39, a whole share (1) 8.19 and
// 17.69. Which thread reads a channel does not change its sums.
constexpr int64_t kGuidedShare = 2;
constexpr int64_t kMinRunChannels = 32;
// int8 products of up to kInt8SoloMaxRows rows run on the calling thread alone (no helper is scheduled). At
// so few rows the int8 kernel widens and scales each weight for one or two multiplies, and a second thread
// made it slower, not faster: measured on an AMD EPYC (2 cores, AVX-512), the default model's 121 one-row
// products as a chain of dependent calls (Q8_0 layout), 6.1-6.9 ms with XLA's intra-op helper, 5.0-5.2 alone;
// per-channel scales 5.6-6.6 against 4.2-4.5; two rows 8.6-9.0 against 6.6-7.0; at four rows the helper won
// (10.2-10.6 against 11.8-12.1) and at eight by 1.55x. A single 18.8 MB int8 call of one row was faster alone
// too (27-32 against 25-28 GB/s), so it is not the helper's wake-up alone. Float rows keep their helper (the
// bfloat16 chain: 8.2-8.5 ms with it, 9.6-9.8 alone). (That machine's CPU family was not recorded; one of its
// threads read int8 weights at 27-32 GB/s, as a core with full-width 512-bit units would.)
// On AMD Zen 4 (family 19h, the first with AVX-512), which runs each 512-bit operation as two 256-bit halves,
// one thread's arithmetic is what bounds the same products: a register of 16 weights takes a sign extension, a
// conversion, a scaling and a multiply-add, and one row made 20-22 GB/s of int8 weights alone, in cache and
// from memory alike, where the memory reads 34-37 (kernel alone, 11.8 and 151 MB weights of one row); with
// the helper 41-43 and 32-35 GB/s. There every int8 product has its helper (Int8SoloMaxRows): one stream of
// the Q8_0 file served, 9.2 -> 7.4 ms a token (llama.cpp 7.0-7.3, the same machine, alternating).
constexpr int64_t kInt8SoloMaxRows = 2;

#if defined(__AVX2__)  // (the AVX-512 build defines it too) the builds that ask: SplitsWideVectors, ReadsChannelAtATime
// Whether this CPU is AMD family 19h (Zen 3 and Zen 4). Read once, from CPUID.
bool AmdFamily19h() {
#if defined(__x86_64__)
  static const bool zen = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xF, family = base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
    return family == 0x19;
  }();
  return zen;
#else
  return false;
#endif
}
#endif

#if defined(__AVX512F__)
// Whether this CPU runs 512-bit vector operations as two 256-bit halves: AMD family 19h (only Zen 4 has
// AVX-512, so only the AVX-512 build asks).
bool SplitsWideVectors() { return AmdFamily19h(); }
#endif

// The most rows of an int8 product that run on the calling thread alone, on this CPU (kInt8SoloMaxRows): none
// in the builds without AVX-512, whose registers widen 8 weights at a time, half of AVX-512's, so that one
// thread's arithmetic bounds an int8 row as on Zen 4. Measured there with the AVX2 library forced (and XLA at
// AVX2): one stream of int8 weights served, scratch figures in bench/README ("The AVX2 paths on the Zen 4").
int64_t Int8SoloMaxRows() {
#if defined(__AVX512F__)
  return SplitsWideVectors() ? 0 : kInt8SoloMaxRows;
#else
  return 0;
#endif
}

struct Bf16 {  // a bfloat16 weight, as its bit pattern
  uint16_t bits;
};
struct Bf16Dot {};  // bfloat16 weights (as Bf16) multiplied by VDPBF16PS, unwidened (Bf16DotBlock)
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

// kLanes float32 weights: a plain load.
inline VF Widen(const float* p) { return LoadF(p); }

inline float WidenOne(float w) { return w; }
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

// x's n values rounded to bfloat16 (to nearest even; NaNs are not kept), as float32.
std::vector<float> RoundedToBf16(const float* x, int64_t n) {
  std::vector<float> out(n);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VU u;
    std::memcpy(&u, x + i, sizeof u);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    std::memcpy(out.data() + i, &u, sizeof u);
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    std::memcpy(out.data() + i, &u, sizeof u);
  }
  return out;
}

struct Problem {
  const float* x;
  const void* w;       // int8_t, Bf16, _Float16 or float [N, K]
  const void* scales;  // [N, K / G] (unscaled weights: unused, G = K)
  int64_t M, N, K, G;
  float* y;
  uint16_t* packed = nullptr;  // the AMX path's x as bfloat16 tiles (PackRowsForAmx); else unused
  const uint16_t* x_bf16 = nullptr;  // the AVX512-BF16 path's x as bfloat16 bits [M, K] (Bf16Bits); else unused
};

// One row of x is bound by reading the weights, and how far ahead the core's loads run is bounded by the
// instructions it holds past the oldest unfinished one: at one row Block's and Bf16DotBlock's loops over K
// take kOneRowSteps steps an iteration (the same steps in the same order: the same sums, bit for bit), paying
// the loop's counter, compare and branch once for them. Measured on an AMD EPYC Zen 4 (2 cores): the default
// model's 121 float32 one-row products, this library's calls (Work, the crew) outside XLA against the same
// calls with a plain channel loop as the tile (bench/csrc/row_read.c's), alternating in one process, read
// 0.70-0.99x as fast with a step an iteration and 0.90-1.35x with four (in minutes where the memory gave the
// plain loop ~50 GB/s: 15.3 against 10.6 ms with one step, 11.5 against 11.1 with four); one stream in the
// engine, the two libraries alternating in one process (20 rounds of 48 tokens), 0.97x the time a token at
// float32 and at bfloat16.
constexpr int kOneRowSteps = 4;

// Where an int8 weight's scales are applied. Per-channel scales (G = K) multiply each channel's sum once, at the
// end, in every build (kPerChannel: y = s * sum_k w_k * x_k). Grouped scales (G < K, a multiple of kLanes; other
// groups as in the AVX-512 build): the AVX-512 build
// multiplies each register of widened weights by its group's scale before the multiply-adds (y = sum_k (w_k *
// s_g(k)) * x_k: a multiply a register, shared by the rows of a pass); the other builds sum each group's products
// unscaled in accumulators of its own and add them into the row's accumulators times the group's scale once the
// group ends (kScalesAfterGroups, y = sum_g s_g * sum_{k in g} w_k * x_k, lane by lane: GroupSums), a
// multiply-add a group and row instead of a multiply a register. Either way a row's sums do not depend on the rows
// or channels beside it: each accumulator adds the same products in the same order. Per-channel scales at the end,
// measured on an AMD EPYC Zen 4 (2 cores; the default model's 121 products with per-channel scales, 135 MB, as a
// chain of dependent calls under XLA, alternating processes, two rounds): the AVX-512 library at 4 rows 8.5 / 9.3 ->
// 7.4 / 7.5 ms, 8 rows 17.3 / 16.9 -> 13.8 / 13.7, one row even (4.2-6.2 ms either, bound by the memory); the AVX2
// library forced (with its passes of 4 rows) at 4 rows 8.4 / 10.0 -> 8.5 / 8.4, 8 rows 37.6 / 35.5 -> 16.4 / 17.3.
#if defined(__AVX512F__)
constexpr bool kScalesAfterGroups = false;
#else
constexpr bool kScalesAfterGroups = true;
#endif

// Rows [m0, m0 + R) by output channels [n0, n0 + NO): R * NO independent accumulators. W: the weights'
// type; S: their scales' (NoScale: none); kPerChannel: one scale a channel (G = K), which multiplies its sums at
// the end (else each register of weights is multiplied by its group's scale).
template <typename W, typename S, int R, int NO, bool kPerChannel = false>
inline void Block(const Problem& p, int64_t m0, int64_t n0) {
  constexpr bool kScaled = !std::is_same_v<S, NoScale> && !kPerChannel;  // scales applied to the weights
  const int64_t K = p.K, G = p.G, groups = K / G;
  const W* w = static_cast<const W*>(p.w);
  // The next NO channels' weights (contiguous, NO * K of them) are prefetched while these are read, as
  // many bytes an iteration as it reads: NO rows of K weights each are too short a stream for the
  // hardware prefetchers, and a decode step's weights come from memory. Measured on an Intel Xeon (2
  // cores), bfloat16 [1536 x 576] weights of 60 layers, one row: 23 -> 35 GB/s as independent products,
  // 15 -> 21 GB/s as a chain of dependent ones. (Reading each channel whole, one sequential stream,
  // was slower, with or without prefetches.) Prefetches past the matrix's end never fault. int8 weights
  // need them (the default model's 30 layers, one row, a chain of dependent products: 8.3-9.7 ms with
  // them, 10.9-13.2 without). float32 weights were not prefetched while they lay on 4 KiB pages, where the
  // prefetches slowed them (the same chain 20.4-23.7 ms with them, 18.0-19.6 without; alternating
  // processes, a machine whose CPU was not recorded) and still do (AMD EPYC Zen 4: 1.04x the time); on the
  // 2 MiB pages an engine's weights now get (jpaged/device/huge_pages.py), one row of them is faster with
  // them (0.91x the time, one process alternating; 0.91-0.95x against the library without, alternating
  // processes), 16 rows slower (1.04-1.06x), so float32 weights are prefetched for one row only, and for a
  // block of one channel: in the AVX2 build at every row count (kPrefetchOneChannel), in the AVX-512 build at 8
  // rows (a call's one pass: Passes; the chain of Channels' comment at 8 rows 32.5 / 32.7 -> 26.4 / 26.3 ms with
  // them, at 6 rows 21.4 / 26.0 -> 26.7 / 27.4 and at 4 slower too).
  constexpr bool kPrefetch = sizeof(W) < 4 || R == 1 || (NO == 1 && (kPrefetchOneChannel || R == kMaxRows));
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + NO) * K);
  VF acc[R][NO] = {};
  float tail[R][NO] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float s[NO];
    if constexpr (kScaled)
      for (int o = 0; o < NO; ++o) s[o] = Scale(static_cast<const S*>(p.scales) + (n0 + o) * groups + g);
    const int64_t k1 = (g + 1) * G;
    int64_t k = g * G;
    auto step = [&](int64_t k) {  // kLanes inputs of every row and channel
      if constexpr (kPrefetch) {
        for (int b = 0; b < static_cast<int>(NO * kLanes * sizeof(W)); b += 64) __builtin_prefetch(ahead + b, 0, 3);
        ahead += NO * kLanes * sizeof(W);
      }
      VF xv[R];
      for (int r = 0; r < R; ++r) xv[r] = LoadF(p.x + (m0 + r) * K + k);
      for (int o = 0; o < NO; ++o) {
        VF wv = Widen(w + (n0 + o) * K + k);
        if constexpr (kScaled) wv *= s[o];
        for (int r = 0; r < R; ++r) acc[r][o] += wv * xv[r];
      }
    };
    if constexpr (R == 1)  // kOneRowSteps steps an iteration
      for (; k + kOneRowSteps * kLanes <= k1; k += kOneRowSteps * kLanes)
#pragma GCC unroll kOneRowSteps
        for (int j = 0; j < kOneRowSteps; ++j) step(k + j * kLanes);
    for (; k + kLanes <= k1; k += kLanes) step(k);
    for (; k < k1; ++k)  // a group that is not a multiple of kLanes columns
      for (int o = 0; o < NO; ++o) {
        float wk = WidenOne(w[(n0 + o) * K + k]);
        if constexpr (kScaled) wk *= s[o];
        for (int r = 0; r < R; ++r) tail[r][o] += wk * p.x[(m0 + r) * K + k];
      }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NO; ++o) {
      p.y[(m0 + r) * p.N + n0 + o] = AddLanes(acc[r][o]) + tail[r][o];
      if constexpr (kPerChannel) p.y[(m0 + r) * p.N + n0 + o] *= Scale(static_cast<const S*>(p.scales) + n0 + o);
    }
}

#ifdef JPAGED_AVX512_BF16
// The AVX512-BF16 path of bfloat16 weights (CPUs with AVX512-BF16 where the AMX path does not take them: AMD
// Zen 4 and later, Intel Cooper Lake): VDPBF16PS multiplies 32 bfloat16 weights by 32 bfloat16 values of x
// and adds each lane's pair of products into one float32 accumulator, so the weights are never widened (the
// AVX-512 path widens every register of them: a zero-extension and a shift, then an FMA). x is rounded to
// bfloat16 once per call (Bf16Bits, as RoundedToBf16 rounds it), so a product differs from the AVX-512
// path's only in the order of its float32 sums (lane i holds inputs 2i and 2i + 1 of every 32); inputs and
// sums that are float32 subnormals are flushed to zero by the instruction. Every row count of a call takes
// this path where the CPU has it, so a row's sums do not depend on the rows beside it. Measured on an AMD
// EPYC with AVX512-BF16 (2 cores): the default model's 121 one-row products as a chain of dependent calls,
// 7.6-7.9 ms against 8.0-8.1 on the AVX-512 path (3 alternating pairs, one library).
std::vector<uint16_t> Bf16Bits(const float* x, int64_t n) {
  std::vector<uint16_t> out(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    out[i] = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);  // to nearest even, as RoundedToBf16
  }
  return out;
}

bool Avx512Bf16Ready() {
  static const bool ready = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return ready;
}

// Block's counterpart for bfloat16 weights (Tile<Bf16Dot, NoScale>): rows [m0, m0 + R) by channels [n0, n0 + NO),
// the weights prefetched as Block prefetches them.
template <int R, int NO>
__attribute__((target("avx512f,avx512bf16"))) inline void Bf16DotBlock(const Problem& p, int64_t m0, int64_t n0) {
  constexpr int64_t kPair = 32;  // bfloat16 values per register
  const int64_t K = p.K;
  const uint16_t* w = static_cast<const uint16_t*>(p.w);
  const uint16_t* x = p.x_bf16;
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + NO) * K);
  __m512 acc[R][NO];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_setzero_ps();
  int64_t k = 0;
  auto step = [&](int64_t k) __attribute__((target("avx512f,avx512bf16"))) {  // kPair inputs of every row and channel
    for (int b = 0; b < NO * 64; b += 64) __builtin_prefetch(ahead + b, 0, 3);
    ahead += NO * 64;
    __m512bh xv[R];
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x + (m0 + r) * K + k);
    for (int o = 0; o < NO; ++o) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n0 + o) * K + k);
      for (int r = 0; r < R; ++r) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wv, xv[r]);
    }
  };
  if constexpr (R == 1)  // kOneRowSteps steps an iteration (Block's)
    for (; k + kOneRowSteps * kPair <= K; k += kOneRowSteps * kPair)
#pragma GCC unroll kOneRowSteps
      for (int j = 0; j < kOneRowSteps; ++j) step(k + j * kPair);
  for (; k + kPair <= K; k += kPair) step(k);
  float tail[R][NO] = {};
  for (; k < K; ++k)  // K not a multiple of 32
    for (int o = 0; o < NO; ++o) {
      const float wk = WidenOne(Bf16{w[(n0 + o) * K + k]});
      for (int r = 0; r < R; ++r) tail[r][o] += wk * WidenOne(Bf16{x[(m0 + r) * K + k]});
    }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NO; ++o) {
      VF sums;
      std::memcpy(&sums, &acc[r][o], sizeof sums);
      p.y[(m0 + r) * p.N + n0 + o] = AddLanes(sums) + tail[r][o];
    }
}

#endif  // JPAGED_AVX512_BF16

// Block, or Bf16DotBlock for bfloat16 weights on VDPBF16PS (W = Bf16Dot).
template <typename W, typename S, int R, int NO, bool kPerChannel>
inline void AnyBlock(const Problem& p, int64_t m0, int64_t n0) {
#ifdef JPAGED_AVX512_BF16
  if constexpr (std::is_same_v<W, Bf16Dot>) return Bf16DotBlock<R, NO>(p, m0, n0);
  else
#endif
    Block<W, S, R, NO, kPerChannel>(p, m0, n0);
}

// Channels per block of one row of x (Rows): each is a stream of the weights read side by side with the
// block's others. On the AVX-512 build, int8 and VDPBF16PS's bfloat16 weights read faster 4 streams at a
// time than 8, float32 ones slower: the default model's 121 one-row products as a chain of dependent calls,
// int8 (Q8_0) 0.89-0.95x the time with 4, bfloat16 0.93-0.97x, float32 1.06-1.11x (AMD EPYC Zen 4, 2 cores;
// both in one process, alternating); the kernel alone, one thread, 151 MB of bfloat16 weights from memory,
// 16-23 GB/s with 8, 20-26 with 4. (That was the choice between 4 and 8; on Zen 4 float32 and bfloat16 weights
// now read one channel at a time, faster still: ReadsChannelAtATime.)
template <typename W>
constexpr int kOneRowChannels =
#if defined(__AVX512F__)
    std::is_same_v<W, int8_t> || std::is_same_v<W, Bf16Dot> ? 4 : 8;
#else
    8;
#endif

// Whether one row of x (and float32 calls of up to kMaxRows rows: Passes) reads float32 and VDPBF16PS's bfloat16
// weights a channel at a time (each channel's K weights whole, one sequential stream, then the next channel's), not
// kOneRowChannels streams side by side: on AMD Zen 4 (AmdFamily19h, in the AVX-512 build). There the side-by-side
// streams read below the memory's rate, and a channel at a time reaches it. Measured on an AMD EPYC Zen 4 (2 cores): a
// C++ scratch loop of the kernel's two access patterns, two threads, the default model's [49152 x 576] bfloat16 LM head
// from memory, 26-35 GB/s with 4 streams against 40-44 a channel at a time (medians of 9-15 calls in four runs; a plain
// two-thread sum of as many bytes: 27-34); in the engine, one stream's decode step traced (jax.profiler, the two
// alternating in one process, median of 4 rounds), bfloat16 11.9 -> 10.6 ms (gate/up 133 -> 114 us a layer, down 69 ->
// 56, the LM head 2.12 -> 1.85 ms), float32 20.5 -> 19.4 ms. The sums are the same, bit for bit (each channel's are
// added in the same order). int8 weights stay 4 streams: widening and scaling bound them on Zen 4, and one channel at a
// time was slower (7.8 -> 9.7 ms the step). An Intel Xeon read its channels faster side by side (Block's comment), so
// only AMD does. The AVX2 build on AMD family 19h reads them a channel at a time too, its widened bfloat16 weights
// (Bf16) included: measured on the Zen 4 with the AVX2 library forced (XLA at AVX2; one stream in the engine, 4
// requests of 96 tokens a process, alternating processes, 3 rounds), float32 18.97 -> 16.50, 19.33 -> 17.12, 17.15 ->
// 17.02 ms a token, bfloat16 11.69 -> 10.08, 12.26 -> 10.31, 11.63 -> 9.90. Zen 3, the AVX2-only family 19h, was not
// measured. The portable build keeps its side-by-side streams.
template <typename W>
constexpr bool kChannelAtATimeKinds =
    std::is_same_v<W, Bf16Dot> || std::is_same_v<W, float> || std::is_same_v<W, Bf16>;

bool ReadsChannelAtATime() {  // the AVX-512 build (which has AVX2 too) and the AVX2 build
#if defined(__AVX2__)
  return AmdFamily19h();
#else
  return false;
#endif
}

// Rows [m0, m0 + R) by the channels [n0, n1) of grouped int8 weights (G < K, a multiple of kLanes) in the builds that
// scale a group's sums (kScalesAfterGroups; at most kGroupSumRows rows): a channel at a time, one sequential stream,
// its groups kSideBySide at a time, each group's sums of each row in an accumulator of its own (R * kSideBySide >= 8
// independent chains of multiply-adds: Block's one row of Q8_0, 4 registers a group, spent as many instructions
// between groups as in them), then added into the row's accumulator times the group's scale, in the order of the
// groups. A row's sums do not depend on R or kSideBySide: each group's start from zero and add the same products in
// the same order, and join the row's in the order of the groups. W: int8_t, or float for WidenedTile's widened
// (unscaled) weights. Groups that are not a multiple of kLanes take Block's scaled registers, at every row count.
// Measured on an AMD EPYC Zen 4 (2 cores) with the AVX2 library forced (XLA at AVX2; the default model's 121
// products of the Q8_0 layout, 143 MB, as a chain of dependent calls under XLA, alternating processes, medians of
// 3 x 9 calls, two rounds), against Block's scaled registers in passes of 8 rows: 1 row 5.9 / 6.2 -> 5.1 / 5.8 ms, 2
// rows 7.7 / 6.5 -> 6.4 / 6.4, 4 rows 9.8 / 9.8 -> 12.1 / 8.8, 8 rows 35.9 / 35.5 -> 21.5 / 19.5 (Block's 8-row
// pass spilled its registers), 16 rows 70.6 / 73.4 -> 35.4 / 35.1, 32 rows 75.0 / 82.2 -> 73.9 / 74.9; in cache
// (2 layers) one row 5.3 -> 4.7 ms. One stream of the Q8_0 file in the engine, 4 requests of 96 tokens a process,
// 3 rounds: int8 8.25 / 7.36 / 8.27 -> 6.77 / 7.46 / 6.99 ms a token, int8-bf16 8.82 / 7.87 / 8.01 -> 6.74 / 6.53
// / 6.73.
constexpr int kGroupSumRows = 4;
// Whether int8 weights with scales S run in passes of kGroupSumRows rows (Passes) and grouped ones take GroupSums
// (Rows): in the builds that scale a group's sums.
template <typename S>
constexpr bool kGroupSums = !std::is_same_v<S, NoScale> && kScalesAfterGroups;
template <typename W, typename S, int R>
void GroupSums(const Problem& p, int64_t m0, int64_t n0, int64_t n1) {
  static_assert(R <= kGroupSumRows);
  constexpr int kSideBySide = R == 1 ? 8 : R == 2 ? 4 : 2;
  const int64_t K = p.K, G = p.G, groups = K / G;
  const float* x = p.x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const W* w = static_cast<const W*>(p.w) + n * K;
    const S* scales = static_cast<const S*>(p.scales) + n * groups;
    const char* ahead = reinterpret_cast<const char*>(w + K);  // the next channel's weights, prefetched as Block does
    VF acc[R] = {};
    auto run = [&](int64_t g, auto side_by_side) {  // groups [g, g + side_by_side)
      constexpr int kGroups = decltype(side_by_side)::value;
      if constexpr (sizeof(W) < 4) {  // int8 weights from memory (not WidenedTile's, in cache)
        for (int64_t b = 0; b < kGroups * G; b += 64) __builtin_prefetch(ahead + b, 0, 3);
        ahead += kGroups * G;
      }
      float s[kGroups];
#pragma GCC unroll 8
      for (int i = 0; i < kGroups; ++i) s[i] = Scale(scales + g + i);
      VF sums[R][kGroups];
#pragma GCC unroll 8
      for (int i = 0; i < kGroups; ++i)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) sums[r][i] = VF{};
      for (int64_t k = 0; k < G; k += kLanes)
#pragma GCC unroll 8
        for (int i = 0; i < kGroups; ++i) {
          const VF wv = Widen(w + (g + i) * G + k);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) sums[r][i] += wv * LoadF(x + r * K + (g + i) * G + k);
        }
#pragma GCC unroll 8
      for (int i = 0; i < kGroups; ++i)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] += sums[r][i] * s[i];
    };
    int64_t g = 0;
    for (; g + kSideBySide <= groups; g += kSideBySide) run(g, std::integral_constant<int, kSideBySide>{});
    for (; g < groups; ++g) run(g, std::integral_constant<int, 1>{});
    for (int r = 0; r < R; ++r) p.y[(m0 + r) * p.N + n] = AddLanes(acc[r]);
  }
}

// Rows [m0, m0 + R) by the channels [n0, n1) in Blocks: NO at a time (8 accumulators or more: kWideChannels; one
// row: kOneRowChannels), the rest one by one; every channel one by one where ReadsChannelAtATime, for one row and
// for `one_pass` (Passes: float32 rows of a call of up to kMaxRows, whose weights come from memory once; in a
// pass after the first they come from cache, where NO channels side by side share each load of x). The sums are
// the same, bit for bit. Measured on an AMD EPYC Zen 4 (2 cores; the default model's 121 float32 products, 538
// MB, as a chain of dependent calls under XLA, side by side -> a channel at a time, alternating processes, medians
// of 3 x 9 calls, two rounds): the AVX-512 library at 2 rows 20.8 / 20.4 -> 12.5 / 16.3 ms, 4 rows 24.3 / 24.2 ->
// 20.5 / 19.0, 6 rows (passes of 4 and 2 -> one) 29.5 / 30.3 -> 26.0 / 21.4, 8 rows 32.3 / 32.4 -> 25.0 / 26.0
// (with Block's prefetches), 16 and 32 rows in one pass slower (42.8 / 42.4 -> 47.8 / 43.1, 75.4 / 69.9 -> 77.4 /
// 79.5), hence kMaxRows; the AVX2 library (passes of 8 rows) at 2 rows 20.3 / 21.4 -> 16.5 / 15.7, 4 rows 27.9 /
// 27.3 -> 23.6 / 23.4, 6 rows 32.3 / 33.3 -> 29.7 / 30.9. bfloat16 rows a channel at a time at 2-6 rows were even
// to 1.13x slower (both libraries), so they keep it to one row.
template <typename W, typename S, int R, bool kPerChannel>
void Channels(const Problem& p, int64_t m0, int64_t n0, int64_t n1, bool one_pass) {
  constexpr int NO = R >= 8 ? 1 : R >= 4 ? kWideChannels : R >= 2 ? 4 : kOneRowChannels<W>;
  int64_t n = n0;
  if (!(one_pass || (R == 1 && kChannelAtATimeKinds<W> && ReadsChannelAtATime())))
    for (; n + NO <= n1; n += NO) AnyBlock<W, S, R, NO, kPerChannel>(p, m0, n);
  for (; n < n1; ++n) AnyBlock<W, S, R, 1, kPerChannel>(p, m0, n);
}

// Rows [m0, m0 + R) by the channels [n0, n1): grouped int8 weights in the builds that scale a group's sums
// (kScalesAfterGroups) in GroupSums, the rest in Blocks (Channels; per-channel scales: kPerChannel).
template <typename W, typename S, int R>
void Rows(const Problem& p, int64_t m0, int64_t n0, int64_t n1, bool one_pass) {
  if constexpr (kGroupSums<S> && R <= kGroupSumRows)
    if (p.G < p.K && p.G % kLanes == 0) return GroupSums<W, S, R>(p, m0, n0, n1);
  if constexpr (!std::is_same_v<S, NoScale>)
    if (p.G == p.K) return Channels<W, S, R, true>(p, m0, n0, n1, one_pass);
  Channels<W, S, R, false>(p, m0, n0, n1, one_pass);
}

// Rows [m0, m1) by channels [n0, n1), kPassRows rows a pass over the channels (int8 weights where a group's sums
// are scaled: kGroupSumRows, GroupSums' most; float32 rows where ReadsChannelAtATime, up to kMaxRows: one pass).
template <typename W, typename S>
void Passes(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const bool one_pass = std::is_same_v<W, float> && m1 - m0 <= kMaxRows && ReadsChannelAtATime();
  const int64_t rows = one_pass ? kMaxRows : kGroupSums<S> ? kGroupSumRows : kPassRows;
  for (int64_t m = m0; m < m1; m += rows) {
    switch (std::min<int64_t>(rows, m1 - m)) {
      case 1: Rows<W, S, 1>(p, m, n0, n1, one_pass); break;
      case 2: Rows<W, S, 2>(p, m, n0, n1, one_pass); break;
      case 3: Rows<W, S, 3>(p, m, n0, n1, one_pass); break;
      case 4: Rows<W, S, 4>(p, m, n0, n1, one_pass); break;
      case 5: Rows<W, S, 5>(p, m, n0, n1, one_pass); break;
      case 6: Rows<W, S, 6>(p, m, n0, n1, one_pass); break;
      case 7: Rows<W, S, 7>(p, m, n0, n1, one_pass); break;
      default: Rows<W, S, 8>(p, m, n0, n1, one_pass); break;
    }
  }
}

// Rows [m0, m1) by channels [n0, n1) of int8 weights with grouped scales (G < K, a multiple of kLanes), many rows (at
// least kWidenedRows; Tile chooses): each channel's weights are widened and scaled once into a float32 scratch of this
// thread, kTile channels at a time, then every pass of rows multiplies them as float32 rows (Block<float, NoScale>),
// where Block<int8_t, S> would widen and scale them again in every pass, a group (Q8_0: 32 weights, two registers) at a
// time. The sums are Block<int8_t, S>'s, bit for bit: each float32 weight is the value Block<int8_t, S> multiplies x by
// (Widen, then times its group's scale), and a row's products are added in the same order, a group's kLanes-wide steps
// one after another. In the builds that scale a group's sums (kScalesAfterGroups) the scratch holds the widened weights
// unscaled, and GroupSums<float, S> multiplies them with their scales, as GroupSums<int8_t, S> would. Measured on an
// AMD EPYC Zen 4 (2 cores; kernel alone, 30-layer stacks, the old and new library alternating in one process, 5
// rounds, medians; the AVX-512 library): Q8_0 [576 x 3072] 948 -> 869 us at 32 rows, 491 -> 490 at 16; Q8_0
// [1536 x 576] 472 -> 418 at 32, 251 -> 239 at 16; per-channel scales [576 x 3072] even at 32 rows and 1.03-1.06x
// slower at 16, and 8 rows (guided, bound by reading the weights) 1.2x slower, so those keep Block's widening in
// registers. In the engine, 24 requests of the Q8_0 file at once: 233 -> 237 tokens/s (0.98-1.10x by round).
// Fewer rows share too little of each widening: Q8_0 at 9 rows 1.02-1.15x the time ([576 x 3072]) and 0.94-1.79x
// ([1536 x 576]), at 12 rows 0.93-1.07x and 0.98-1.10x, at 16 0.96-1.02x and 0.93-1.17x, at 24 0.89-1.02x and
// 0.90-0.94x (the same A/B, medians 306 -> 354, 151 -> 170, 361 -> 381, 175 -> 184, 478 -> 472, 229 -> 220, 722 ->
// 667, 333 -> 303 us), so it starts past 16 rows.
constexpr int64_t kWidenedRows = 17;
template <typename S>
void WidenedTile(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (; n1 - n0 > kTile; n0 += kTile) WidenedTile<S>(p, m0, m1, n0, n0 + kTile);  // kTile channels a scratch
  const int64_t K = p.K, G = p.G, groups = K / G, channels = n1 - n0;
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < channels * K) scratch.resize(channels * K);
  const int8_t* w = static_cast<const int8_t*>(p.w) + n0 * K;
  const char* ahead = reinterpret_cast<const char*>(w);
  for (int64_t c = 0; c < channels; ++c) {
    float* out = scratch.data() + c * K;
    for (int64_t g = 0; g < groups; ++g) {
      float s = 1.0f;  // the group's scale, where the scratch holds scaled weights
      if constexpr (!kScalesAfterGroups) s = Scale(static_cast<const S*>(p.scales) + (n0 + c) * groups + g);
      for (int64_t k = g * G; k < (g + 1) * G; k += kLanes) {  // G is a multiple of kLanes (Tile checks)
        __builtin_prefetch(ahead + 2048, 0, 3);  // the weights come from memory: 2 KB ahead, every register
        ahead += kLanes;
        VF wv = Widen(w + c * K + k);
        if constexpr (!kScalesAfterGroups) wv *= s;
        std::memcpy(out + k, &wv, sizeof wv);
      }
    }
  }
  Problem widened = p;
  widened.w = scratch.data();
  widened.y = p.y + n0;  // rows keep y's stride (N); channel c of the scratch is y's column n0 + c
  if constexpr (kScalesAfterGroups) {  // widened, not scaled: GroupSums scales their sums
    widened.scales = static_cast<const S*>(p.scales) + n0 * groups;
    return Passes<float, S>(widened, m0, m1, 0, channels);
  }
  widened.scales = nullptr;
  widened.G = K;
  Passes<float, NoScale>(widened, m0, m1, 0, channels);
}

template <typename W, typename S>
void Tile(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<W, int8_t>)
    if (m1 - m0 >= kWidenedRows && p.G < p.K && p.G % kLanes == 0) return WidenedTile<S>(p, m0, m1, n0, n1);
  Passes<W, S>(p, m0, m1, n0, n1);
}

#ifdef JPAGED_AMX
// The AMX path of bfloat16 weights (Intel's Advanced Matrix Extensions: eight tile registers of up to
// 16 rows x 64 bytes, and TDPBF16PS, a bfloat16 x bfloat16 -> float32 tile product). Many rows make a
// product bound by arithmetic, which the tiles do several times faster than AVX-512; one row is bound by
// reading the weights, which tile loads stream faster than the AVX-512 path's prefetched rows. It
// computes y's transpose tile by tile, so that the weights are loaded as they are stored:
//   A tile: 16 output channels x 32 inputs of the weights, straight from [N, K] (stride 2K bytes);
//   B tile: 32 inputs x 16 rows of x, in the instruction's pairs layout (row r holds, for each of the 16
//           rows j of x, its inputs 2r and 2r + 1): x packed once per call (PackRowsForAmx, 16 rows
//           at a time, shared by the threads as the first items of the call), the last block of rows
//           padded with zeros;
//   C tile: 16 channels x 16 rows of float32 sums, over all of K, then transposed into y.
// x is rounded to bfloat16 on every path (by the packing's conversion here, RoundedToBf16 on the AVX-512
// path), so the paths differ only in the order of the sums. K must be a multiple of 32; channels past the
// last whole 16 take the AVX-512 path, and so does every product on a CPU without AMX-BF16 (or where
// Linux does not grant the tile state).
// The packing and the output's transposes in registers (they were a scatter and a gather per row, and the
// packing ran on the calling thread alone): the default model's decode step of 128 rows, bfloat16, 96-97
// -> 82-85 ms; kernel alone, 128 rows of [576 x 1536], 0.33 -> 0.24 ms.
constexpr int64_t kAmxK = 32;         // inputs per tile (64 bytes of bfloat16)
constexpr int64_t kAmxRows = 16;      // rows of x per B tile, channels per A tile
constexpr int64_t kAmxRowChunk = 256; // rows of x per work item (its packed rows stay in L2 between items)
// Outputs of at least kAmxWideOutput channels (an LM head) take kAmxWideTile channels an item, so that
// each row of y is written 2 KB at a time, not 128 bytes to each row's page in turn. The default model's
// LM head (alternating builds, kernel alone): 64 rows 4.8-6.1 -> 2.9-3.6 ms, 128 rows 8.0-10.0 -> 5.0-6.8.
constexpr int64_t kAmxWideOutput = 8192, kAmxWideTile = 512;
constexpr size_t kKeptPackSize = size_t{1} << 19;  // bfloat16 values of x's packing kept by a thread (1 MiB)
// Every row count takes the tiles, one row too (the default model's decode step 16.3-16.7 -> 15.2-15.3 ms).

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The 16 x 16 transpose of 32-bit values in place: v[r][j] becomes the old v[j][r] (in-lane unpacks of
// pairs and quads, then two rounds of 128-bit lane shuffles: 64 shuffles, no memory round trip).
__attribute__((target("avx512f"))) inline void Transpose16x16(__m512i v[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // b[4 g + c]: element c of each 128-bit lane, rows 4 g .. 4 g + 3
    b[4 * g] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
    b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), e1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i e2 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE), e3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    v[c] = _mm512_shuffle_i32x4(e0, e1, 0x88);
    v[4 + c] = _mm512_shuffle_i32x4(e0, e1, 0xDD);
    v[8 + c] = _mm512_shuffle_i32x4(e2, e3, 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(e2, e3, 0xDD);
  }
}

// Whether this CPU has AMX-BF16 and the kernel let this process use its tiles (Linux asks each process
// to request the tile state: ARCH_REQ_XCOMP_PERM). Asked once.
bool AmxReady() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Rows [16 mb, 16 mb + 16) of x f32[M, K] as B tiles (rows past M: zeros), block-row-major:
// packed[((mb * K / 32 + kb) * 16 + r) * 32 + 2 * j + e] = x[16 mb + j, 32 kb + 2 r + e], rounded to nearest
// even. Each row's 32 inputs are one conversion to pairs (AVX512-BF16, which every AMX-BF16 CPU has); a
// tile's 16 rows of pairs are then transposed in registers and stored whole, a tile at a time.
__attribute__((target("avx512f,avx512bf16"))) void PackRowsForAmx(const Problem& p, int64_t mb) {
  const int64_t kb_count = p.K / kAmxK, rows = std::min<int64_t>(kAmxRows, p.M - mb * kAmxRows);
  const float* x = p.x + mb * kAmxRows * p.K;
  uint16_t* out = p.packed + mb * kb_count * kAmxRows * kAmxK;
  for (int64_t kb = 0; kb < kb_count; ++kb, out += kAmxRows * kAmxK) {
    __m512i v[kAmxRows];
    for (int64_t j = 0; j < kAmxRows; ++j) {
      const float* in = x + j * p.K + kb * kAmxK;
      v[j] = j < rows ? reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + 16), _mm512_loadu_ps(in)))
                      : _mm512_setzero_si512();
    }
    Transpose16x16(v);
    for (int64_t r = 0; r < kAmxRows; ++r) _mm512_storeu_si512(out + r * kAmxK, v[r]);
  }
}

// y[m, n] for rows [m0, m0 + 16 NB) (those below M) and channels [n0, n0 + 16 NA): NA x NB C tiles
// (tmm0-3), NA A tiles (tmm4-5) and NB B tiles (tmm6-7) per 32 inputs.
template <int NA, int NB>
__attribute__((target("amx-tile,amx-bf16"))) void AmxBlock(const Problem& p, int64_t m0, int64_t n0) {
  const int64_t K = p.K, kb_count = K / kAmxK;
  const auto* w = static_cast<const uint16_t*>(p.w);
  const uint16_t* b0 = p.packed + (m0 / kAmxRows) * kb_count * kAmxRows * kAmxK;
  const uint16_t* b1 = b0 + kb_count * kAmxRows * kAmxK;
  const uint16_t* a0 = w + n0 * K;
  const uint16_t* a1 = a0 + kAmxRows * K;
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (NA == 2) _tile_zero(2);
  if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    _tile_loadd(4, a0 + kb * kAmxK, K * 2);
    _tile_loadd(6, b0 + kb * kAmxRows * kAmxK, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, b1 + kb * kAmxRows * kAmxK, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NA == 2) {
      _tile_loadd(5, a1 + kb * kAmxK, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][kAmxRows][kAmxRows];  // [tile][channel][row]
  _tile_stored(0, c[0], 64);
  if constexpr (NB == 2) _tile_stored(1, c[1], 64);
  if constexpr (NA == 2) _tile_stored(2, c[2], 64);
  if constexpr (NA == 2 && NB == 2) _tile_stored(3, c[3], 64);
  for (int a = 0; a < NA; ++a)
    for (int b = 0; b < NB; ++b) {
      __m512i t[kAmxRows];  // the tile's rows (channels), then transposed: y's rows
      for (int64_t r = 0; r < kAmxRows; ++r) t[r] = _mm512_load_si512(c[a * 2 + b][r]);
      Transpose16x16(t);
      const int64_t mb = m0 + b * kAmxRows, rows = std::min<int64_t>(kAmxRows, p.M - mb);
      for (int64_t j = 0; j < rows; ++j) _mm512_storeu_si512(p.y + (mb + j) * p.N + n0 + a * kAmxRows, t[j]);
    }
}

// Rows [m0, m1) by channels [n0, n1) on the tiles (m0 a multiple of 16); channels past the last whole
// 16 on the AVX-512 path.
__attribute__((target("amx-tile,amx-bf16"))) void AmxTile(const Problem& p, int64_t m0, int64_t m1, int64_t n0,
                                                         int64_t n1) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kAmxRows;
  _tile_loadconfig(&config);
  const int64_t whole = n0 + (n1 - n0) / kAmxRows * kAmxRows;
  for (int64_t m = m0; m < m1; m += 2 * kAmxRows) {
    const bool two_b = m + kAmxRows < m1;
    int64_t n = n0;
    for (; n + 2 * kAmxRows <= whole; n += 2 * kAmxRows) two_b ? AmxBlock<2, 2>(p, m, n) : AmxBlock<2, 1>(p, m, n);
    for (; n < whole; n += kAmxRows) two_b ? AmxBlock<1, 2>(p, m, n) : AmxBlock<1, 1>(p, m, n);
  }
  _tile_release();
  if (whole < n1) Tile<Bf16, NoScale>(p, m0, m1, whole, n1);
}
#endif  // JPAGED_AMX

// The work items of one call: for each of its problems (one weight each, all of the same rows of x), rows
// [m0, m1) by channels [n0, n1) (a chunk of rows by that problem's tile_channels channels, the rows' chunks
// outermost), the problems' items one after another; claimed by the calling thread and the crew's helpers
// (work_list.h); threads that start after the last item was claimed return without touching the buffers (which
// live only until the handler returns). Where x must be packed first (the AMX path), its blocks of rows are
// claimed the same way before any item (once for every problem: they share x), and a thread takes items
// only once every block is packed (it waits at most for the blocks other threads are packing: a few
// microseconds). A guided call (few rows off the AMX tiles: kGuidedShare) has one item per channel instead,
// claimed in runs of them (DrainGuided).
struct Work {
  static constexpr int kMaxProblems = 4;
  Problem problems[kMaxProblems];
  int num_problems = 1;
  void (*tile)(const Problem&, int64_t, int64_t, int64_t, int64_t);  // Tile<W, S> or AmxTile
  int64_t row_chunk;  // rows per item (M: one chunk)
  bool solo = false;  // the calling thread takes every item (kInt8SoloMaxRows)
  int64_t tile_channels[kMaxProblems] = {kTile, kTile, kTile, kTile};  // channels per item, per problem
  void (*pack)(const Problem&, int64_t) = nullptr;  // packs one block of x's rows into problems[0].packed
  int64_t pack_blocks = 0;
  int64_t tiles[kMaxProblems] = {}, first_item[kMaxProblems + 1] = {}, items = 0;
  // guided: the items are channels, problem after problem (first_item: where each problem's channels begin)
  bool guided = false;
  int64_t runs_share = 1;  // a guided claim takes the unclaimed channels / runs_share (kGuidedShare per thread)
  std::atomic<int64_t> next_block{0}, blocks_packed{0};
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  // Sets the items: guided (a call of at most kMaxRows rows, off the AMX tiles), or tiles of rows by channels.
  void Plan(int64_t threads) {
    guided = pack == nullptr && problems[0].M <= kMaxRows;
    runs_share = kGuidedShare * std::max<int64_t>(threads, 1);
    const int64_t chunks = guided ? 1 : (problems[0].M + row_chunk - 1) / row_chunk;
    for (int i = 0; i < num_problems; ++i) {
      tiles[i] = guided ? problems[i].N : (problems[i].N + tile_channels[i] - 1) / tile_channels[i];
      first_item[i + 1] = first_item[i] + tiles[i] * chunks;
    }
    items = first_item[num_problems];
  }

  // Whether another thread could take part of the items.
  bool Shareable() const { return !solo && items > (guided ? kMinRunChannels : 1); }

  void Drain() {
    if (guided) return DrainGuided();
    for (int64_t b = next_block.fetch_add(1); b < pack_blocks; b = next_block.fetch_add(1)) {
      pack(problems[0], b);
      blocks_packed.fetch_add(1, std::memory_order_release);
    }
    for (int spins = 0; blocks_packed.load(std::memory_order_acquire) < pack_blocks; ++spins)
      spins < 4096 ? Pause() : std::this_thread::yield();
    for (int64_t t = next.fetch_add(1); t < items; t = next.fetch_add(1)) {
      int i = 0;
      while (t >= first_item[i + 1]) ++i;
      const Problem& p = problems[i];
      const int64_t u = t - first_item[i], m0 = u / tiles[i] * row_chunk, n0 = u % tiles[i] * tile_channels[i];
      tile(p, m0, std::min(p.M, m0 + row_chunk), n0, std::min(p.N, n0 + tile_channels[i]));
      FinishItems(done, 1, items, mu, finished);
    }
  }

  // Claims runs of channels, each the unclaimed ones / runs_share (at least kMinRunChannels, within one
  // problem), until none is left.
  void DrainGuided() {
    int64_t start = next.load(std::memory_order_relaxed);
    while (start < items) {
      int i = 0;
      while (start >= first_item[i + 1]) ++i;
      const int64_t run = std::max(kMinRunChannels, (items - start) / runs_share);
      const int64_t size = std::min(run, first_item[i + 1] - start);
      if (!next.compare_exchange_weak(start, start + size)) continue;  // another thread claimed first: reread
      const Problem& p = problems[i];
      const int64_t n0 = start - first_item[i];
      tile(p, 0, p.M, n0, n0 + size);
      FinishItems(done, size, items, mu, finished);
      start = next.load(std::memory_order_relaxed);
    }
  }
};

// Runs `work` (its problems, tile function and row chunk set) on the calling thread and the crew (as many
// helpers as XLA has intra-op threads, less one: work_list.h), or on the calling thread alone where
// `work->solo`. The crew, against XLA's intra-op threads scheduled per call: the default model's 121 one-row
// products as a chain of dependent calls, 0.92-0.95x the time at bfloat16 (AMD EPYC Zen 4, 2 cores; both in
// one process, alternating).
ffi::Error Run(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  if (work->problems[0].M == 0) return ffi::Error::Success();
  work->Plan(pool.num_threads());
  if (work->items == 0) return ffi::Error::Success();
  if (work->Shareable() && pool.num_threads() > 1)
    Crew::Get(static_cast<int>(pool.num_threads()) - 1).Offer([work] { work->Drain(); });
  work->Drain();
  AwaitItems(work->done, work->items, work->mu, work->finished);
  return ffi::Error::Success();
}

// The layer `layer` of a stack [L, N, K] (a 2-D weight: one layer): its element offset, or -1 when
// out of range.
int64_t LayerOffset(ffi::Span<const int64_t> dims, ffi::Buffer<ffi::S32>& layer) {
  const int64_t L = dims.size() == 3 ? dims[0] : 1, id = *layer.typed_data();
  return id < 0 || id >= L ? -1 : id * dims[dims.size() - 2] * dims[dims.size() - 1];
}

// Result i of a call, checked to be f32[M, N] (a smaller buffer would be written past its end): its data in
// `y`; else an error naming `kernel`.
ffi::Error CheckedResult(ffi::RemainingRets& results, int i, int64_t M, int64_t N, const std::string& kernel,
                         float** y) {
  auto result = results.get<ffi::Buffer<ffi::F32>>(i);
  if (!result.has_value()) return ffi::Error::InvalidArgument(kernel + ": the results must be float32 arrays");
  auto dims = (*result)->dimensions();
  if (dims.size() != 2 || dims[0] != M || dims[1] != N)
    return ffi::Error::InvalidArgument(kernel + ": each result must be [M, N] of its weight's N");
  *y = (*result)->typed_data();
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                      ffi::RemainingArgs weights, ffi::RemainingRets results) {
  auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("int8 matmul: x must be [M, K]");
  const int64_t M = x_dims[0], K = x_dims[1];
  const int count = static_cast<int>(weights.size() / 2);
  if (weights.size() % 2 != 0 || count < 1 || count > Work::kMaxProblems || results.size() != static_cast<size_t>(count))
    return ffi::Error::InvalidArgument("int8 matmul: 1 to 4 weights, each values then scales, one result each");
  auto work = std::make_shared<Work>();
  work->num_problems = count;
  work->row_chunk = M;
  ffi::DataType type = ffi::DataType::INVALID;
  for (int i = 0; i < count; ++i) {
    auto values = weights.get<ffi::Buffer<ffi::S8>>(2 * i);
    auto scales = weights.get<ffi::AnyBuffer>(2 * i + 1);
    if (!values.has_value() || !scales.has_value())
      return ffi::Error::InvalidArgument("int8 matmul: each weight's values must be int8");
    auto w_dims = values->dimensions();
    auto s_dims = scales->dimensions();
    const size_t rank = w_dims.size();
    if ((rank != 2 && rank != 3) || s_dims.size() != rank)
      return ffi::Error::InvalidArgument("int8 matmul: x must be [M, K], values [(L,) N, K], scales [(L,) N, K / G]");
    const int64_t N = w_dims[rank - 2], groups = s_dims[rank - 1];
    if (w_dims[rank - 1] != K || s_dims[rank - 2] != N || groups < 1 || K % groups != 0 ||
        (rank == 3 && s_dims[0] != w_dims[0]))
      return ffi::Error::InvalidArgument("int8 matmul: values must be [(L,) N, K] with x's K, and scales [(L,) N, K / G] "
                                         "with G dividing K");
    const auto t = scales->element_type();
    if (t != ffi::DataType::F32 && t != ffi::DataType::F16)
      return ffi::Error::InvalidArgument("int8 matmul: scales must be float32 or float16");
    if (i > 0 && t != type)
      return ffi::Error::InvalidArgument("int8 matmul: the scales of one call must share a dtype");
    type = t;
    const int64_t offset = LayerOffset(w_dims, layer);
    if (offset < 0) return ffi::Error::InvalidArgument("int8 matmul: layer out of range");
    float* y = nullptr;
    if (auto error = CheckedResult(results, i, M, N, "int8 matmul", &y); error.failure()) return error;
    const int64_t scale_offset = offset / K * groups, scale_size = t == ffi::DataType::F16 ? 2 : 4;
    work->problems[i] = Problem{x.typed_data(), values->typed_data() + offset,
                                static_cast<const char*>(scales->untyped_data()) + scale_offset * scale_size, M, N, K,
                                K / groups, y};
  }
  work->tile = type == ffi::DataType::F16 ? Tile<int8_t, _Float16> : Tile<int8_t, float>;
  work->solo = M <= Int8SoloMaxRows();
  return Run(pool, std::move(work));
}

ffi::Error FloatRowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                           ffi::RemainingArgs weights, ffi::RemainingRets results) {
  auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("float-rows matmul: x must be [M, K]");
  const int64_t M = x_dims[0], K = x_dims[1];
  const int count = static_cast<int>(weights.size());
  if (count < 1 || count > Work::kMaxProblems || results.size() != weights.size())
    return ffi::Error::InvalidArgument("float-rows matmul: 1 to 4 weights, one result each");
  auto work = std::make_shared<Work>();
  work->num_problems = count;
  work->row_chunk = M;
  ffi::DataType type = ffi::DataType::INVALID;
  for (int i = 0; i < count; ++i) {
    auto values = weights.get<ffi::AnyBuffer>(i);
    if (!values.has_value()) return ffi::Error::InvalidArgument("float-rows matmul: the weights must be arrays");
    auto w_dims = values->dimensions();
    const size_t rank = w_dims.size();
    if ((rank != 2 && rank != 3) || w_dims[rank - 1] != K)
      return ffi::Error::InvalidArgument("float-rows matmul: each weight must be [(L,) N, K] with x's K");
    float* y = nullptr;
    if (auto error = CheckedResult(results, i, M, w_dims[rank - 2], "float-rows matmul", &y); error.failure())
      return error;
    const auto t = values->element_type();
    if (t != ffi::DataType::U16 && t != ffi::DataType::BF16 && t != ffi::DataType::F16 && t != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("float-rows matmul: weights must be bfloat16 (or its uint16 bits), float16 "
                                         "or float32");
    const bool same = i == 0 || t == type || ((t == ffi::DataType::U16 || t == ffi::DataType::BF16) &&
                                              (type == ffi::DataType::U16 || type == ffi::DataType::BF16));
    if (!same) return ffi::Error::InvalidArgument("float-rows matmul: the weights of one call must share a dtype");
    type = t;
    const int64_t offset = LayerOffset(w_dims, layer);
    if (offset < 0) return ffi::Error::InvalidArgument("float-rows matmul: layer out of range");
    work->problems[i] = Problem{x.typed_data(),
                                static_cast<const char*>(values->untyped_data()) +
                                    offset * (t == ffi::DataType::F32 ? 4 : 2),
                                nullptr, M, w_dims[rank - 2], K, K, y};
  }
  const bool f32 = type == ffi::DataType::F32, bf16 = type == ffi::DataType::U16 || type == ffi::DataType::BF16;
  work->tile = f32 ? Tile<float, NoScale> : bf16 ? Tile<Bf16, NoScale> : Tile<_Float16, NoScale>;
  bool all_on_tiles = false;
  std::vector<float> rounded;  // these (and x_bits) outlive Run, which returns when every item is done
  std::vector<uint16_t> own_packed;
#ifdef JPAGED_AMX
  if (bf16 && K % kAmxK == 0 && AmxReady()) {
    const int64_t blocks = (M + kAmxRows - 1) / kAmxRows;
    // A decode step's few rows: one buffer per calling thread, kept between calls (a fresh one of this size
    // is a fresh mapping, its pages faulted in on every call: ~20 us of a 128-row product of the default
    // model). More rows (a prefill): a buffer of the call's own, so that no thread keeps the largest.
    const size_t size = blocks * kAmxRows * K;
    static thread_local std::vector<uint16_t> kept;
    if (size <= kKeptPackSize && kept.size() < size) kept.resize(kKeptPackSize);
    if (size > kKeptPackSize) own_packed.resize(size);
    work->pack = PackRowsForAmx;  // rounds x to bfloat16 itself, once for every weight
    work->pack_blocks = blocks;
    work->tile = AmxTile;
    work->row_chunk = kAmxRowChunk;
    all_on_tiles = true;
    for (int i = 0; i < count; ++i) {
      work->problems[i].packed = size <= kKeptPackSize ? kept.data() : own_packed.data();
      if (work->problems[i].N >= kAmxWideOutput) work->tile_channels[i] = kAmxWideTile;
      all_on_tiles = all_on_tiles && work->problems[i].N % kAmxRows == 0;
    }
  }
#endif
  std::vector<uint16_t> x_bits;
  bool dot_bf16 = false;
#ifdef JPAGED_AVX512_BF16
  if (bf16 && work->tile == Tile<Bf16, NoScale> && Avx512Bf16Ready()) {  // not on AMX tiles: VDPBF16PS
    dot_bf16 = true;
    x_bits = Bf16Bits(x.typed_data(), M * K);
    for (int i = 0; i < count; ++i) work->problems[i].x_bf16 = x_bits.data();
    work->tile = Tile<Bf16Dot, NoScale>;
  }
#endif
  if (bf16 && !all_on_tiles && !dot_bf16) {  // bfloat16 weights on the AVX-512 path: x rounded first
    rounded = RoundedToBf16(x.typed_data(), M * K);
    for (int i = 0; i < count; ++i) work->problems[i].x = rounded.data();
  }
  return Run(pool, std::move(work));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .RemainingArgs()               // values (s8), scales (f32 or f16), per weight
                                  .RemainingRets());             // y: f32, one per weight

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedFloatRowsMatmul, FloatRowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .RemainingArgs()               // values: u16 (bfloat16 bits), bf16, f16 or f32
                                  .RemainingRets());             // y: f32, one per weight

// Whether the float-rows matmul of this library runs bfloat16 weights on AMX tiles (this CPU has AMX-BF16, the OS granted the tile state, and the library is the AVX-512 build).
extern "C" int JpagedAmxBf16() {
#ifdef JPAGED_AMX
  return AmxReady();
#else
  return 0;
#endif
}

// The most rows of an int8 product that this library runs on the calling thread alone, on this CPU.
extern "C" int JpagedInt8SoloMaxRows() { return static_cast<int>(Int8SoloMaxRows()); }

// Whether this library reads float32 and VDPBF16PS's bfloat16 weights of one row a channel at a time, on this
// CPU (ReadsChannelAtATime).
extern "C" int JpagedReadsChannelAtATime() { return ReadsChannelAtATime(); }

// Whether the float-rows matmul of this library runs bfloat16 weights on VDPBF16PS (the AVX-512 build, on a
// CPU with AVX512-BF16, where the AMX path does not take them).
extern "C" int JpagedAvx512Bf16() {
#ifdef JPAGED_AVX512_BF16
#ifdef JPAGED_AMX
  if (AmxReady()) return 0;
#endif
  return Avx512Bf16Ready();
#else
  return 0;
#endif
}
