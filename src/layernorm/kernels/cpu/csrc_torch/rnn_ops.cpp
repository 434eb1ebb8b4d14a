// The LN-LSTM's planned training call (layernorm/recurrent/_planned.py) as an operator whose
// autograd node is C++: layernorm_cpu::lstm_planned(x, h0, c0, w_hh, w1, b1, w3, b3, w0, b0,
// w_ih, b_ih, b_hh, plan) -> (out, h_n, c_n). Below it, on the same struct templates, the
// cells' training step (layernorm_cpu::lstm_cell_step, ::gru_cell_step: see "The cells'
// training step"), and the Elman cell's, torch's ops in one node (::elman_cell_step).
//
// Why: at small shapes the Python around the sequence kernels (an autograd.Function, a dozen
// buffers, four argument structs a call) takes as long as a tenth to a third of the call: at
// (T, B, I, H) = (50, 8, 64, 128), one thread, 380 µs over a node that computes nothing, where
// the kernels take about 3 ms. Here the same work runs from C++.
//
// What stays in Python: every decision. The plan (LstmPlan, built once per call signature by
// _planned.py) holds each kernel's argument struct with its fixed fields already packed and
// checked (rnn_abi.BoundStruct.template), the byte offsets of the fields a call fills, each
// product's route (torch's GEMM or the C GEMM, as the Python path would take it for the
// signature) and the kernels' addresses. This file fills the per-call fields, allocates the
// buffers, runs the kernels and products in the Python path's order, so the results are its bits
// (tests/test_recurrent_planned.py compares them).

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <c10/core/GradMode.h>
#include <ATen/core/Dict.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;

constexpr const char* kOp = "layernorm_cpu::lstm_planned";
// The kernels' status for a buffer they could not allocate (RNN_ERR_NOMEM of
// ../csrc/layernorm_rnn_abi.h; every other status is an argument the plan checked).
constexpr int kErrNoMem = 2;

// The values a call puts into the structs, by the names of the fields that take them (a
// template's slot names, from rnn_abi.BoundStruct.template): each slot is resolved to one of these
// when the plan is made, so that filling a struct compares no strings.
// (The cells' structs, below, name their layer norms' gains and biases w_ih, b_ih, w_hh, b_hh,
// w_c, b_c.)
enum ValueId {
  V_KEPT, V_SCRATCH, V_X, V_W, V_W_IH, V_W1, V_B1, V_W3, V_B3, V_W0, V_B0, V_GX, V_H, V_C, V_OUT,
  V_DOUT, V_DH, V_DC, V_C0, V_DX, V_HP_GRADS, V_C_GRADS, V_X_GRADS, V_Y, V_DHP, V_HPREV, V_DW,
  V_THREADS, V_HP, V_B_IH, V_W_HH, V_B_HH, V_W_C, V_B_C, V_H_OUT, V_C_OUT, V_GATES, V_TC, V_STATS,
  V_RZ, V_N, V_GHN, V_DGX, V_DC_PREV, V_DPARAMS, V_DCPARAMS, VALUE_COUNT
};
constexpr const char* kValueNames[VALUE_COUNT] = {
    "kept", "scratch", "x", "w", "w_ih", "w1", "b1", "w3", "b3", "w0", "b0", "gx", "h", "c", "out",
    "dout", "dh", "dc", "c0", "dx", "hp_grads", "c_grads", "x_grads", "y", "dhp", "hprev", "dw",
    "threads", "hp", "b_ih", "w_hh", "b_hh", "w_c", "b_c", "h_out", "c_out", "gates", "tc",
    "stats", "rz", "n", "ghn", "dgx", "dc_prev", "dparams", "dcparams"};

// One value a call puts into a struct: a pointer (nullptr: absent) or a 4-byte count.
struct Value {
  ValueId id;
  const void* ptr;
  int64_t count;
};

Value ptr_of(ValueId id, const Tensor& t) {
  return {id, t.defined() ? t.const_data_ptr() : nullptr, -1};
}
Value count_of(ValueId id, int64_t n) { return {id, nullptr, n}; }

// A kernel's argument struct with its fixed fields packed (bytes) and the fields a call fills:
// each a pointer at `offset` (plus `add` bytes: a block of a region) or, with add == -1, a
// 4-byte count; `required`: a pointer that may not be null. A slot whose name is none of
// kValueNames is never given a value (VALUE_COUNT): a null pointer, as Python's pack leaves a
// field the call does not name.
class Template {
 public:
  struct Slot {
    std::string name;
    int64_t offset, add;
    bool required;
    ValueId value = VALUE_COUNT;
  };

  Template() = default;
  // op: the operator that names the plan in errors
  Template(const Tensor& bytes, std::vector<Slot> slots, const char* op = kOp)
      : slots_(std::move(slots)), op_(op) {
    TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1 && bytes.is_contiguous() &&
                    bytes.device().is_cpu(),
                op, ": a struct template must be a contiguous 1-D uint8 CPU tensor");
    const auto* p = bytes.const_data_ptr<uint8_t>();
    bytes_.assign(p, p + bytes.numel());
    for (Slot& s : slots_) {
      const int64_t width = s.add < 0 ? 4 : 8;
      TORCH_CHECK(s.offset >= 0 && s.offset + width <= static_cast<int64_t>(bytes_.size()) &&
                      s.offset % width == 0,
                  op, ": field ", s.name, " at byte ", s.offset, " lies outside its struct of ",
                  bytes_.size(), " bytes");
      for (int v = 0; v < VALUE_COUNT; ++v) {
        if (s.name == kValueNames[v]) s.value = static_cast<ValueId>(v);
      }
      TORCH_CHECK(s.add >= 0 || s.value != VALUE_COUNT, op, ": count field ", s.name,
                  " is no value a call gives");
    }
  }

  bool empty() const { return bytes_.empty(); }

  // The struct of one call: every slot takes the value of its name, a pointer slot without one
  // null (as Python's pack leaves a field the call does not name; a required one is an error).
  std::vector<uint8_t> fill(std::initializer_list<Value> values) const {
    static const Value absent{VALUE_COUNT, nullptr, -1};
    const Value* given[VALUE_COUNT + 1] = {};
    for (const Value& v : values) given[v.id] = &v;
    std::vector<uint8_t> out = bytes_;
    for (const Slot& s : slots_) {
      const Value* v = given[s.value] ? given[s.value] : &absent;
      if (s.add < 0) {
        TORCH_CHECK(v->count >= 1 && v->count <= INT32_MAX, op_, ": bad count for ", s.name);
        const int32_t n = static_cast<int32_t>(v->count);
        std::memcpy(out.data() + s.offset, &n, sizeof n);
      } else {
        TORCH_CHECK(v->ptr != nullptr || !s.required, op_, ": field ", s.name, " needs a tensor");
        const uintptr_t address =
            v->ptr == nullptr ? 0 : reinterpret_cast<uintptr_t>(v->ptr) + static_cast<uintptr_t>(s.add);
        std::memcpy(out.data() + s.offset, &address, sizeof address);
      }
    }
    return out;
  }

 private:
  std::vector<uint8_t> bytes_;
  std::vector<Slot> slots_;
  const char* op_ = kOp;
};

using SeqKernel = int (*)(const void*, const void*);
using OneKernel = int (*)(const void*);

void check_status(int status, const char* kernel) {
  if (status == kErrNoMem) throw std::bad_alloc();
  TORCH_CHECK(status == 0, "layernorm recurrent CPU kernel ", kernel, " refused the plan's "
              "arguments (status ", status, ")");
}

// How a product runs, as the Python path routes it for the plan's signature
// (_planned._routes): torch's GEMM, the C GEMM, a weight's gradient by transposed_product
// (torch's GEMM dᵀ·x into a new buffer, or (xᵀ·d)ᵀ copied), or a gradient's product with both
// operands rounded to bfloat16 by torch's bfloat16 GEMM (_cstep.rounded_product: inside the
// rounded recurrent products).
enum Route : int64_t {
  TORCH = 0, C_GEMM = 1, TRANSPOSED = 2, TRANSPOSED_SWAPPED = 3, ROUNDED = 4
};

// a · b into out (float32) as _cstep.rounded_product computes it: both rounded to bfloat16
// (a transposed operand stays transposed), products summed in float32, the result rounded once.
Tensor rounded_product(Tensor& out, const Tensor& a, const Tensor& b) {
  return out.copy_(at::mm(a.to(at::kBFloat16), b.to(at::kBFloat16)));
}

// Template indices, in the order Python hands them over.
enum TemplateId { FWD, SEQ_FWD, BWD, SEQ_BWD, PROJ, DX, DW_HH, DW_IH, TEMPLATE_COUNT };
// The plan's settings, handed over by name (_planned._node_plan).
enum ConfigId {
  IN_LOOP, REVERSE, ROWS, BATCH, HIDDEN, GATES, INPUTS, KEPT_NUMEL, SCRATCH_NUMEL, DHP_OFFSET,
  DGATES_OFFSET, PROJ_ROUTE, DX_ROUTE, DW_HH_ROUTE, DW_IH_ROUTE, LAYER_NORM, CONFIG_COUNT
};
constexpr const char* kConfigNames[CONFIG_COUNT] = {
    "in_loop", "reverse", "rows", "batch", "hidden", "gates", "inputs", "kept_numel",
    "scratch_numel", "dhp_offset", "dgates_offset", "proj_route", "dx_route", "dw_hh_route",
    "dw_ih_route", "layer_norm"};
enum KernelId { K_FWD_SEQ, K_BWD_SEQ, K_MATMUL, K_WEIGHT_GRAD, KERNEL_COUNT };

// A training plan of one call signature (see the top of this file and _planned.TrainingPlan).
struct LstmPlan : torch::CustomClassHolder {
  Template templates[TEMPLATE_COUNT];
  int64_t config[CONFIG_COUNT] = {};
  intptr_t kernels[KERNEL_COUNT] = {};
  at::ScalarType dtype = at::kFloat;
  Tensor defaults[6];  // ones and zeros for w1, b1, w3, b3, w0, b0
  std::string double_backward, batched_backward;  // the backward's refusals (_fused's)

  // structs[i]: template i's bytes (empty: unused); slots: (template, name, offset, add,
  // required) flattened as names + (template, offset, add, required) quadruples; cfg: every
  // setting of kConfigNames; refusals: "double_backward" and "batched_backward".
  LstmPlan(std::vector<Tensor> structs, std::vector<std::string> names, std::vector<int64_t> where,
           std::vector<int64_t> kernel_addresses, c10::Dict<std::string, int64_t> cfg,
           std::vector<Tensor> gains_and_biases, c10::Dict<std::string, std::string> refusals) {
    TORCH_CHECK(structs.size() == TEMPLATE_COUNT && kernel_addresses.size() == KERNEL_COUNT &&
                    gains_and_biases.size() == 6 && where.size() == 4 * names.size(),
                kOp, ": a plan takes ", TEMPLATE_COUNT, " structs, ", KERNEL_COUNT,
                " kernels, 6 defaults and 4 numbers a field");
    for (int i = 0; i < CONFIG_COUNT; ++i) {
      TORCH_CHECK(cfg.contains(kConfigNames[i]), kOp, ": a plan's settings lack ",
                  kConfigNames[i]);
      config[i] = cfg.at(kConfigNames[i]);
    }
    TORCH_CHECK(cfg.size() == CONFIG_COUNT, kOp, ": a plan takes the ", CONFIG_COUNT,
                " settings of kConfigNames, got ", cfg.size());
    TORCH_CHECK(refusals.contains("double_backward") && refusals.contains("batched_backward"),
                kOp, ": a plan takes its backward's refusals");
    double_backward = refusals.at("double_backward");
    batched_backward = refusals.at("batched_backward");
    std::vector<std::vector<Template::Slot>> slots(TEMPLATE_COUNT);
    for (size_t i = 0; i < names.size(); ++i) {
      const int64_t t = where[4 * i];
      TORCH_CHECK(t >= 0 && t < TEMPLATE_COUNT, kOp, ": field ", names[i], " of no struct");
      slots[t].push_back({names[i], where[4 * i + 1], where[4 * i + 2], where[4 * i + 3] != 0});
    }
    for (int t = 0; t < TEMPLATE_COUNT; ++t) {
      if (structs[t].numel() > 0) templates[t] = Template(structs[t], std::move(slots[t]));
    }
    for (int i = 0; i < KERNEL_COUNT; ++i) kernels[i] = static_cast<intptr_t>(kernel_addresses[i]);
    TORCH_CHECK(kernels[K_FWD_SEQ] != 0 && kernels[K_BWD_SEQ] != 0 && !templates[FWD].empty() &&
                    !templates[SEQ_FWD].empty() && !templates[BWD].empty() &&
                    !templates[SEQ_BWD].empty(),
                kOp, ": a plan needs the sequence kernels and their structs");
    for (int i = 0; i < 6; ++i) defaults[i] = gains_and_biases[i];
    dtype = defaults[0].scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, kOp,
                ": the sequence kernels take float32 or float64, got ", dtype);
  }

  int64_t operator[](ConfigId i) const { return config[i]; }

  // The settings by name, as the plan was given them (for tests).
  c10::Dict<std::string, int64_t> settings() const {
    c10::Dict<std::string, int64_t> out;
    for (int i = 0; i < CONFIG_COUNT; ++i) out.insert(kConfigNames[i], config[i]);
    return out;
  }

  void run_seq(KernelId k, const char* name, const std::vector<uint8_t>& a,
               const std::vector<uint8_t>& s) const {
    check_status(reinterpret_cast<SeqKernel>(kernels[k])(a.data(), s.data()), name);
  }

  void run_one(KernelId k, const char* name, const std::vector<uint8_t>& a) const {
    TORCH_CHECK(kernels[k] != 0, kOp, ": the plan has no ", name, " kernel");
    check_status(reinterpret_cast<OneKernel>(kernels[k])(a.data()), name);
  }
};

Tensor new_cpu(at::IntArrayRef sizes, at::ScalarType dtype) {
  return Tensor(at::detail::empty_cpu(sizes, dtype));
}

int64_t threads() { return std::max<int64_t>(1, at::get_num_threads()); }

// a · wᵀ (transposed: w as W_ih is stored, (N, K)) or a · w into a new (M, cols) tensor, by the
// plan's route (_cstep.input_product).
Tensor input_product(const LstmPlan& plan, Route route, TemplateId t, const Tensor& a,
                     const Tensor& w, bool transposed) {
  const int64_t cols = transposed ? w.size(0) : w.size(1);
  Tensor out = new_cpu({a.size(0), cols}, a.scalar_type());
  if (route == C_GEMM) {
    plan.run_one(K_MATMUL, "matmul",
                 plan.templates[t].fill({ptr_of(V_X, a), ptr_of(V_W, w), ptr_of(V_Y, out),
                                         count_of(V_THREADS, threads())}));
    return out;
  }
  if (route == ROUNDED) return rounded_product(out, a, transposed ? w.t() : w);
  return at::mm_out(out, a, transposed ? w.t() : w);
}

// dᵀ · x, a weight's gradient over every row (_fused._weight_grad by the plan's route).
Tensor weight_grad(const LstmPlan& plan, Route route, TemplateId t, const Tensor& d,
                   const Tensor& x) {
  switch (route) {
    case TORCH:
      return d.t().mm(x);
    case C_GEMM: {
      Tensor dw = new_cpu({d.size(1), x.size(1)}, d.scalar_type());
      plan.run_one(K_WEIGHT_GRAD, "weight_grad",
                   plan.templates[t].fill({ptr_of(V_DHP, d), ptr_of(V_HPREV, x), ptr_of(V_DW, dw),
                                           count_of(V_THREADS, threads())}));
      return dw;
    }
    case TRANSPOSED: {
      Tensor out = new_cpu({d.size(1), x.size(1)}, d.scalar_type());
      return at::mm_out(out, d.t(), x);
    }
    case TRANSPOSED_SWAPPED: {
      Tensor out = new_cpu({d.size(1), x.size(1)}, d.scalar_type());
      Tensor swapped = new_cpu({x.size(1), d.size(1)}, d.scalar_type());
      return out.copy_(at::mm_out(swapped, x.t(), d).t());
    }
    case ROUNDED: {
      Tensor out = new_cpu({d.size(1), x.size(1)}, d.scalar_type());
      return rounded_product(out, d.t(), x);
    }
  }
  TORCH_CHECK(false, kOp, ": no product route ", static_cast<int64_t>(route));
}

void check_input(const char* name, const Tensor& t, at::IntArrayRef shape, at::ScalarType dtype,
                 const char* op = kOp) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.device().is_cpu() &&
                  t.scalar_type() == dtype && t.sizes() == shape && !at::isTensorSubclassLike(t),
              op, ": expected ", name, " to be a ", dtype, " CPU tensor of shape ", shape,
              ", got ", t.defined() ? std::string(c10::toString(t.scalar_type())) + " tensor of "
              "shape " + c10::str(t.sizes()) + " on " + t.device().str() : std::string("None"));
}

void check_optional(const char* name, const OptTensor& t, int64_t n, at::ScalarType dtype,
                    const char* op = kOp) {
  if (t.has_value() && t->defined()) check_input(name, *t, {n}, dtype, op);
}

const Tensor& or_default(const OptTensor& t, const Tensor& fallback) {
  return t.has_value() && t->defined() ? *t : fallback;
}

Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

struct Forward {
  Tensor out, h, c, previous, gx, kept, x, c0, w_hh, w_ih, w1, w3, w0;
};

// PlannedLSTMSequence.forward of _planned.py, step for step.
Forward lstm_forward(const LstmPlan& plan, const Tensor& x_in, const Tensor& h0_in,
                     const Tensor& c0_in, const Tensor& w_hh_in, const OptTensor& w1,
                     const OptTensor& b1, const OptTensor& w3, const OptTensor& b3,
                     const OptTensor& w0, const OptTensor& b0, const Tensor& w_ih_in,
                     const OptTensor& b_ih, const OptTensor& b_hh) {
  const auto dt = plan.dtype;
  const int64_t n = plan[ROWS], batch = plan[BATCH], hs = plan[HIDDEN], g = plan[GATES],
                inputs = plan[INPUTS];
  check_input("x", x_in, {n, inputs}, dt);
  check_input("h0", h0_in, {batch, hs}, dt);
  check_input("c0", c0_in, {batch, hs}, dt);
  check_input("w_hh", w_hh_in, {g, hs}, dt);
  check_input("w_ih", w_ih_in, {g, inputs}, dt);
  check_optional("w1", w1, g, dt);
  check_optional("b1", b1, g, dt);
  check_optional("w3", w3, hs, dt);
  check_optional("b3", b3, hs, dt);
  check_optional("w0", w0, g, dt);
  check_optional("b0", b0, g, dt);
  check_optional("b_ih", b_ih, g, dt);
  check_optional("b_hh", b_hh, g, dt);
  const bool biases = b_ih.has_value() && b_ih->defined();
  TORCH_CHECK(biases == (b_hh.has_value() && b_hh->defined()), kOp,
              ": expected both of torch's biases b_ih, b_hh or neither");
  Forward f;
  f.x = x_in.contiguous();
  f.w_hh = w_hh_in.contiguous();
  f.w_ih = w_ih_in.contiguous();
  f.kept = new_cpu({plan[KEPT_NUMEL]}, dt);
  const bool in_loop = plan[IN_LOOP] != 0, reverse = plan[REVERSE] != 0;
  if (!in_loop) {
    f.gx = input_product(plan, static_cast<Route>(plan[PROJ_ROUTE]), PROJ, f.x, f.w_ih, true);
  }
  // _fused.fold_input_bias: (b_ih + b_hh) + b0
  Tensor bias0 = value_or_undefined(b0);
  if (biases) {
    Tensor folded = at::add(*b_ih, *b_hh);
    bias0 = bias0.defined() ? folded.add_(bias0) : folded;
  }
  // without layer norms gx = x W_ihᵀ + b0: added here, or by the time loop to each step's rows
  // (_fused.LSTMSequence's plain input side)
  const bool layer_norm = plan[LAYER_NORM] != 0;
  if (!layer_norm && !in_loop && bias0.defined()) f.gx.add_(bias0);
  const Tensor h0 = h0_in.contiguous();
  f.c0 = c0_in.contiguous();
  // _fused._output_and_previous: the output's buffer has B more rows, h0's copy, before its rows
  // (after them in reverse); previous is every row's h_{t−1}
  Tensor full = new_cpu({n + batch, hs}, dt);
  f.out = at::empty({0}, full.options())
              .set_(full.storage(), full.storage_offset() + (reverse ? 0 : batch * hs), {n, hs},
                    {hs, 1});
  (reverse ? full.narrow(0, n, batch) : full.narrow(0, 0, batch)).copy_(h0);
  f.previous = reverse ? full.narrow(0, batch, n) : full.narrow(0, 0, n);
  f.h = h0.clone();
  f.c = f.c0.clone();
  f.w1 = or_default(w1, plan.defaults[0]);
  const Tensor& pb1 = or_default(b1, plan.defaults[1]);
  f.w3 = or_default(w3, plan.defaults[2]);
  const Tensor& pb3 = or_default(b3, plan.defaults[3]);
  f.w0 = or_default(w0, plan.defaults[4]);
  const Tensor& pb0 = bias0.defined() ? bias0 : plan.defaults[5];
  const auto args = plan.templates[FWD].fill(
      {ptr_of(V_KEPT, f.kept), ptr_of(V_W1, f.w1), ptr_of(V_B1, pb1), ptr_of(V_W3, f.w3),
       ptr_of(V_B3, pb3), ptr_of(V_W0, f.w0), ptr_of(V_B0, pb0), ptr_of(V_GX, f.gx),
       ptr_of(V_H, f.h), ptr_of(V_C, f.c), ptr_of(V_OUT, f.out)});
  const auto seq = plan.templates[SEQ_FWD].fill(
      {ptr_of(V_W, f.w_hh), count_of(V_THREADS, threads()), ptr_of(V_X, in_loop ? f.x : Tensor()),
       ptr_of(V_W_IH, in_loop ? f.w_ih : Tensor()),
       ptr_of(V_B0, in_loop && !layer_norm ? bias0 : Tensor())});
  plan.run_seq(K_FWD_SEQ, "lstm_fwd_seq", args, seq);
  return f;
}

constexpr int kTensorArgs = 13;  // x, h0, c0, w_hh, w1, b1, w3, b3, w0, b0, w_ih, b_ih, b_hh

struct LstmPlannedFn : public torch::autograd::Function<LstmPlannedFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& h0,
                               const Tensor& c0, const Tensor& w_hh, const OptTensor& w1,
                               const OptTensor& b1, const OptTensor& w3, const OptTensor& b3,
                               const OptTensor& w0, const OptTensor& b0, const Tensor& w_ih,
                               const OptTensor& b_ih, const OptTensor& b_hh,
                               const c10::intrusive_ptr<LstmPlan>& plan) {
    Forward f = lstm_forward(*plan, x, h0, c0, w_hh, w1, b1, w3, b3, w0, b0, w_ih, b_ih, b_hh);
    // the output is saved for autograd's check that nothing wrote it since (previous is its
    // memory, read by the backward)
    ctx->save_for_backward({f.x, f.c0, f.w_hh, f.w_ih, f.w1, f.w3, f.w0, f.out, f.previous, f.gx,
                            f.kept});
    ctx->saved_data["plan"] = plan;
    // which of the 13 tensor arguments were given (an absent one has no edge)
    const OptTensor* opt[] = {&w1, &b1, &w3, &b3, &w0, &b0};
    int64_t given = 0b1111 | (1 << 10);
    for (int i = 0; i < 6; ++i) {
      if (opt[i]->has_value() && (*opt[i])->defined()) given |= int64_t{1} << (4 + i);
    }
    if (b_ih.has_value() && b_ih->defined()) given |= int64_t{1} << 11;
    if (b_hh.has_value() && b_hh->defined()) given |= int64_t{1} << 12;
    ctx->saved_data["given"] = given;
    return {f.out, f.h, f.c};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto plan = ctx->saved_data["plan"].toCustomClass<LstmPlan>();
    const LstmPlan& p = *plan;
    TORCH_CHECK(!c10::GradMode::is_enabled(), p.double_backward);
    TORCH_CHECK(!at::isTensorSubclassLike(grads[0]) && grads[0].device().is_cpu() &&
                    grads[0].layout() == at::kStrided,
                p.batched_backward);
    const int64_t given = ctx->saved_data["given"].toInt();
    bool need[kTensorArgs];
    for (int i = 0, edge = 0; i < kTensorArgs; ++i) {
      need[i] = (given >> i & 1) && ctx->needs_input_grad(edge++);
    }
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &c0 = saved[1], &w_hh = saved[2], &w_ih = saved[3],
                 &w1 = saved[4], &w3 = saved[5], &w0 = saved[6], &previous = saved[8],
                 &gx = saved[9], &kept = saved[10];
    const auto dt = p.dtype;
    const int64_t n = p[ROWS], hs = p[HIDDEN], g = p[GATES], inputs = p[INPUTS];
    Tensor scratch = new_cpu({p[SCRATCH_NUMEL]}, dt);
    const Tensor dout = grads[0].contiguous();
    const Tensor dh = grads[1].contiguous().clone();
    const Tensor dc = grads[2].contiguous().clone();
    check_input("the output's gradient", dout, {n, hs}, dt);
    const bool need_b0 = need[9] || need[11] || need[12];  // b0's gradient is b_ih's and b_hh's
    const bool layer_norm = p[LAYER_NORM] != 0;
    Tensor sums_hp, sums_c, sums_x;
    if (layer_norm && (need[4] || need[5] || need[6] || need[7] || need[8] || need_b0)) {
      Tensor sums = new_cpu({4 * g + 2 * hs}, dt);
      sums_hp = sums.narrow(0, 0, 2 * g);
      sums_c = sums.narrow(0, 2 * g, 2 * hs);
      sums_x = sums.narrow(0, 2 * g + 2 * hs, 2 * g);
    }
    const bool x_in_loop = p[IN_LOOP] != 0 && need[0];
    Tensor dx = x_in_loop ? new_cpu({n, inputs}, dt) : Tensor();
    const auto args = p.templates[BWD].fill(
        {ptr_of(V_KEPT, kept), ptr_of(V_SCRATCH, scratch), ptr_of(V_DOUT, dout), ptr_of(V_DH, dh),
         ptr_of(V_DC, dc), ptr_of(V_W1, w1), ptr_of(V_W3, w3), ptr_of(V_C0, c0), ptr_of(V_W0, w0),
         ptr_of(V_GX, gx)});
    const auto seq = p.templates[SEQ_BWD].fill(
        {ptr_of(V_W, w_hh), count_of(V_THREADS, threads()),
         ptr_of(V_W_IH, x_in_loop ? w_ih : Tensor()), ptr_of(V_DX, dx),
         ptr_of(V_HP_GRADS, sums_hp), ptr_of(V_C_GRADS, sums_c), ptr_of(V_X_GRADS, sums_x)});
    p.run_seq(K_BWD_SEQ, "lstm_bwd_seq", args, seq);
    const Tensor dhp = scratch.narrow(0, p[DHP_OFFSET], n * g).view({n, g});
    Tensor d_w_hh = need[3] ? weight_grad(p, static_cast<Route>(p[DW_HH_ROUTE]), DW_HH, dhp,
                                          previous)
                            : Tensor();
    auto half = [](const Tensor& s, int k, bool needed) {
      return needed ? s.chunk(2)[k] : Tensor();
    };
    Tensor dw1, db1, dw3, db3, dw0, db0;
    if (sums_hp.defined()) {
      dw1 = half(sums_hp, 0, need[4]);
      db1 = half(sums_hp, 1, need[5]);
      dw3 = half(sums_c, 0, need[6]);
      db3 = half(sums_c, 1, need[7]);
      dw0 = half(sums_x, 0, need[8]);
      db0 = half(sums_x, 1, need_b0);
    }
    // dgates: the kernel turned it into the raw projection's gradient
    const Tensor dgates = scratch.narrow(0, p[DGATES_OFFSET], n * g).view({n, g});
    if (!layer_norm && need_b0) db0 = dgates.sum(0);  // b0 added to x W_ihᵀ: dgates summed
    Tensor d_x = x_in_loop ? dx : Tensor();
    if (need[0] && !x_in_loop) {
      d_x = input_product(p, static_cast<Route>(p[DX_ROUTE]), DX, dgates, w_ih, false);
    }
    Tensor d_w_ih =
        need[10] ? weight_grad(p, static_cast<Route>(p[DW_IH_ROUTE]), DW_IH, dgates, x) : Tensor();
    return {d_x, dh, dc, d_w_hh, dw1, db1, dw3, db3, dw0, need[9] ? db0 : Tensor(), d_w_ih,
            need[11] ? db0 : Tensor(), need[12] ? db0 : Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> lstm_planned(
    const Tensor& x, const Tensor& h0, const Tensor& c0, const Tensor& w_hh, const OptTensor& w1,
    const OptTensor& b1, const OptTensor& w3, const OptTensor& b3, const OptTensor& w0,
    const OptTensor& b0, const Tensor& w_ih, const OptTensor& b_ih, const OptTensor& b_hh,
    const c10::intrusive_ptr<LstmPlan>& plan) {
  auto r = LstmPlannedFn::apply(x, h0, c0, w_hh, w1, b1, w3, b3, w0, b0, w_ih, b_ih, b_hh, plan);
  return {r[0], r[1], r[2]};
}

// Where autograd does not record (no input requires grad, or gradients are off): the forward.
std::tuple<Tensor, Tensor, Tensor> lstm_planned_forward(
    const Tensor& x, const Tensor& h0, const Tensor& c0, const Tensor& w_hh, const OptTensor& w1,
    const OptTensor& b1, const OptTensor& w3, const OptTensor& b3, const OptTensor& w0,
    const OptTensor& b0, const Tensor& w_ih, const OptTensor& b_ih, const OptTensor& b_hh,
    const c10::intrusive_ptr<LstmPlan>& plan) {
  Forward f = lstm_forward(*plan, x, h0, c0, w_hh, w1, b1, w3, b3, w0, b0, w_ih, b_ih, b_hh);
  return {f.out, f.h, f.c};
}

// ---- The cells' training step ----
//
// layernorm_cpu::lstm_cell_step(x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh,
//     lw_c, lb_c, plan) -> (h_t, c_t) and layernorm_cpu::gru_cell_step(x, h, w_ih, w_hh, b_ih,
//     b_hh, lw_ih, lb_ih, lw_hh, lb_hh, plan) -> h_t: _cellstep.LSTMCellStep and GRUCellStep
// (one step of a cell with gradients: the two products, the cell kernel forward, the cell
// kernel backward and the products' gradients) with a C++ node, for float32 and float64. At
// (B, I, H) = (1, 64, 128) the autograd.Function's Python (its frames, the two structs' checks,
// the buffers) took about a quarter of a step forward and backward. The plan (CellPlan, made
// once per signature by _cellstep.cell_plan) holds the two structs with their sizes and eps
// packed (rnn_abi.BoundStruct.template) and the kernels' addresses; this code checks the
// tensors, makes the same products and buffers in the same order as the Function, so the
// results are its bits (tests/test_recurrent_cells.py compares them). Its backward under grad
// mode (create_graph=True) or for gradients with no memory of their own (vmap's batched
// tensors) differentiates the step's ops instead, through layernorm::cell_reference_grads, which
// _cellstep registers: the reference stays defined once, in Python.

constexpr const char* kCellOp = "layernorm_cpu::lstm_cell_step / gru_cell_step";
enum CellTemplateId { CELL_FWD, CELL_BWD, CELL_TEMPLATES };
// The plan's sizes, in the order Python hands them over.
enum CellSizeId { CELL_ROWS, CELL_INPUTS, CELL_HIDDEN, CELL_GATES, CELL_STATS, CELL_SIZES };

struct CellPlan : torch::CustomClassHolder {
  std::string cell;  // "lstm" or "gru": the reference's name
  Template templates[CELL_TEMPLATES];
  intptr_t kernels[CELL_TEMPLATES] = {};
  int64_t sizes[CELL_SIZES] = {};
  double eps = 0;
  at::ScalarType dtype = at::kFloat;

  // structs: the forward's and the backward's bytes; names + where (template, offset, add,
  // required): their call fields, as LstmPlan's; kernel_addresses: forward, backward; sizes:
  // rows, inputs, hidden, gates, statistics a row (CellSizeId); like: a tensor of the dtype.
  CellPlan(std::string cell_name, std::vector<Tensor> structs, std::vector<std::string> names,
           std::vector<int64_t> where, std::vector<int64_t> kernel_addresses,
           std::vector<int64_t> plan_sizes, double plan_eps, Tensor like)
      : cell(std::move(cell_name)), eps(plan_eps), dtype(like.scalar_type()) {
    TORCH_CHECK(cell == "lstm" || cell == "gru", kCellOp, ": no cell named ", cell);
    TORCH_CHECK(structs.size() == CELL_TEMPLATES && kernel_addresses.size() == CELL_TEMPLATES &&
                    plan_sizes.size() == CELL_SIZES && where.size() == 4 * names.size(),
                kCellOp, ": a plan takes ", CELL_TEMPLATES, " structs and kernels, ", CELL_SIZES,
                " sizes and 4 numbers a field");
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, kCellOp,
                ": the cell kernels take float32 or float64, got ", dtype);
    std::vector<std::vector<Template::Slot>> slots(CELL_TEMPLATES);
    for (size_t i = 0; i < names.size(); ++i) {
      const int64_t t = where[4 * i];
      TORCH_CHECK(t >= 0 && t < CELL_TEMPLATES, kCellOp, ": field ", names[i], " of no struct");
      slots[t].push_back({names[i], where[4 * i + 1], where[4 * i + 2], where[4 * i + 3] != 0});
    }
    for (int t = 0; t < CELL_TEMPLATES; ++t) {
      TORCH_CHECK(kernel_addresses[t] != 0 && structs[t].numel() > 0, kCellOp,
                  ": a plan needs both cell kernels and their structs");
      templates[t] = Template(structs[t], std::move(slots[t]), kCellOp);
      kernels[t] = static_cast<intptr_t>(kernel_addresses[t]);
    }
    for (int i = 0; i < CELL_SIZES; ++i) {
      TORCH_CHECK(plan_sizes[i] >= 1, kCellOp, ": a plan's sizes must be >= 1");
      sizes[i] = plan_sizes[i];
    }
    TORCH_CHECK(sizes[CELL_GATES] == (cell == "lstm" ? 4 : 3), kCellOp, ": an ", cell,
                " has ", cell == "lstm" ? 4 : 3, " gates");
  }

  int64_t operator[](CellSizeId i) const { return sizes[i]; }

  void run(CellTemplateId t, const char* name, const std::vector<uint8_t>& args) const {
    check_status(reinterpret_cast<OneKernel>(kernels[t])(args.data()), name);
  }
};

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// The layer norm's bias with torch's bias added (they meet in every gate), or zeros
// (_cellstep._bias_sum).
Tensor bias_sum(const OptTensor& ln_bias, const OptTensor& bias, int64_t n, at::ScalarType dt) {
  if (given(ln_bias)) return given(bias) ? at::add(*ln_bias, *bias) : ln_bias->contiguous();
  return given(bias) ? bias->contiguous() : at::zeros({n}, at::TensorOptions().dtype(dt));
}

// What both cells' steps take into their kernel forward: the raw projections gx = x W_ihᵀ and
// hp = h W_hhᵀ, the layer norms' gains, and their biases with torch's added.
struct CellSides {
  Tensor gx, hp, g_ih, g_hh, bias_ih, bias_hh;
};

// The checks every step makes (each tensor of its shape and the plan's dtype on the CPU), then
// the step's sides, as _cellstep's Functions make them (h as the caller passes it).
CellSides cell_sides(const CellPlan& p, const Tensor& x, const Tensor& h, const Tensor& w_ih,
                     const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                     const Tensor& lw_ih, const OptTensor& lb_ih, const Tensor& lw_hh,
                     const OptTensor& lb_hh) {
  const auto dt = p.dtype;
  const int64_t rows = p[CELL_ROWS], hs = p[CELL_HIDDEN], gh = p[CELL_GATES] * hs;
  check_input("x", x, {rows, p[CELL_INPUTS]}, dt, kCellOp);
  check_input("h", h, {rows, hs}, dt, kCellOp);
  check_input("w_ih", w_ih, {gh, p[CELL_INPUTS]}, dt, kCellOp);
  check_input("w_hh", w_hh, {gh, hs}, dt, kCellOp);
  check_optional("b_ih", b_ih, gh, dt, kCellOp);
  check_optional("b_hh", b_hh, gh, dt, kCellOp);
  check_input("lw_ih", lw_ih, {gh}, dt, kCellOp);
  check_optional("lb_ih", lb_ih, gh, dt, kCellOp);
  check_input("lw_hh", lw_hh, {gh}, dt, kCellOp);
  check_optional("lb_hh", lb_hh, gh, dt, kCellOp);
  return {at::mm(x, w_ih.t()), at::mm(h, w_hh.t()), lw_ih.contiguous(), lw_hh.contiguous(),
          bias_sum(lb_ih, b_ih, gh, dt), bias_sum(lb_hh, b_hh, gh, dt)};
}

// layernorm::cell_reference_grads(str cell, Tensor[] douts, Tensor?[] inputs, float eps,
//     bool[] needs) -> Tensor?[]
std::vector<OptTensor> cell_reference_grads(const std::string& cell, at::TensorList douts,
                                            const variable_list& inputs, double eps,
                                            const std::vector<bool>& needs) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("layernorm::cell_reference_grads", "")
                       .typed<std::vector<OptTensor>(c10::string_view, at::TensorList,
                                                     const c10::List<OptTensor>&, double,
                                                     at::ArrayRef<bool>)>();
  c10::List<OptTensor> given_inputs;
  for (const Tensor& t : inputs) given_inputs.push_back(t.defined() ? OptTensor(t) : std::nullopt);
  const std::unique_ptr<bool[]> flags(new bool[needs.size()]);
  for (size_t i = 0; i < needs.size(); ++i) flags[i] = needs[i];
  return op.call(cell, douts, given_inputs, eps, at::ArrayRef<bool>(flags.get(), needs.size()));
}

// Whether a backward differentiates the reference (ops/_dispatch.reference_backward).
bool cell_reference_backward(const variable_list& grads) {
  if (c10::GradMode::is_enabled()) return true;
  for (const Tensor& g : grads) {
    if (g.defined() && (at::isTensorSubclassLike(g) || !g.device().is_cpu() ||
                        g.layout() != at::kStrided)) {
      return true;
    }
  }
  return false;
}

// Which of a node's inputs need a gradient: inputs[i] given (an absent optional has no edge)
// and its edge asking for one.
std::vector<bool> needs_of(AutogradContext* ctx, const variable_list& inputs) {
  std::vector<bool> need(inputs.size());
  for (size_t i = 0, edge = 0; i < inputs.size(); ++i) {
    need[i] = inputs[i].defined() && ctx->needs_input_grad(edge++);
  }
  return need;
}

variable_list reference_result(const std::vector<OptTensor>& grads) {
  variable_list out;
  for (const OptTensor& g : grads) out.push_back(g.has_value() ? *g : Tensor());
  out.push_back(Tensor());  // the plan
  return out;
}

Tensor optional_tensor(const OptTensor& t) { return given(t) ? *t : Tensor(); }

// _cellstep._product_grads: x's, h's, W_ih's and W_hh's gradients (those need asks for) through
// gx = x W_ihᵀ and hp = h W_hhᵀ; dh_direct: h's gradient that bypasses W_hh, added.
std::array<Tensor, 4> product_grads(const bool need[4], const Tensor& dgx, const Tensor& dhp,
                                    const Tensor& x, const Tensor& h, const Tensor& w_ih,
                                    const Tensor& w_hh, const Tensor& dh_direct) {
  Tensor dh;
  if (need[1]) dh = dh_direct.defined() ? at::addmm(dh_direct, dhp, w_hh) : at::mm(dhp, w_hh);
  return {need[0] ? at::mm(dgx, w_ih) : Tensor(), dh, need[2] ? at::mm(dgx.t(), x) : Tensor(),
          need[3] ? at::mm(dhp.t(), h) : Tensor()};
}

// The buffers of one LSTM step forward: h_t and c_t, and what its backward reads.
struct LstmCellForward {
  Tensor h_out, c_out, gx, hp, gates, tc, stats;
};

LstmCellForward lstm_cell_forward(const CellPlan& p, const Tensor& x, const Tensor& h,
                                  const Tensor& c_in, const Tensor& w_ih, const Tensor& w_hh,
                                  const OptTensor& b_ih, const OptTensor& b_hh,
                                  const Tensor& lw_ih, const OptTensor& lb_ih, const Tensor& lw_hh,
                                  const OptTensor& lb_hh, const Tensor& lw_c,
                                  const OptTensor& lb_c) {
  const auto dt = p.dtype;
  const int64_t rows = p[CELL_ROWS], hs = p[CELL_HIDDEN];
  TORCH_CHECK(p.cell == "lstm", kCellOp, ": an LSTM step needs an LSTM plan");
  check_input("c", c_in, {rows, hs}, dt, kCellOp);
  check_input("lw_c", lw_c, {hs}, dt, kCellOp);
  check_optional("lb_c", lb_c, hs, dt, kCellOp);
  const CellSides in = cell_sides(p, x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh);
  const Tensor c = c_in.contiguous();
  LstmCellForward f;
  f.gx = in.gx;
  f.hp = in.hp;
  f.h_out = new_cpu({rows, hs}, dt);
  f.c_out = new_cpu({rows, hs}, dt);
  f.tc = new_cpu({rows, hs}, dt);
  f.gates = new_cpu({rows, 4 * hs}, dt);
  f.stats = new_cpu({rows, p[CELL_STATS]}, dt);
  const Tensor g_c = lw_c.contiguous(), bias_c = bias_sum(lb_c, std::nullopt, hs, dt);
  p.run(CELL_FWD, "lstm_cell_fwd",
        p.templates[CELL_FWD].fill(
            {ptr_of(V_GX, f.gx), ptr_of(V_HP, f.hp), ptr_of(V_C, c), ptr_of(V_W_IH, in.g_ih),
             ptr_of(V_B_IH, in.bias_ih), ptr_of(V_W_HH, in.g_hh), ptr_of(V_B_HH, in.bias_hh),
             ptr_of(V_W_C, g_c), ptr_of(V_B_C, bias_c), ptr_of(V_H_OUT, f.h_out),
             ptr_of(V_C_OUT, f.c_out), ptr_of(V_GATES, f.gates), ptr_of(V_TC, f.tc),
             ptr_of(V_STATS, f.stats)}));
  return f;
}

struct LstmCellFn : public torch::autograd::Function<LstmCellFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& h,
                               const Tensor& c, const Tensor& w_ih, const Tensor& w_hh,
                               const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& lw_ih,
                               const OptTensor& lb_ih, const Tensor& lw_hh, const OptTensor& lb_hh,
                               const Tensor& lw_c, const OptTensor& lb_c,
                               const c10::intrusive_ptr<CellPlan>& plan) {
    LstmCellForward f = lstm_cell_forward(*plan, x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih,
                                          lw_hh, lb_hh, lw_c, lb_c);
    ctx->save_for_backward({x, h, c, w_ih, w_hh, optional_tensor(b_ih), optional_tensor(b_hh),
                            lw_ih, optional_tensor(lb_ih), lw_hh, optional_tensor(lb_hh), lw_c,
                            optional_tensor(lb_c), f.gx, f.hp, f.c_out, f.gates, f.tc, f.stats});
    ctx->saved_data["plan"] = plan;
    return {f.h_out, f.c_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto plan = ctx->saved_data["plan"].toCustomClass<CellPlan>();
    const CellPlan& p = *plan;
    const variable_list saved = ctx->get_saved_variables();
    const variable_list inputs(saved.begin(), saved.begin() + 13);
    const std::vector<bool> need = needs_of(ctx, inputs);
    if (cell_reference_backward(grads)) {
      return reference_result(cell_reference_grads("lstm", grads, inputs, p.eps, need));
    }
    const Tensor &x = saved[0], &h = saved[1], &c = saved[2], &w_ih = saved[3], &w_hh = saved[4],
                 &lw_ih = saved[7], &lw_hh = saved[9], &lw_c = saved[11], &gx = saved[13],
                 &hp = saved[14], &c_out = saved[15], &gates = saved[16], &tc = saved[17],
                 &stats = saved[18];
    const auto dt = p.dtype;
    const int64_t rows = p[CELL_ROWS], hs = p[CELL_HIDDEN];
    const Tensor dh = grads[0].contiguous(), dc = grads[1].contiguous();
    check_input("h_t's gradient", dh, {rows, hs}, dt, kCellOp);
    check_input("c_t's gradient", dc, {rows, hs}, dt, kCellOp);
    const Tensor dgx = new_cpu({rows, 4 * hs}, dt), dhp = new_cpu({rows, 4 * hs}, dt);
    const Tensor dc_prev = new_cpu({rows, hs}, dt), dparams = new_cpu({4, 4 * hs}, dt),
                 dcparams = new_cpu({2, hs}, dt);
    const Tensor c_kept = c.contiguous(), g_ih = lw_ih.contiguous(), g_hh = lw_hh.contiguous(),
                 g_c = lw_c.contiguous();
    p.run(CELL_BWD, "lstm_cell_bwd",
          p.templates[CELL_BWD].fill(
              {ptr_of(V_DH, dh), ptr_of(V_DC, dc), ptr_of(V_GX, gx), ptr_of(V_HP, hp),
               ptr_of(V_C, c_kept), ptr_of(V_C_OUT, c_out), ptr_of(V_W_IH, g_ih),
               ptr_of(V_W_HH, g_hh), ptr_of(V_W_C, g_c), ptr_of(V_GATES, gates), ptr_of(V_TC, tc),
               ptr_of(V_STATS, stats), ptr_of(V_DGX, dgx), ptr_of(V_DHP, dhp),
               ptr_of(V_DC_PREV, dc_prev), ptr_of(V_DPARAMS, dparams),
               ptr_of(V_DCPARAMS, dcparams)}));
    const bool products[4] = {need[0], need[1], need[3], need[4]};
    auto [dx, dh_prev, dw_ih, dw_hh] = product_grads(products, dgx, dhp, x, h, w_ih, w_hh, Tensor());
    const auto sums = dparams.unbind(0);  // gains and biases of LN(gx), LN(hp)
    const auto c_sums = dcparams.unbind(0);
    return {dx,
            dh_prev,
            need[2] ? dc_prev : Tensor(),
            dw_ih,
            dw_hh,
            need[5] ? sums[1].clone() : Tensor(),  // the same sums as the LN biases', apart
            need[6] ? sums[3].clone() : Tensor(),
            need[7] ? sums[0] : Tensor(),
            need[8] ? sums[1] : Tensor(),
            need[9] ? sums[2] : Tensor(),
            need[10] ? sums[3] : Tensor(),
            need[11] ? c_sums[0] : Tensor(),
            need[12] ? c_sums[1] : Tensor(),
            Tensor()};
  }
};

// The buffers of one GRU step forward: h_t, and what its backward reads.
struct GruCellForward {
  Tensor out, gx, hp, rz, n, ghn, stats;
};

GruCellForward gru_cell_forward(const CellPlan& p, const Tensor& x, const Tensor& h_in,
                                const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                                const OptTensor& b_hh, const Tensor& lw_ih, const OptTensor& lb_ih,
                                const Tensor& lw_hh, const OptTensor& lb_hh) {
  const auto dt = p.dtype;
  const int64_t rows = p[CELL_ROWS], hs = p[CELL_HIDDEN];
  TORCH_CHECK(p.cell == "gru", kCellOp, ": a GRU step needs a GRU plan");
  check_input("h", h_in, {rows, hs}, dt, kCellOp);  // before it is made contiguous
  const Tensor h = h_in.contiguous();
  const CellSides in = cell_sides(p, x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh);
  GruCellForward f;
  f.gx = in.gx;
  f.hp = in.hp;
  f.out = new_cpu({rows, hs}, dt);
  f.rz = new_cpu({rows, 2 * hs}, dt);
  f.n = new_cpu({rows, hs}, dt);
  f.ghn = new_cpu({rows, hs}, dt);
  f.stats = new_cpu({rows, p[CELL_STATS]}, dt);
  p.run(CELL_FWD, "gru_cell_fwd",
        p.templates[CELL_FWD].fill(
            {ptr_of(V_GX, f.gx), ptr_of(V_HP, f.hp), ptr_of(V_H, h), ptr_of(V_W_IH, in.g_ih),
             ptr_of(V_B_IH, in.bias_ih), ptr_of(V_W_HH, in.g_hh), ptr_of(V_B_HH, in.bias_hh),
             ptr_of(V_OUT, f.out), ptr_of(V_RZ, f.rz), ptr_of(V_N, f.n), ptr_of(V_GHN, f.ghn),
             ptr_of(V_STATS, f.stats)}));
  return f;
}

struct GruCellFn : public torch::autograd::Function<GruCellFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& h,
                        const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                        const OptTensor& b_hh, const Tensor& lw_ih, const OptTensor& lb_ih,
                        const Tensor& lw_hh, const OptTensor& lb_hh,
                        const c10::intrusive_ptr<CellPlan>& plan) {
    GruCellForward f =
        gru_cell_forward(*plan, x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh);
    ctx->save_for_backward({x, h, w_ih, w_hh, optional_tensor(b_ih), optional_tensor(b_hh), lw_ih,
                            optional_tensor(lb_ih), lw_hh, optional_tensor(lb_hh), f.gx, f.hp,
                            f.rz, f.n, f.ghn, f.stats});
    ctx->saved_data["plan"] = plan;
    return f.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto plan = ctx->saved_data["plan"].toCustomClass<CellPlan>();
    const CellPlan& p = *plan;
    const variable_list saved = ctx->get_saved_variables();
    const variable_list inputs(saved.begin(), saved.begin() + 10);
    const std::vector<bool> need = needs_of(ctx, inputs);
    if (cell_reference_backward(grads)) {
      return reference_result(cell_reference_grads("gru", grads, inputs, p.eps, need));
    }
    const Tensor &x = saved[0], &h_in = saved[1], &w_ih = saved[2], &w_hh = saved[3],
                 &lw_ih = saved[6], &lw_hh = saved[8], &gx = saved[10], &hp = saved[11],
                 &rz = saved[12], &n = saved[13], &ghn = saved[14], &stats = saved[15];
    const auto dt = p.dtype;
    const int64_t rows = p[CELL_ROWS], hs = p[CELL_HIDDEN];
    const Tensor dout = grads[0].contiguous();
    check_input("h_t's gradient", dout, {rows, hs}, dt, kCellOp);
    const Tensor h = h_in.contiguous(), g_ih = lw_ih.contiguous(), g_hh = lw_hh.contiguous();
    const Tensor dgx = new_cpu({rows, 3 * hs}, dt), dhp = new_cpu({rows, 3 * hs}, dt);
    const Tensor dh = new_cpu({rows, hs}, dt), dparams = new_cpu({4, 3 * hs}, dt);
    p.run(CELL_BWD, "gru_cell_bwd",
          p.templates[CELL_BWD].fill(
              {ptr_of(V_DOUT, dout), ptr_of(V_GX, gx), ptr_of(V_HP, hp), ptr_of(V_H, h),
               ptr_of(V_W_IH, g_ih), ptr_of(V_W_HH, g_hh), ptr_of(V_RZ, rz), ptr_of(V_N, n),
               ptr_of(V_GHN, ghn), ptr_of(V_STATS, stats), ptr_of(V_DGX, dgx), ptr_of(V_DHP, dhp),
               ptr_of(V_DH, dh), ptr_of(V_DPARAMS, dparams)}));
    const bool products[4] = {need[0], need[1], need[2], need[3]};
    auto [dx, dh_prev, dw_ih, dw_hh] = product_grads(products, dgx, dhp, x, h, w_ih, w_hh, dh);
    const auto sums = dparams.unbind(0);
    return {dx,
            dh_prev,
            dw_ih,
            dw_hh,
            need[4] ? sums[1].clone() : Tensor(),  // the same sums as the LN biases', apart
            need[5] ? sums[3].clone() : Tensor(),
            need[6] ? sums[0] : Tensor(),
            need[7] ? sums[1] : Tensor(),
            need[8] ? sums[2] : Tensor(),
            need[9] ? sums[3] : Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor> lstm_cell_step(
    const Tensor& x, const Tensor& h, const Tensor& c, const Tensor& w_ih, const Tensor& w_hh,
    const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& lw_ih, const OptTensor& lb_ih,
    const Tensor& lw_hh, const OptTensor& lb_hh, const Tensor& lw_c, const OptTensor& lb_c,
    const c10::intrusive_ptr<CellPlan>& plan) {
  auto r = LstmCellFn::apply(x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh, lw_c,
                             lb_c, plan);
  return {r[0], r[1]};
}

Tensor gru_cell_step(const Tensor& x, const Tensor& h, const Tensor& w_ih, const Tensor& w_hh,
                     const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& lw_ih,
                     const OptTensor& lb_ih, const Tensor& lw_hh, const OptTensor& lb_hh,
                     const c10::intrusive_ptr<CellPlan>& plan) {
  return GruCellFn::apply(x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh, plan);
}


// ---- The Elman cell's training step ----
//
// layernorm_cpu::elman_cell_step(x, h, w_ih, w_hh, b_ih, b_hh, lw, lb, eps, relu) -> h_t: the
// LN-RNN cell's step h_t = f(LN(x W_ihᵀ + h W_hhᵀ; lw, lb) + b_ih + b_hh) (_steps.rnn_step with
// torch's layer norm, as the cell's ops run it up to _dispatch.TORCH_KERNEL_NUMEL elements) as one
// node whose forward and backward are torch's own ops called from C++: the ops' results and
// derivatives (autograd's formulas for mm, native_layer_norm, the bias adds and tanh / relu), one
// node where the ops took seven and their Python. Double and batched backward take the step's
// ops through layernorm::cell_reference_grads, as the other cells' nodes do.

constexpr const char* kElmanOp = "layernorm_cpu::elman_cell_step";

// h_t, and what the backward reads: the pre-activation a and its row statistics.
struct ElmanForward {
  Tensor out, a, mean, rstd;
};

ElmanForward elman_forward(const Tensor& x, const Tensor& h, const Tensor& w_ih,
                           const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                           const OptTensor& lw, const OptTensor& lb, double eps, bool relu) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, kElmanOp, ": expected x to be (B, I) rows, got ",
                "shape ", x.sizes());
    const auto dt = x.scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, kElmanOp,
                ": the step takes float32 or float64, got ", dt);
    const int64_t rows = x.size(0), inputs = x.size(1), hs = w_hh.size(0);
    check_input("x", x, {rows, inputs}, dt, kElmanOp);
    check_input("h", h, {rows, hs}, dt, kElmanOp);
    check_input("w_ih", w_ih, {hs, inputs}, dt, kElmanOp);
    check_input("w_hh", w_hh, {hs, hs}, dt, kElmanOp);
    for (const auto& [name, t] : {std::pair{"b_ih", &b_ih}, {"b_hh", &b_hh}, {"lw", &lw},
                                  {"lb", &lb}}) {
      check_optional(name, *t, hs, dt, kElmanOp);
    }
    TORCH_CHECK(eps > 0 && std::isfinite(eps), kElmanOp, ": eps must be finite and > 0, got ", eps);
    // _steps.rnn_step: F.linear(x, w_ih) + F.linear(h, w_hh), torch's layer norm, the biases
    const Tensor a = at::mm(x, w_ih.t()).add_(at::mm(h, w_hh.t()));
    auto [y, mean, rstd] = at::native_layer_norm(a, {hs}, lw, lb, eps);
    if (given(b_ih)) y = y + *b_ih;
    if (given(b_hh)) y = y + *b_hh;
    return {relu ? at::relu(y) : at::tanh(y), a, mean, rstd};
}

struct ElmanCellFn : public torch::autograd::Function<ElmanCellFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& h, const Tensor& w_ih,
                        const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                        const OptTensor& lw, const OptTensor& lb, double eps, bool relu) {
    const ElmanForward f = elman_forward(x, h, w_ih, w_hh, b_ih, b_hh, lw, lb, eps, relu);
    ctx->save_for_backward({x, h, w_ih, w_hh, optional_tensor(b_ih), optional_tensor(b_hh),
                            optional_tensor(lw), optional_tensor(lb), f.a, f.mean, f.rstd, f.out});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["relu"] = relu;
    return f.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const variable_list inputs(saved.begin(), saved.begin() + 8);
    const std::vector<bool> need = needs_of(ctx, inputs);
    const bool relu = ctx->saved_data["relu"].toBool();
    if (cell_reference_backward(grads)) {
      variable_list out = reference_result(cell_reference_grads(
          relu ? "rnn_relu" : "rnn_tanh", grads, inputs, ctx->saved_data["eps"].toDouble(), need));
      out.push_back(Tensor());  // relu
      return out;
    }
    const Tensor &x = saved[0], &h = saved[1], &w_ih = saved[2], &w_hh = saved[3],
                 &lw = saved[6], &lb = saved[7], &a = saved[8], &mean = saved[9],
                 &rstd = saved[10], &out = saved[11];
    // autograd's derivatives of the forward's ops, in its order
    const int64_t hs = a.size(1);
    const Tensor dy =
        relu ? at::threshold_backward(grads[0], out, 0) : at::tanh_backward(grads[0], out);
    auto [da, dlw, dlb] = at::native_layer_norm_backward(
        dy, a, {hs}, mean, rstd, lw.defined() ? OptTensor(lw) : std::nullopt,
        lb.defined() ? OptTensor(lb) : std::nullopt, {need[0] || need[1] || need[2] || need[3],
                                                      need[6], need[7]});
    const Tensor db = need[4] || need[5] ? at::sum_to(dy, at::IntArrayRef(&hs, 1)) : Tensor();
    return {need[0] ? at::mm(da, w_ih) : Tensor(),
            need[1] ? at::mm(da, w_hh) : Tensor(),
            need[2] ? at::mm(da.t(), x) : Tensor(),
            need[3] ? at::mm(da.t(), h) : Tensor(),
            need[4] ? db : Tensor(),
            need[5] ? (need[4] ? db.clone() : db) : Tensor(),
            need[6] ? dlw : Tensor(),
            need[7] ? dlb : Tensor(),
            Tensor(),
            Tensor()};
  }
};

Tensor elman_cell_step(const Tensor& x, const Tensor& h, const Tensor& w_ih, const Tensor& w_hh,
                       const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& lw,
                       const OptTensor& lb, double eps, bool relu) {
  return ElmanCellFn::apply(x, h, w_ih, w_hh, b_ih, b_hh, lw, lb, eps, relu);
}

// Where autograd does not record: the cells' forwards alone.
std::tuple<Tensor, Tensor> lstm_cell_step_forward(
    const Tensor& x, const Tensor& h, const Tensor& c, const Tensor& w_ih, const Tensor& w_hh,
    const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& lw_ih, const OptTensor& lb_ih,
    const Tensor& lw_hh, const OptTensor& lb_hh, const Tensor& lw_c, const OptTensor& lb_c,
    const c10::intrusive_ptr<CellPlan>& plan) {
  LstmCellForward f = lstm_cell_forward(*plan, x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih,
                                        lw_hh, lb_hh, lw_c, lb_c);
  return {f.h_out, f.c_out};
}

Tensor gru_cell_step_forward(const Tensor& x, const Tensor& h, const Tensor& w_ih,
                             const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                             const Tensor& lw_ih, const OptTensor& lb_ih, const Tensor& lw_hh,
                             const OptTensor& lb_hh, const c10::intrusive_ptr<CellPlan>& plan) {
  return gru_cell_forward(*plan, x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh).out;
}

Tensor elman_cell_step_forward(const Tensor& x, const Tensor& h, const Tensor& w_ih,
                               const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                               const OptTensor& lw, const OptTensor& lb, double eps, bool relu) {
  return elman_forward(x, h, w_ih, w_hh, b_ih, b_hh, lw, lb, eps, relu).out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layernorm_cpu, m) {
  m.class_<LstmPlan>("LstmPlan")
      .def(torch::init<std::vector<Tensor>, std::vector<std::string>, std::vector<int64_t>,
                       std::vector<int64_t>, c10::Dict<std::string, int64_t>, std::vector<Tensor>,
                       c10::Dict<std::string, std::string>>())
      .def("settings", &LstmPlan::settings);
  m.def(
      "lstm_planned(Tensor x, Tensor h0, Tensor c0, Tensor w_hh, Tensor? w1, Tensor? b1, "
      "Tensor? w3, Tensor? b3, Tensor? w0, Tensor? b0, Tensor w_ih, Tensor? b_ih, Tensor? b_hh, "
      "__torch__.torch.classes.layernorm_cpu.LstmPlan plan) -> (Tensor, Tensor, Tensor)");
  m.class_<CellPlan>("CellPlan").def(
      torch::init<std::string, std::vector<Tensor>, std::vector<std::string>, std::vector<int64_t>,
                  std::vector<int64_t>, std::vector<int64_t>, double, Tensor>());
  m.def(
      "lstm_cell_step(Tensor x, Tensor h, Tensor c, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh, Tensor lw_ih, Tensor? lb_ih, Tensor lw_hh, Tensor? lb_hh, Tensor lw_c, "
      "Tensor? lb_c, __torch__.torch.classes.layernorm_cpu.CellPlan plan) -> (Tensor, Tensor)");
  m.def(
      "gru_cell_step(Tensor x, Tensor h, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, "
      "Tensor lw_ih, Tensor? lb_ih, Tensor lw_hh, Tensor? lb_hh, "
      "__torch__.torch.classes.layernorm_cpu.CellPlan plan) -> Tensor");
  m.def(
      "elman_cell_step(Tensor x, Tensor h, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, "
      "Tensor? lw, Tensor? lb, float eps, bool relu) -> Tensor");
}

TORCH_LIBRARY_IMPL(layernorm_cpu, Autograd, m) {
  m.impl("lstm_planned", lstm_planned);
  m.impl("lstm_cell_step", lstm_cell_step);
  m.impl("gru_cell_step", gru_cell_step);
  m.impl("elman_cell_step", elman_cell_step);
}

TORCH_LIBRARY_IMPL(layernorm_cpu, CPU, m) {
  m.impl("lstm_planned", lstm_planned_forward);
  m.impl("lstm_cell_step", lstm_cell_step_forward);
  m.impl("gru_cell_step", gru_cell_step_forward);
  m.impl("elman_cell_step", elman_cell_step_forward);
}
