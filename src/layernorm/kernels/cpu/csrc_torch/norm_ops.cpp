// The norm kernels of ../csrc/norms.c as PyTorch operators whose autograd node is C++:
// layernorm_cpu::layer_norm, ::rms_norm and ::ada_norm on the rows of a contiguous tensor (its
// last dimension; any leading dimensions are rows).
//
// Why: a small call (a decoder's per-token norm) spends most of its time in the Python around
// the kernels (an autograd.Function, the argument checks, the kernel's struct), about 30 µs a
// forward and backward where torch's own layer norm, a C++ node, takes 20 in all. These operators
// do the same work from C++: they check their arguments, allocate the outputs, fill the kernels'
// argument structs (../csrc/layernorm_cpu_abi.h, generated from abi.py) and call the kernels of
// the instruction-set target Python selected, whose addresses Python hands over once
// (layernorm_cpu::set_kernel). The formulas, error model and results are the kernels' own: the
// operators add no arithmetic. layernorm/kernels/cpu/torch_ops.py builds and loads this file and
// states when the ops route here.
//
// Double backward (a backward under grad mode, create_graph=True) and a backward whose incoming
// gradient has no memory of its own (vmap's batched tensors, tensor subclasses) differentiate the
// Python reference instead, through the operator layernorm::norm_reference_grads, which Python
// registers (layernorm/ops/_reference_grads.py): the reference stays defined once, in Python.

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

extern "C" {
#define _Static_assert static_assert
#include "layernorm_cpu_abi.h"
#undef _Static_assert
}

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;

// Every kernel takes one pointer to its argument struct. The structs of one kernel differ between
// dtypes only in their pointers' element types (the header's static asserts give every instance
// the same offsets), so the float32 struct is filled for every dtype.
using Kernel = int (*)(const void*);
enum KernelId { LN_FWD, LN_BWD, RMS_FWD, RMS_BWD, ADA_FWD, ADA_BWD, KERNEL_COUNT };
constexpr std::array<const char*, KERNEL_COUNT> kKernelNames = {
    "ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd", "ada_fwd", "ada_bwd"};
// The instances' suffixes in abi.py, in the order of dtype_slot.
constexpr std::array<const char*, 4> kSuffixes = {"f32", "f64", "bf16", "f16"};
std::array<std::array<Kernel, 4>, KERNEL_COUNT> g_kernels{};

// Below this many elements one thread does the whole op; from this many bytes of (M, N) tensors
// moved an output bypasses the caches. Python's values (_native._GRAIN, STREAM_MIN_BYTES), which
// configure() sets before the kernels are handed over (no kernel runs before).
int64_t g_grain = 1;
int64_t g_stream_min_bytes = INT64_MAX;

int dtype_slot(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kBFloat16: return 2;
    case at::kHalf: return 3;
    default: return -1;
  }
}

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

at::ScalarType compute_dtype(at::ScalarType t) { return is_half(t) ? at::kFloat : t; }

Kernel kernel(KernelId id, at::ScalarType t, const char* op) {
  Kernel fn = g_kernels[id][dtype_slot(t)];
  TORCH_CHECK(fn != nullptr, op, ": the kernel ", kKernelNames[id], "_", kSuffixes[dtype_slot(t)],
              " was not set (layernorm.kernels.cpu.torch_ops loads the operators with them)");
  return fn;
}

void run(KernelId id, at::ScalarType t, const char* op, const void* args) {
  if (kernel(id, t, op)(args) != 0) {
    throw std::bad_alloc();  // the kernels' one failure: a buffer they could not allocate
  }
}

int32_t threads_for(int64_t m, int64_t n) {
  int64_t t = std::min<int64_t>(at::get_num_threads(), m);
  t = std::min<int64_t>(t, (m * n) / g_grain);
  return static_cast<int32_t>(std::max<int64_t>(1, t));
}

int32_t stream_for(const Tensor& x, int tensors) {
  return static_cast<int32_t>(tensors * x.numel() * static_cast<int64_t>(x.element_size()) >=
                              g_stream_min_bytes);
}

// A forward's stream flag on `threads` threads, a backward to follow or not
// (_native._stream_forward's rule): the half types' forwards keep plain stores; without a
// backward, on two threads or more, x alone must take the streaming size.
int32_t stream_forward(const Tensor& x, int32_t threads, bool for_backward) {
  return x.element_size() == 2 ? 0 : stream_for(x, threads >= 2 && !for_backward ? 1 : 2);
}

std::string describe(const Tensor& t) {
  std::string s = std::string(c10::toString(t.scalar_type())) + " tensor of shape " +
                  c10::str(t.sizes()) + " on " + t.device().str();
  if (!t.is_contiguous()) s += ", not contiguous";
  return s;
}

// x: the rows, a contiguous CPU tensor of a dtype the kernels have, each row its last dimension
// (N elements; M = numel / N rows, every leading dimension together).
void check_rows(const char* op, const char* name, const Tensor& x) {
  TORCH_CHECK(x.defined() && x.layout() == at::kStrided && x.device().is_cpu() && x.dim() >= 1 &&
                  x.is_contiguous() && dtype_slot(x.scalar_type()) >= 0 && x.size(-1) >= 1,
              op, ": expected ", name, " to be a contiguous CPU tensor of rows along its last "
              "dimension (N >= 1 elements), float32, float64, bfloat16 or float16, got ",
              x.defined() ? describe(x) : std::string("None"));
  TORCH_CHECK(!at::isTensorSubclassLike(x), op, ": ", name, " must be a plain tensor");
}

int64_t row_length(const Tensor& x) { return x.size(-1); }
int64_t row_count(const Tensor& x) { return x.numel() / x.size(-1); }

// A tensor of x's shape and dtype (an incoming gradient).
void check_like(const char* op, const char* name, const Tensor& t, const Tensor& x) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.device().is_cpu() &&
                  t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() &&
                  t.is_contiguous() && !at::isTensorSubclassLike(t),
              op, ": expected ", name, " to be a contiguous CPU tensor of x's shape ", x.sizes(),
              " and dtype ", x.scalar_type(), ", got ", t.defined() ? describe(t) : "None");
}

// A gain or bias: a contiguous CPU vector of N elements in x's dtype or its compute dtype.
void check_param(const char* op, const char* name, const OptTensor& p, const Tensor& x) {
  if (!p.has_value() || !p->defined()) return;
  const Tensor& t = *p;
  const auto dt = t.scalar_type();
  TORCH_CHECK(t.layout() == at::kStrided && t.device().is_cpu() && t.dim() == 1 &&
                  t.size(0) == row_length(x) && t.is_contiguous() && !at::isTensorSubclassLike(t) &&
                  (dt == x.scalar_type() || dt == compute_dtype(x.scalar_type())),
              op, ": expected ", name, " to be a contiguous 1-D CPU tensor of ", row_length(x),
              " elements in ", x.scalar_type(), " or ", compute_dtype(x.scalar_type()), ", got ",
              describe(t));
}

void check_eps(const char* op, double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps > 0, op, ": expected eps > 0 and finite, got ", eps);
}

void check_finite(const char* op, const char* name, double v) {
  TORCH_CHECK(std::isfinite(v), op, ": expected ", name, " to be finite, got ", v);
}

const Tensor* given(const OptTensor& p) { return p.has_value() && p->defined() ? &*p : nullptr; }
const Tensor* given(const Tensor& t) { return t.defined() ? &t : nullptr; }

// The kernels' half_params flag (_native._half_params): 1 where x is of a half type and every
// parameter given is in x's dtype.
int32_t half_params(const Tensor& x, std::initializer_list<const Tensor*> params) {
  if (!is_half(x.scalar_type())) return 0;
  bool any = false;
  for (const Tensor* p : params) {
    if (p == nullptr) continue;
    if (p->scalar_type() != x.scalar_type()) return 0;
    any = true;
  }
  return any ? 1 : 0;
}

// A gain or bias as the kernels take it: as it is with the half_params flag 1 (in x's dtype),
// else in the compute dtype (a half one beside a float32 one converted here).
Tensor kernel_param(const Tensor* p, const Tensor& x, int32_t half) {
  if (p == nullptr) return Tensor();
  const auto cdt = compute_dtype(x.scalar_type());
  return half || p->scalar_type() == cdt ? *p : p->to(cdt);
}

const void* ptr(const Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }
void* mut(const Tensor& t) { return t.defined() ? t.mutable_data_ptr() : nullptr; }

// A new contiguous CPU tensor from the CPU allocator itself, as torch's own CPU kernels make
// their outputs: at::empty and at::empty_like pass through the dispatcher first, a few hundred ns
// each of a per-token call's 20 µs, and a forward and backward make six.
Tensor new_cpu(at::IntArrayRef sizes, at::ScalarType dtype) {
  return Tensor(at::detail::empty_cpu(sizes, dtype));
}

Tensor new_like(const Tensor& x) { return new_cpu(x.sizes(), x.scalar_type()); }

Tensor stats(const Tensor& x, int64_t n) { return new_cpu({n}, compute_dtype(x.scalar_type())); }

bool grad_mode() { return c10::GradMode::is_enabled(); }

bool needs_grad(std::initializer_list<const Tensor*> ts) {
  if (!grad_mode()) return false;
  for (const Tensor* t : ts) {
    if (t != nullptr && t->requires_grad()) return true;
  }
  return false;
}

// ---- forward and backward of each norm: checked inputs, allocated outputs, one kernel call ----

struct LnForward {
  Tensor y, mean, rstd;
};

LnForward ln_forward(const char* op, const Tensor& x, const OptTensor& weight,
                     const OptTensor& bias, double eps, bool for_backward) {
  check_rows(op, "x", x);
  check_param(op, "weight", weight, x);
  check_param(op, "bias", bias, x);
  check_eps(op, eps);
  const int64_t m = row_count(x), n = row_length(x);
  const int32_t half = half_params(x, {given(weight), given(bias)});
  Tensor w = kernel_param(given(weight), x, half);
  Tensor b = kernel_param(given(bias), x, half);
  LnForward out{new_like(x), stats(x, m), stats(x, m)};
  ln_fwd_args_f32 a{};
  a.x = static_cast<const float*>(x.const_data_ptr());
  a.weight = ptr(w);
  a.bias = ptr(b);
  a.y = static_cast<float*>(out.y.mutable_data_ptr());
  a.mean = static_cast<float*>(out.mean.mutable_data_ptr());
  a.rstd = static_cast<float*>(out.rstd.mutable_data_ptr());
  a.M = m;
  a.N = n;
  a.eps = eps;
  a.threads = threads_for(m, n);
  a.stream = stream_forward(x, a.threads, for_backward);
  a.half_params = half;
  run(LN_FWD, x.scalar_type(), op, &a);
  return out;
}

// The gain's gradient in the dtype the backward's half_params flag gives it.
Tensor param_grad(const Tensor& x, int32_t half) {
  const int64_t n = row_length(x);
  return half ? new_cpu({n}, x.scalar_type()) : stats(x, n);
}

// The float32 sums of a half bias's gradient (the kernels' dbias is in the compute dtype) as a
// vector of that dtype, rounded to nearest even as a cast rounds them: here, where an ATen cast's
// dispatch and iterator took more of a per-token backward than the kernel (bfloat16 (1, 768),
// Intel Xeon: the node's forward + backward 1.08-1.13x torch's with the cast, 1.00-1.03x without).
Tensor rounded_to(const std::vector<float>& sums, at::ScalarType dtype) {
  Tensor out = new_cpu({static_cast<int64_t>(sums.size())}, dtype);
  if (dtype == at::kBFloat16) {
    auto* o = out.mutable_data_ptr<c10::BFloat16>();
    for (size_t j = 0; j < sums.size(); ++j) o[j] = c10::BFloat16(sums[j]);
  } else {
    TORCH_INTERNAL_ASSERT(dtype == at::kHalf, "rounded_to: a half dtype, got ", dtype);
    auto* o = out.mutable_data_ptr<c10::Half>();
    for (size_t j = 0; j < sums.size(); ++j) o[j] = c10::Half(sums[j]);
  }
  return out;
}

// dbias comes back in bias_dtype: the compute dtype's sums as they are, a half bias's rounded.
std::array<Tensor, 3> ln_backward(const char* op, const Tensor& dy, const Tensor& x,
                                  const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                  bool detach_mean, bool detach_std,
                                  std::array<bool, 3> needs, at::ScalarType bias_dtype) {
  check_like(op, "dy", dy, x);
  const int64_t m = row_count(x), n = row_length(x);
  const int32_t half = half_params(x, {given(weight)});
  Tensor dx = needs[0] ? new_like(x) : Tensor();
  Tensor dw = needs[1] && weight.defined() ? param_grad(x, half) : Tensor();
  const bool half_db = needs[2] && is_half(bias_dtype);
  std::vector<float> db_sums(half_db ? n : 0);
  Tensor db = needs[2] && !half_db ? stats(x, n) : Tensor();
  Tensor w = kernel_param(given(weight), x, half);
  ln_bwd_args_f32 a{};
  a.dy = static_cast<const float*>(dy.const_data_ptr());
  a.x = static_cast<const float*>(x.const_data_ptr());
  a.mean = static_cast<const float*>(mean.const_data_ptr());
  a.rstd = static_cast<const float*>(rstd.const_data_ptr());
  a.weight = ptr(w);
  a.dx = static_cast<float*>(mut(dx));
  a.dweight = mut(dw);
  a.dbias = half_db ? db_sums.data() : static_cast<float*>(mut(db));
  a.M = m;
  a.N = n;
  a.detach_mean = detach_mean;
  a.detach_std = detach_std;
  a.threads = threads_for(m, n);
  a.stream = stream_for(x, needs[0] ? 3 : 2);
  a.half_params = half;
  run(LN_BWD, x.scalar_type(), op, &a);
  return {dx, dw, half_db ? rounded_to(db_sums, bias_dtype) : db};
}

struct RmsForward {
  Tensor y, rstd;
};

RmsForward rms_forward(const char* op, const Tensor& x, const OptTensor& weight, double eps,
                       bool for_backward) {
  check_rows(op, "x", x);
  check_param(op, "weight", weight, x);
  check_eps(op, eps);
  const int64_t m = row_count(x), n = row_length(x);
  const int32_t half = half_params(x, {given(weight)});
  Tensor w = kernel_param(given(weight), x, half);
  RmsForward out{new_like(x), stats(x, m)};
  rms_fwd_args_f32 a{};
  a.x = static_cast<const float*>(x.const_data_ptr());
  a.weight = ptr(w);
  a.y = static_cast<float*>(out.y.mutable_data_ptr());
  a.rstd = static_cast<float*>(out.rstd.mutable_data_ptr());
  a.M = m;
  a.N = n;
  a.eps = eps;
  a.threads = threads_for(m, n);
  a.stream = stream_forward(x, a.threads, for_backward);
  a.half_params = half;
  run(RMS_FWD, x.scalar_type(), op, &a);
  return out;
}

std::array<Tensor, 2> rms_backward(const char* op, const Tensor& dy, const Tensor& x,
                                   const Tensor& rstd, const Tensor& weight,
                                   std::array<bool, 2> needs) {
  check_like(op, "dy", dy, x);
  const int64_t m = row_count(x), n = row_length(x);
  const int32_t half = half_params(x, {given(weight)});
  Tensor dx = needs[0] ? new_like(x) : Tensor();
  Tensor dw = needs[1] && weight.defined() ? param_grad(x, half) : Tensor();
  Tensor w = kernel_param(given(weight), x, half);
  rms_bwd_args_f32 a{};
  a.dy = static_cast<const float*>(dy.const_data_ptr());
  a.x = static_cast<const float*>(x.const_data_ptr());
  a.rstd = static_cast<const float*>(rstd.const_data_ptr());
  a.weight = ptr(w);
  a.dx = static_cast<float*>(mut(dx));
  a.dweight = mut(dw);
  a.M = m;
  a.N = n;
  a.threads = threads_for(m, n);
  a.stream = stream_for(x, needs[0] ? 3 : 2);
  a.half_params = half;
  run(RMS_BWD, x.scalar_type(), op, &a);
  return {dx, dw};
}

struct AdaForward {
  Tensor z, mean, rstd;
};

AdaForward ada_forward(const char* op, const Tensor& x, double k, double scale, double eps,
                       bool for_backward) {
  check_rows(op, "x", x);
  check_eps(op, eps);
  check_finite(op, "k", k);
  check_finite(op, "scale", scale);
  const int64_t m = row_count(x), n = row_length(x);
  AdaForward out{new_like(x), stats(x, m), stats(x, m)};
  ada_fwd_args_f32 a{};
  a.x = static_cast<const float*>(x.const_data_ptr());
  a.z = static_cast<float*>(out.z.mutable_data_ptr());
  a.mean = static_cast<float*>(out.mean.mutable_data_ptr());
  a.rstd = static_cast<float*>(out.rstd.mutable_data_ptr());
  a.M = m;
  a.N = n;
  a.eps = eps;
  a.k = k;
  a.scale = scale;
  a.threads = threads_for(m, n);
  a.stream = stream_forward(x, a.threads, for_backward);
  run(ADA_FWD, x.scalar_type(), op, &a);
  return out;
}

Tensor ada_backward(const char* op, const Tensor& dz, const Tensor& x, const Tensor& mean,
                    const Tensor& rstd, double k, double scale) {
  check_like(op, "dz", dz, x);
  const int64_t m = row_count(x), n = row_length(x);
  Tensor dx = new_like(x);
  ada_bwd_args_f32 a{};
  a.dz = static_cast<const float*>(dz.const_data_ptr());
  a.x = static_cast<const float*>(x.const_data_ptr());
  a.mean = static_cast<const float*>(mean.const_data_ptr());
  a.rstd = static_cast<const float*>(rstd.const_data_ptr());
  a.dx = static_cast<float*>(dx.mutable_data_ptr());
  a.M = m;
  a.N = n;
  a.k = k;
  a.scale = scale;
  a.threads = threads_for(m, n);
  a.stream = stream_for(x, 3);
  run(ADA_BWD, x.scalar_type(), op, &a);
  return dx;
}

// ---- the reference's gradients, for what the kernels' backward cannot give ----

// Whether a backward differentiates the reference (as ops/_dispatch.reference_backward): under
// grad mode (create_graph=True: the result must itself be differentiable), or for an incoming
// gradient whose memory no kernel can read.
bool reference_backward(const Tensor& grad) {
  return grad_mode() || at::isTensorSubclassLike(grad) || !grad.device().is_cpu() ||
         grad.layout() != at::kStrided;
}

// layernorm::norm_reference_grads(str norm, Tensor dy, Tensor x, Tensor? weight, Tensor? bias,
//     float[] scalars, bool[] flags, bool[] needs) -> Tensor?[]
std::vector<OptTensor> reference_grads(c10::string_view norm, const Tensor& dy, const Tensor& x,
                                       const Tensor& weight, const Tensor& bias,
                                       at::ArrayRef<double> scalars, at::ArrayRef<bool> flags,
                                       at::ArrayRef<bool> needs) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("layernorm::norm_reference_grads", "")
          .typed<std::vector<OptTensor>(c10::string_view, const Tensor&, const Tensor&,
                                        const OptTensor&, const OptTensor&, at::ArrayRef<double>,
                                        at::ArrayRef<bool>, at::ArrayRef<bool>)>();
  const OptTensor w = weight.defined() ? OptTensor(weight) : std::nullopt;
  const OptTensor b = bias.defined() ? OptTensor(bias) : std::nullopt;
  return op.call(norm, dy, x, w, b, scalars, flags, needs);
}

Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

// ---- autograd nodes ----

struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight,
                        const OptTensor& bias, double eps, bool detach_mean, bool detach_std) {
    auto out = ln_forward("layernorm_cpu::layer_norm", x, weight, bias, eps, true);
    ctx->save_for_backward({x, value_or_undefined(weight), value_or_undefined(bias), out.mean,
                            out.rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["detach_mean"] = detach_mean;
    ctx->saved_data["detach_std"] = detach_std;
    return out.y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
    const bool dm = ctx->saved_data["detach_mean"].toBool();
    const bool ds = ctx->saved_data["detach_std"].toBool();
    // needs_input_grad counts the tensors given (an absent weight has no edge)
    size_t edge = 1;
    const bool need_dw = weight.defined() && ctx->needs_input_grad(edge++);
    const bool need_db = bias.defined() && ctx->needs_input_grad(edge++);
    const std::array<bool, 3> needs = {ctx->needs_input_grad(0), need_dw, need_db};
    const Tensor& dy = grads[0];
    if (reference_backward(dy)) {
      auto g = reference_grads("layer_norm", dy, x, weight, bias,
                               {ctx->saved_data["eps"].toDouble()}, {dm, ds}, needs);
      return {value_or_undefined(g[0]), value_or_undefined(g[1]), value_or_undefined(g[2]),
              Tensor(), Tensor(), Tensor()};
    }
    const auto bias_dtype = bias.defined() ? bias.scalar_type() : x.scalar_type();
    auto g = ln_backward("layernorm_cpu::layer_norm (backward)", dy.contiguous(), x, saved[3],
                         saved[4], weight, dm, ds, needs, bias_dtype);
    return {g[0], g[1], g[2], Tensor(), Tensor(), Tensor()};
  }
};

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight,
                        double eps) {
    auto out = rms_forward("layernorm_cpu::rms_norm", x, weight, eps, true);
    ctx->save_for_backward({x, value_or_undefined(weight), out.rstd});
    ctx->saved_data["eps"] = eps;
    return out.y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1];
    // needs_input_grad counts the tensors given (an absent weight has no edge)
    const std::array<bool, 2> needs = {ctx->needs_input_grad(0),
                                       weight.defined() && ctx->needs_input_grad(1)};
    const Tensor& dy = grads[0];
    if (reference_backward(dy)) {
      auto g = reference_grads("rms_norm", dy, x, weight, Tensor(),
                               {ctx->saved_data["eps"].toDouble()}, {}, needs);
      return {value_or_undefined(g[0]), value_or_undefined(g[1]), Tensor()};
    }
    auto g = rms_backward("layernorm_cpu::rms_norm (backward)", dy.contiguous(), x, saved[2],
                          weight, needs);
    return {g[0], g[1], Tensor()};
  }
};

struct AdaNormFn : public torch::autograd::Function<AdaNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, double k, double scale,
                        double eps) {
    auto out = ada_forward("layernorm_cpu::ada_norm", x, k, scale, eps, true);
    ctx->save_for_backward({x, out.mean, out.rstd});
    ctx->saved_data["k"] = k;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["eps"] = eps;
    return out.z;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const double k = ctx->saved_data["k"].toDouble();
    const double scale = ctx->saved_data["scale"].toDouble();
    const Tensor& dz = grads[0];
    if (reference_backward(dz)) {
      auto g = reference_grads("ada_norm", dz, saved[0], Tensor(), Tensor(),
                               {k, scale, ctx->saved_data["eps"].toDouble()}, {}, {true});
      return {value_or_undefined(g[0]), Tensor(), Tensor(), Tensor()};
    }
    Tensor dx = ada_backward("layernorm_cpu::ada_norm (backward)", dz.contiguous(), saved[0],
                             saved[1], saved[2], k, scale);
    return {dx, Tensor(), Tensor(), Tensor()};
  }
};

// ---- the operators: the node where autograd records, the forward kernel alone otherwise ----

Tensor layer_norm_autograd(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                           double eps, bool detach_mean, bool detach_std) {
  if (!needs_grad({&x, given(weight), given(bias)})) {
    return ln_forward("layernorm_cpu::layer_norm", x, weight, bias, eps, false).y;
  }
  return LayerNormFn::apply(x, weight, bias, eps, detach_mean, detach_std);
}

Tensor layer_norm_cpu(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
                      bool, bool) {
  return ln_forward("layernorm_cpu::layer_norm", x, weight, bias, eps, false).y;
}

Tensor rms_norm_autograd(const Tensor& x, const OptTensor& weight, double eps) {
  if (!needs_grad({&x, given(weight)})) {
    return rms_forward("layernorm_cpu::rms_norm", x, weight, eps, false).y;
  }
  return RmsNormFn::apply(x, weight, eps);
}

Tensor rms_norm_cpu(const Tensor& x, const OptTensor& weight, double eps) {
  return rms_forward("layernorm_cpu::rms_norm", x, weight, eps, false).y;
}

Tensor ada_norm_autograd(const Tensor& x, double k, double scale, double eps) {
  if (!needs_grad({&x})) {
    return ada_forward("layernorm_cpu::ada_norm", x, k, scale, eps, false).z;
  }
  return AdaNormFn::apply(x, k, scale, eps);
}

Tensor ada_norm_cpu(const Tensor& x, double k, double scale, double eps) {
  return ada_forward("layernorm_cpu::ada_norm", x, k, scale, eps, false).z;
}

// set_kernel("ln_fwd_f32", address): the kernel of that name in the loaded library.
void set_kernel(c10::string_view name, int64_t address) {
  const std::string s(name);
  for (int id = 0; id < KERNEL_COUNT; ++id) {
    for (size_t slot = 0; slot < kSuffixes.size(); ++slot) {
      if (s == std::string(kKernelNames[id]) + "_" + kSuffixes[slot]) {
        TORCH_CHECK(address != 0, "layernorm_cpu::set_kernel: a null address for ", s);
        g_kernels[id][slot] = reinterpret_cast<Kernel>(static_cast<intptr_t>(address));
        return;
      }
    }
  }
  TORCH_CHECK(false, "layernorm_cpu::set_kernel: no kernel named ", s);
}

void configure(int64_t grain, int64_t stream_min_bytes) {
  TORCH_CHECK(grain >= 1 && stream_min_bytes >= 0, "layernorm_cpu::configure: expected grain >= 1 "
              "and stream_min_bytes >= 0, got ", grain, " and ", stream_min_bytes);
  g_grain = grain;
  g_stream_min_bytes = stream_min_bytes;
}

}  // namespace

TORCH_LIBRARY(layernorm_cpu, m) {
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, bool detach_mean=False, "
        "bool detach_std=False) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("ada_norm(Tensor x, float k, float scale, float eps) -> Tensor");
  m.def("set_kernel(str name, int address) -> ()", set_kernel);
  m.def("configure(int grain, int stream_min_bytes) -> ()", configure);
}

TORCH_LIBRARY_IMPL(layernorm_cpu, Autograd, m) {
  m.impl("layer_norm", layer_norm_autograd);
  m.impl("rms_norm", rms_norm_autograd);
  m.impl("ada_norm", ada_norm_autograd);
}

TORCH_LIBRARY_IMPL(layernorm_cpu, CPU, m) {
  m.impl("layer_norm", layer_norm_cpu);
  m.impl("rms_norm", rms_norm_cpu);
  m.impl("ada_norm", ada_norm_cpu);
}
