// Lane types: one SIMD width per instruction set, each exposing the same small set of
// IEEE-754 binary32 operations so that optim_kernels.inc is written once.
//
// Every operation here rounds exactly once (or not at all), so the same sequence of calls
// gives the same bits on every lane type: the kernels' rounding is decided by which
// operations they call, never by the compiler (the build uses -ffp-contract=off).
//
// This header is included three times by module.cpp, each time inside a different
// namespace and target region, with exactly one of GOCKPT_LANES_{PORTABLE,AVX2,AVX512}
// defined. It deliberately has no include guard.

#if defined(GOCKPT_LANES_AVX2) || defined(GOCKPT_LANES_AVX512)

// The square root of MKL's generic SSE code path (mkl_vml_kernel_sSqrt_EXHAynn), the one
// vsSqrt runs on CPUs that are not Intel (AMD EPYC and Ryzen, with or without AVX-512);
// torch's CPU sqrt calls it there. Read from its machine code and checked against it on all
// 2^31 non-negative binary32 inputs on an AMD EPYC (Zen 3): a 12-bit reciprocal square root
// estimate (RSQRTPS, whose table differs between CPU vendors, so it must be this CPU's
// instruction) refined by two coupled Newton steps with separately rounded multiplies and
// adds. The result is faithful, not always correctly rounded. Lanes MKL hands to its scalar
// path get what that path returns: zero, subnormals and inputs above 0x1.ffep127 (and +inf,
// NaN) their IEEE square root, negative numbers a positive quiet NaN.
static inline __m256 mkl_sse_sqrt8(__m256 x) {
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 y = _mm256_rsqrt_ps(x);
  const __m256 s = _mm256_mul_ps(x, y);
  const __m256 h = _mm256_mul_ps(half, y);
  const __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
  const __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, e), s);
  const __m256 h1 = _mm256_add_ps(_mm256_mul_ps(h, e), h);
  const __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(s1, s1));
  __m256 root = _mm256_add_ps(_mm256_mul_ps(r, h1), s1);
  // MKL's own test: bits + 0x7f800000 > 0xfefff000 as signed 32-bit integers.
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i rare = _mm256_cmpgt_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7f800000)),
                                          _mm256_set1_epi32(static_cast<int>(0xfefff000u)));
  root = _mm256_blendv_ps(root, _mm256_sqrt_ps(x), _mm256_castsi256_ps(rare));
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(root, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), negative);
}

#endif

#if defined(GOCKPT_LANES_PORTABLE)

struct L {
  using V = float;
  static constexpr int W = 1;
  static constexpr bool kHasMklSqrt = false;
  static constexpr bool kHasMklSseSqrt = false;
  static constexpr const char* kName = "portable";

  static inline V load(const float* p) { return *p; }
  static inline void store(float* p, V v) { *p = v; }
  static inline V load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static inline V load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static inline V set1(float x) { return x; }
  static inline V add(V a, V b) { return a + b; }
  static inline V sub(V a, V b) { return a - b; }
  static inline V mul(V a, V b) { return a * b; }
  static inline V div(V a, V b) { return a / b; }
  static inline V neg(V a) { return -a; }
  // a * b + c, rounded once (a libm call where the target has no FMA instruction).
  static inline V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
  // c - a * b, rounded once.
  static inline V fnmadd(V a, V b, V c) { return std::fma(-a, b, c); }
  static inline V sqrt_ieee(V a) { return std::sqrt(a); }
  static inline V sqrt_mkl(V a) { return std::sqrt(a); }  // never selected: kHasMklSqrt
  static inline V sqrt_mkl_sse(V a) { return std::sqrt(a); }  // never selected
  // torch.maximum: NaN if either operand is NaN.
  static inline V max_nan(V a, V b) {
    if (std::isnan(a) || std::isnan(b)) return a + b;
    return a > b ? a : b;
  }
};

#elif defined(GOCKPT_LANES_AVX2)

struct L {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr bool kHasMklSqrt = false;
  static constexpr bool kHasMklSseSqrt = true;
  static constexpr const char* kName = "avx2";

  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static inline V load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static inline V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V div(V a, V b) { return _mm256_div_ps(a, b); }
  static inline V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static inline V sqrt_ieee(V a) { return _mm256_sqrt_ps(a); }
  static inline V sqrt_mkl(V a) { return _mm256_sqrt_ps(a); }  // never selected
  static inline V sqrt_mkl_sse(V a) { return mkl_sse_sqrt8(a); }
  static inline V max_nan(V a, V b) {
    V m = _mm256_max_ps(a, b);
    V unordered = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    return _mm256_blendv_ps(m, _mm256_add_ps(a, b), unordered);
  }
};

#elif defined(GOCKPT_LANES_AVX512)

struct L {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr bool kHasMklSqrt = true;
  static constexpr bool kHasMklSseSqrt = true;
  static constexpr const char* kName = "avx512";

  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static inline V load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static inline V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V div(V a, V b) { return _mm512_div_ps(a, b); }
  static inline V neg(V a) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  static inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static inline V sqrt_ieee(V a) { return _mm512_sqrt_ps(a); }

  // The square root that MKL's vsSqrt computes in high-accuracy mode on AVX-512 machines
  // (torch's CPU sqrt calls it): a 14-bit reciprocal square root estimate refined by one
  // Newton step written with two FMAs. The result is faithful, not always correctly rounded
  // (it misses by one ulp near rounding midpoints, always downwards). Inputs below 2^-102
  // are scaled by 2^64 first and the root by 2^-32 after; zeros and +inf pass through.
  // Checked against torch.sqrt on all 2^32 binary32 inputs (NaN payloads aside).
  static inline V sqrt_mkl(V x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(0x1p-102f), _CMP_LT_OQ);
    const V xs = _mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p64f));
    const V y = _mm512_rsqrt14_ps(xs);
    const V s = _mm512_mul_ps(xs, y);
    const V h = _mm512_mul_ps(_mm512_set1_ps(0.5f), y);
    const V r = _mm512_fnmadd_ps(s, s, xs);
    V root = _mm512_fmadd_ps(r, h, s);
    root = _mm512_mask_mul_ps(root, tiny, root, _mm512_set1_ps(0x1p-32f));
    const __mmask16 pass = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                           _mm512_cmp_ps_mask(x, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(root, pass, x);
  }
  // MKL's non-Intel path is SSE code: the same eight-lane steps on each half (AVX-512F
  // machines have AVX2; the halves move through the 64-bit-lane casts AVX-512F has).
  static inline V sqrt_mkl_sse(V x) {
    const __m256 lo = mkl_sse_sqrt8(_mm512_castps512_ps256(x));
    const __m256 hi = mkl_sse_sqrt8(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
  }
  static inline V max_nan(V a, V b) {
    V m = _mm512_max_ps(a, b);
    const __mmask16 unordered = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_add_ps(m, unordered, a, b);
  }
};

#else
#error "define one of GOCKPT_LANES_PORTABLE, GOCKPT_LANES_AVX2, GOCKPT_LANES_AVX512"
#endif
