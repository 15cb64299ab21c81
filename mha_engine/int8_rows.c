/* Per-row passes around the int8 GEMM (mha_engine/int8_rows.py compiles this at first use).

   The same float32 operations, in the same order, as Int8Linear's eager torch ops, one pass
   over a row (in L1) instead of seven over the batch: the results are bit-identical to the
   eager path (tested), and each row depends only on itself (batch invariance).
   Build flags: -O3 -ffp-contract=off (no fused multiply-add beyond the explicit fmaf calls,
   which mirror those of torch's addcmul kernel where it fuses them), -fopenmp where the
   compiler has it: rows are split over `threads` of torch's own OpenMP pool (the same
   libgomp.so.1), each row computed the same way on any thread. */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif


static const float TINY = 1.17549435e-38f; /* torch.finfo(torch.float32).tiny */
static const float ROUND_MAGIC = 12582912.0f; /* 1.5 * 2^23 */

/* Exact min and max of a row, and whether it holds a NaN. Vector min/max return the
   accumulator when the new value is NaN, as the scalar tail's comparisons do, so NaN is
   tracked apart (an unordered compare); +-Inf shows up as the min or max itself. Four
   accumulators each: one chain of dependent min/max would wait on the previous result. */
static void row_range(const float *row, int64_t k, float *lo_out, float *hi_out, int *nan_out) {
  float l = row[0], h = row[0];
  int nan = 0;
  int64_t c = 0;
#if defined(__AVX512F__)
  __m512 lo[4], hi[4];
  __mmask16 unordered = 0;
  for (int u = 0; u < 4; ++u) lo[u] = hi[u] = _mm512_set1_ps(l);
  for (; c + 64 <= k; c += 64) {
    for (int u = 0; u < 4; ++u) {
      const __m512 v = _mm512_loadu_ps(row + c + 16 * u);
      lo[u] = _mm512_min_ps(v, lo[u]);
      hi[u] = _mm512_max_ps(v, hi[u]);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
  }
  for (; c + 16 <= k; c += 16) {
    const __m512 v = _mm512_loadu_ps(row + c);
    lo[0] = _mm512_min_ps(v, lo[0]);
    hi[0] = _mm512_max_ps(v, hi[0]);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const __m512 lo4 = _mm512_min_ps(_mm512_min_ps(lo[0], lo[1]), _mm512_min_ps(lo[2], lo[3]));
  const __m512 hi4 = _mm512_max_ps(_mm512_max_ps(hi[0], hi[1]), _mm512_max_ps(hi[2], hi[3]));
  l = _mm512_reduce_min_ps(lo4);
  h = _mm512_reduce_max_ps(hi4);
  nan = unordered != 0;
#elif defined(__AVX2__)
  __m256 lo[4], hi[4], unordered = _mm256_setzero_ps();
  for (int u = 0; u < 4; ++u) lo[u] = hi[u] = _mm256_set1_ps(l);
  for (; c + 32 <= k; c += 32) {
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(row + c + 8 * u);
      lo[u] = _mm256_min_ps(v, lo[u]);
      hi[u] = _mm256_max_ps(v, hi[u]);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  float lanes[8][8];
  for (int u = 0; u < 4; ++u) {
    _mm256_storeu_ps(lanes[u], lo[u]);
    _mm256_storeu_ps(lanes[4 + u], hi[u]);
  }
  for (int u = 0; u < 4; ++u) {
    for (int j = 0; j < 8; ++j) {
      l = lanes[u][j] < l ? lanes[u][j] : l;
      h = lanes[4 + u][j] > h ? lanes[4 + u][j] : h;
    }
  }
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; c < k; ++c) {
    const float v = row[c];
    l = v < l ? v : l;
    h = v > h ? v : h;
    nan |= v != v;
  }
  *lo_out = l;
  *hi_out = h;
  *nan_out = nan;
}

/* Rows x (n, k), row stride ldx: q = round((x - mid) / scale) + levels + 1 as bytes, with
   mid = (max + min) / 2 and scale = max((max - min) / (2 * levels), TINY) per row. A row
   holding NaN gets scale and mid NaN, one holding +-Inf (or whose max - min overflows) an
   infinite scale or mid: either way its output row is not finite (nor is eager's), and its q
   is the zero point (no float -> int cast of a non-finite value). */
void mha_int8_quantize_rows(const float *x, int64_t n, int64_t k, int64_t ldx, int32_t levels,
                            uint8_t *q, float *scale, float *mid, int32_t threads) {
  /* t + (1.5 * 2^23 + zero point) lands where float32's spacing is 1, so the add rounds t to
     the nearest integer, ties to even (the magic number is even), as torch.round does. */
  const float round_add = ROUND_MAGIC + (float)(levels + 1);
  const float steps = (float)(2 * levels);
  (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) {
    const float *row = x + i * ldx;
    uint8_t *qrow = q + i * k;
    float l, h;
    int nan;
    row_range(row, k, &l, &h, &nan);
    float m = (h + l) * 0.5f;
    float s = (h - l) / steps;
    if (s < TINY) s = TINY;
    if (nan) m = s = NAN;
    scale[i] = s;
    mid[i] = m;
    if (!isfinite(m) || !isfinite(s)) {
      for (int64_t c2 = 0; c2 < k; ++c2) qrow[c2] = (uint8_t)(levels + 1);
      continue;
    }
    const float inv = 1.0f / s;
    for (int64_t c2 = 0; c2 < k; ++c2) {
      const float t = (row[c2] - m) * inv; /* in [-levels, levels] */
      qrow[c2] = (uint8_t)(int32_t)((t + round_add) - ROUND_MAGIC); /* round(t) + zero point */
    }
  }
}

/* In place on y (n, m), the GEMM's (sum of (q - zero_point) * W_q) * weight_scale:
   y = y * scale + bias, then y += mid * weight_sums, then y += residual (if given), per row.
   With fused != 0 the two multiply-adds are fused (as torch's vectorised addcmul kernels do
   on AVX2 / AVX-512), else each product is rounded first (its DEFAULT kernels). bias and
   residual may be NULL; residual has row stride ldr. */
void mha_int8_epilogue(float *y, int64_t n, int64_t m, const float *scale, const float *mid,
                       const float *bias, const float *weight_sums, const float *residual,
                       int64_t ldr, int32_t fused, int32_t threads) {
  (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) {
    float *row = y + i * m;
    const float s = scale[i], md = mid[i];
    if (fused && bias) {
      for (int64_t j = 0; j < m; ++j) row[j] = fmaf(md, weight_sums[j], fmaf(row[j], s, bias[j]));
    } else if (fused) {
      for (int64_t j = 0; j < m; ++j) row[j] = fmaf(md, weight_sums[j], row[j] * s);
    } else if (bias) {
      for (int64_t j = 0; j < m; ++j) row[j] = (bias[j] + row[j] * s) + md * weight_sums[j];
    } else {
      for (int64_t j = 0; j < m; ++j) row[j] = row[j] * s + md * weight_sums[j];
    }
    if (residual) {
      const float *r = residual + i * ldr;
      for (int64_t j = 0; j < m; ++j) row[j] += r[j];
    }
  }
}

/* 1 when built with OpenMP (the caller then passes threads > 1 for large batches). */
int mha_int8_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
