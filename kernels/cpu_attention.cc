// Paged attention for the CPU, called from XLA through its FFI (kernels/cpu.py builds and registers it).
//
// Each query row attends to keys [first, seen) of its request's pages in the pool, with an online softmax, one
// page at a time: no gathered copy of the context and no work past a row's last key (or before its window). Rows
// go in blocks of up to kBlockRows consecutive rows of one request (a prefill chunk's rows, or one decode row);
// a block reads each of its pages once, transposed into a [head_dim][page_size] tile so that the scores of a
// page are one vector per query head. Work items are (block, kv head) pairs, shared with the helper threads of
// cpu_parallel.h.
//
// Layouts (kernels/kv_pool.py): pool [L, N, page_size, 2 * Hkv, D] with K of head h at 2h and V at 2h + 1;
// q and out [T, Hq, D] float32, query head h * G + g reads KV head h (G = Hq / Hkv). The pool holds float32,
// bfloat16, or fp8 (e4m3fn, e5m2) values; narrow ones are widened to float32 as a page is read.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;
using sgjax_cpu::ParallelFor;

namespace {

constexpr int64_t kBlockRows = 16;

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// An fp8 pool's value (kernels/kv_pool.py: --kv-cache-dtype fp8_e4m3 / fp8_e5m2): one byte of sign, kExp exponent
// and kMan mantissa bits, exponent bias 2^(kExp-1) - 1. A type of its own per format so that the templates pick its
// decoding table and encoder. e4m3fn (jnp.float8_e4m3fn) has no infinities and one NaN code a sign (0x7f), its
// largest value 448 (0x7e); e5m2 (jnp.float8_e5m2) is IEEE-like: 0x7c is inf, 0x7d-0x7f NaN, 57344 (0x7b) largest.
template <int E, int M>
struct Fp8 {
  uint8_t bits;
  static constexpr int kExp = E, kMan = M;
  static constexpr int kBias = (1 << (kExp - 1)) - 1;
  static constexpr bool kIeee = kExp == 5;  // e5m2 keeps inf and NaNs at the top exponent; e4m3fn only S.1111.111
  static constexpr uint8_t kMaxCode = kIeee ? 0x7b : 0x7e;
  // The NaN the jax writer leaves in the pool on a CPU: e4m3fn's one NaN code, the value's sign kept; for e5m2
  // 0x7f whatever the sign (XLA's scatter goes through float16, whose convert back gives 0x7f for any NaN; a bare
  // float32 convert gives +-0x7e). Every reader takes either for NaN.
  static constexpr uint8_t kNanCode = 0x7f;
  static constexpr bool kNanSigned = !kIeee;
};
using E4m3 = Fp8<4, 3>;
using E5m2 = Fp8<5, 2>;
static_assert(sizeof(E4m3) == 1 && sizeof(E5m2) == 1, "a pool value is one byte");

// The value of each of the 256 codes: a table read is cheaper than decoding the fields per value, and one table
// holds every special case (subnormals, -0, e5m2's infinities, the NaNs). The scalar paths read it; AVX-512's
// Load16 decodes 16 codes with float16 conversions (tests/kernels/test_cpu_attention.py holds both to every code).
template <typename F>
std::vector<float> Fp8Values() {
  std::vector<float> out(256);
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> F::kMan) & ((1 << F::kExp) - 1), m = c & ((1 << F::kMan) - 1);
    const float sign = (c & 0x80) ? -1.0f : 1.0f;
    float magnitude;
    if (F::kIeee ? e == (1 << F::kExp) - 1 : (c & 0x7f) == 0x7f) {
      magnitude = (F::kIeee && m == 0) ? INFINITY : NAN;
    } else if (e == 0) {  // subnormal: m / 2^kMan of the smallest normal exponent
      magnitude = std::ldexp(static_cast<float>(m), 1 - F::kBias - F::kMan);
    } else {
      magnitude = std::ldexp(1.0f + std::ldexp(static_cast<float>(m), -F::kMan), e - F::kBias);
    }
    out[c] = sign * magnitude;
  }
  return out;
}
// Built when the library loads (no guard in the kernels' loops).
template <typename F>
const std::vector<float> kFp8Table = Fp8Values<F>();

template <int E, int M>
inline float ToFloat(Fp8<E, M> x) {
  return kFp8Table<Fp8<E, M>>[x.bits];
}

struct Problem {
  const float* q;
  float* out;
  const int32_t* table;  // [R, P]
  const int32_t* row_req;
  const int32_t* row_first;
  const int32_t* row_seen;
  int64_t layer, num_pages, page_size, num_kv_heads, group, head_dim, pages_per_req, num_reqs;
  float sm_scale, softcap;
};

// exp(x[i] - shift) in place, for x[i] <= shift (scores less their maximum); -inf (a masked key) gives 0.
// Vectorized: Cephes' single-precision polynomial after a Cody-Waite reduction (about 1 ulp); std::exp is a scalar
// call, a fifth of a decode step's kernel time before.
#if defined(__AVX512F__)
inline __m512 ExpVec(__m512 v) {
  const __m512 c = _mm512_max_ps(v, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), c);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), out);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 ExpVec(__m256 v) {
  const __m256 c = _mm256_max_ps(v, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), c);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_and_ps(out, _mm256_cmp_ps(v, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}
#endif

inline void ExpShifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(x + i, ExpVec(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(shift))));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), _mm512_set1_ps(shift));
    _mm512_mask_storeu_ps(x + i, tail, ExpVec(v));
    i = n;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(x + i, ExpVec(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(shift))));
  }
#endif
  for (; i < n; ++i) x[i] = x[i] == -INFINITY ? 0.0f : std::exp(x[i] - shift);
}

inline float Sum(const float* x, int64_t n) {
  float out = 0.0f;
  for (int64_t i = 0; i < n; ++i) out += x[i];
  return out;
}

// Scores of four query vectors against a page's keys, transposed as kt [d][ps]: out [4][ps].
inline void TileScores(const float* const q[4], const float* kt, int64_t d, int64_t ps, float* out) {
#if defined(__AVX512F__)
  if (ps == 16) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < d; ++i) {
      const __m512 k = _mm512_loadu_ps(kt + i * 16);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[0][i]), k, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[1][i]), k, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(q[2][i]), k, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(q[3][i]), k, a3);
    }
    _mm512_storeu_ps(out, a0);
    _mm512_storeu_ps(out + 16, a1);
    _mm512_storeu_ps(out + 32, a2);
    _mm512_storeu_ps(out + 48, a3);
    return;
  }
#endif
  for (int64_t t = 0; t < 4; ++t) {
    float* o = out + t * ps;
    std::fill(o, o + ps, 0.0f);
    for (int64_t i = 0; i < d; ++i) {
      const float qi = q[t][i];
      for (int64_t s = 0; s < ps; ++s) o[s] += qi * kt[i * ps + s];
    }
  }
}

// acc [d] = acc * rescale + sum_s e[s] * v[s * stride .. + d] over the `count` keys of a page.
inline void AccumulateValues(float* acc, float rescale, const float* e, const float* v, int64_t stride,
                             int64_t count, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(rescale);
  for (; i + 64 <= d; i += 64) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + i), scale);
    __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 16), scale);
    __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 32), scale);
    __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 48), scale);
    for (int64_t s = 0; s < count; ++s) {
      const __m512 w = _mm512_set1_ps(e[s]);
      const float* vs = v + s * stride + i;
      a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vs), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vs + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vs + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vs + 48), a3);
    }
    _mm512_storeu_ps(acc + i, a0);
    _mm512_storeu_ps(acc + i + 16, a1);
    _mm512_storeu_ps(acc + i + 32, a2);
    _mm512_storeu_ps(acc + i + 48, a3);
  }
#endif
  for (; i < d; ++i) {
    float a = acc[i] * rescale;
    for (int64_t s = 0; s < count; ++s) a += e[s] * v[s * stride + i];
    acc[i] = a;
  }
}

#if defined(__AVX512F__)
// 16 float32 from 16 values of the pool: float32, or bfloat16 widened (its bits are a float32's high half), ...
inline __m512 Load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 Load16(const uint16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// ... or fp8, as float16 (the CPU converts 16 at once, subnormals exact; float32 arithmetic on subnormals is flushed
// under XLA's denormals-are-zero). A gather from the codes' table took 1.4-1.9x a bf16 pool's time (64 decode rows
// of 512 keys, SmolLM2's heads, on 2 shared cores), this 0.7-0.8x. An e5m2 code is a float16's high byte.
inline __m512 Load16(const E5m2* x) {
  const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(codes, 8));
}
// An e4m3fn code's exponent and mantissa fill float16's shifted by 7 (sign apart): the value over 2^(15 - 7); its
// NaN (S.1111.111) reads as +-480 that way, which no other code does.
inline __m512 Load16(const E4m3* x) {
  const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x7f)), 7);
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(480.0f), _CMP_EQ_OQ),
                            _mm512_set1_ps(NAN));
}

// Lane s of the result is the sum of v[s]'s 16 lanes: a transposing tree of 45 shuffles and adds where 16 separate
// reductions take ~100 instructions on one dependency chain each.
inline __m512 SumLanes16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // b[i]: keys 4i..4i+3, each 128-bit lane its own partial sums
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  }
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88), _mm512_shuffle_f32x4(c01, c23, 0xDD));
}

// Rows [r0, r1) of one request (a decode row, or a block of a prefill chunk's rows) against KV heads [h0, h1), for
// pages of 16 slots and head_dim 16 * DV, without a softcap: a query head's 16 scores of a page are one vector
// (SumLanes16), its softmax is vector code, and its accumulator stays in registers over the page. The page is read
// once for all the rows: a bf16 or fp8 page widened once per head into float32 tiles, a float32 one in place (no
// transposed copy). The next page is prefetched slot by slot as this one is read: a request's pages lie anywhere
// in the pool, beyond the hardware prefetcher's reach, and one core's demand misses alone fetch about half the
// memory's speed.
template <typename KV, int DV>
void AttendRows16(const Problem& p, const KV* pool, int64_t r0, int64_t r1, int64_t h0, int64_t h1) {
  constexpr int64_t ps = 16, d = 16 * DV;
  const int64_t g_count = p.group, heads = (h1 - h0) * g_count, units = (r1 - r0) * heads;
  const int64_t kv_width = 2 * p.num_kv_heads * d, q_stride = p.num_kv_heads * g_count * d;
  const int64_t slot_bytes = kv_width * static_cast<int64_t>(sizeof(KV));
  const int64_t cap = p.pages_per_req * ps;
  int64_t lo = INT64_MAX, hi = 0;  // the keys any row sees
  for (int64_t r = r0; r < r1; ++r) {
    if (std::min<int64_t>(p.row_seen[r], cap) > p.row_first[r]) {
      lo = std::min<int64_t>(lo, p.row_first[r]);
      hi = std::max<int64_t>(hi, std::min<int64_t>(p.row_seen[r], cap));
    }
  }
  const int64_t req = std::clamp<int64_t>(p.row_req[r0], 0, p.num_reqs - 1);
  thread_local std::vector<float> buf;
  buf.resize(units * (d + 2) + ps + 2 * ps * d);
  float* acc = buf.data();          // [units, d]: unit (row - r0) * heads + (h - h0) * G + g
  float* m = acc + units * d;       // [units]
  float* l = m + units;             // [units]
  float* e = l + units;             // [ps]: a page's weights of one unit
  float* kf = e + ps;               // [ps, d]: a narrow page's keys of one head in float32
  float* vf = kf + ps * d;          // [ps, d]: its values
  std::fill(acc, acc + units * d, 0.0f);
  std::fill(m, m + units, -INFINITY);
  std::fill(l, l + units, 0.0f);
  for (int64_t page = (lo == INT64_MAX ? 0 : lo / ps); lo != INT64_MAX && page * ps < hi; ++page) {
    const int64_t id = std::clamp<int64_t>(p.table[req * p.pages_per_req + page], 0, p.num_pages - 1);
    const KV* base = pool + ((p.layer * p.num_pages + id) * ps) * kv_width;
    const int64_t t0 = std::max<int64_t>(lo - page * ps, 0), t1 = std::min<int64_t>(hi - page * ps, ps);
    const char* next = nullptr;
    if ((page + 1) * ps < hi) {
      const int64_t nid = std::clamp<int64_t>(p.table[req * p.pages_per_req + page + 1], 0, p.num_pages - 1);
      next = reinterpret_cast<const char*>(pool + ((p.layer * p.num_pages + nid) * ps) * kv_width);
    }
    for (int64_t h = h0; h < h1; ++h) {
      // this head's K and V of slot s: base + s * kv_width + 2hd and + (2h + 1)d
      const KV* kp = base + 2 * h * d;
      const float* keys;
      const float* vals;
      int64_t stride;
      if constexpr (std::is_same<KV, float>::value) {
        keys = kp;
        vals = kp + d;
        stride = kv_width;
      } else {
        for (int64_t s = t0; s < t1; ++s) {
          for (int j = 0; j < DV; ++j) {
            _mm512_storeu_ps(kf + s * d + 16 * j, Load16(kp + s * kv_width + 16 * j));
            _mm512_storeu_ps(vf + s * d + 16 * j, Load16(kp + s * kv_width + d + 16 * j));
          }
        }
        keys = kf;
        vals = vf;
        stride = d;
      }
      if (next != nullptr) {  // this head's share of the next page: its slots' K and V lines
        const int64_t per_head = (slot_bytes + (h1 - h0) - 1) / (h1 - h0);
        const char* a = next + (h - h0) * per_head;
        const char* b = next + std::min<int64_t>((h - h0 + 1) * per_head, slot_bytes);
        for (int64_t s = 0; s < ps; ++s) {
          for (const char* x = a + s * slot_bytes; x < b + s * slot_bytes; x += 64) _mm_prefetch(x, _MM_HINT_T0);
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t s0 = std::max<int64_t>(p.row_first[r] - page * ps, 0);
        const int64_t s1 = std::min<int64_t>(std::min<int64_t>(p.row_seen[r], cap) - page * ps, ps);
        if (s1 <= s0) continue;  // this row sees no key of the page
        const __mmask16 live = static_cast<__mmask16>(((1u << s1) - 1u) & ~((1u << s0) - 1u));
        for (int64_t g = 0; g < g_count; ++g) {
          const int64_t u = (r - r0) * heads + (h - h0) * g_count + g;
          const float* qu = p.q + r * q_stride + (h * g_count + g) * d;
          __m512 qv[DV];
          for (int j = 0; j < DV; ++j) qv[j] = _mm512_loadu_ps(qu + 16 * j);
          __m512 dots[ps];
          for (int64_t s = 0; s < ps; ++s) {
            __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
            if ((live >> s) & 1) {
              const float* k = keys + s * stride;
              for (int j = 0; j < DV; j += 2) {
                x0 = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k + 16 * j), x0);
                if (j + 1 < DV) x1 = _mm512_fmadd_ps(qv[j + 1], _mm512_loadu_ps(k + 16 * j + 16), x1);
              }
            }
            dots[s] = _mm512_add_ps(x0, x1);
          }
          __m512 scores = _mm512_mul_ps(SumLanes16(dots), _mm512_set1_ps(p.sm_scale));
          if (p.softcap > 0.0f) {  // Gemma 2: cap * tanh(score / cap), lane by lane (as AttendBlock does)
            float v[ps];
            _mm512_storeu_ps(v, scores);
            for (int64_t s = 0; s < ps; ++s) v[s] = p.softcap * std::tanh(v[s] / p.softcap);
            scores = _mm512_loadu_ps(v);
          }
          const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, scores);
          const float m_new = std::max(m[u], _mm512_reduce_max_ps(sc));
          const float rescale = std::exp(m[u] - m_new);  // exp(-inf) = 0 before the first key
          const __m512 w = ExpVec(_mm512_sub_ps(sc, _mm512_set1_ps(m_new)));  // masked keys: 0
          l[u] = l[u] * rescale + _mm512_reduce_add_ps(w);
          m[u] = m_new;
          _mm512_storeu_ps(e, w);
          __m512 a[DV];
          for (int j = 0; j < DV; ++j) {
            a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + u * d + 16 * j), _mm512_set1_ps(rescale));
          }
          for (int64_t s = s0; s < s1; ++s) {
            const __m512 ws = _mm512_set1_ps(e[s]);
            const float* v = vals + s * stride;
            for (int j = 0; j < DV; ++j) a[j] = _mm512_fmadd_ps(ws, _mm512_loadu_ps(v + 16 * j), a[j]);
          }
          for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc + u * d + 16 * j, a[j]);
        }
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < heads; ++j) {
      const int64_t u = (r - r0) * heads + j;
      float* o = p.out + r * q_stride + h0 * g_count * d + j * d;
      const float inv = l[u] > 0.0f ? 1.0f / l[u] : 0.0f;  // a row that sees nothing (padding) gives zeros
      for (int64_t i = 0; i < d; ++i) o[i] = acc[u * d + i] * inv;
    }
  }
}

// The row kernel for this shape, or null (the general paths).
template <typename KV>
using RowsFn = void (*)(const Problem&, const KV*, int64_t, int64_t, int64_t, int64_t);
template <typename KV>
RowsFn<KV> Rows16(const Problem& p) {
  if (p.page_size != 16) return nullptr;
  if (p.head_dim == 64) return AttendRows16<KV, 4>;
  if (p.head_dim == 128) return AttendRows16<KV, 8>;
  if (p.head_dim == 256) return AttendRows16<KV, 16>;
  return nullptr;
}
#endif

// Rows [r0, r1) of one request against KV head h.
template <typename KV>
void AttendBlock(const Problem& p, const KV* pool, int64_t r0, int64_t r1, int64_t h) {
  const int64_t ps = p.page_size, d = p.head_dim, g_count = p.group, rows = r1 - r0;
  const int64_t kv_width = 2 * p.num_kv_heads * d;  // one slot's K and V of every head
  const int64_t q_stride = p.num_kv_heads * g_count * d;
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t r = r0; r < r1; ++r) {
    if (p.row_seen[r] > p.row_first[r]) {
      lo = std::min<int64_t>(lo, p.row_first[r]);
      hi = std::max<int64_t>(hi, p.row_seen[r]);
    }
  }
  const int64_t units = rows * g_count;  // (row, query head) pairs of this block
  std::vector<float> acc(units * d, 0.0f), m(units, -INFINITY), l(units, 0.0f);
  std::vector<float> kt(d * ps), vs(ps * d), sc(4 * ps);
  std::vector<int64_t> unit(units);
  const int64_t req = std::clamp<int64_t>(p.row_req[r0], 0, p.num_reqs - 1);
  hi = std::min<int64_t>(hi, p.pages_per_req * ps);
  for (int64_t page = (lo == INT64_MAX ? 0 : lo / ps); lo != INT64_MAX && page * ps < hi; ++page) {
    const int64_t id = std::clamp<int64_t>(p.table[req * p.pages_per_req + page], 0, p.num_pages - 1);
    const KV* base = pool + ((p.layer * p.num_pages + id) * ps) * kv_width;
    for (int64_t s = 0; s < ps; ++s) {
      const KV* k = base + s * kv_width + (2 * h) * d;
      const KV* v = k + d;
      for (int64_t i = 0; i < d; ++i) {
        kt[i * ps + s] = ToFloat(k[i]);
        vs[s * d + i] = ToFloat(v[i]);
      }
    }
    const int64_t key0 = page * ps;
    // The (row, query head) units that see a key of this page, scored together (they share the tile's loads).
    int64_t live = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t first = p.row_first[r], seen = p.row_seen[r];
      if (seen <= first || key0 >= seen || key0 + ps <= first) continue;
      for (int64_t g = 0; g < g_count; ++g) unit[live++] = (r - r0) * g_count + g;
    }
    for (int64_t j = 0; j < live; j += 4) {
      const int64_t n = std::min<int64_t>(4, live - j);
      const float* qs[4];
      for (int64_t t = 0; t < 4; ++t) {
        const int64_t u = unit[j + std::min(t, n - 1)];
        qs[t] = p.q + (r0 + u / g_count) * q_stride + (h * g_count + u % g_count) * d;
      }
      TileScores(qs, kt.data(), d, ps, sc.data());
      for (int64_t t = 0; t < n; ++t) {
        const int64_t u = unit[j + t], r = r0 + u / g_count;
        float* x = sc.data() + t * ps;
        const int64_t first = p.row_first[r], seen = p.row_seen[r];
        float page_max = -INFINITY;
        for (int64_t s = 0; s < ps; ++s) {
          const int64_t key = key0 + s;
          float v = x[s] * p.sm_scale;
          if (p.softcap > 0.0f) v = p.softcap * std::tanh(v / p.softcap);
          x[s] = (key >= first && key < seen) ? v : -INFINITY;
          page_max = std::max(page_max, x[s]);
        }
        const float m_new = std::max(m[u], page_max);
        const float rescale = std::exp(m[u] - m_new);  // exp(-inf) = 0 before the first key
        ExpShifted(x, ps, m_new);
        l[u] = l[u] * rescale + Sum(x, ps);
        m[u] = m_new;
        AccumulateValues(acc.data() + u * d, rescale, x, vs.data(), d, ps, d);
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t u = (r - r0) * g_count + g;
      float* o = p.out + r * q_stride + (h * g_count + g) * d;
      const float inv = l[u] > 0.0f ? 1.0f / l[u] : 0.0f;  // a row that sees nothing (padding) gives zeros
      for (int64_t i = 0; i < d; ++i) o[i] = acc[u * d + i] * inv;
    }
  }
}

template <typename KV>
ffi::Error Run(const Problem& p, const KV* pool, int64_t num_rows) {
  // Blocks: runs of consecutive rows of one request, at most kBlockRows long. A row's result does not depend on
  // its block (batch invariance): the row kernel and AttendBlock each compute a row alone, and a shape takes one
  // of them for every block.
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t r = 0; r < num_rows;) {
    int64_t end = r + 1;
    while (end < num_rows && end - r < kBlockRows && p.row_req[end] == p.row_req[r]) ++end;
    blocks.emplace_back(r, end);
    r = end;
  }
#if defined(__AVX512F__)
  const RowsFn<KV> rows16 = Rows16<KV>(p);
#else
  const void* rows16 = nullptr;
#endif
  // With the row kernel a block of one row takes all its KV heads in one item (its pages stream), unless there are
  // too few blocks to keep the threads busy; other blocks go head by head.
  const int64_t split = (static_cast<int64_t>(blocks.size()) >= 2 * sgjax_cpu::Threads()) ? 1 : p.num_kv_heads;
  std::vector<std::pair<int64_t, int64_t>> work;  // (block, first head)
  auto step_of = [&](const std::pair<int64_t, int64_t>& b) {
    return rows16 != nullptr && b.second - b.first == 1 ? p.num_kv_heads / split : 1;
  };
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b) {
    for (int64_t h = 0; h < p.num_kv_heads; h += step_of(blocks[b])) work.emplace_back(b, h);
  }
  auto fn = [&](int64_t i) {
    const auto& b = blocks[work[i].first];
    const int64_t h = work[i].second;
#if defined(__AVX512F__)
    if (rows16 != nullptr) return rows16(p, pool, b.first, b.second, h, std::min(h + step_of(b), p.num_kv_heads));
#endif
    AttendBlock<KV>(p, pool, b.first, b.second, h);
  };
  int64_t keys = 0;  // the keys the blocks read, each block its pages once
  for (const auto& b : blocks) keys += std::max<int64_t>(0, p.row_seen[b.second - 1] - p.row_first[b.first]);
  const int64_t bytes = keys * 2 * p.num_kv_heads * p.head_dim * static_cast<int64_t>(sizeof(KV));
  ParallelFor(static_cast<int64_t>(work.size()), bytes, fn);
  return ffi::Error::Success();
}

// float32 to bfloat16, rounded to nearest even (XLA's convert); a NaN stays a (quiet) NaN.
inline uint16_t ToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline void StoreRow(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void StoreRow(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < n; ++i) dst[i] = ToBf16(src[i]);
}

// float32 to fp8 as the jax path writes an fp8 pool (kv_pool.to_pool): clipped to the format's largest value, then
// XLA's convert, rounded to nearest even. So: saturation past the largest value (inf too), a NaN stays a NaN (the
// code the jax writer leaves: F::kNanCode), and the sign of a zero or of what rounds to zero is kept.
template <typename F>
inline F ToFp8(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;  // |x|'s bits: ordered as |x| is
  const float magnitude = std::fabs(x);
  if (a > 0x7f800000u) return F{static_cast<uint8_t>((F::kNanSigned ? sign : 0) | F::kNanCode)};
  if (magnitude >= kFp8Table<F>[F::kMaxCode]) return F{static_cast<uint8_t>(sign | F::kMaxCode)};
  if (magnitude < std::ldexp(1.0f, 1 - F::kBias)) {
    // below the smallest normal the codes are multiples of its 2^-kMan: scaled by a power of two (exact), rounded
    // to an integer to nearest even (the default rounding mode); 2^kMan rounds up into the smallest normal's code
    const float steps = std::nearbyint(std::ldexp(magnitude, F::kBias - 1 + F::kMan));
    return F{static_cast<uint8_t>(sign | static_cast<uint8_t>(steps))};
  }
  // normal: float32's mantissa cut to kMan bits, to nearest even (a carry moves up the exponent, as it should),
  // and the exponent rebiased
  constexpr int shift = 23 - F::kMan;
  const uint32_t rounded = (a + (1u << (shift - 1)) - 1u + ((a >> shift) & 1u)) >> shift;
  return F{static_cast<uint8_t>(sign | (rounded - (static_cast<uint32_t>(127 - F::kBias) << F::kMan)))};
}

template <int E, int M>
inline void StoreRow(Fp8<E, M>* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ToFp8<Fp8<E, M>>(src[i]);  // a step's few new rows: scalar suffices
}

// The step's new keys and values into `layer` of the pool, in place (the pool is the call's aliased result): XLA's
// CPU scatter into a bfloat16 array converts the whole pool to float32 and back, seconds a step. Slots outside the
// pool are skipped.
template <typename KV>
void WriteKV(KV* pool, const float* k, const float* v, const int32_t* slots, int64_t rows, const Problem& p) {
  const int64_t d = p.head_dim, kv_width = 2 * p.num_kv_heads * d, limit = p.num_pages * p.page_size;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = slots[r];
    if (slot < 0 || slot >= limit) continue;
    KV* dst = pool + (p.layer * limit + slot) * kv_width;  // slot = page * page_size + offset
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      StoreRow(dst + 2 * h * d, k + (r * p.num_kv_heads + h) * d, d);
      StoreRow(dst + (2 * h + 1) * d, v + (r * p.num_kv_heads + h) * d, d);
    }
  }
}

// The step's keys and values into the pool, then the attention over it (which reads them among the rest).
template <typename KV>
ffi::Error WriteAndRun(const Problem& p, KV* pool, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                       ffi::Buffer<ffi::S32> slots, int64_t rows) {
  WriteKV(pool, k.typed_data(), v.typed_data(), slots.typed_data(), rows, p);
  return Run(p, static_cast<const KV*>(pool), rows);
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer pool_in, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> row_req, ffi::Buffer<ffi::S32> row_first,
                          ffi::Buffer<ffi::S32> row_seen, float sm_scale, float softcap,
                          ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> pool) {
  auto qd = q.dimensions(), pd = pool->dimensions(), td = table.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || pd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q [T, Hq, D], pool [L, N, S, 2Hkv, D], table [R, P]");
  }
  if (kd.size() != 3 || kd[0] != qd[0] || kd[1] * 2 != pd[3] || kd[2] != pd[4] || v.element_count() != k.element_count() ||
      slots.element_count() != qd[0]) {
    return ffi::Error::InvalidArgument("paged attention: k and v [T, Hkv, D], slots [T]");
  }
  if (pool->untyped_data() != pool_in.untyped_data()) {  // not aliased (the Python side always asks for it)
    std::memcpy(pool->untyped_data(), pool_in.untyped_data(), pool->size_bytes());
  }
  Problem p;
  p.q = q.typed_data();
  p.out = out->typed_data();
  p.table = table.typed_data();
  p.row_req = row_req.typed_data();
  p.row_first = row_first.typed_data();
  p.row_seen = row_seen.typed_data();
  p.num_pages = pd[1];
  p.page_size = pd[2];
  p.num_kv_heads = pd[3] / 2;
  p.head_dim = pd[4];
  p.group = qd[1] / p.num_kv_heads;
  p.num_reqs = td[0];
  p.pages_per_req = td[1];
  p.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, pd[0] - 1);
  p.sm_scale = sm_scale;
  p.softcap = softcap;
  if (qd[2] != p.head_dim || p.group * p.num_kv_heads != qd[1] || p.num_reqs == 0) {
    return ffi::Error::InvalidArgument("paged attention: q's heads and head_dim do not match the pool's");
  }
  const int64_t rows = qd[0];
  switch (pool->element_type()) {
    case ffi::DataType::F32:
      return WriteAndRun(p, reinterpret_cast<float*>(pool->untyped_data()), k, v, slots, rows);
    case ffi::DataType::BF16:
      return WriteAndRun(p, reinterpret_cast<uint16_t*>(pool->untyped_data()), k, v, slots, rows);
    case ffi::DataType::F8E4M3FN:
      return WriteAndRun(p, reinterpret_cast<E4m3*>(pool->untyped_data()), k, v, slots, rows);
    case ffi::DataType::F8E5M2:
      return WriteAndRun(p, reinterpret_cast<E5m2*>(pool->untyped_data()), k, v, slots, rows);
    default:
      return ffi::Error::InvalidArgument(
          "paged attention: the pool must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SgjaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots
                                  .Arg<ffi::AnyBuffer>()          // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_req
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_first
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_seen
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::AnyBuffer>());        // pool, aliased to the argument
