// Paged attention on the CPU, as an XLA FFI handler: reads K/V blocks in place through the block
// tables (no gather into new buffers), with an online softmax over tiles of keys (one vector of
// scores each: 16 keys under AVX-512, 8 under AVX2, 4 in the portable build).
//
// Work items: a chunk of up to 16 query tokens of one row (a decode row is one chunk of one
// token), with all its KV heads (the vector path: head_dim 64 or 128, up to 8 query heads per KV
// head) or with one KV head (the generic path, any shape). The calling thread and XLA's intra-op
// threads take items from a shared list, longest first. On the vector path a decode token's item
// scores each key by summing its products across lanes (RunRowChunk); a prompt chunk's item scores a
// tile of keys for several tokens at once as a small matrix product (RunPromptChunk), with the same sums
// in the same order, so that a token's output is the same bit for bit in any chunk (batch invariance; with
// full attention: a windowed item's tiles start at its first token's window, so they move with the chunk):
// on the 120 vs_peers prompts (10,532 tokens, bfloat16 pool, Intel Xeon, 2 cores) 33-37 -> 28-29 ms a
// layer (20-25 with the sums in another order, which changed a beam search's tokens under preemption).
//
// Built three times by setup.py (AVX-512, AVX2 + FMA + F16C, portable), each a shared library that
// exports the handler `JpagedPagedAttention`; jpaged/device/attention/native.py picks the variant
// the CPU runs and registers it with jax.ffi. The code is plain C++ with GCC's vector extensions
// (and `#pragma omp simd` loops in the generic path), written for vectors of kLanes floats, the
// width of the variant's registers: a wider vector than the target's registers is no vector to GCC
// (it lives in memory: the AVX2 build of 16-lane code made 6x the stack accesses of the AVX-512 one
// and ran 4.4-8x slower, slower than the portable build).
//
// Operands (see native.py, which derives them from a step's ModelInputs):
//   q        f32[N, H, D]            the packed new tokens' queries (H = KVH * G query heads)
//   pool     T[L, NB, 2, BS, KVH, D] T = f32, f16, or u16 holding bfloat16 bit patterns; block b's
//                                    keys at [l, b, 0], its values at [l, b, 1], side by side
//   layer    s32[]                   which layer of the stacked pool to read
//   window   s32[]                   W >= 1: the query token at position p sees the keys at positions
//                                    p - W < k <= p (a sliding window; 1 << 30: every key in context)
//   tables   s32[B, M]               each row's physical blocks in logical order
//   context  s32[B]                  tokens of each row in the cache after this step (its new ones included)
//   q_start  s32[B], q_len s32[B]    row b's new tokens are q[q_start[b] : q_start[b] + q_len[b]],
//                                    at positions context[b] - q_len[b] ... context[b] - 1
//   attributes `scale` (f32) and `softcap` (f32; 0: none): each score s (after scaling) becomes
//                                    softcap * tanh(s / softcap) before the mask and the softmax
// Result: f32[N, H, D]; query token i of row b attends to the row's cached positions <= its own
// and > its own - W (exact softmax; causal within the row). Tokens no row claims (padding) get zeros.
//
// Invariants: a row reads only the slots of positions < context[b] and >= its first token's
// position - W + 1 (unused slots may hold anything, NaN included; the block table entries wholly
// before the window are not even looked up: they may name the null block, or anything); block ids
// that are read are checked against the pool (an out-of-range id, layer or row fails the call with
// an error instead of reading out of bounds).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "lanes.h"
#include "work_list.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---- vectors of kLanes floats: lanes.h -----------------------------------------------------

constexpr int kTile = kLanes;     // keys per softmax update: a tile's scores are one vector
constexpr int kQueryChunk = 16;   // query tokens per work item (a prefill row has several)
#ifndef JPAGED_PREFETCH_KEYS
#define JPAGED_PREFETCH_KEYS 32
#endif
constexpr int kPrefetchTiles = JPAGED_PREFETCH_KEYS / kTile;  // how far ahead the vector path prefetches
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <int... P>
constexpr VI LaneIndices(std::integer_sequence<int, P...>) { return VI{P...}; }
const VI kLaneIds = LaneIndices(kLaneSeq);  // 0, 1, ..., kLanes - 1

// exp(x) lane by lane, for x <= 0 (scores minus their running maximum): Cephes' single-precision
// polynomial, within 2 ulp; x below -87 gives exp(-87), not 0 (callers mask what must be 0).
inline VF ExpNonPositive(VF x) {
  x = x < -87.0f ? Splat(-87.0f) : x;
  const VF shifter = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  VF n = (x * 1.44269504088896341f + shifter) - shifter;
  VF r = x - n * 0.693359375f + n * 2.12194440e-4f;
  VF p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float ExpNonPositive(float x) { return ExpNonPositive(Splat(x))[0]; }

template <int S = kLanes / 2>
inline float MaxLanes(VF x) {
  const VF y = SwapLanes<S>(x, kLaneSeq);
  x = x > y ? x : y;
  if constexpr (S > 1) return MaxLanes<S / 2>(x);
  return x[0];
}

// c * tanh(x / c) lane by lane (inv_c = 1 / c): logit soft-capping. tanh as Cephes' tanhf: an odd
// polynomial below 0.625, 1 - 2 / (exp(2|y|) + 1) above, within a few ulp.
inline VF SoftCap(VF x, float c, float inv_c) {
  const VF y = x * inv_c;
  const VF a = y < 0.0f ? -y : y;
  const VF z = y * y;
  VF small = Splat(-5.70498872745e-3f);
  small = small * z + 2.06390887954e-2f;
  small = small * z - 5.37397155531e-2f;
  small = small * z + 1.33314422036e-1f;
  small = small * z - 3.33332819422e-1f;
  small = small * z * a + a;
  const VF e = ExpNonPositive(-2.0f * a);  // exp(-2|y|); exp(-87) for |y| past 43.5, where tanh is 1
  const VF large = 1.0f - 2.0f * e / (1.0f + e);
  const VF t = a < 0.625f ? small : large;
  return (y < 0.0f ? -t : t) * c;
}

// ---- element conversion ------------------------------------------------------------------------

inline float BF16BitsToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float F16ToFloat(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, sizeof x);
  return static_cast<float>(x);
}

enum class PoolType { kF32, kF16, kBF16Bits };

// Bytes of one stored value.
constexpr int64_t ElementBytes(PoolType type) { return type == PoolType::kF32 ? 4 : 2; }

// A pointer to `D` floats of one token's K or V for one head: the pool itself for float32,
// else `scratch` filled with the widened values.
inline const float* ReadRow(const void* pool, int64_t offset, int64_t D, PoolType type, float* scratch) {
  switch (type) {
    case PoolType::kF32:
      return static_cast<const float*>(pool) + offset;
    case PoolType::kBF16Bits: {
      const uint16_t* src = static_cast<const uint16_t*>(pool) + offset;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) scratch[d] = BF16BitsToFloat(src[d]);
      return scratch;
    }
    case PoolType::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(pool) + offset;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) scratch[d] = F16ToFloat(src[d]);
      return scratch;
    }
  }
  return scratch;
}

// ---- one work item: a query chunk of one row against one KV head ------------------------------

struct Problem {
  const float* q;
  const void* k;  // the pool; token offsets (TokenOffsets) count from here for K
  const void* v;  // the pool plus one block's K: the same offsets give V
  PoolType type;
  int64_t H, D, NB, BS, KVH, G, M;
  int64_t layer_offset;  // elements before this layer's blocks (each 2 * BS * KVH * D: its K, then its V)
  const int32_t* tables;
  const int32_t* context;
  const int32_t* q_start;
  const int32_t* q_len;
  float scale;
  int64_t window;          // W: query position q sees keys q - W + 1 .. q
  float softcap, inv_softcap;  // 0, 0: no soft-capping
  float* out;
};

struct WorkItem {
  int32_t row, kv_head, chunk_start, chunk_len;
  int64_t cost;
  bool all_heads = false;  // every KV head at once (the vector path; kv_head unused)
};

// Elements from p.k to slot `slot` of block `block`'s keys in this layer; the same count from p.v
// reaches its values. A block holds 2 * BS slots of KVH * D: its BS keys, then its BS values.
inline int64_t SlotOffset(const Problem& p, int64_t block, int64_t slot) {
  return p.layer_offset + (block * 2 * p.BS + slot) * p.KVH * p.D;
}

// The keys a work item reads: positions ItemFirstKey .. ItemKeys - 1 of its row (the window of its
// first query token through its last token).
inline int64_t ItemKeys(const Problem& p, const WorkItem& item) {
  return p.context[item.row] - p.q_len[item.row] + item.chunk_start + item.chunk_len;
}

inline int64_t ItemFirstKey(const Problem& p, const WorkItem& item) {
  return std::max<int64_t>(0, ItemKeys(p, item) - item.chunk_len - p.window + 1);
}

// The first lane of a tile (keys tile .. tile + kTile - 1) that the query at `q_pos` sees: 0 but in the
// window's first tiles.
inline int FirstVisible(const Problem& p, int64_t q_pos, int64_t tile) {
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kTile, q_pos - p.window + 1 - tile)));
}

// Prefetches `bytes` bytes from byte `at` of a pool (K or V) into the L2 cache, not L1 (hint 1,
// PREFETCHT1): a tile's K and V rows are 24 KiB (float32, the default model), so the tiles in
// flight would not fit a 32-48 KiB L1 beside the tile being read (on an AMD EPYC, hint 3 took 1.2x
// as long at 64 and 120 rows x 480).
inline void PrefetchL2(const void* pool, int64_t at, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(static_cast<const char*>(pool) + at + byte, 0, 1);
}

// ---- the generic path: any head_dim and group size ---------------------------------------------
//
// One work item is a chunk of query tokens of one row against one KV head; scores one by one.
// Returns false when the row names a block outside the pool.
bool RunItem(const Problem& p, const WorkItem& item, std::vector<float>& buffer) {
  const int64_t D = p.D, G = p.G, H = p.H;
  const int64_t nvec = static_cast<int64_t>(item.chunk_len) * G;
  const int64_t context = p.context[item.row];
  const int64_t first_pos = context - p.q_len[item.row] + item.chunk_start;  // position of the chunk's first query
  const int64_t last_pos = first_pos + item.chunk_len - 1;
  const int64_t first_key = ItemFirstKey(p, item);
  const int32_t* table = p.tables + static_cast<int64_t>(item.row) * p.M;

  // buffer: scaled queries [nvec, D] | acc [nvec, D] | k rows [kTile, D] | v rows [kTile, D]
  buffer.resize(static_cast<size_t>(2 * nvec * D + 2 * kTile * D));
  float* qs = buffer.data();
  float* acc = qs + nvec * D;
  float* k_scratch = acc + nvec * D;
  float* v_scratch = k_scratch + kTile * D;
  std::vector<float> m(nvec, kNegInf), l(nvec, 0.0f);
  for (int64_t i = 0; i < item.chunk_len; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = p.q + ((p.q_start[item.row] + item.chunk_start + i) * H + item.kv_head * G + g) * D;
      float* dst = qs + (i * G + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
    }
  }
  std::fill(acc, acc + nvec * D, 0.0f);

  const int64_t head = item.kv_head * D;
  const int64_t elem = ElementBytes(p.type);
  const float* k_rows[kTile];
  const float* v_rows[kTile];
  float scores[kTile] = {}, probs[kTile];

  for (int64_t tile = first_key; tile <= last_pos; tile += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, last_pos + 1 - tile));
    for (int t = 0; t < n; ++t) {
      const int64_t pos = tile + t;
      const int64_t block = table[pos / p.BS];
      if (block < 0 || block >= p.NB) return false;
      const int64_t offset = SlotOffset(p, block, pos % p.BS) + head;
      k_rows[t] = ReadRow(p.k, offset, D, p.type, k_scratch + t * D);
      v_rows[t] = ReadRow(p.v, offset, D, p.type, v_scratch + t * D);
    }
    // prefetch the next tile's rows (its blocks are anywhere in the pool)
    for (int64_t pos = tile + kTile; pos < std::min<int64_t>(tile + 2 * kTile, last_pos + 1); ++pos) {
      const int64_t block = table[pos / p.BS];
      if (block < 0 || block >= p.NB) break;
      const int64_t offset = (SlotOffset(p, block, pos % p.BS) + head) * elem;
      PrefetchL2(p.k, offset, D * elem);
      PrefetchL2(p.v, offset, D * elem);
    }
    for (int64_t j = 0; j < nvec; ++j) {
      const int64_t q_pos = first_pos + j / G;
      const int visible = static_cast<int>(std::min<int64_t>(n, q_pos + 1 - tile));  // causal: keys <= q_pos
      const int first = FirstVisible(p, q_pos, tile);  // the window: keys > q_pos - W
      if (visible <= first) continue;
      const float* qv = qs + j * D;
      for (int t = first; t < visible; ++t) {
        const float* kv = k_rows[t];
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qv[d] * kv[d];
        scores[t] = s;
      }
      VF tile_scores;
      std::memcpy(&tile_scores, scores, sizeof tile_scores);  // lanes outside first .. visible - 1: masked below
      if (p.softcap > 0.0f) tile_scores = SoftCap(tile_scores, p.softcap, p.inv_softcap);
      const VI in_view = (kLaneIds >= first) & (kLaneIds < visible);
      tile_scores = in_view ? tile_scores : Splat(kNegInf);
      const float m_new = std::max(m[j], MaxLanes(tile_scores));
      const float alpha = m[j] == kNegInf ? 0.0f : ExpNonPositive(m[j] - m_new);
      VF tile_probs = ExpNonPositive(tile_scores - m_new);
      tile_probs = in_view ? tile_probs : VF{};
      std::memcpy(probs, &tile_probs, sizeof tile_probs);
      float sum = 0.0f;
      for (int t = 0; t < kTile; ++t) sum += probs[t];
      m[j] = m_new;
      l[j] = l[j] * alpha + sum;
      float* a = acc + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      for (int t = first; t < visible; ++t) {
        const float pt = probs[t];
        const float* vv = v_rows[t];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += pt * vv[d];
      }
    }
  }
  for (int64_t i = 0; i < item.chunk_len; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = i * G + g;
      const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
      float* dst = p.out + ((p.q_start[item.row] + item.chunk_start + i) * H + item.kv_head * G + g) * D;
      const float* a = acc + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = a[d] * inv;
    }
  }
  return true;
}


// ---- the vector path: head_dim 64 or 128, 1-8 query heads per KV head ---------------------------
//
// A tile's kLanes scores sit in one vector: each key's partial products (D / kLanes vectors,
// multiplied into one) are summed across lanes for the tile's keys at once by a transposing
// reduction tree, so the softmax (max, exp, sum) runs on whole vectors. The tree's first two levels
// run on every 4 keys' products while they are in registers (SumLanes4Keys), the rest once per tile
// (SumLanesTile): a quarter of the stores and loads of keeping all the tile's keys' products.

template <PoolType T>
inline VF LoadLanes(const void* base, int64_t offset) {
  if constexpr (T == PoolType::kF32) {
    VF x;
    std::memcpy(&x, static_cast<const float*>(base) + offset, sizeof x);
    return x;
  } else if constexpr (T == PoolType::kBF16Bits) {
    VH h;
    std::memcpy(&h, static_cast<const uint16_t*>(base) + offset, sizeof h);
    VU u = __builtin_convertvector(h, VU) << 16;
    VF x;
    std::memcpy(&x, &u, sizeof x);
    return x;
  } else {
    VHF h;
    std::memcpy(&h, static_cast<const uint16_t*>(base) + offset, sizeof h);
    return __builtin_convertvector(h, VF);
  }
}

// Level J of the tree (J >= 1): a and b each hold 2^(J-1) keys' partial sums in runs of
// 2 * (kLanes >> J) lanes, keys in order; the result holds their 2^J keys in runs of kLanes >> J lanes
// (each run's two halves added), in order. Source lane of result lane p, `half` 0 or 1:
constexpr int TreeSource(int J, int p, int half) {
  const int run = kLanes >> J, per_input = 1 << (J - 1), key = p / run;
  return (key / per_input) * kLanes + (key % per_input) * 2 * run + half * run + p % run;
}

template <int J, int... P>
inline VF TreeLevel(VF a, VF b, std::integer_sequence<int, P...>) {
  return __builtin_shufflevector(a, b, TreeSource(J, P, 0)...) + __builtin_shufflevector(a, b, TreeSource(J, P, 1)...);
}

// Levels 1 and 2, on the products of keys 4i .. 4i + 3 (a[0..3]): one vector, runs of kLanes / 4.
inline VF SumLanes4Keys(const VF* a) {
  return TreeLevel<2>(TreeLevel<1>(a[0], a[1], kLaneSeq), TreeLevel<1>(a[2], a[3], kLaneSeq), kLaneSeq);
}

// out[t] = the sum of key t's lanes, for the tile's keys t = 0 .. kLanes - 1, from
// c[i] = SumLanes4Keys(keys 4i .. 4i + 3): the levels past 2.
inline VF SumLanesTile(const VF* c) {
  if constexpr (kLanes == 4) return c[0];
  if constexpr (kLanes == 8) return TreeLevel<3>(c[0], c[1], kLaneSeq);
  if constexpr (kLanes == 16)
    return TreeLevel<4>(TreeLevel<3>(c[0], c[1], kLaneSeq), TreeLevel<3>(c[2], c[3], kLaneSeq), kLaneSeq);
}

// The pool offsets (elements, head 0) of the n tokens at positions start .. start + n - 1 of a row
// with block table `table`, in this layer: one division for all of them. Returns how many lie in
// blocks inside the pool (stopping at the first that does not).
inline int TokenOffsets(const Problem& p, const int32_t* table, int64_t start, int n, int64_t* out) {
  int64_t entry = start / p.BS, slot = start % p.BS;
  for (int t = 0; t < n; ++t) {
    const int64_t block = table[entry];
    if (block < 0 || block >= p.NB) return t;
    out[t] = SlotOffset(p, block, slot);
    if (++slot == p.BS) slot = 0, ++entry;
  }
  return n;
}

// The online softmax's step over one tile for one query token's H heads, shared by both kernels of the
// vector path (so that a token's output is the same bit for bit whichever of them ran it): s[j], head j's
// scores of the tile's keys, is soft-capped, masked to the lanes [first, visible) and becomes the head's
// probabilities (exp(s - m_new)); m[j] and l[j], its running maximum and sum, are updated; alpha[j] is
// exp(m_old - m_new), the factor for its running output (0 before its first key), kLanes heads per
// vector exp.
inline void SoftmaxTile(const Problem& p, int first, int visible, int64_t H, VF* s, float* m, float* l, float* alpha) {
  const bool partial = first > 0 || visible < kTile;
  const VI in_view = (kLaneIds >= first) & (kLaneIds < visible);
  for (int64_t j = 0; j < H; ++j) {
    if (p.softcap > 0.0f) s[j] = SoftCap(s[j], p.softcap, p.inv_softcap);
    if (partial) s[j] = in_view ? s[j] : Splat(kNegInf);
    alpha[j] = std::max(m[j], MaxLanes(s[j]));  // m_new, until the loop below
  }
  for (int64_t j0 = 0; j0 < H; j0 += kLanes) {
    const int64_t heads = std::min<int64_t>(kLanes, H - j0);
    VF diff{};
    VI fresh{};
    for (int64_t j = 0; j < heads; ++j) {
      const float m_old = m[j0 + j], m_new = alpha[j0 + j];
      fresh[j] = m_old == kNegInf;
      diff[j] = m_old == kNegInf ? 0.0f : m_old - m_new;
    }
    const VF a = fresh != 0 ? VF{} : ExpNonPositive(diff);
    for (int64_t j = 0; j < heads; ++j) {
      m[j0 + j] = alpha[j0 + j];
      alpha[j0 + j] = a[j];
    }
  }
  for (int64_t j = 0; j < H; ++j) {
    VF pr = ExpNonPositive(s[j] - m[j]);
    if (partial) pr = in_view ? pr : VF{};
    l[j] = l[j] * alpha[j] + AddLanes(pr);
    s[j] = pr;
  }
}

// The vector path's outputs: rows * H query heads' unnormalised sums acc (`vectors` of them, D / kLanes
// per head) divided by their softmax sums l (a head that saw no key: zeros), from q's token first_row on.
inline void WriteOutputs(const Problem& p, int64_t first_row, int64_t vectors, const VF* acc, const float* l) {
  const int64_t C = p.D / kLanes;
  float* dst = p.out + first_row * p.H * p.D;
  for (int64_t e = 0; e < vectors; ++e) {
    const float inv = l[e / C] > 0.0f ? 1.0f / l[e / C] : 0.0f;
    const VF x = acc[e] * inv;
    std::memcpy(dst + e * kLanes, &x, sizeof x);
  }
}

// The kLanes x kLanes transpose of v[0 .. kLanes - 1] in place (v[r][e] becomes the old v[e][r]): at each
// level S (kLanes / 2 .. 1), the rows r and r + S swap their off-diagonal blocks of S lanes, one two-source
// shuffle per row.
template <int S, int... P>
inline VF LowBlocks(VF a, VF b, std::integer_sequence<int, P...>) {  // a's lanes with bit S clear, b's below them
  return __builtin_shufflevector(a, b, ((P & S) ? kLanes + P - S : P)...);
}
template <int S, int... P>
inline VF HighBlocks(VF a, VF b, std::integer_sequence<int, P...>) {  // a's lanes above those with bit S set, b's
  return __builtin_shufflevector(a, b, ((P & S) ? kLanes + P : P + S)...);
}
template <int S>
inline void TransposeLevel(VF* v) {
  for (int r = 0; r < kLanes; ++r)
    if (!(r & S)) {
      const VF a = v[r], b = v[r + S];
      v[r] = LowBlocks<S>(a, b, kLaneSeq);
      v[r + S] = HighBlocks<S>(a, b, kLaneSeq);
    }
  if constexpr (S > 1) TransposeLevel<S / 2>(v);
}
inline void TransposeLanes(VF* v) { TransposeLevel<kLanes / 2>(v); }

// The scores of N (query token, query head) pairs against one tile of keys, from the tile's K rows
// transposed (kt[d]: dimension d of the tile's keys, one vector; q[n]: pair n's scaled query), summed as
// RunRowChunk sums them, bit for bit: there key t's score is its lanes' sum by a halving tree (lane L
// plus lane L + kLanes / 2, ...) of the lane-wise products q[c * kLanes + L] * k[c * kLanes + L] summed
// over c from + 0 (one product per add, so that the compiler fuses every one into a multiply-add in both:
// starting from the first product would leave it free to fuse either of the first two). Here lane L's sums
// over c are whole vectors (one lane per key) and the tree adds them as such: the lanes L0, L0 + S,
// L0 + 2S, ... into out, the evens then the odds of that set (TreeScores<C, N, 0, 1>: every lane).
template <int C, int N, int L0, int S>
inline void TreeScores(const VF* kt, const float* const* q, VF* out) {
  if constexpr (S == kLanes) {  // one lane, L0
    for (int n = 0; n < N; ++n) out[n] = VF{};
    for (int c = 0; c < C; ++c)  // a scalar times a vector: a broadcast
      for (int n = 0; n < N; ++n) out[n] += q[n][c * kLanes + L0] * kt[c * kLanes + L0];
  } else {
    VF odd[N];
    TreeScores<C, N, L0, 2 * S>(kt, q, out);
    TreeScores<C, N, L0 + S, 2 * S>(kt, q, odd);
    for (int n = 0; n < N; ++n) out[n] += odd[n];
  }
}

// One work item of the vector path with several query tokens (a prompt's chunk, up to kQueryChunk tokens),
// every KV head, a tile of kTile keys at a time as a small matrix product: the tile's K rows are widened
// and transposed once per KV head, so that the scores are vector multiply-adds of a broadcast query element
// (TreeScores, several query tokens' G heads per loaded vector of keys), with no sum across lanes; the tile's
// V rows are widened once per KV head, and each query token's G heads take them key by key. RunRowChunk's
// one-token loop, run per token, reloads the tile's K rows for every token. The same arithmetic, in the same
// order, as RunRowChunk's (TreeScores, SoftmaxTile, the outputs' multiply-adds): a token's output does not
// depend on the chunk it was computed in, nor on whether it was decoded alone (batch invariance: a request's
// tokens do not depend on the step's budget, on preemption by recompute, or on the other requests).
// Returns false on a block outside the pool.
template <PoolType T, int D, int G>
bool RunPromptChunk(const Problem& p, const WorkItem& item) {
  constexpr int C = D / kLanes;  // vectors per head's row
  constexpr int kTokens = G >= 6 ? 2 : 4;  // query tokens whose scores share a loaded kt[d]
  const int64_t H = p.H, KVH = p.KVH, Q = item.chunk_len;
  const int32_t* table = p.tables + static_cast<int64_t>(item.row) * p.M;
  const int64_t first_row = p.q_start[item.row] + item.chunk_start;  // the chunk's first token in q
  const int64_t keys = ItemKeys(p, item), first_key = ItemFirstKey(p, item);
  const int64_t first_pos = keys - Q;  // the chunk's first token's position
  // per (query token, query head): the scaled query, running max / sum, unnormalised output
  std::vector<float> qs(Q * H * D);
  const float* q_src = p.q + first_row * H * D;
  for (int64_t e = 0; e < Q * H * D; ++e) qs[e] = q_src[e] * p.scale;
  std::vector<VF> acc(Q * H * C, VF{}), kt(D), vs(kTile * C), scores(Q * H);
  std::vector<float> m(Q * H, kNegInf), l(Q * H, 0.0f), alpha(Q * H);
  int64_t offsets[kTile];
  int first[kQueryChunk], visible[kQueryChunk];  // query token i sees the tile's lanes [first[i], visible[i])
  for (int64_t tile = first_key; tile < keys; tile += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, keys - tile));
    if (TokenOffsets(p, table, tile, n, offsets) < n) return false;
    for (int64_t i = 0; i < Q; ++i) {
      visible[i] = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, first_pos + i + 1 - tile)));
      first[i] = FirstVisible(p, first_pos + i, tile);
    }
    // scores, KV head by KV head: kt from the tile's K rows (keys past n: zeros), then kTokens tokens at a time
    for (int64_t h = 0; h < KVH; ++h) {
      for (int c = 0; c < C; ++c) {
        VF* block = &kt[c * kLanes];
        for (int t = 0; t < kTile; ++t) block[t] = t < n ? LoadLanes<T>(p.k, offsets[t] + h * D + kLanes * c) : VF{};
        TransposeLanes(block);
      }
      for (int64_t i0 = 0; i0 < Q; i0 += kTokens) {
        const float* qt[kTokens * G];  // past the chunk's last token: that token again, computed, not stored
        for (int u = 0; u < kTokens; ++u)
          for (int g = 0; g < G; ++g) qt[u * G + g] = &qs[(std::min<int64_t>(i0 + u, Q - 1) * H + h * G + g) * D];
        VF s[kTokens * G];
        TreeScores<C, kTokens * G, 0, 1>(kt.data(), qt, s);
        for (int u = 0; u < kTokens && i0 + u < Q; ++u)
          for (int g = 0; g < G; ++g) scores[(i0 + u) * H + h * G + g] = s[u * G + g];
      }
    }
    // the online softmax of every query token that sees a key of this tile: scores become probabilities
    for (int64_t i = 0; i < Q; ++i)
      if (visible[i] > first[i]) SoftmaxTile(p, first[i], visible[i], H, &scores[i * H], &m[i * H], &l[i * H], &alpha[i * H]);
    // outputs, KV head by KV head: the tile's V rows widened once, then each token's G heads key by key
    for (int64_t h = 0; h < KVH; ++h) {
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < C; ++c) vs[t * C + c] = LoadLanes<T>(p.v, offsets[t] + h * D + kLanes * c);
      for (int64_t i = 0; i < Q; ++i) {
        if (visible[i] <= first[i]) continue;
        const int64_t base = i * H + h * G;
        VF a[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) a[g][c] = acc[(base + g) * C + c] * alpha[base + g];
        for (int t = first[i]; t < visible[i]; ++t)
          for (int g = 0; g < G; ++g) {
            const VF pt = Splat(scores[base + g][t]);
            for (int c = 0; c < C; ++c) a[g][c] += pt * vs[t * C + c];
          }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) acc[(base + g) * C + c] = a[g][c];
      }
    }
  }
  WriteOutputs(p, first_row, Q * H * C, acc.data(), l.data());
  return true;
}

// One work item of the vector path: query tokens chunk_start .. chunk_start + chunk_len - 1 of a
// row (decode: its one token), every KV head: the row's blocks are read whole (a block's K and V,
// every head, are one contiguous run of the pool), and each K or V row is loaded once for the
// G query heads that read it. head_dim D is a multiple of kLanes. Query token i sees the keys at positions <= its
// own and > its own - W. Tiles start at the first token's window (ItemFirstKey), so that a
// windowed row reads about W keys, none of the blocks before. Returns false on a block outside
// the pool.
//
// Per tile of keys and query token: the scores of every query head (KV head by KV head, the
// group's query vectors in registers, so that the loads are K's alone), then the online softmax
// of every query head together (independent chains the CPU overlaps), then the outputs KV head by
// KV head. The tile kPrefetchTiles ahead is prefetched into L2 (PrefetchL2), its K rows through
// the score loop and its V rows through the output loop, so that the requests spread over the
// whole tile's work (all of them in the score loop took 1.1x as long, float32 and bfloat16, at 64
// and 120 rows x 480 on an AMD EPYC); past the item's last tile, that is the first tiles of
// `next`, the item this thread runs next (if any), so that a row's first blocks do not wait on
// memory either.
template <PoolType T, int D, int G>
bool RunRowChunk(const Problem& p, const WorkItem& item, const WorkItem* next) {
  if (item.chunk_len > 1) return RunPromptChunk<T, D, G>(p, item);
  constexpr int C = D / kLanes;  // vectors per head's row
  constexpr int64_t elem = ElementBytes(T);
  const int64_t H = p.H, KVH = p.KVH, Q = item.chunk_len;
  const int32_t* table = p.tables + static_cast<int64_t>(item.row) * p.M;
  const int64_t first_row = p.q_start[item.row] + item.chunk_start;  // the chunk's first token in q
  const int64_t keys = ItemKeys(p, item);  // the chunk reads positions first_key .. keys - 1
  const int64_t first_key = ItemFirstKey(p, item);
  const int64_t first_pos = keys - Q;      // the chunk's first token's position
  const int64_t tiles = (keys - first_key + kTile - 1) / kTile;
  const int32_t* next_table = next ? p.tables + static_cast<int64_t>(next->row) * p.M : nullptr;
  const int64_t next_keys = next ? ItemKeys(p, *next) : 0;
  const int64_t next_first_key = next ? ItemFirstKey(p, *next) : 0;

  // per (query token, query head): scaled query, running max / sum, unnormalised output
  std::vector<VF> qv(Q * H * C), acc(Q * H * C, VF{});
  std::vector<float> m(Q * H, kNegInf), l(Q * H, 0.0f);
  const float* q_src = p.q + first_row * H * D;
  for (int64_t i = 0; i < Q * H * C; ++i) {
    std::memcpy(&qv[i], q_src + kLanes * i, sizeof(VF));
    qv[i] *= p.scale;
  }
  int64_t offsets[kTile];  // of each key's token (head 0) in the pool
  std::vector<VF> partial(H * kTile / 4);  // [query head][keys 4i .. 4i + 3]: SumLanes4Keys of their products
  std::vector<float> alpha(H);
  std::vector<VF> tile_scores(H);  // a query token's scores of the tile, then its probabilities
  for (int64_t tile = first_key; tile < keys; tile += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, keys - tile));
    if (TokenOffsets(p, table, tile, n, offsets) < n) return false;
    // the tokens kPrefetchTiles ahead (prefetched in the loops below): this item's, or next's
    int64_t ahead[kTile];
    int ahead_n = 0;
    const int64_t ahead_tile = (tile - first_key) / kTile + kPrefetchTiles;
    const bool in_next = ahead_tile >= tiles;
    const int32_t* ahead_table = in_next ? next_table : table;
    const int64_t ahead_start = in_next ? next_first_key + (ahead_tile - tiles) * kTile : first_key + ahead_tile * kTile;
    const int64_t ahead_end = ahead_table ? std::min(ahead_start + kTile, in_next ? next_keys : keys) : 0;
    if (ahead_end > ahead_start) {
      ahead_n = TokenOffsets(p, ahead_table, ahead_start, static_cast<int>(ahead_end - ahead_start), ahead);
      for (int t = 0; t < ahead_n; ++t) ahead[t] *= elem;  // in bytes
    }
    for (int64_t i = 0; i < Q; ++i) {
      const int visible = static_cast<int>(std::min<int64_t>(n, first_pos + i + 1 - tile));  // causal
      const int first = FirstVisible(p, first_pos + i, tile);  // the window (0 for the chunk's first token)
      if (visible <= first) continue;
      const VF* q = &qv[i * H * C];  // [H][C]
      // scores: KV head by KV head, with its G query heads' vectors held in registers; the K rows
      // of the tile kPrefetchTiles ahead are prefetched a token's head at a time, spread over the loop
      for (int64_t h = 0; h < KVH; ++h) {
        VF qh[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) qh[g][c] = q[(h * G + g) * C + c];
        for (int t0 = 0; t0 < kTile; t0 += 4) {
          VF s[G][4];
          for (int u = 0; u < 4; ++u) {
            const int t = t0 + u;
            if (i == 0 && t < ahead_n) PrefetchL2(p.k, ahead[t] + h * D * elem, D * elem);
            if (t < visible) {
              VF k[C];
              for (int c = 0; c < C; ++c) k[c] = LoadLanes<T>(p.k, offsets[t] + h * D + kLanes * c);
              for (int g = 0; g < G; ++g) {
                s[g][u] = VF{};  // + 0, not the first product: one product per add, fused as in TreeScores
                for (int c = 0; c < C; ++c) s[g][u] += qh[g][c] * k[c];
              }
            } else {
              for (int g = 0; g < G; ++g) s[g][u] = VF{};
            }
          }
          for (int g = 0; g < G; ++g) partial[(h * G + g) * (kTile / 4) + t0 / 4] = SumLanes4Keys(s[g]);
        }
      }
      // the online softmax of every query head: scores become probabilities
      for (int64_t j = 0; j < H; ++j) tile_scores[j] = SumLanesTile(&partial[j * (kTile / 4)]);
      SoftmaxTile(p, first, visible, H, tile_scores.data(), &m[i * H], &l[i * H], alpha.data());
      // outputs: KV head by KV head; the V rows of the tile ahead are prefetched as the K rows were
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t base = i * H + h * G;
        VF a[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) a[g][c] = acc[(base + g) * C + c] * alpha[h * G + g];
        for (int t = first; t < visible; ++t) {
          if (i == 0 && t < ahead_n) PrefetchL2(p.v, ahead[t] + h * D * elem, D * elem);
          VF v[C];
          for (int c = 0; c < C; ++c) v[c] = LoadLanes<T>(p.v, offsets[t] + h * D + kLanes * c);
          for (int g = 0; g < G; ++g) {
            const VF pt = Splat(tile_scores[h * G + g][t]);
            for (int c = 0; c < C; ++c) a[g][c] += pt * v[c];
          }
        }
        if (i == 0)  // the rest of the tile ahead's V rows (past a last tile's visible keys)
          for (int t = visible; t < ahead_n; ++t) PrefetchL2(p.v, ahead[t] + h * D * elem, D * elem);
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) acc[(base + g) * C + c] = a[g][c];
      }
    }
  }
  WriteOutputs(p, first_row, Q * H * C, acc.data(), l.data());
  return true;
}

// The vector path's kernel for this problem (head_dim 64 or 128, 1-8 query heads per KV head),
// or null where the generic path serves it.
using ChunkFn = bool (*)(const Problem&, const WorkItem&, const WorkItem* next);

template <PoolType T, int D>
ChunkFn ChunkKernelFor(int64_t G) {
  switch (G) {
    case 1: return RunRowChunk<T, D, 1>;
    case 2: return RunRowChunk<T, D, 2>;
    case 3: return RunRowChunk<T, D, 3>;
    case 4: return RunRowChunk<T, D, 4>;
    case 5: return RunRowChunk<T, D, 5>;
    case 6: return RunRowChunk<T, D, 6>;
    case 7: return RunRowChunk<T, D, 7>;
    case 8: return RunRowChunk<T, D, 8>;
  }
  return nullptr;
}

template <PoolType T>
ChunkFn ChunkKernelTyped(const Problem& p) {
  if (p.D == 64) return ChunkKernelFor<T, 64>(p.G);
  if (p.D == 128) return ChunkKernelFor<T, 128>(p.G);
  return nullptr;
}

ChunkFn ChunkKernel(const Problem& p) {
  switch (p.type) {
    case PoolType::kF32: return ChunkKernelTyped<PoolType::kF32>(p);
    case PoolType::kBF16Bits: return ChunkKernelTyped<PoolType::kBF16Bits>(p);
    case PoolType::kF16: return ChunkKernelTyped<PoolType::kF16>(p);
  }
  return nullptr;
}

// ---- the work list, shared by the calling thread and XLA's intra-op pool ----------------------

struct Work {
  Problem problem;
  std::vector<WorkItem> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> bad_block{false};
  std::mutex mu;
  std::condition_variable finished;

  // Claims and runs items until none are left, each claimed one item ahead so that the vector path
  // can prefetch the start of the next while it finishes the current. Threads that start late find
  // none and return: they never touch the buffers, which live only until the handler returns.
  void Drain() {
    std::vector<float> buffer;
    const ChunkFn vector_path = ChunkKernel(problem);
    const int64_t total = static_cast<int64_t>(items.size());
    for (int64_t i = next.fetch_add(1), j; i < total; i = j) {
      j = next.fetch_add(1);
      const WorkItem& item = items[i];
      const WorkItem* after = j < total ? &items[j] : nullptr;
      const bool ok = item.all_heads ? vector_path(problem, item, after) : RunItem(problem, item, buffer);
      if (!ok) bad_block = true;
      FinishItems(done, 1, total, mu, finished);
    }
  }
};

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pool,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> context,
                          ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len, float scale,
                          float softcap, ffi::ResultBuffer<ffi::F32> out) {
  auto q_dims = q.dimensions();
  auto pool_dims = kv_pool.dimensions();
  auto table_dims = tables.dimensions();
  if (q_dims.size() != 3 || pool_dims.size() != 6 || pool_dims[2] != 2 || table_dims.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q must be [N, H, D], the pool [L, NB, 2, BS, KVH, D], "
                                       "the block tables [B, M]");
  const int64_t N = q_dims[0], H = q_dims[1], D = q_dims[2];
  const int64_t L = pool_dims[0], NB = pool_dims[1], BS = pool_dims[3], KVH = pool_dims[4];
  const int64_t B = table_dims[0], M = table_dims[1];
  if (pool_dims[5] != D || KVH <= 0 || H % KVH != 0)
    return ffi::Error::InvalidArgument("paged attention: head_dim differs between q and the pools, or the "
                                       "query heads are not a multiple of the KV heads");
  const size_t rows = static_cast<size_t>(B);
  if (context.element_count() != rows || q_start.element_count() != rows || q_len.element_count() != rows)
    return ffi::Error::InvalidArgument("paged attention: context, q_start and q_len need one entry per row");
  PoolType type;
  switch (kv_pool.element_type()) {
    case ffi::DataType::F32: type = PoolType::kF32; break;
    case ffi::DataType::F16: type = PoolType::kF16; break;
    case ffi::DataType::U16: type = PoolType::kBF16Bits; break;  // jpaged stores bfloat16 pools as bits
    default:
      return ffi::Error::InvalidArgument("paged attention: pools must be float32, float16 or uint16 "
                                         "(bfloat16 bit patterns)");
  }
  const int32_t layer_id = *layer.typed_data();
  if (layer_id < 0 || layer_id >= L) return ffi::Error::InvalidArgument("paged attention: layer out of range");
  if (window.element_count() != 1 || *window.typed_data() < 1)
    return ffi::Error::InvalidArgument("paged attention: the window must be one int32 >= 1");
  const int64_t window_len = *window.typed_data();
  if (!(softcap >= 0.0f) || std::isinf(softcap))
    return ffi::Error::InvalidArgument("paged attention: softcap must be finite and >= 0 (0: none)");

  auto work = std::make_shared<Work>();
  const int64_t block_k_bytes = BS * KVH * D * ElementBytes(type);
  const char* base = static_cast<const char*>(kv_pool.untyped_data());
  work->problem = Problem{q.typed_data(), base, base + block_k_bytes, type, H, D, NB, BS,
                          KVH, H / KVH, M, layer_id * NB * 2 * BS * KVH * D, tables.typed_data(),
                          context.typed_data(), q_start.typed_data(), q_len.typed_data(), scale,
                          window_len, softcap, softcap > 0.0f ? 1.0f / softcap : 0.0f, out->typed_data()};
  const bool vector_path = ChunkKernel(work->problem) != nullptr;
  float* result = out->typed_data();
  std::fill(result, result + N * H * D, 0.0f);
  const int32_t* ctx = context.typed_data();
  const int32_t* qs = q_start.typed_data();
  const int32_t* ql = q_len.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    if (ql[b] <= 0 || ctx[b] <= 0) continue;  // a padding row
    if (ql[b] > ctx[b] || ctx[b] > M * BS || qs[b] < 0 || qs[b] + ql[b] > N)
      return ffi::Error::InvalidArgument("paged attention: row " + std::to_string(b) +
                                         " has tokens outside q, or a context longer than its block table");
    for (int32_t c = 0; c < ql[b]; c += kQueryChunk) {  // decode: one chunk of one token
      WorkItem item{static_cast<int32_t>(b), 0, c, std::min(kQueryChunk, ql[b] - c), 0};
      item.cost = (ItemKeys(work->problem, item) - ItemFirstKey(work->problem, item)) * item.chunk_len;
      if (vector_path) {
        item.all_heads = true;
        item.cost *= KVH;
        work->items.push_back(item);
      } else {
        for (item.kv_head = 0; item.kv_head < KVH; ++item.kv_head) work->items.push_back(item);
      }
    }
  }
  // longest first, so that the threads finish together
  std::stable_sort(work->items.begin(), work->items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  const int64_t total = static_cast<int64_t>(work->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  AwaitItems(work->done, total, work->mu, work->finished);
  if (work->bad_block)
    return ffi::Error::InvalidArgument("paged attention: a block table names a block outside the pool");
  return ffi::Error::Success();
}

// The cache write of JpagedPagedAttentionWrite: the new tokens' keys and values (k_new, v_new [N, KVH, D],
// in the pool's storage dtype) into their slots of layer `layer_id` of the pool at `base`: slot s is
// offset s % BS of block s / BS, as `xla_write_kv` scatters them; a slot outside the pool is skipped (XLA's
// scatter drops it too). One token's KVH * D keys are contiguous in the pool, and so are its values.
ffi::Error WriteKv(char* base, ffi::Span<const int64_t> pool_dims, ffi::DataType pool_type, int32_t layer_id,
                   ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slots) {
  const int64_t L = pool_dims[0], NB = pool_dims[1], BS = pool_dims[3], KVH = pool_dims[4], D = pool_dims[5];
  auto k_dims = k_new.dimensions();
  const int64_t N = slots.element_count();
  if (k_new.element_type() != pool_type || v_new.element_type() != pool_type)
    return ffi::Error::InvalidArgument("paged attention write: the new keys and values must be in the pool's dtype");
  if (k_dims.size() != 3 || k_dims[0] != N || k_dims[1] != KVH || k_dims[2] != D ||
      v_new.dimensions().size() != 3 || v_new.element_count() != k_new.element_count())
    return ffi::Error::InvalidArgument("paged attention write: the new keys and values must be [N, KVH, D] of the "
                                       "pool's KV heads and head_dim, one per slot");
  if (layer_id < 0 || layer_id >= L) return ffi::Error::InvalidArgument("paged attention: layer out of range");
  const int64_t token_bytes = KVH * D * ffi::ByteWidth(pool_type), block_bytes = BS * token_bytes;
  const char* k = static_cast<const char*>(k_new.untyped_data());
  const char* v = static_cast<const char*>(v_new.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < N; ++i) {
    if (slot[i] < 0 || slot[i] >= NB * BS) continue;
    char* keys = base + ((layer_id * NB + slot[i] / BS) * 2) * block_bytes + (slot[i] % BS) * token_bytes;
    std::memcpy(keys, k + i * token_bytes, token_bytes);
    std::memcpy(keys + block_bytes, v + i * token_bytes, token_bytes);
  }
  return ffi::Error::Success();
}

// JpagedPagedAttentionWrite: the cache write of the step's new tokens (WriteKv) and then PagedAttention, in
// one call (the pool operand aliased to the second result, updated in place): the write as XLA's scatters
// was several small operations per layer.
ffi::Error PagedAttentionWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pool,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                               ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> context,
                               ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len, ffi::AnyBuffer k_new,
                               ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slots, float scale, float softcap,
                               ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> kv_pool_out) {
  auto pool_dims = kv_pool.dimensions();
  if (pool_dims.size() != 6 || pool_dims[2] != 2 || kv_pool_out->element_type() != kv_pool.element_type() ||
      kv_pool_out->size_bytes() != kv_pool.size_bytes())
    return ffi::Error::InvalidArgument("paged attention write: the pool must be [L, NB, 2, BS, KVH, D], and the "
                                       "second result the same array");
  char* base = static_cast<char*>(kv_pool_out->untyped_data());
  if (base != kv_pool.untyped_data())  // XLA aliases them (input_output_aliases); else the result starts as a copy
    std::memcpy(base, kv_pool.untyped_data(), kv_pool.size_bytes());
  if (auto error = WriteKv(base, pool_dims, kv_pool.element_type(), *layer.typed_data(), k_new, v_new, slots);
      error.failure())
    return error;
  return PagedAttention(pool, q, *kv_pool_out, layer, window, tables, context, q_start, q_len, scale, softcap, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // kv_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // context
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_len
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedPagedAttentionWrite, PagedAttentionWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // kv_pool (aliased to the second result)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // context
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_len
                                  .Arg<ffi::AnyBuffer>()          // k_new
                                  .Arg<ffi::AnyBuffer>()          // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::AnyBuffer>());        // kv_pool, with the new tokens written

// Which instructions this library was built for ("avx512", "avx2" or "portable").
extern "C" const char* JpagedNativeVariant() { return JPAGED_VARIANT; }

// Whether this CPU runs the instructions of `variant`: called in the portable library only, before
// any other variant is loaded.
extern "C" int JpagedCpuCanRun(const char* variant) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (std::strcmp(variant, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  if (std::strcmp(variant, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(variant, "portable") == 0;
}
