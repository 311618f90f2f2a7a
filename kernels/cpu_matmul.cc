// Matrix products for the CPU with the weights read in place, called from XLA through its FFI (kernels/cpu.py
// builds and registers it).
//
// y_i[M, N_i] = x[M, K] @ W_i[layer]^T * scale_i[layer] for one to a few matrices W_i that share x (q, k and v;
// gate and up): W_i [L, N_i, K] (stacked layers, `layer` picks one: a scanned loop reads its layer's matrix where
// it lies instead of slicing a copy) or [N_i, K]; int8 with a float32 scale per output row (weight-only int8) or
// per group of 32 weights along a row (a GGUF Q8_0 file's), packed int4 with a (scale, low) pair per group of 32,
// or bfloat16 / float32 without. Activations and accumulation are float32; a weight is widened in registers.
//
// The few-row products of decode are bound by reading the weights: the work items are chunks of output rows of
// every matrix, each read once for all of x's rows (x stays in L1/L2), on XLA's intra-op threads.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;
using sgjax_cpu::ParallelFor;

namespace {

constexpr int64_t kRowsPerItem = 32;    // output rows per work item, at least
constexpr int64_t kItemsPerThread = 4;  // work items per thread, about
constexpr int kMR = 4;                // x rows per pass over a weight row

inline float Widen(float w) { return w; }
inline float Widen(int8_t w) { return static_cast<float>(w); }
inline float Widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One vector of float32 lanes: x's and a weight row's next lanes, widened.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec LoadX(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadW(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadW(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec LoadW(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
// The mask of the first `count` lanes (all past 16, none below 0).
inline __mmask16 Lanes(int64_t count) { return static_cast<__mmask16>((1u << std::clamp<int64_t>(count, 0, 16)) - 1); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec LoadX(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadW(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadW(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec LoadW(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float Sum(Vec v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
#else
constexpr int64_t kLanes = 1;
using Vec = float;
inline Vec Zero() { return 0.0f; }
inline Vec LoadX(const float* p) { return *p; }
template <typename W>
inline Vec LoadW(const W* p) { return Widen(*p); }
inline Vec Fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline float Sum(Vec v) { return v; }
#endif

// y[m, n] = sum_k x[m, k] * w[n, k] * scale[n] for MR rows of x and each row n in [n0, n1) of w (row stride k).
// A weight row is read kUnroll vectors at a time, each widened once and multiplied into every x row: independent
// accumulators per vector keep the FMAs' latency hidden (4 rows of 16 lanes at a time ran at a third of the speed
// of one row of 64 for a single x row).
constexpr int kUnroll = 4;

template <typename W, int MR>
void Rows(const float* x, const W* w, int64_t k, const float* scale, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t step = kUnroll * kLanes;
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * k;
    Vec acc[MR][kUnroll];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < kUnroll; ++u) acc[m][u] = Zero();
    int64_t i = 0;
    for (; i + step <= k; i += step) {
      Vec wv[kUnroll];
      for (int u = 0; u < kUnroll; ++u) wv[u] = LoadW(row + i + u * kLanes);
      for (int m = 0; m < MR; ++m)
        for (int u = 0; u < kUnroll; ++u) acc[m][u] = Fma(wv[u], LoadX(x + m * k + i + u * kLanes), acc[m][u]);
    }
    for (; i + kLanes <= k; i += kLanes) {
      const Vec wv = LoadW(row + i);
      for (int m = 0; m < MR; ++m) acc[m][0] = Fma(wv, LoadX(x + m * k + i), acc[m][0]);
    }
    for (int m = 0; m < MR; ++m) {
      Vec total = acc[m][0];
      for (int u = 1; u < kUnroll; ++u) total = Add(total, acc[m][u]);
      float out = Sum(total);
      for (int64_t t = i; t < k; ++t) out += x[m * k + t] * Widen(row[t]);
      y[m * ldy + n] = scale == nullptr ? out : out * scale[n];
    }
  }
}

// The dot-product instructions' paths, where the CPU has them and K is a multiple of 64: x is converted once per call,
// then a weight row is one load and one instruction per x row for each 64 bytes (the widening paths above spend
// 3-4 instructions per 16 weights: one stream's decode ran at a third of the memory's speed).
#if defined(__AVX512BF16__)
// bf16 matrices: x rounded to bf16, pairs multiplied exactly and summed in float32 (vdpbf16ps): the numerics of
// XLA's bf16 dot, which rounds x to bf16 too (model/llama.dot).
std::vector<uint16_t> RoundToBf16(const float* x, int64_t count) {
  std::vector<uint16_t> out(count);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  }
  for (; i < count; ++i) {
    __m128 v = _mm_set_ss(x[i]);
    out[i] = static_cast<uint16_t>(_mm_cvtsi128_si32(reinterpret_cast<__m128i>(_mm_cvtneps_pbh(v))));
  }
  return out;
}

template <int MR>
void Bf16Rows(const uint16_t* xb, const uint16_t* w, int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * k;
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 64) {
      const __m512i w0 = _mm512_loadu_si512(row + i), w1 = _mm512_loadu_si512(row + i + 32);
      for (int m = 0; m < MR; ++m) {
        const uint16_t* xr = xb + m * k + i;
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr)),
                                     reinterpret_cast<__m512bh>(w0));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + 32)),
                                     reinterpret_cast<__m512bh>(w1));
      }
    }
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bf16 matrices on the CPU's matrix unit (AMX): the vector loop above does one vdpbf16ps per 64 weight bytes per x
// row, so past ~4 rows it is bound by the instructions, not the memory; a tile product takes 16 x rows for the same
// 1 KB of weights. Computed transposed, y^T = W x^T, so the weights are tdpbf16ps's A operand read in place (16
// matrix rows of 32 k each, strided), and x (rounded to bf16, as above) is packed once per call as its B operand.
// The same numerics as vdpbf16ps: bf16 pairs multiplied exactly, summed in float32.
std::atomic<bool> amx_wanted{true};  // SgjaxUseAmx: the tests run the vector loop on a CPU with AMX too

bool AmxPermitted() {
  // Linux hands out the tile registers' state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM).
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

bool AmxReady() { return AmxPermitted() && amx_wanted.load(std::memory_order_relaxed); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x's rows m0.. (16 at most, the rest zero) as B operands, per block of 32 k: [K / 32][16 k pairs][16 rows] pairs.
// A transpose of pairs: each (block, pair) gathers the 16 rows' pair (a scalar copy was ~4% of a prefill).
std::vector<uint32_t> PackTileX(const uint16_t* xb, int64_t rows, int64_t k) {
  std::vector<uint32_t> out((k / 32) * 256);
  const auto* pairs = reinterpret_cast<const int*>(xb);  // row m's pair j at m * k / 2 + j
  const __mmask16 live = Lanes(rows);
  const __m512i row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(k / 2)));
  for (int64_t b = 0; b < k / 32; ++b) {
    for (int64_t p = 0; p < 16; ++p) {
      _mm512_storeu_si512(out.data() + b * 256 + p * 16,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row, pairs + b * 16 + p, 4));
    }
  }
  return out;
}

using TileA = std::pair<const void*, int64_t>;

// One pass of tile products: NT (1-2) tiles of 16 output rows (their A operands per k block in ops[2 b + t])
// against MC (1-2) chunks of 16 x rows from chunk `chunk`, over every k block; C tile t + 2 m goes to c + 256 (t + 2
// m). A 2 x 2 block loads four operands for four products, where four A tiles against one chunk loaded five.
template <int NT, int MC>
void TilePass(const std::vector<std::vector<uint32_t>>& xt, size_t chunk, const TileA* ops, int64_t blocks, float* c) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MC == 2) _tile_zero(2);
  if constexpr (NT == 2 && MC == 2) _tile_zero(3);
  const uint32_t* x0 = xt[chunk].data();
  const uint32_t* x1 = MC == 2 ? xt[chunk + 1].data() : nullptr;
  for (int64_t b = 0; b < blocks; ++b) {
    const TileA* o = ops + b * 2;
    _tile_loadd(4, o[0].first, o[0].second);
    if constexpr (NT == 2) _tile_loadd(5, o[1].first, o[1].second);
    _tile_loadd(6, x0 + b * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 5, 6);
    if constexpr (MC == 2) {
      _tile_loadd(7, x1 + b * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NT == 2) _tile_stored(1, c + 256, 64);
  if constexpr (MC == 2) _tile_stored(2, c + 512, 64);
  if constexpr (NT == 2 && MC == 2) _tile_stored(3, c + 768, 64);
}

// The tile products of output rows [n0, n1) for all `rows` x rows (xt: their chunks of 16 as B operands), each
// output row times row_scale (or not: null). a(n, buf, ops) sets ops[2 b] to the A operand of rows [n, n + 16)
// and k block b, for every b, as (pointer, stride in bytes): the weights where they lie (bf16: n1 - n0 a multiple
// of 16), or widened into buf, [block][16 x 32] bf16, rows from n1 on zero (int8, int4: any n1). Each 32 rows' operands are taken once, then used for
// every chunk of x while they are in L1 / L2 (a prefill's hundreds of rows), two chunks a pass.
template <typename A>
void Tiles(const std::vector<std::vector<uint32_t>>& xt, int64_t rows, int64_t k, float* y, int64_t ldy, int64_t n0,
           int64_t n1, const float* row_scale, A a) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  const int64_t blocks = k / 32;
  thread_local std::vector<uint16_t> wide;  // widened operands: [2 tiles][block][16 x 32]
  thread_local std::vector<TileA> ops;      // [block][2 tiles]
  if (static_cast<int64_t>(wide.size()) < blocks * 2 * 512) wide.resize(blocks * 2 * 512);
  if (static_cast<int64_t>(ops.size()) < blocks * 2) ops.resize(blocks * 2);
  alignas(64) float c[4 * 256];
  // tile[i][m] is y[m0 + m][n + i]: each x row's 16 gathered (a scalar copy was ~10% of a prefill)
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  auto scatter = [&](const float* tile, int64_t m0, int64_t n) {
    const __mmask16 live = Lanes(n1 - n);
    const int64_t count_m = std::min<int64_t>(16, rows - m0);
    const __m512 scale = row_scale ? _mm512_maskz_loadu_ps(live, row_scale + n) : _mm512_set1_ps(1.0f);
    for (int64_t m = 0; m < count_m; ++m) {
      const __m512 v = _mm512_i32gather_ps(column, tile + m, 4);
      _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n, live, row_scale ? _mm512_mul_ps(v, scale) : v);
    }
  };
  const size_t chunks = xt.size();
  for (int64_t n = n0; n < n1;) {
    const int tiles = n + 32 <= n1 ? 2 : 1;
    for (int t = 0; t < tiles; ++t) a(n + 16 * t, wide.data() + t * blocks * 512, ops.data() + t);
    for (size_t chunk = 0; chunk < chunks;) {
      const int pair = chunk + 1 < chunks ? 2 : 1;
      if (tiles == 2 && pair == 2) TilePass<2, 2>(xt, chunk, ops.data(), blocks, c);
      else if (tiles == 2) TilePass<2, 1>(xt, chunk, ops.data(), blocks, c);
      else if (pair == 2) TilePass<1, 2>(xt, chunk, ops.data(), blocks, c);
      else TilePass<1, 1>(xt, chunk, ops.data(), blocks, c);
      for (int m = 0; m < pair; ++m) {
        for (int t = 0; t < tiles; ++t) scatter(c + 256 * (t + 2 * m), 16 * static_cast<int64_t>(chunk + m), n + 16 * t);
      }
      chunk += pair;
    }
    n += 16 * tiles;
  }
  _tile_release();  // the thread's context switches need not save the tiles
}


// The A operands of rows [n, n + 16) (those from `end` on zero) for every k block b (a group of 32), widened to
// bf16 into buf ([block][16 x 32]) and pointed to by ops[2 b]. A row at a time, along it: block by block across
// the 16 rows, each load of a row's scales missed the cache (~40% of a 16-row step's widening).
void PointOps(int64_t blocks, int live, uint16_t* buf, TileA* ops) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (live < 16) std::memset(buf + b * 512 + live * 32, 0, (16 - live) * 64);
    ops[2 * b] = {buf + b * 512, 64};
  }
}

// int8: exact where the scale is per row (int8 values are bf16 values; the tiles' results are scaled), each times
// its group's scale and rounded where there is one per group (`groups`: [N, K / 32], else null).
void WidenInt8(const int8_t* w, const float* groups, int64_t k, int64_t end, int64_t n, uint16_t* buf, TileA* ops) {
  const int64_t blocks = k / 32;
  const int live = static_cast<int>(std::min<int64_t>(16, end - n));
  PointOps(blocks, live, buf, ops);
  for (int r = 0; r < live; ++r) {
    const int8_t* row = w + (n + r) * k;
    const float* scale = groups == nullptr ? nullptr : groups + (n + r) * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* src = row + b * 32;
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
      __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
      if (scale != nullptr) {
        const __m512 s = _mm512_set1_ps(scale[b]);
        lo = _mm512_mul_ps(lo, s);
        hi = _mm512_mul_ps(hi, s);
      }
      _mm512_storeu_si512(buf + b * 512 + r * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

// Packed int4 (model/quant.Int4Matrix: runs of 64, weight j of a run in byte j's low nibble, j + 32 in its high
// one; a (scale, low) pair per group of 32): a run's two groups from one load.
void WidenInt4(const uint8_t* w, const float* pairs, int64_t k, int64_t end, int64_t n, uint16_t* buf, TileA* ops) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int64_t blocks = k / 32;
  const int live = static_cast<int>(std::min<int64_t>(16, end - n));
  PointOps(blocks, live, buf, ops);
  for (int r = 0; r < live; ++r) {
    const uint8_t* row = w + (n + r) * (k / 2);
    const float* p = pairs + (n + r) * blocks * 2;
    for (int64_t run = 0; run < k / 64; ++run) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + run * 32));
      for (int half = 0; half < 2; ++half) {
        const int64_t b = 2 * run + half;
        const __m256i u = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, nibble);
        const __m512 scale = _mm512_set1_ps(p[2 * b]), low = _mm512_set1_ps(p[2 * b + 1]);
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u)));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1)));
        _mm512_storeu_si512(buf + b * 512 + r * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                                      _mm512_fmadd_ps(q1, scale, low), _mm512_fmadd_ps(q0, scale, low))));
      }
    }
  }
}
#endif

#if defined(__AVX512VNNI__)
// int8 matrices: x quantized to int8 per block of 64 (its largest magnitude / 127, as llama.cpp's Q8 blocks of
// 32 quantize activations), each block's integer dot product exact (vpdpbusd, the weights offset to unsigned by
// 128 and the offset's share taken off once per x row), scaled and summed in float32.
struct QuantizedX {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, K / 64]
  std::vector<float> offset; // [M]: 128 * sum over blocks of scale * sum(q)
  std::vector<float> group_sums;  // [M, K / 32]: each group of 32's sum, scale * sum(q) (int4 weights' low)
};

QuantizedX QuantizeBlocks(const float* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / 64;
  QuantizedX out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks), std::vector<float>(rows),
                 std::vector<float>(rows * k / 32)};
  for (int64_t m = 0; m < rows; ++m) {
    float offset = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + m * k + b * 64;
      __m512 peak = _mm512_setzero_ps();
      for (int u = 0; u < 4; ++u) peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(v + 16 * u)));
      const float scale = _mm512_reduce_max_ps(peak) / 127.0f;
      const __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
      int32_t sum = 0;
      for (int u = 0; u < 4; ++u) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * u), inv));  // round to nearest
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + m * k + b * 64 + 16 * u), _mm512_cvtsepi32_epi8(q));
        sum += _mm512_reduce_add_epi32(q);
      }
      out.scale[m * blocks + b] = scale;
      offset += 128.0f * scale * static_cast<float>(sum);
      for (int g = 0; g < 2; ++g) {
        int32_t group = 0;
        for (int i = 0; i < 32; ++i) group += out.q[m * k + b * 64 + 32 * g + i];
        out.group_sums[m * (k / 32) + 2 * b + g] = scale * static_cast<float>(group);
      }
    }
    out.offset[m] = offset;
  }
  return out;
}

template <int MR>
void Int8Rows(const QuantizedX& xq, int64_t m0, const int8_t* w, int64_t k, const float* wscale, float* y,
              int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t blocks = k / 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xr = xq.q.data() + m0 * k;
  const float* xs = xq.scale.data() + m0 * blocks;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * k;
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(row + b * 64), flip);  // w + 128, unsigned
      for (int m = 0; m < MR; ++m) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, _mm512_loadu_si512(xr + m * k + b * 64));
        acc[m][b & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xs[m * blocks + b]), acc[m][b & 1]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const float dot = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - xq.offset[m0 + m];
      y[m * ldy + n] = dot * wscale[n];
    }
  }
}

// Matrices whose weights are, per group of 32 along a row, low + scale * u with u an unsigned byte: int4
// (model/quant.Int4Matrix: a run of 32 bytes holds 64 steps u, low nibbles the first 32, high the next, widened to
// bytes in order) and int8 with a scale per group (Q8_0's: u = q + 128, low = -128 * scale).
// block(n, b) gives row n's 64 weights from 64 b as u and its two groups' scales; vpdpbusd's lanes 0-7 and 8-15
// sum the two groups, which take their scales. lows(n, g) gives row n's lows of groups g to g + 15 (zero past the
// row), each times x's group sum into the accumulators once per row (a scalar sum per group cost a 4-row pass
// ~15%).
struct GroupBlock {
  __m512i u;
  float s[2];
};

template <int MR, typename Block, typename Lows>
void GroupRows(const QuantizedX& xq, int64_t m0, int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1,
               Block block, Lows lows) {
  const int64_t blocks = k / 64, groups = k / 32;
  const int8_t* xr = xq.q.data() + m0 * k;
  const float* xs = xq.scale.data() + m0 * blocks;
  const float* sums = xq.group_sums.data() + m0 * groups;
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const GroupBlock g = block(n, b);
      const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(g.s[0]), _mm256_set1_ps(g.s[1]), 1);
      for (int m = 0; m < MR; ++m) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g.u, _mm512_loadu_si512(xr + m * k + b * 64));
        acc[m][b & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_set1_ps(xs[m * blocks + b])),
                                        acc[m][b & 1]);
      }
    }
    for (int64_t g = 0; g < groups; g += 16) {
      const __m512 low = lows(n, g);
      const __mmask16 live = Lanes(groups - g);
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = _mm512_fmadd_ps(low, _mm512_maskz_loadu_ps(live, sums + m * groups + g), acc[m][0]);
      }
    }
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
  }
}

inline GroupBlock Int4Block(const uint8_t* w, const float* params, int64_t k, int64_t n, int64_t b) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * k / 2 + b * 32));
  const float* p = params + (n * (k / 32) + 2 * b) * 2;  // (scale, low) per group
  return {_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, nibble)),
                             _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), 1),
          {p[0], p[2]}};
}


// Row n's lows of groups g to g + 15: every second float of its (scale, low) pairs.
inline __m512 Int4Lows(const float* params, int64_t k, int64_t n, int64_t g) {
  const int64_t live = std::min<int64_t>(16, k / 32 - g);
  const float* p = params + (n * (k / 32) + g) * 2;
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(Lanes(2 * live), p), odd,
                                _mm512_maskz_loadu_ps(Lanes(2 * live - 16), p + 16));
}

inline GroupBlock Int8Block(const int8_t* w, const float* scale, int64_t k, int64_t n, int64_t b) {
  const float* s = scale + n * (k / 32) + 2 * b;
  return {_mm512_xor_si512(_mm512_loadu_si512(w + n * k + b * 64), _mm512_set1_epi8(static_cast<char>(0x80))),
          {s[0], s[1]}};
}

// Row n's lows of groups g to g + 15: -128 times their scales.
inline __m512 Int8Lows(const float* scale, int64_t k, int64_t n, int64_t g) {
  return _mm512_mul_ps(_mm512_set1_ps(-128.0f), _mm512_maskz_loadu_ps(Lanes(k / 32 - g), scale + n * (k / 32) + g));
}

#endif

// int4, and int8 with group scales, elsewhere: a row widened to float32 (value(n, i): weight i of row n, scaled),
// then the widening loop's float32 path over it.
template <int MR, typename Value>
void WidenedRows(const float* x, int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1, Value value) {
  std::vector<float> row(k);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t i = 0; i < k; ++i) row[i] = value(n, i);
    Rows<float, MR>(x, row.data(), k, nullptr, y + n, ldy, 0, 1);
  }
}

inline float Int4Value(const uint8_t* w, const float* params, int64_t k, int64_t n, int64_t i) {
  const int64_t run = i / 64, j = i % 64;
  const uint8_t byte = w[n * k / 2 + run * 32 + j % 32];
  const float* p = params + (n * (k / 32) + i / 32) * 2;  // (scale, low)
  return p[1] + p[0] * static_cast<float>(j < 32 ? byte & 0x0F : byte >> 4);
}

// fn(mr, m) over x's rows in passes of kMR rows and one of the rest; mr() is the pass's row count, a constant.
template <typename Fn>
void ForRows(int64_t rows, Fn fn) {
  int64_t m = 0;
  for (; m + kMR <= rows; m += kMR) fn(std::integral_constant<int, kMR>(), m);
  switch (rows - m) {
    case 3: fn(std::integral_constant<int, 3>(), m); break;
    case 2: fn(std::integral_constant<int, 2>(), m); break;
    case 1: fn(std::integral_constant<int, 1>(), m); break;
    default: break;
  }
}

struct Matrix {
  const void* w;       // this layer's [N, K]
  const float* scale;  // this layer's [N] (int8), [N, K / 32] (int8 grouped), [N, K / 32, 2] (int4), or null
  ffi::DataType type;
  float* y;            // [M, N]
  int64_t n;
  bool grouped;        // int8 with a scale per group of 32
};

ffi::Error Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                  ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("matmul: x must be [M, K]");
  const int64_t rows = xd[0], k = xd[1];
  // Each result's weights: one (weights, scale) pair, or `group` pairs (its layers as separate [N, K] buffers,
  // `layer` picks one: a scan over a model's per-layer matrices reads them where they are, no stacked copy).
  const size_t group = rets.size() == 0 ? 0 : args.size() / (2 * rets.size());
  if (rets.size() == 0 || group == 0 || args.size() != 2 * group * rets.size()) {
    return ffi::Error::InvalidArgument("matmul: the same number of (weights, scale) pairs of arguments per result");
  }
  const int64_t picked = layer.typed_data()[0];
  std::vector<Matrix> mats;
  int64_t bytes = 0;  // the weights the call reads
  for (size_t i = 0; i < rets.size(); ++i) {
    const size_t pair = i * group + static_cast<size_t>(std::clamp<int64_t>(picked, 0, group - 1));
    auto w = args.get<ffi::AnyBuffer>(2 * pair);
    auto s = args.get<ffi::AnyBuffer>(2 * pair + 1);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !s.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("matmul: buffers");
    auto wd = w->dimensions();
    const ffi::DataType type = w->element_type();
    const bool int4 = type == ffi::DataType::U8;  // two weights a byte
    if ((wd.size() != 2 && (wd.size() != 3 || group > 1)) || wd.back() * (int4 ? 2 : 1) != k ||
        (int4 && k % 64 != 0)) {
      return ffi::Error::InvalidArgument(
          "matmul: weights must be [L, N, K] or [N, K] (a group of layers: [N, K] each) with x's K "
          "(int4: [.., K / 2])");
    }
    const int64_t n = wd[wd.size() - 2];
    const int64_t depth = wd.size() == 3 ? wd[0] : 1;
    const int64_t l = std::clamp<int64_t>(picked, 0, depth - 1);
    int64_t width;  // bytes per row
    switch (type) {
      case ffi::DataType::F32: width = 4 * k; break;
      case ffi::DataType::BF16: width = 2 * k; break;
      case ffi::DataType::S8: width = k; break;
      case ffi::DataType::U8: width = k / 2; break;
      default: return ffi::Error::InvalidArgument("matmul: weights must be float32, bfloat16, int8 or packed int4");
    }
    bytes += n * width;
    const int64_t count = static_cast<int64_t>(s->element_count());
    // int8 with a scale per group of 32 (k = 32: the same as one per row)
    const bool grouped = type == ffi::DataType::S8 && k % 32 == 0 && k > 32 && count == depth * n * (k / 32);
    const int64_t per_row = int4 ? k / 16 : grouped ? k / 32 : 1;  // scales (int4: a (scale, low) pair per group)
    const bool scaled = count == depth * n * per_row && s->element_type() == ffi::DataType::F32;
    if (type == ffi::DataType::S8 && !scaled) {
      return ffi::Error::InvalidArgument(
          "matmul: int8 weights need a float32 scale per row [L, N] / [N] or per 32 [L, N, K / 32] / [N, K / 32]");
    }
    if (int4 && !scaled) {
      return ffi::Error::InvalidArgument(
          "matmul: int4 weights need float32 (scale, low) pairs [L, N, K / 32, 2] or [N, K / 32, 2]");
    }
    if (static_cast<int64_t>((*y)->element_count()) != rows * n || (*y)->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("matmul: result must be float32 [M, N]");
    }
    mats.push_back({static_cast<const char*>(w->untyped_data()) + l * n * width,
                    scaled ? reinterpret_cast<const float*>(s->untyped_data()) + l * n * per_row : nullptr, type,
                    reinterpret_cast<float*>((*y)->untyped_data()), n, grouped});
  }
  // Items of whole output rows, about kItemsPerThread per thread over all the matrices (long runs of a weight
  // matrix stream best), at least kRowsPerItem rows.
  int64_t total_rows = 0;
  for (const Matrix& mat : mats) total_rows += mat.n;
  const int64_t per_item =  // a multiple of 16 (the tile products' rows)
      (std::max<int64_t>(kRowsPerItem, total_rows / (kItemsPerThread * sgjax_cpu::Threads()) + 1) + 15) / 16 * 16;
  std::vector<std::pair<int64_t, int64_t>> work;  // (matrix, first output row)
  for (int64_t i = 0; i < static_cast<int64_t>(mats.size()); ++i) {
    for (int64_t n = 0; n < mats[i].n; n += per_item) work.emplace_back(i, n);
  }
  const float* xp = x.typed_data();
  [[maybe_unused]] const bool blocks64 = k % 64 == 0;
  [[maybe_unused]] auto has = [&](ffi::DataType t) {
    return std::any_of(mats.begin(), mats.end(), [t](const Matrix& mat) { return mat.type == t; });
  };
  [[maybe_unused]] const bool integer = has(ffi::DataType::S8) || has(ffi::DataType::U8);
  [[maybe_unused]] bool amx = false;  // read once: the tests switch it between calls
  // int8 / int4 matrices past one vector pass's rows run on AMX tiles, where there are (below, vpdpbusd reads the
  // narrow weights at the memory's speed; above, it is bound by the instructions): all their rows, so x is rounded
  // to bf16 for them and not quantized
  [[maybe_unused]] bool int_tiles = false;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  amx = AmxReady();
  int_tiles = blocks64 && integer && rows > kMR && amx;
#endif
#if defined(__AVX512BF16__)
  const std::vector<uint16_t> xb =
      blocks64 && (has(ffi::DataType::BF16) || int_tiles) ? RoundToBf16(xp, rows * k) : std::vector<uint16_t>();
#endif
#if defined(__AVX512VNNI__)
  const QuantizedX xq = blocks64 && integer && !int_tiles ? QuantizeBlocks(xp, rows, k) : QuantizedX();
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  // x's rows in chunks of 16 as tile operands (bf16 matrices; int8 / int4 ones as above)
  std::vector<std::vector<uint32_t>> xt;
  if (blocks64 && (has(ffi::DataType::BF16) || int_tiles) && amx) {
    for (int64_t m = 0; m < rows; m += 16) xt.push_back(PackTileX(xb.data() + m * k, std::min<int64_t>(16, rows - m), k));
  }
  // the tile products of mat's rows [n0, end) for all of x; returns end
  auto tiles = [&](const Matrix& mat, int64_t n0, int64_t end, const float* row_scale, auto a) {
    Tiles(xt, rows, k, mat.y, mat.n, n0, end, row_scale, a);
    return end;
  };
#endif
  auto fn = [&](int64_t item) {
    const Matrix& mat = mats[work[item].first];
    const int64_t n0 = work[item].second, n1 = std::min(n0 + per_item, mat.n);
#if defined(__AVX512BF16__)
    if (blocks64 && mat.type == ffi::DataType::BF16) {
      const auto* w = static_cast<const uint16_t*>(mat.w);
      int64_t rest = n0;  // the output rows the vector loop computes
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
      if (!xt.empty()) {
        rest = tiles(mat, n0, n0 + (n1 - n0) / 16 * 16, nullptr, [&](int64_t n, uint16_t*, TileA* ops) {
          for (int64_t b = 0; b < k / 32; ++b) ops[2 * b] = TileA{w + n * k + b * 32, 2 * k};
        });  // the last rows of a matrix that are not 16 on the vector loop (the same numerics)
      }
#endif
      ForRows(rows, [&](auto mr, int64_t m) {
        Bf16Rows<mr()>(xb.data() + m * k, w, k, mat.y + m * mat.n, mat.n, rest, n1);
      });
      return;
    }
#endif
#if defined(__AVX512VNNI__)
    if (blocks64 && mat.type == ffi::DataType::S8) {
      const auto* w = static_cast<const int8_t*>(mat.w);
      int64_t rest = n0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
      if (int_tiles) {
        const float* groups = mat.grouped ? mat.scale : nullptr;
        rest = tiles(mat, n0, n1, mat.grouped ? nullptr : mat.scale, [&](int64_t n, uint16_t* buf, TileA* ops) {
          WidenInt8(w, groups, k, n1, n, buf, ops);
        });
      }
#endif
      ForRows(rows, [&](auto mr, int64_t m) {
        if (mat.grouped) {
          GroupRows<mr()>(xq, m, k, mat.y + m * mat.n, mat.n, rest, n1,
                          [&](int64_t n, int64_t b) { return Int8Block(w, mat.scale, k, n, b); },
                          [&](int64_t n, int64_t g) { return Int8Lows(mat.scale, k, n, g); });
        } else {
          Int8Rows<mr()>(xq, m, w, k, mat.scale, mat.y + m * mat.n, mat.n, rest, n1);
        }
      });
      return;
    }
    if (mat.type == ffi::DataType::U8) {
      const auto* w = static_cast<const uint8_t*>(mat.w);
      int64_t rest = n0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
      if (int_tiles) {
        rest = tiles(mat, n0, n1, nullptr, [&](int64_t n, uint16_t* buf, TileA* ops) {
          WidenInt4(w, mat.scale, k, n1, n, buf, ops);
        });
      }
#endif
      ForRows(rows, [&](auto mr, int64_t m) {
        GroupRows<mr()>(xq, m, k, mat.y + m * mat.n, mat.n, rest, n1,
                        [&](int64_t n, int64_t b) { return Int4Block(w, mat.scale, k, n, b); },
                        [&](int64_t n, int64_t g) { return Int4Lows(mat.scale, k, n, g); });
      });
      return;
    }
#endif
    if (mat.type == ffi::DataType::U8 || mat.grouped) {
      ForRows(rows, [&](auto mr, int64_t m) {
        WidenedRows<mr()>(xp + m * k, k, mat.y + m * mat.n, mat.n, n0, n1, [&](int64_t n, int64_t i) {
          if (mat.grouped) return static_cast<float>(static_cast<const int8_t*>(mat.w)[n * k + i]) *
                                  mat.scale[n * (k / 32) + i / 32];
          return Int4Value(static_cast<const uint8_t*>(mat.w), mat.scale, k, n, i);
        });
      });
      return;
    }
    auto widening = [&](const auto* w) {
      ForRows(rows, [&](auto mr, int64_t m) {
        Rows<std::remove_const_t<std::remove_pointer_t<decltype(w)>>, mr()>(xp + m * k, w, k, mat.scale,
                                                                            mat.y + m * mat.n, mat.n, n0, n1);
      });
    };
    switch (mat.type) {
      case ffi::DataType::S8: widening(static_cast<const int8_t*>(mat.w)); break;
      case ffi::DataType::BF16: widening(static_cast<const uint16_t*>(mat.w)); break;
      default: widening(static_cast<const float*>(mat.w)); break;
    }
  };
  ParallelFor(static_cast<int64_t>(work.size()), bytes, fn);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SgjaxMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .RemainingArgs()               // (weights, scale) per matrix
                                  .RemainingRets());             // y per matrix

// ctypes (kernels/cpu.py): whether bf16 products may use the matrix unit (1) or not (0), or only the setting
// (-1); returns the setting before (1 or 0), or -1 where this build or the OS has no AMX.
extern "C" int SgjaxUseAmx(int wanted) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if (!AmxPermitted()) return -1;
  return wanted < 0 ? static_cast<int>(amx_wanted.load()) : static_cast<int>(amx_wanted.exchange(wanted != 0));
#else
  (void)wanted;
  return -1;
#endif
}
