// gockpt._gockpt_native: CPU replay kernels for Adam/AdamW and SGD (GoCkpt §4.3).
//
// Python passes flat, C-contiguous buffers (numpy views of CPU tensors; bf16 as int16 or
// uint16 views, fp16 as float16) and per-tensor coefficients computed on the host exactly as
// torch.optim computes them. The kernels release the GIL and split the elements into chunks
// run by up to num_threads threads. Each kernel is compiled for a portable target and, on
// x86-64, for AVX2+FMA+F16C and AVX-512F through target regions; the best one the running CPU
// supports is picked at run time (the build machine may differ from the run machine, so
// nothing is compiled with -march=native). The build needs pybind11 headers only, not torch.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define GOCKPT_X86 1
#include <immintrin.h>
#else
#define GOCKPT_X86 0
#endif

#include "kernel_args.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own AVX-512 intrinsic headers (the _mm512_undefined_* idiom) here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace gockpt {

namespace portable {
#define GOCKPT_LANES_PORTABLE
#include "lanes.h"
#include "optim_kernels.inc"
#undef GOCKPT_LANES_PORTABLE
}  // namespace portable

#if GOCKPT_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#define GOCKPT_LANES_AVX2
#include "lanes.h"
#include "optim_kernels.inc"
#undef GOCKPT_LANES_AVX2
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif
namespace avx512 {
#define GOCKPT_LANES_AVX512
#include "lanes.h"
#include "optim_kernels.inc"
#undef GOCKPT_LANES_AVX512
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // GOCKPT_X86

namespace {

namespace py = pybind11;

enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

struct Kernels {
  void (*adam)(const AdamEntry&, const AdamFlags&, int64_t, int64_t);
  void (*sgd)(const SgdEntry&, const SgdFlags&, int64_t, int64_t);
  void (*sqrt)(const float*, float*, int64_t, SqrtKind);
};

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

bool cpu_has(Isa isa) {
#if GOCKPT_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx2) return avx2;
  if (isa == Isa::kAvx512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
  return isa == Isa::kPortable;
}

Kernels kernels_for(Isa isa) {
#if GOCKPT_X86
  if (isa == Isa::kAvx512) return {avx512::adam_run, avx512::sgd_run, avx512::sqrt_run};
  if (isa == Isa::kAvx2) return {avx2::adam_run, avx2::sgd_run, avx2::sqrt_run};
#endif
  return {portable::adam_run, portable::sgd_run, portable::sqrt_run};
}

std::vector<std::string> usable_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPortable}) {
    if (cpu_has(isa)) out.emplace_back(isa_name(isa));
  }
  return out;
}

Isa parse_isa(const std::string& name) {
  if (name == "auto") {
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2}) {
      if (cpu_has(isa)) return isa;
    }
    return Isa::kPortable;
  }
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPortable}) {
    if (name == isa_name(isa)) {
      if (!cpu_has(isa)) throw py::value_error("isa '" + name + "' is not supported by this CPU");
      return isa;
    }
  }
  throw py::value_error("isa must be 'auto', 'avx512', 'avx2' or 'portable', got '" + name + "'");
}

SqrtKind parse_sqrt(const std::string& name, Isa isa) {
  if (name == "ieee") return SqrtKind::kIeee;
  if (name == "mkl_avx512") {
    if (isa != Isa::kAvx512) {
      throw py::value_error("sqrt 'mkl_avx512' needs the avx512 kernels, selected isa is '" +
                            std::string(isa_name(isa)) + "'");
    }
    return SqrtKind::kMklAvx512;
  }
  if (name == "mkl_sse") {
    if (isa == Isa::kPortable) {
      throw py::value_error("sqrt 'mkl_sse' needs the avx2 or avx512 kernels, selected isa is "
                            "'portable'");
    }
    return SqrtKind::kMklSse;
  }
  throw py::value_error("sqrt must be 'ieee', 'mkl_avx512' or 'mkl_sse', got '" + name + "'");
}

Recipe parse_recipe(const std::string& name) {
  if (name == "aten_cpu") return Recipe::kAtenCpu;
  if (name == "cuda_foreach") return Recipe::kCudaForeach;
  if (name == "cuda_single") return Recipe::kCudaSingle;
  throw py::value_error("recipe must be 'aten_cpu', 'cuda_foreach' or 'cuda_single', got '" +
                        name + "'");
}

WeightDecay parse_wd(const std::string& name) {
  if (name == "none") return WeightDecay::kNone;
  if (name == "coupled") return WeightDecay::kCoupled;
  if (name == "decoupled") return WeightDecay::kDecoupled;
  throw py::value_error("weight_decay must be 'none', 'coupled' or 'decoupled', got '" + name +
                        "'");
}

// A flat, C-contiguous view of one buffer argument; `what` names it in errors.
py::buffer_info flat_view(const py::buffer& b, bool writable, const std::string& what) {
  py::buffer_info info = b.request(writable);
  int64_t expect = info.itemsize;
  for (int64_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expect) {
      throw py::value_error(what + " must be C-contiguous");
    }
    expect *= info.shape[d];
  }
  return info;
}

char format_code(const py::buffer_info& info) {
  return info.format.empty() ? '\0' : info.format.back();  // drops '<', '=', '@'
}

float* f32_ptr(const py::buffer_info& info, int64_t n, const std::string& what) {
  if (format_code(info) != 'f' || info.itemsize != 4) {
    throw py::type_error(what + " must be a float32 buffer, got format '" + info.format + "'");
  }
  if (info.size != n) {
    throw py::value_error(what + " has " + std::to_string(info.size) + " elements, expected " +
                          std::to_string(n));
  }
  return static_cast<float*>(info.ptr);
}

GradType grad_type(const py::buffer_info& info, const std::string& what) {
  const char c = format_code(info);
  if (c == 'f' && info.itemsize == 4) return GradType::kF32;
  if (c == 'e' && info.itemsize == 2) return GradType::kF16;
  if ((c == 'h' || c == 'H') && info.itemsize == 2) return GradType::kBF16;
  throw py::type_error(what + " must be float32, float16, or bfloat16 viewed as int16/uint16; "
                       "got format '" + info.format + "'");
}

struct Chunk {
  int64_t entry;
  int64_t begin;
  int64_t end;
};

constexpr int64_t kChunkElems = int64_t{1} << 16;

std::vector<Chunk> make_chunks(const std::vector<int64_t>& sizes) {
  std::vector<Chunk> chunks;
  for (int64_t e = 0; e < static_cast<int64_t>(sizes.size()); ++e) {
    for (int64_t b = 0; b < sizes[e]; b += kChunkElems) {
      chunks.push_back({e, b, std::min(sizes[e], b + kChunkElems)});
    }
  }
  return chunks;
}

// Runs body(chunk) for every chunk on up to num_threads threads (the caller included). The
// workers copy the caller's floating-point control state, so flush-to-zero settings of the
// calling thread apply to every element alike.
template <class F>
void run_chunks(const std::vector<Chunk>& chunks, int num_threads, F body) {
  const int64_t nt = std::min<int64_t>(std::max(num_threads, 1), chunks.size());
  if (nt <= 1) {
    for (const Chunk& c : chunks) body(c);
    return;
  }
  std::atomic<size_t> next{0};
#if GOCKPT_X86
  const unsigned int csr = _mm_getcsr();
#endif
  auto worker = [&]() {
#if GOCKPT_X86
    _mm_setcsr(csr);
#endif
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < chunks.size();) {
      body(chunks[i]);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(nt - 1);
  try {
    for (int64_t t = 1; t < nt; ++t) threads.emplace_back(worker);
  } catch (const std::system_error&) {
    // Fewer threads than asked: the ones started and the caller finish the work.
  }
  worker();
  for (std::thread& t : threads) t.join();
}

void adam_step(const py::list& params, const py::list& grads, const py::list& exp_avgs,
               const py::list& exp_avg_sqs, const py::list& max_exp_avg_sqs,
               const std::vector<std::vector<double>>& coefs, bool fma, const std::string& sqrt,
               const std::string& recipe, bool amsgrad, bool maximize,
               const std::string& weight_decay, int num_threads, const std::string& isa_arg) {
  const Isa isa = parse_isa(isa_arg);
  const AdamFlags flags{fma, amsgrad, maximize, parse_wd(weight_decay), parse_sqrt(sqrt, isa),
                        parse_recipe(recipe)};
  const size_t n = params.size();
  if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n || coefs.size() != n ||
      (amsgrad ? max_exp_avg_sqs.size() != n : max_exp_avg_sqs.size() != 0)) {
    throw py::value_error("adam_step: params, grads, exp_avgs, exp_avg_sqs, coefs (and "
                          "max_exp_avg_sqs with amsgrad, else empty) must have equal lengths");
  }
  std::vector<py::buffer_info> views;  // keeps the buffers exported while the kernel runs
  views.reserve(5 * n);
  std::vector<AdamEntry> entries(n);
  std::vector<int64_t> sizes(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    views.push_back(flat_view(params[i].cast<py::buffer>(), true, "params" + at));
    const int64_t numel = views.back().size;
    AdamEntry& e = entries[i];
    e.n = sizes[i] = numel;
    e.p = f32_ptr(views.back(), numel, "params" + at);
    views.push_back(flat_view(grads[i].cast<py::buffer>(), false, "grads" + at));
    e.gtype = grad_type(views.back(), "grads" + at);
    if (views.back().size != numel) throw py::value_error("grads" + at + " size mismatch");
    e.g = views.back().ptr;
    views.push_back(flat_view(exp_avgs[i].cast<py::buffer>(), true, "exp_avgs" + at));
    e.m = f32_ptr(views.back(), numel, "exp_avgs" + at);
    views.push_back(flat_view(exp_avg_sqs[i].cast<py::buffer>(), true, "exp_avg_sqs" + at));
    e.v = f32_ptr(views.back(), numel, "exp_avg_sqs" + at);
    e.vmax = nullptr;
    if (amsgrad) {
      views.push_back(
          flat_view(max_exp_avg_sqs[i].cast<py::buffer>(), true, "max_exp_avg_sqs" + at));
      e.vmax = f32_ptr(views.back(), numel, "max_exp_avg_sqs" + at);
    }
    const std::vector<double>& k = coefs[i];
    if (k.size() != 7) {
      throw py::value_error("coefs" + at + " must be (wd, 1-beta1, beta2, 1-beta2, "
                            "bias_correction2_sqrt, eps, -step_size)");
    }
    AdamCoef& c = e.c;
    c.wd = static_cast<float>(k[0]);
    c.w = static_cast<float>(k[1]);
    c.w1m = 1.0f - c.w;
    c.w_small = std::fabs(c.w) < 0.5f;
    c.b2 = static_cast<float>(k[2]);
    c.c2 = static_cast<float>(k[3]);
    c.bc2s = static_cast<float>(k[4]);
    c.bc2s_rcp = 1.0f / c.bc2s;
    c.eps = static_cast<float>(k[5]);
    c.value = static_cast<float>(k[6]);
  }
  const Kernels kern = kernels_for(isa);
  {
    py::gil_scoped_release release;
    const std::vector<Chunk> chunks = make_chunks(sizes);
    run_chunks(chunks, num_threads, [&](const Chunk& ch) {
      kern.adam(entries[ch.entry], flags, ch.begin, ch.end);
    });
  }
}

void sgd_step(const py::list& params, const py::list& grads, const py::list& momentum_buffers,
              const std::vector<bool>& init_buffers, const std::vector<std::vector<double>>& coefs,
              bool fma, bool maximize, bool weight_decay, bool momentum, bool nesterov,
              int num_threads, const std::string& isa_arg) {
  const Isa isa = parse_isa(isa_arg);
  const SgdFlags flags{fma, maximize, weight_decay, momentum, nesterov};
  const size_t n = params.size();
  if (grads.size() != n || coefs.size() != n ||
      (momentum ? (momentum_buffers.size() != n || init_buffers.size() != n)
                : momentum_buffers.size() != 0)) {
    throw py::value_error("sgd_step: params, grads, coefs (and momentum_buffers, init_buffers "
                          "with momentum, else empty) must have equal lengths");
  }
  std::vector<py::buffer_info> views;
  views.reserve(3 * n);
  std::vector<SgdEntry> entries(n);
  std::vector<int64_t> sizes(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    views.push_back(flat_view(params[i].cast<py::buffer>(), true, "params" + at));
    const int64_t numel = views.back().size;
    SgdEntry& e = entries[i];
    e.n = sizes[i] = numel;
    e.p = f32_ptr(views.back(), numel, "params" + at);
    views.push_back(flat_view(grads[i].cast<py::buffer>(), false, "grads" + at));
    e.gtype = grad_type(views.back(), "grads" + at);
    if (views.back().size != numel) throw py::value_error("grads" + at + " size mismatch");
    e.g = views.back().ptr;
    e.buf = nullptr;
    e.init_buf = false;
    if (momentum) {
      views.push_back(
          flat_view(momentum_buffers[i].cast<py::buffer>(), true, "momentum_buffers" + at));
      e.buf = f32_ptr(views.back(), numel, "momentum_buffers" + at);
      e.init_buf = init_buffers[i];
    }
    const std::vector<double>& k = coefs[i];
    if (k.size() != 4) {
      throw py::value_error("coefs" + at + " must be (weight_decay, momentum, 1-dampening, -lr)");
    }
    e.c = {static_cast<float>(k[0]), static_cast<float>(k[1]), static_cast<float>(k[2]),
           static_cast<float>(k[3])};
  }
  const Kernels kern = kernels_for(isa);
  {
    py::gil_scoped_release release;
    const std::vector<Chunk> chunks = make_chunks(sizes);
    run_chunks(chunks, num_threads, [&](const Chunk& ch) {
      kern.sgd(entries[ch.entry], flags, ch.begin, ch.end);
    });
  }
}

void sqrt_f32(const py::buffer& src, const py::buffer& dst, const std::string& flavour,
              const std::string& isa_arg) {
  const Isa isa = parse_isa(isa_arg);
  const SqrtKind kind = parse_sqrt(flavour, isa);
  py::buffer_info in = flat_view(src, false, "src");
  py::buffer_info out = flat_view(dst, true, "dst");
  const float* x = f32_ptr(in, in.size, "src");
  float* y = f32_ptr(out, in.size, "dst");
  const Kernels kern = kernels_for(isa);
  py::gil_scoped_release release;
  kern.sqrt(x, y, in.size, kind);
}

}  // namespace
}  // namespace gockpt

PYBIND11_MODULE(_gockpt_native, m) {
  namespace py = pybind11;
  using namespace pybind11::literals;
  m.doc() = "GoCkpt CPU replay kernels (Adam/AdamW, SGD); see gockpt._native.";
  m.def("isas", &gockpt::usable_isas,
        "Instruction sets whose kernels this CPU can run, best first.");
  m.def("adam_step", &gockpt::adam_step, "params"_a, "grads"_a, "exp_avgs"_a, "exp_avg_sqs"_a,
        "max_exp_avg_sqs"_a, "coefs"_a, py::kw_only(), "fma"_a, "sqrt"_a, "recipe"_a,
        "amsgrad"_a, "maximize"_a, "weight_decay"_a, "num_threads"_a = 1, "isa"_a = "auto",
        "One Adam/AdamW update of a list of tensors, in place (GIL released).");
  m.def("sgd_step", &gockpt::sgd_step, "params"_a, "grads"_a, "momentum_buffers"_a,
        "init_buffers"_a, "coefs"_a, py::kw_only(), "fma"_a, "maximize"_a, "weight_decay"_a,
        "momentum"_a, "nesterov"_a, "num_threads"_a = 1, "isa"_a = "auto",
        "One SGD update of a list of tensors, in place (GIL released).");
  m.def("sqrt", &gockpt::sqrt_f32, "src"_a, "dst"_a, "flavour"_a = "ieee", "isa"_a = "auto",
        "Elementwise square root of a float32 buffer with the kernels' sqrt flavour.");
}
