// Matrix products for the CPU, called from XLA through its FFI (kernels/cpu.py packs the weights and registers it).
//
// y_i[M, N_i] = x[M, K] @ W_i[layer]^T for one to a few matrices W_i that share x (q, k and v; gate and up), every
// row count through the same code: one output's arithmetic never depends on how many rows x has, which rows they
// are, or how the work is split between threads (batch invariance, docs/engine.md). Stacked layers [L, ...] are
// read in place at `layer` (a scanned forward passes a layer index, never a sliced copy).
//
// The weights come packed in panels of 16 output rows (kernels/cpu.py pack_matrix), so one vector holds one value
// of each of the panel's 16 rows and an x value is broadcast to all of them: no horizontal sums, and each weight
// loaded once serves every x row of a pass. Per panel, by the weights' type:
//   float32  [K][16]                     y[l] = sum over k in order of x[k] * w[l][k] (fused, one chain per output)
//   bfloat16 [K / 2][16][2]              x rounded to bf16; vdpbf16ps over k pairs in order
//   int4     [K / 64][8][64] u8          weight = low + scale * u (u in 0..15; a (scale, low) pair per 32 along a
//                                        row, params [K / 32][2][16]); run h, vector j, byte 4l + i holds u of k =
//                                        64h + 4j + i (low nibble) and 64h + 32 + 4j + i (high nibble)
//   int8     [K / 4][16][4] s8           weight = scale * q (a scale per 32 along a row, params [K / 32][16])
// Integer matrices take x quantized per group of 32 (scale = max |x| / 127, q = round(x / scale)): each group's
// sum of products is an exact int32 (vpdpbusd over u8 weights, int8 ones offset by 128), then per group in order
//   acc = fma(float(isum), scale_w * scale_x, acc); acc = fma(low_w, scale_x * sum(q), acc)
// (int8: low_w = -128 * scale_w). An integer sum is the same in any order, so the scalar path below (builds
// without AVX-512 VNNI) gives the same bits as the vector one; float32 likewise (one fused multiply-add per k).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;
using sgjax_cpu::ParallelFor;

namespace {

constexpr int64_t kPanel = 16;       // output rows per panel
constexpr int64_t kGroup = 32;       // weights per integer scale, and x values per quantization scale
constexpr int64_t kRowBlock = 64;    // x rows per pass over a work item's panels (they stay in L1 / L2)
constexpr int64_t kItemsPerThread = 4;

enum class Kind { kF32, kBf16, kInt4, kInt8 };

// x as the integer products read it: q int8 [M, K], and per group of 32 its scale and scale * sum(q).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

// Row m's groups: scale = max |x| / 127, q = x * (1 / scale) rounded to nearest even. Vector and scalar agree
// bit for bit (max is exact, one rounding per product).
void QuantizeRow(const float* x, int64_t k, int8_t* q, float* scale, float* sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* v = x + g * kGroup;
    float peak = 0.0f;
#if defined(__AVX512F__)
    peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)), _mm512_abs_ps(_mm512_loadu_ps(v + 16))));
#else
    for (int64_t i = 0; i < kGroup; ++i) peak = std::max(peak, std::fabs(v[i]));
#endif
    const float s = peak / 127.0f;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    int32_t total = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float r = std::nearbyint(v[i] * inv);
      const int32_t c = static_cast<int32_t>(std::clamp(r, -128.0f, 127.0f));
      q[g * kGroup + i] = static_cast<int8_t>(c);
      total += c;
    }
    scale[g] = s;
    sum[g] = s * static_cast<float>(total);
  }
}

// float32 to bfloat16, rounded to nearest even (XLA's convert); NaN stays NaN.
inline uint16_t ToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float FromBf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One matrix of a call: this layer's packed panels and parameters, its result and real row count.
struct Matrix {
  Kind kind;
  const void* w;
  const float* params;
  float* y;  // [M, n]
  int64_t n, panels;
};

struct Inputs {
  const float* x;               // [M, K]
  const uint16_t* xb;           // x in bf16 (bf16 matrices), or null
  const QuantizedX* xq;         // x quantized (integer matrices), or null
  int64_t rows, k;
};

// Stores the 16 values of one x row's panel p (the first `live` are real rows of the matrix).
inline void StorePanel(float* y, const float* v, int64_t live) { std::memcpy(y, v, live * sizeof(float)); }

#if defined(__AVX512F__)
inline __mmask16 LiveLanes(int64_t live) { return static_cast<__mmask16>((1u << std::min<int64_t>(live, 16)) - 1u); }

template <int MR>
void StoreAcc(const __m512* acc, float* y, int64_t ldy, int64_t live) {
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy, LiveLanes(live), acc[m]);
}

template <int MR>
void F32Panel(const float* w, const Inputs& in, int64_t m0, float* y, int64_t ldy, int64_t live) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const float* x = in.x + m0 * in.k;
  for (int64_t k = 0; k < in.k; ++k) {
    const __m512 wv = _mm512_loadu_ps(w + k * kPanel);
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * in.k + k]), wv, acc[m]);
  }
  StoreAcc<MR>(acc, y, ldy, live);
}

#if defined(__AVX512BF16__)
template <int MR>
void Bf16Panel(const uint16_t* w, const Inputs& in, int64_t m0, float* y, int64_t ldy, int64_t live) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const uint16_t* x = in.xb + m0 * in.k;
  for (int64_t k = 0; k < in.k; k += 2) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k * kPanel);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * in.k + k, sizeof(pair));
      acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  StoreAcc<MR>(acc, y, ldy, live);
}
#endif

#if defined(__AVX512VNNI__)
inline __m512i Broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// The float part of one group g for MR rows: isum[m] its integer sums; scale / low the panel's 16 rows'.
template <int MR>
inline void AddGroup(__m512* acc, const __m512i* isum, __m512 scale, __m512 low, const QuantizedX& xq,
                     int64_t m0, int64_t groups, int64_t g) {
  for (int m = 0; m < MR; ++m) {
    const int64_t at = (m0 + m) * groups + g;
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(scale, _mm512_set1_ps(xq.scale[at])), acc[m]);
    acc[m] = _mm512_fmadd_ps(low, _mm512_set1_ps(xq.sum[at]), acc[m]);
  }
}

template <int MR>
void Int4Panel(const uint8_t* w, const float* params, const Inputs& in, int64_t m0, float* y, int64_t ldy,
               int64_t live) {
  const int64_t k = in.k, groups = k / kGroup;
  const int8_t* x = in.xq->q.data() + m0 * k;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t h = 0; h < k / 64; ++h) {
    __m512i lo_sum[MR], hi_sum[MR];
    for (int m = 0; m < MR; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i packed = _mm512_loadu_si512(w + (h * 8 + j) * 64);
      const __m512i lo = _mm512_and_si512(packed, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      for (int m = 0; m < MR; ++m) {
        lo_sum[m] = _mm512_dpbusd_epi32(lo_sum[m], lo, Broadcast4(x + m * k + 64 * h + 4 * j));
        hi_sum[m] = _mm512_dpbusd_epi32(hi_sum[m], hi, Broadcast4(x + m * k + 64 * h + 32 + 4 * j));
      }
    }
    for (int half = 0; half < 2; ++half) {
      const int64_t g = 2 * h + half;
      const float* p = params + g * 2 * kPanel;
      AddGroup<MR>(acc, half == 0 ? lo_sum : hi_sum, _mm512_loadu_ps(p), _mm512_loadu_ps(p + kPanel), *in.xq, m0,
                   groups, g);
    }
  }
  StoreAcc<MR>(acc, y, ldy, live);
}

template <int MR>
void Int8Panel(const int8_t* w, const float* params, const Inputs& in, int64_t m0, float* y, int64_t ldy,
               int64_t live) {
  const int64_t k = in.k, groups = k / kGroup;
  const int8_t* x = in.xq->q.data() + m0 * k;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[MR];
    for (int m = 0; m < MR; ++m) sum[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(w + (g * 8 + j) * 64), flip);  // q + 128
      for (int m = 0; m < MR; ++m) sum[m] = _mm512_dpbusd_epi32(sum[m], u, Broadcast4(x + m * k + 32 * g + 4 * j));
    }
    const __m512 scale = _mm512_loadu_ps(params + g * kPanel);
    AddGroup<MR>(acc, sum, scale, _mm512_mul_ps(scale, _mm512_set1_ps(-128.0f)), *in.xq, m0, groups, g);
  }
  StoreAcc<MR>(acc, y, ldy, live);
}
#endif  // __AVX512VNNI__
#endif  // __AVX512F__

// The scalar path: the vector paths' arithmetic lane by lane (builds without AVX-512, and types whose dot-product
// instructions this build lacks).
void ScalarPanel(const Matrix& mat, const void* w, const float* params, const Inputs& in, int64_t m, float* y,
                 int64_t live) {
  const int64_t k = in.k, groups = k / kGroup;
  float out[kPanel];
  for (int64_t l = 0; l < kPanel; ++l) {
    float acc = 0.0f;
    switch (mat.kind) {
      case Kind::kF32: {
        const float* wp = static_cast<const float*>(w);
        for (int64_t i = 0; i < k; ++i) acc = std::fma(in.x[m * k + i], wp[i * kPanel + l], acc);
        break;
      }
      case Kind::kBf16: {
        const uint16_t* wp = static_cast<const uint16_t*>(w);
        for (int64_t i = 0; i < k; ++i) {
          const float xi = FromBf16(ToBf16(in.x[m * k + i]));
          acc += xi * FromBf16(wp[(i / 2) * 2 * kPanel + 2 * l + i % 2]);
        }
        break;
      }
      case Kind::kInt4:
      case Kind::kInt8: {
        const bool int4 = mat.kind == Kind::kInt4;
        const int8_t* xq = in.xq->q.data() + m * k;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t isum = 0;
          for (int64_t i = 0; i < kGroup; ++i) {
            const int64_t kk = g * kGroup + i;
            int32_t u;
            if (int4) {
              const int64_t h = kk / 64, r = kk % 64, j = (r % 32) / 4, b = r % 4;
              const uint8_t byte = static_cast<const uint8_t*>(w)[(h * 8 + j) * 64 + 4 * l + b];
              u = r < 32 ? (byte & 0x0F) : (byte >> 4);
            } else {
              u = static_cast<int32_t>(static_cast<const int8_t*>(w)[(kk / 4) * 64 + 4 * l + kk % 4]) + 128;
            }
            isum += u * static_cast<int32_t>(xq[kk]);
          }
          const float scale = int4 ? params[g * 2 * kPanel + l] : params[g * kPanel + l];
          const float low = int4 ? params[g * 2 * kPanel + kPanel + l] : scale * -128.0f;
          const int64_t at = m * groups + g;
          acc = std::fma(static_cast<float>(isum), scale * in.xq->scale[at], acc);
          acc = std::fma(low, in.xq->sum[at], acc);
        }
        break;
      }
    }
    out[l] = acc;
  }
  StorePanel(y, out, live);
}

// Bytes of one panel's packed weights and parameters (floats).
int64_t PanelBytes(Kind kind, int64_t k) {
  switch (kind) {
    case Kind::kF32: return 4 * kPanel * k;
    case Kind::kBf16: return 2 * kPanel * k;
    case Kind::kInt4: return kPanel * k / 2;
    case Kind::kInt8: return kPanel * k;
  }
  return 0;
}

int64_t PanelParams(Kind kind, int64_t k) {
  return kind == Kind::kInt4 ? 2 * kPanel * k / kGroup : kind == Kind::kInt8 ? kPanel * k / kGroup : 0;
}

// Rows [m0, m0 + MR) of panel p: the vector path of the matrix's type where this build has it, else the scalar one.
template <int MR>
void RunPanel(const Matrix& mat, int64_t p, const Inputs& in, int64_t m0) {
  const int64_t k = in.k, live = std::min<int64_t>(kPanel, mat.n - p * kPanel);
  const char* w = static_cast<const char*>(mat.w) + p * PanelBytes(mat.kind, k);
  const float* params = mat.params == nullptr ? nullptr : mat.params + p * PanelParams(mat.kind, k);
  float* y = mat.y + m0 * mat.n + p * kPanel;
#if defined(__AVX512F__)
  switch (mat.kind) {
    case Kind::kF32: return F32Panel<MR>(reinterpret_cast<const float*>(w), in, m0, y, mat.n, live);
#if defined(__AVX512BF16__)
    case Kind::kBf16: return Bf16Panel<MR>(reinterpret_cast<const uint16_t*>(w), in, m0, y, mat.n, live);
#endif
#if defined(__AVX512VNNI__)
    case Kind::kInt4: return Int4Panel<MR>(reinterpret_cast<const uint8_t*>(w), params, in, m0, y, mat.n, live);
    case Kind::kInt8: return Int8Panel<MR>(reinterpret_cast<const int8_t*>(w), params, in, m0, y, mat.n, live);
#endif
    default: break;
  }
#endif
  for (int m = 0; m < MR; ++m) ScalarPanel(mat, w, params, in, m0 + m, y + m * mat.n, live);
}

// fn(MR, m) over rows [m0, m1) in passes of 8 x rows, then one of the rest.
template <typename Fn>
void ForRows(int64_t m0, int64_t m1, Fn fn) {
  int64_t m = m0;
  for (; m + 8 <= m1; m += 8) fn(std::integral_constant<int, 8>(), m);
  switch (m1 - m) {
    case 7: fn(std::integral_constant<int, 7>(), m); break;
    case 6: fn(std::integral_constant<int, 6>(), m); break;
    case 5: fn(std::integral_constant<int, 5>(), m); break;
    case 4: fn(std::integral_constant<int, 4>(), m); break;
    case 3: fn(std::integral_constant<int, 3>(), m); break;
    case 2: fn(std::integral_constant<int, 2>(), m); break;
    case 1: fn(std::integral_constant<int, 1>(), m); break;
    default: break;
  }
}

Kind KindOf(ffi::DataType t, bool* ok) {
  *ok = true;
  switch (t) {
    case ffi::DataType::F32: return Kind::kF32;
    case ffi::DataType::BF16: return Kind::kBf16;
    case ffi::DataType::U8: return Kind::kInt4;
    case ffi::DataType::S8: return Kind::kInt8;
    default: *ok = false; return Kind::kF32;
  }
}

ffi::Error Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs args,
                  ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("matmul: x must be [M, K]");
  const int64_t rows = xd[0], k = xd[1];
  if (rets.size() == 0 || args.size() != 2 * rets.size()) {
    return ffi::Error::InvalidArgument("matmul: one (panels, params) pair of arguments per result");
  }
  const int64_t picked = layer.typed_data()[0];
  std::vector<Matrix> mats;
  bool integer = false, bf16 = false;
  int64_t bytes = 0;  // the weights the call reads
  for (size_t i = 0; i < rets.size(); ++i) {
    auto w = args.get<ffi::AnyBuffer>(2 * i);
    auto s = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !s.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("matmul: buffers");
    bool ok;
    const Kind kind = KindOf(w->element_type(), &ok);
    if (!ok) return ffi::Error::InvalidArgument("matmul: panels must be float32, bfloat16, uint8 (int4) or int8");
    auto wd = w->dimensions();
    auto yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != rows || (*y)->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("matmul: each result must be float32 [M, N]");
    }
    const int64_t n = yd[1], panels = (n + kPanel - 1) / kPanel;
    const int64_t per_panel = PanelBytes(kind, k) / static_cast<int64_t>(ffi::ByteWidth(w->element_type()));
    if ((wd.size() != 2 && wd.size() != 3) || wd[wd.size() - 2] != panels || wd.back() != per_panel) {
      return ffi::Error::InvalidArgument("matmul: panels must be [L, ceil(N / 16), per panel] or [ceil(N / 16), "
                                         "per panel] for x's K (kernels/cpu.py pack_matrix)");
    }
    const bool is_int = kind == Kind::kInt4 || kind == Kind::kInt8;
    if ((is_int && k % (kind == Kind::kInt4 ? 64 : kGroup) != 0) || (kind == Kind::kBf16 && k % 2 != 0)) {
      return ffi::Error::InvalidArgument("matmul: K must be a multiple of 64 (int4), 32 (int8) or 2 (bfloat16)");
    }
    const int64_t depth = wd.size() == 3 ? wd[0] : 1;
    const int64_t l = std::clamp<int64_t>(picked, 0, depth - 1);
    const int64_t params = PanelParams(kind, k) * panels;
    if (is_int && (s->element_type() != ffi::DataType::F32 ||
                   static_cast<int64_t>(s->element_count()) != depth * params)) {
      return ffi::Error::InvalidArgument("matmul: integer panels need their float32 params [L, P, per panel]");
    }
    integer |= is_int;
    bf16 |= kind == Kind::kBf16;
    bytes += panels * PanelBytes(kind, k) + 4 * params;
    mats.push_back({kind, static_cast<const char*>(w->untyped_data()) + l * panels * PanelBytes(kind, k),
                    is_int ? reinterpret_cast<const float*>(s->untyped_data()) + l * params : nullptr,
                    reinterpret_cast<float*>((*y)->untyped_data()), n, panels});
  }
  Inputs in{x.typed_data(), nullptr, nullptr, rows, k};
  // x converted once per call, a chunk of rows per item (a prefill's rows in parallel)
  std::vector<uint16_t> xb(bf16 ? rows * k : 0);
  QuantizedX xq;
  if (integer) xq = {std::vector<int8_t>(rows * k), std::vector<float>(rows * k / kGroup),
                     std::vector<float>(rows * k / kGroup)};
  if (bf16 || integer) {
    constexpr int64_t kChunk = 16;
    ParallelFor((rows + kChunk - 1) / kChunk, rows * k * 4, [&](int64_t c) {
      for (int64_t m = c * kChunk; m < std::min(rows, (c + 1) * kChunk); ++m) {
        if (bf16) for (int64_t i = 0; i < k; ++i) xb[m * k + i] = ToBf16(in.x[m * k + i]);
        if (integer) QuantizeRow(in.x + m * k, k, xq.q.data() + m * k, xq.scale.data() + m * (k / kGroup),
                                 xq.sum.data() + m * (k / kGroup));
      }
    });
    in.xb = bf16 ? xb.data() : nullptr;
    in.xq = integer ? &xq : nullptr;
  }
  // Items: runs of whole panels of one matrix, about kItemsPerThread per thread over all of them (long runs of a
  // matrix stream best); each item covers every x row, kRowBlock rows at a time over its panels.
  int64_t total = 0;
  for (const Matrix& mat : mats) total += mat.panels;
  const int64_t per_item = std::max<int64_t>(1, total / (kItemsPerThread * sgjax_cpu::Threads()));
  std::vector<std::pair<int64_t, int64_t>> work;  // (matrix, first panel)
  for (int64_t i = 0; i < static_cast<int64_t>(mats.size()); ++i) {
    for (int64_t p = 0; p < mats[i].panels; p += per_item) work.emplace_back(i, p);
  }
  ParallelFor(static_cast<int64_t>(work.size()), bytes, [&](int64_t item) {
    const Matrix& mat = mats[work[item].first];
    const int64_t p0 = work[item].second, p1 = std::min(p0 + per_item, mat.panels);
    for (int64_t mb = 0; mb < rows; mb += kRowBlock) {
      for (int64_t p = p0; p < p1; ++p) {
        ForRows(mb, std::min(rows, mb + kRowBlock), [&](auto mr, int64_t m) { RunPanel<mr()>(mat, p, in, m); });
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SgjaxMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .RemainingArgs()               // (panels, params) per matrix
                                  .RemainingRets());             // y per matrix
