// Arguments of the replay kernels, shared by every instruction-set build of them.
//
// Shape legend: every array of one tensor entry has the same number of elements ``n``
// (the parameter's numel, flattened in memory order); coefficients are per tensor because
// each parameter carries its own step count (torch.optim state["step"]).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace gockpt {

enum class GradType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline int grad_bytes(GradType t) { return t == GradType::kF32 ? 4 : 2; }

// Which kernels' rounding to reproduce, beside FMA on/off and the sqrt flavour.
enum class Recipe : int {
  // ATen CPU kernels as torch.optim's single-tensor Adam calls them (also the CPU foreach
  // path, which runs the same kernels): v += (c2*g)*g as one FMA, p += (-step_size*m)/d.
  kAtenCpu = 0,
  // CUDA foreach kernels: v += c2*(g*g), p += -step_size*(m/d), d = sqrt(v)/bc2s + eps.
  kCudaForeach = 1,
  // CUDA single-tensor kernels: as kCudaForeach but sqrt(v) times the rounded reciprocal
  // of bc2s (ATen's CUDA division by a CPU scalar multiplies by its reciprocal).
  kCudaSingle = 2,
};

// kIeee: correctly rounded; kMklAvx512: MKL's AVX-512 path (Intel); kMklSse: MKL's generic SSE
// path (CPUs that are not Intel). See lanes.h.
enum class SqrtKind : int { kIeee = 0, kMklAvx512 = 1, kMklSse = 2 };

enum class WeightDecay : int { kNone = 0, kCoupled = 1, kDecoupled = 2 };

// Per-tensor Adam coefficients in binary32, converted once from the doubles (or 0-dim
// tensor values) torch computes on the host, exactly as ATen converts a Scalar.
struct AdamCoef {
  float wd;      // coupled: alpha of grad.add(param, alpha=wd); decoupled: 1 - lr*wd
  float w;       // lerp weight 1 - beta1
  float w1m;     // 1 - w, rounded in binary32 (ATen's lerp for weights >= 0.5)
  bool w_small;  // |w| < 0.5: which lerp formula ATen uses
  float b2;      // beta2
  float c2;      // 1 - beta2
  float bc2s;    // sqrt(1 - beta2^step)
  float bc2s_rcp;  // 1 / bc2s rounded in binary32 (Recipe::kCudaSingle)
  float eps;
  float value;   // -lr / (1 - beta1^step)
};

struct AdamEntry {
  float* p;              // (n,) fp32, updated in place
  const void* g;         // (n,) fp32 | fp16 | bf16
  float* m;              // (n,) fp32 exp_avg
  float* v;              // (n,) fp32 exp_avg_sq
  float* vmax;           // (n,) fp32 max_exp_avg_sq, or nullptr without amsgrad
  int64_t n;
  GradType gtype;
  AdamCoef c;
};

struct AdamFlags {
  bool fma;
  bool amsgrad;
  bool maximize;
  WeightDecay wd;
  SqrtKind sqrt;
  Recipe recipe;
};

struct SgdCoef {
  float wd;      // alpha of grad.add(param, alpha=weight_decay)
  float mom;     // momentum
  float damp1;   // 1 - dampening
  float neg_lr;  // -lr
};

struct SgdEntry {
  float* p;        // (n,) fp32, updated in place
  const void* g;   // (n,) fp32 | fp16 | bf16
  float* buf;      // (n,) fp32 momentum_buffer, or nullptr without momentum
  bool init_buf;   // first step: the buffer becomes a copy of the (decayed) gradient
  int64_t n;
  GradType gtype;
  SgdCoef c;
};

struct SgdFlags {
  bool fma;
  bool maximize;
  bool has_wd;
  bool has_momentum;
  bool nesterov;
};

// Exact conversions used by the portable lanes (the SIMD lanes convert in hardware).
inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exp = 113u;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace gockpt
