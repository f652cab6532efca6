// Warm-call dispatch in C++: the problem key read straight from the TensorImpls, one hash lookup, and for aten
// winners at::mm / at::_int_mm called directly. The Python warm path spends ~1 us per call building a 13-field key
// from tensor attributes; on a host-bound mm (GPU time under the host's ~5-18 us per launch) that is the gap to
// torch.mm. Built and loaded by kernels/fastpath.py; every miss returns None and the Python path takes over.
//
// Entries are registered from the Python key tuple that api._fast_key builds, so both tables agree by
// construction: (op, a.dtype, b.dtype, a.shape, b.shape, a.stride(), b.stride(), a.device, b.device,
//  a.data_ptr() & 15, b.data_ptr() & 15, fp32 precision or None, grad flag).
// Only keys with precision None (no fp32) and grad flag False are accepted; everything else stays in Python.
// All access happens with the GIL held, which is what serialises the table.
//
// Grad routes (api._grad_routes): a call autograd needs (grad mode on, an input requiring grad) whose layer api handed
// to torch's own autograd is computed here by at::mm / at::linear with grad mode on, so autograd records torch's own
// nodes, at torch's host cost. Registered from the route's key (the call's no-grad-style key, which inputs require
// grad) under an op code of its own per (op, which of a/x, b/weight, bias require grad): grad_op.
//
// kernels.linear(x, weight, bias, activation) is served by call_linear: its key is mm's key for (x viewed as 2-D,
// weight.t()) under an op code of its own per (bias present, activation), registered from api's linear key
// (mm key, activation, bias facts). The bias facts are not keyed: every bias this table serves has the same ones
// given the rest of the key (x's dtype and device, length N, stride 1, 16-byte aligned), so call_linear checks them
// on each call and declines any other bias (the Python path then validates it, or serves it with a copy).
//
// kernels.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype) is served by call_scaled_mm: mm's key for (a, b) under
// an op code of its own per (scaling, bias present, out dtype), registered from kernels.dispatch.scaled's key
// (mm-style key with op "scaled_mm", scaling, bias present, out dtype). As for linear's bias, the scales' and the
// bias's facts are not keyed but checked on each call (fp32 scales on a's device, contiguous, of the scaling's
// shapes; the bias as linear's, in the out dtype), and anything else is declined. Their values are never read: a
// warm call must not sync the GPU (non-finite scales are refused on the cold path only).
//
// Native launches (type NativeLaunch): a compiled Triton choice as a list of kernel launches whose arguments are all
// fixed for the problem except the operand pointers (a, b, out, and the epilogue's scales and bias), launched with
// cuLaunchKernel from here. The Python path (launcher closure -> torch.empty -> Triton's C launcher parsing ~15
// Python arguments) costs 10+ us of host time per call on the lent machines' hosts, more than many of these kernels
// run on the GPU. The CUDA driver is reached through dlopen, so this file builds against CPU-only torch too (where no
// NativeLaunch is ever made).
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/stack.h>
#include <ATen/core/DimVector.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kFields = 15;
using Key = std::array<int64_t, kFields>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

enum Kind : int {
  kAtenMm = 0, kAtenIntMm = 1, kPython = 2, kNative = 3, kAtenAddmm = 4, kAtenScaledMm = 5,
  kTorchLinear = 6,  // a grad route's at::linear and the activation out of place (torch's autograd records both)
};

// Op codes: the key's first field. Linear's: kOpLinear + 4 * (bias present) + activation.
constexpr int64_t kOpMm = 0, kOpIntMm = 1, kOpLinear = 8;
enum Activation : int { kActNone = 0, kActRelu = 1, kActGelu = 2, kActSilu = 3 };

int64_t linear_op(bool bias, int activation) { return kOpLinear + (bias ? 4 : 0) + activation; }
bool is_linear_op(int64_t op) { return op >= kOpLinear && op < kOpLinear + 8; }
bool linear_has_bias(int64_t op) { return ((op - kOpLinear) & 4) != 0; }

// Grad routes' op codes: kGradBase * (1 + pattern) + the call's op, pattern = 1 * (a or x requires grad) + 2 * (b or
// weight does) + 4 * (the bias does); every other op code is below kGradBase.
constexpr int64_t kGradBase = 32;
int64_t grad_op(int64_t op, int pattern) { return kGradBase * (1 + pattern) + op; }
bool is_grad_op(int64_t op) { return op >= kGradBase; }
int64_t grad_base_op(int64_t op) { return op % kGradBase; }

// scaled_mm's op codes: kOpScaled + 8 * (row-wise scales) + 4 * (bias present) + the out dtype's index in
// kScaledOut. A problem's scaling, bias and out dtype pick its kernel (they are part of GemmProblem), so they are
// part of the key.
constexpr int64_t kOpScaled = 16;
enum Scaling : int { kNoScaling = 0, kTensorScaling = 1, kRowScaling = 2 };
constexpr at::ScalarType kScaledOut[3] = {at::kBFloat16, at::kHalf, at::kFloat};

int64_t scaled_op(int scaling, bool bias, int out_index) {
  return kOpScaled + (scaling == kRowScaling ? 8 : 0) + (bias ? 4 : 0) + out_index;
}
bool is_scaled_op(int64_t op) { return op >= kOpScaled && op < kOpScaled + 16 && ((op - kOpScaled) & 3) != 3; }
int scaled_op_scaling(int64_t op) { return ((op - kOpScaled) & 8) != 0 ? kRowScaling : kTensorScaling; }
bool scaled_op_bias(int64_t op) { return ((op - kOpScaled) & 4) != 0; }
at::ScalarType scaled_op_out(int64_t op) { return kScaledOut[(op - kOpScaled) & 3]; }

// An out dtype's index in kScaledOut, or -1 (not one scaled_mm produces: Python raises).
int scaled_out_index(at::ScalarType dtype) {
  for (int i = 0; i < 3; ++i) {
    if (kScaledOut[i] == dtype) return i;
  }
  return -1;
}

// "tensor" / "row" -> their code; anything else kNoScaling.
int scaling_code(PyObject* name) {
  if (!PyUnicode_Check(name)) return kNoScaling;
  if (PyUnicode_CompareWithASCIIString(name, "tensor") == 0) return kTensorScaling;
  if (PyUnicode_CompareWithASCIIString(name, "row") == 0) return kRowScaling;
  return kNoScaling;
}

// None -> kActNone, "relu" / "gelu" / "silu" -> their code, anything else -1 (not served: Python validates it).
int activation_code(PyObject* activation) {
  if (activation == Py_None) return kActNone;
  if (!PyUnicode_Check(activation)) return -1;
  if (PyUnicode_CompareWithASCIIString(activation, "relu") == 0) return kActRelu;
  if (PyUnicode_CompareWithASCIIString(activation, "gelu") == 0) return kActGelu;
  if (PyUnicode_CompareWithASCIIString(activation, "silu") == 0) return kActSilu;
  return -1;
}

struct Entry {
  int kind;
  PyObject* launch;  // owned; for kPython and kNative
};

std::unordered_map<Key, Entry, KeyHash>& table() {
  static auto* t = new std::unordered_map<Key, Entry, KeyHash>();  // never destroyed: no teardown-order issues
  return *t;
}
int64_t g_hits = 0;

int64_t device_code(c10::DeviceType type, c10::DeviceIndex index) {
  return (static_cast<int64_t>(type) << 16) | static_cast<int64_t>(static_cast<uint16_t>(index));
}

// -1 (no entry's) for a tensor without storage: torch.func's wrappers (vmap, grad) have no data pointer to read
int64_t alignment(const at::Tensor& t) {
  return t.has_storage() ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) : -1;
}

bool key_from_tensors(int64_t op, const at::Tensor& a, const at::Tensor& b, Key& k) {
  if (a.dim() != 2 || b.dim() != 2) return false;
  const auto da = a.device(), db = b.device();
  auto sa = a.sizes(), sb = b.sizes();
  auto ta = a.strides(), tb = b.strides();
  k = {op,
       static_cast<int64_t>(a.scalar_type()),
       static_cast<int64_t>(b.scalar_type()),
       sa[0], sa[1], sb[0], sb[1], ta[0], ta[1], tb[0], tb[1],
       device_code(da.type(), da.index()),
       device_code(db.type(), db.index()),
       alignment(a), alignment(b)};
  return true;
}

// Linear's x as a 2-D (M, K) operand without a copy: its sizes and strides, as x.reshape(-1, K) gives them when
// that is a view (the strides computed as view does). False when only a copy would flatten x.
bool flat_2d(const at::Tensor& x, int64_t& m, int64_t& s0, int64_t& s1) {
  const int64_t k = x.size(-1);
  if (x.dim() == 2) {
    m = x.size(0), s0 = x.stride(0), s1 = x.stride(1);
    return true;
  }
  if (k == 0) return false;  // reshape(-1, 0) cannot infer M: Python raises it
  m = x.numel() / k;
  auto strides = at::detail::computeStride(x.sizes(), x.strides(), at::DimVector{m, k});
  if (!strides) return false;
  s0 = (*strides)[0], s1 = (*strides)[1];
  return true;
}

// mm's key for (x2, weight.t()) under a linear op code, read from x and weight without making either view.
bool key_from_linear(int64_t op, const at::Tensor& x, const at::Tensor& w, Key& k) {
  if (w.dim() != 2 || x.dim() < 1 || x.layout() != c10::kStrided || w.layout() != c10::kStrided) return false;
  int64_t m = 0, s0 = 0, s1 = 0;
  if (!flat_2d(x, m, s0, s1)) return false;
  const auto dx = x.device(), dw = w.device();
  k = {op,
       static_cast<int64_t>(x.scalar_type()),
       static_cast<int64_t>(w.scalar_type()),
       m, x.size(-1), w.size(1), w.size(0), s0, s1, w.stride(1), w.stride(0),
       device_code(dx.type(), dx.index()),
       device_code(dw.type(), dw.index()),
       alignment(x), alignment(w)};
  return true;
}

// The bias facts every entry with a bias assumes (see the top of this file): `dtype` is linear's x dtype or
// scaled_mm's out dtype, `device` the product's.
bool servable_bias(const at::Tensor& bias, at::ScalarType dtype, c10::Device device, int64_t n) {
  return bias.layout() == c10::kStrided && bias.dim() == 1 && bias.size(0) == n && bias.stride(0) == 1 &&
         bias.scalar_type() == dtype && bias.device() == device && alignment(bias) == 0;
}

// kernels.scaled_mm's scaling_of on the scales' shapes for an (M, K) x (K, N) product: one element each (at most
// 2-D) -> tensor-wise, (M, 1) and (1, N) -> row-wise, anything else kNoScaling (Python raises about it).
int scaling_of(const at::Tensor& scale_a, const at::Tensor& scale_b, int64_t m, int64_t n) {
  if (scale_a.numel() == 1 && scale_b.numel() == 1 && scale_a.dim() <= 2 && scale_b.dim() <= 2) return kTensorScaling;
  if (scale_a.dim() == 2 && scale_b.dim() == 2 && scale_a.size(0) == m && scale_a.size(1) == 1 &&
      scale_b.size(0) == 1 && scale_b.size(1) == n) {
    return kRowScaling;
  }
  return kNoScaling;
}

// The scale facts every scaled entry assumes: fp32 on a's device, contiguous with a unit last stride (what
// validation asks, and what lets a kernel index scale_a[row] and scale_b[col] without strides).
bool servable_scale(const at::Tensor& scale, const at::Tensor& a) {
  return scale.layout() == c10::kStrided && scale.scalar_type() == at::kFloat && scale.device() == a.device() &&
         scale.is_contiguous() && (scale.dim() == 0 || scale.stride(scale.dim() - 1) == 1);
}

// The key of a scaled_mm call: mm's key for (a, b) under the op code of its scaling, bias and out dtype; false when
// a scale or the bias is not one this table serves as is.
bool key_from_scaled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                     const at::Tensor* bias, int out_index, Key& k) {
  if (a.layout() != c10::kStrided || b.layout() != c10::kStrided || a.dim() != 2 || b.dim() != 2) return false;
  const int scaling = scaling_of(scale_a, scale_b, a.size(0), b.size(1));
  if (scaling == kNoScaling || !servable_scale(scale_a, a) || !servable_scale(scale_b, a)) return false;
  if (bias != nullptr && !servable_bias(*bias, kScaledOut[out_index], a.device(), b.size(1))) return false;
  return key_from_tensors(scaled_op(scaling, bias != nullptr, out_index), a, b, k);
}

bool read_pair(PyObject* seq, int64_t& x, int64_t& y) {
  if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != 2) return false;
  x = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, 0));
  y = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, 1));
  return !PyErr_Occurred();
}

bool is_long(PyObject* o, int64_t value) {
  if (!PyLong_Check(o)) return false;
  int64_t v = PyLong_AsLongLong(o);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return v == value;
}

// api's bias facts (dtype, shape, stride, device[, grad flag]) -> true when they are the ones servable_bias checks
// for the problem of key k (k[1] x's dtype, k[6] N, k[11] x's device).
// A grad route's key (grad = true) may carry either grad flag; `bias_grad` then says which.
bool bias_facts_servable(PyObject* facts, const Key& k, bool grad = false, bool* bias_grad = nullptr) {
  if (!PyTuple_Check(facts) || PyTuple_GET_SIZE(facts) < 4 || PyTuple_GET_SIZE(facts) > 5) return false;
  PyObject *dtype = PyTuple_GET_ITEM(facts, 0), *shape = PyTuple_GET_ITEM(facts, 1);
  PyObject *stride = PyTuple_GET_ITEM(facts, 2), *device = PyTuple_GET_ITEM(facts, 3);
  PyObject* flag = PyTuple_GET_SIZE(facts) == 5 ? PyTuple_GET_ITEM(facts, 4) : Py_False;
  if (flag != Py_False && !(grad && flag == Py_True)) return false;
  if (bias_grad != nullptr) *bias_grad = flag == Py_True;
  if (!THPDtype_Check(dtype) || !THPDevice_Check(device) || !PyTuple_Check(shape) || !PyTuple_Check(stride) ||
      PyTuple_GET_SIZE(shape) != 1 || PyTuple_GET_SIZE(stride) != 1) {
    return false;
  }
  const auto& dev = reinterpret_cast<THPDevice*>(device)->device;
  return static_cast<int64_t>(reinterpret_cast<THPDtype*>(dtype)->scalar_type) == k[1] &&
         device_code(dev.type(), dev.index()) == k[11] && is_long(PyTuple_GET_ITEM(shape, 0), k[6]) &&
         is_long(PyTuple_GET_ITEM(stride, 0), 1);
}

bool product_key_from_python(PyObject* t, Key& k, bool grad = false);

// linear: (api._fast_key's tuple for ("mm", x2, weight.t()), activation, bias facts or None). With grad (a grad
// route's inner key) the grad flags may be set; `bias_grad` says the bias's.
bool linear_key_from_python(PyObject* t, Key& k, bool grad = false, bool* bias_grad = nullptr) {
  if (!product_key_from_python(PyTuple_GET_ITEM(t, 0), k, grad) || k[0] != kOpMm) return false;
  const int act = activation_code(PyTuple_GET_ITEM(t, 1));
  PyObject* bias = PyTuple_GET_ITEM(t, 2);
  if (act < 0 || (bias != Py_None && !bias_facts_servable(bias, k, grad, bias_grad))) return false;
  k[0] = linear_op(bias != Py_None, act);
  return true;
}

// A grad route's key: (mm's key or linear's, a/x requires grad, b/weight requires grad); false for anything else,
// and for a pattern with no input requiring grad (such a call is no grad route's).
bool grad_key_from_python(PyObject* t, Key& k) {
  PyObject *inner = PyTuple_GET_ITEM(t, 0), *a_grad = PyTuple_GET_ITEM(t, 1), *b_grad = PyTuple_GET_ITEM(t, 2);
  if (!PyTuple_Check(inner) || !PyBool_Check(a_grad) || !PyBool_Check(b_grad)) return false;
  bool bias_grad = false;
  if (PyTuple_GET_SIZE(inner) == 3) {
    if (!linear_key_from_python(inner, k, true, &bias_grad)) return false;
  } else if (!product_key_from_python(inner, k, true) || k[0] != kOpMm) {
    return false;
  }
  const int pattern = (a_grad == Py_True ? 1 : 0) + (b_grad == Py_True ? 2 : 0) + (bias_grad ? 4 : 0);
  if (pattern == 0) return false;
  k[0] = grad_op(k[0], pattern);
  return true;
}

// scaled_mm: (the mm-style tuple with op "scaled_mm", scaling "tensor" | "row", bias present, out dtype).
bool scaled_key_from_python(PyObject* t, Key& k) {
  if (!product_key_from_python(PyTuple_GET_ITEM(t, 0), k) || k[0] != kOpScaled) return false;
  const int scaling = scaling_code(PyTuple_GET_ITEM(t, 1));
  PyObject *bias = PyTuple_GET_ITEM(t, 2), *out_dtype = PyTuple_GET_ITEM(t, 3);
  if (scaling == kNoScaling || (bias != Py_True && bias != Py_False) || !THPDtype_Check(out_dtype)) return false;
  const int out_index = scaled_out_index(reinterpret_cast<THPDtype*>(out_dtype)->scalar_type);
  if (out_index < 0) return false;
  k[0] = scaled_op(scaling, bias == Py_True, out_index);
  return true;
}

// The Python key tuple -> Key; false (no error set) when the key is one this table does not serve. mm / int_mm:
// api._fast_key's tuple; linear's and scaled_mm's wrap an mm-style tuple (3 and 4 fields).
bool key_from_python(PyObject* t, Key& k) {
  if (!PyTuple_Check(t)) return false;
  switch (PyTuple_GET_SIZE(t)) {
    case 3:  // linear's (its second field the activation) or a grad route's (a bool there)
      return PyBool_Check(PyTuple_GET_ITEM(t, 1)) ? grad_key_from_python(t, k) : linear_key_from_python(t, k);
    case 4:
      return scaled_key_from_python(t, k);
    default:
      return product_key_from_python(t, k) && (k[0] == kOpMm || k[0] == kOpIntMm);
  }
}

bool product_key_from_python(PyObject* t, Key& k, bool grad) {
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 13) return false;
  PyObject* op = PyTuple_GET_ITEM(t, 0);
  int64_t op_code;
  if (PyUnicode_Check(op) && PyUnicode_CompareWithASCIIString(op, "mm") == 0) {
    op_code = kOpMm;
  } else if (PyUnicode_Check(op) && PyUnicode_CompareWithASCIIString(op, "int_mm") == 0) {
    op_code = kOpIntMm;
  } else if (PyUnicode_Check(op) && PyUnicode_CompareWithASCIIString(op, "scaled_mm") == 0) {
    op_code = kOpScaled;  // the scaling, bias and out dtype complete it (scaled_key_from_python)
  } else {
    return false;
  }
  PyObject *dta = PyTuple_GET_ITEM(t, 1), *dtb = PyTuple_GET_ITEM(t, 2);
  PyObject *dva = PyTuple_GET_ITEM(t, 7), *dvb = PyTuple_GET_ITEM(t, 8);
  if (!THPDtype_Check(dta) || !THPDtype_Check(dtb) || !THPDevice_Check(dva) || !THPDevice_Check(dvb)) return false;
  PyObject* grad_flag = PyTuple_GET_ITEM(t, 12);
  if (PyTuple_GET_ITEM(t, 11) != Py_None || (grad_flag != Py_False && !(grad && grad_flag == Py_True))) return false;
  k[0] = op_code;
  k[1] = static_cast<int64_t>(reinterpret_cast<THPDtype*>(dta)->scalar_type);
  k[2] = static_cast<int64_t>(reinterpret_cast<THPDtype*>(dtb)->scalar_type);
  if (!read_pair(PyTuple_GET_ITEM(t, 3), k[3], k[4]) || !read_pair(PyTuple_GET_ITEM(t, 4), k[5], k[6]) ||
      !read_pair(PyTuple_GET_ITEM(t, 5), k[7], k[8]) || !read_pair(PyTuple_GET_ITEM(t, 6), k[9], k[10])) {
    PyErr_Clear();
    return false;
  }
  const auto& va = reinterpret_cast<THPDevice*>(dva)->device;
  const auto& vb = reinterpret_cast<THPDevice*>(dvb)->device;
  k[11] = device_code(va.type(), va.index());
  k[12] = device_code(vb.type(), vb.index());
  k[13] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 9));
  k[14] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 10));
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return k[1] != static_cast<int64_t>(at::kFloat) && k[2] != static_cast<int64_t>(at::kFloat);
}

// ---- CUDA driver, resolved at first use ---------------------------------------------------------------------------
using CUresult = int;
constexpr CUresult kCudaSuccess = 0;
using LaunchKernelFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                                    void**, void**);
using CtxGetCurrentFn = CUresult (*)(void**);
using CtxSetCurrentFn = CUresult (*)(void*);
using DeviceGetFn = CUresult (*)(int*, int);
using PrimaryCtxRetainFn = CUresult (*)(void**, int);
using GetErrorStringFn = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernelFn launch = nullptr;
  CtxGetCurrentFn ctx_get = nullptr;
  CtxSetCurrentFn ctx_set = nullptr;
  DeviceGetFn device_get = nullptr;
  PrimaryCtxRetainFn primary_ctx_retain = nullptr;
  GetErrorStringFn error_string = nullptr;
  std::string why_not;  // empty when every entry point resolved
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // torch has loaded it when CUDA is in use
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
      r.why_not = "libcuda.so.1 not found";
      return r;
    }
    auto sym = [&](const char* name) {
      void* p = dlsym(lib, name);
      if (p == nullptr && r.why_not.empty()) r.why_not = std::string("libcuda.so.1 lacks ") + name;
      return p;
    };
    r.launch = reinterpret_cast<LaunchKernelFn>(sym("cuLaunchKernel"));
    r.ctx_get = reinterpret_cast<CtxGetCurrentFn>(sym("cuCtxGetCurrent"));
    r.ctx_set = reinterpret_cast<CtxSetCurrentFn>(sym("cuCtxSetCurrent"));
    r.device_get = reinterpret_cast<DeviceGetFn>(sym("cuDeviceGet"));
    r.primary_ctx_retain = reinterpret_cast<PrimaryCtxRetainFn>(sym("cuDevicePrimaryCtxRetain_v2"));
    if (r.primary_ctx_retain == nullptr) {
      r.why_not.clear();
      r.primary_ctx_retain = reinterpret_cast<PrimaryCtxRetainFn>(sym("cuDevicePrimaryCtxRetain"));
    }
    r.error_string = reinterpret_cast<GetErrorStringFn>(sym("cuGetErrorString"));
    return r;
  }();
  return d;
}

std::string cuda_error(const Driver& d, CUresult code) {
  const char* text = nullptr;
  if (d.error_string != nullptr) d.error_string(code, &text);
  return "CUDA error " + std::to_string(code) + (text != nullptr ? std::string(" (") + text + ")" : std::string());
}

// A thread that never made a CUDA runtime call has no current context (cuLaunchKernel would fail); Triton's launcher
// makes the device's primary context current in that case, and so do we. Returns the failure text, or "".
std::string ensure_context(const Driver& d, int device) {
  void* ctx = nullptr;
  CUresult rc = d.ctx_get(&ctx);
  if (rc == kCudaSuccess && ctx != nullptr) return "";
  int dev = 0;
  if ((rc = d.device_get(&dev, device)) != kCudaSuccess) return "cuDeviceGet: " + cuda_error(d, rc);
  if ((rc = d.primary_ctx_retain(&ctx, dev)) != kCudaSuccess) return "cuDevicePrimaryCtxRetain: " + cuda_error(d, rc);
  if ((rc = d.ctx_set(ctx)) != kCudaSuccess) return "cuCtxSetCurrent: " + cuda_error(d, rc);
  return "";
}

// ---- NativeLaunch ----------------------------------------------------------------------------------------------------
// backends/triton_launch.Operand: the pointers that change per call. A plan is called with a, b, then the epilogue
// tensors its steps take, in the order kernels take them (scale_a, scale_b, bias), then out=None:
// (a, b, out=None), (a, b, bias, out=None), (a, b, scale_a, scale_b[, bias], out=None).
enum Operand : int { kA = 0, kB = 1, kOut = 2, kBias = 3, kScaleA = 4, kScaleB = 5 };
constexpr int kOperands = 6;

struct OperandSlot {
  size_t param;  // index of the kernel parameter that takes this operand's pointer
  int operand;
};

struct KernelStep {
  void* function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<uint64_t> values;  // one 8-byte slot per kernel parameter; an i32 lives in the low half (x86-64)
  std::vector<void*> params;     // &values[i]: what cuLaunchKernel reads
  std::vector<OperandSlot> operands;
};

struct NativePlan {
  int device;
  void* stream;  // the stream whose workspaces the fixed arguments point at
  int64_t m, n;
  at::ScalarType out_dtype;
  bool bias;    // some step takes the bias pointer
  int scaling;  // kNoScaling, or scaled_mm's scaling: the steps take both scale pointers, of 1 or M / N elements
  std::vector<KernelStep> steps;
};

// How many tensors a plan's call takes before `out`, and its signature for error messages.
Py_ssize_t plan_inputs(const NativePlan& plan) {
  return 2 + (plan.scaling != kNoScaling ? 2 : 0) + (plan.bias ? 1 : 0);
}
const char* plan_signature(const NativePlan& plan) {
  if (plan.scaling == kNoScaling) return plan.bias ? "a, b, bias, out=None" : "a, b, out=None";
  return plan.bias ? "a, b, scale_a, scale_b, bias, out=None" : "a, b, scale_a, scale_b, out=None";
}

struct NativeLaunch {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  NativePlan* plan;
  PyObject* fallback;   // the Python launch, called as the plan is: for other streams and outputs we do not write
  PyObject* keepalive;  // owns what the fixed pointers point at (workspaces, scratch)
};

// One call's operands: the tensors, and their Python objects (borrowed). pa / pb may be nullptr (made only if the
// fallback needs them); the epilogue's tensors and objects are nullptr exactly when the plan takes none.
struct Operands {
  const at::Tensor& a;
  const at::Tensor& b;
  const at::Tensor* scale_a = nullptr;
  const at::Tensor* scale_b = nullptr;
  const at::Tensor* bias = nullptr;
  PyObject* pa = nullptr;
  PyObject* pb = nullptr;
  PyObject* pscale_a = nullptr;
  PyObject* pscale_b = nullptr;
  PyObject* pbias = nullptr;
};

PyObject* new_ref(PyObject* given, const at::Tensor& t) {
  if (given == nullptr) return THPVariable_Wrap(t);
  Py_INCREF(given);
  return given;
}

PyObject* call_fallback(NativeLaunch* self, const Operands& ops, PyObject* pout) {
  PyObject* pa = new_ref(ops.pa, ops.a);
  PyObject* pb = pa != nullptr ? new_ref(ops.pb, ops.b) : nullptr;
  PyObject* result = nullptr;
  if (pb != nullptr) {
    PyObject* args[6] = {pa, pb};
    size_t n = 2;
    if (self->plan->scaling != kNoScaling) {
      args[n++] = ops.pscale_a;
      args[n++] = ops.pscale_b;
    }
    if (self->plan->bias) args[n++] = ops.pbias;
    args[n++] = pout != nullptr ? pout : Py_None;
    result = PyObject_Vectorcall(self->fallback, args, n, nullptr);
  }
  Py_XDECREF(pa);
  Py_XDECREF(pb);
  return result;
}

bool writable_output(const NativePlan& plan, const at::Tensor& out) {
  return out.dim() == 2 && out.size(0) == plan.m && out.size(1) == plan.n && out.scalar_type() == plan.out_dtype &&
         out.is_cuda() && out.device().index() == plan.device && (out.stride(0) == plan.n || plan.m <= 1) &&
         (out.stride(1) == 1 || plan.n <= 1) && (reinterpret_cast<uintptr_t>(out.data_ptr()) & 15) == 0;
}

// The bias a kernel reads: a contiguous (N,) vector of the output dtype on the plan's device, 16-byte aligned (the
// alignment Triton assumed for every pointer argument when it compiled the kernel).
bool readable_bias(const NativePlan& plan, const at::Tensor& bias) {
  return bias.is_cuda() && bias.device().index() == plan.device && bias.dim() == 1 && bias.size(0) == plan.n &&
         (bias.stride(0) == 1 || plan.n <= 1) && bias.scalar_type() == plan.out_dtype && alignment(bias) == 0;
}

// A scale a kernel reads: fp32 on the plan's device, contiguous, with `count` elements (1 per tensor, M or N per
// row): the kernels read scale[0], or scale_a[row] and scale_b[col], with no stride and no bounds beyond M and N.
bool readable_scale(const NativePlan& plan, const at::Tensor& scale, int64_t count) {
  return scale.is_cuda() && scale.device().index() == plan.device && scale.scalar_type() == at::kFloat &&
         scale.numel() == count && scale.is_contiguous();
}

bool readable_scales(const NativePlan& plan, const Operands& ops) {
  const bool row = plan.scaling == kRowScaling;
  return readable_scale(plan, *ops.scale_a, row ? plan.m : 1) && readable_scale(plan, *ops.scale_b, row ? plan.n : 1);
}

// The product, or nullptr with a Python error set. pout may be nullptr (allocate) or a tensor to write into.
PyObject* run_native(NativeLaunch* self, const Operands& ops, PyObject* pout) {
  const NativePlan& plan = *self->plan;
  const at::Tensor &a = ops.a, &b = ops.b;
  if (!a.is_cuda() || a.device().index() != plan.device || !b.is_cuda() || a.dim() != 2 || b.dim() != 2 ||
      a.size(0) != plan.m || b.size(1) != plan.n || (plan.bias && !readable_bias(plan, *ops.bias)) ||
      (plan.scaling != kNoScaling && !readable_scales(plan, ops))) {
    return call_fallback(self, ops, pout);  // not the problem this plan was made for: the Python path decides
  }
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(plan.device));
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  void* stream = impl->getStream(device).native_handle();
  if (stream != plan.stream) return call_fallback(self, ops, pout);
  at::Tensor out;
  if (pout != nullptr && pout != Py_None) {
    if (!THPVariable_Check(pout)) return call_fallback(self, ops, pout);
    out = THPVariable_Unpack(pout);
    if (!writable_output(plan, out)) return call_fallback(self, ops, pout);
  }
  const Driver& d = driver();
  if (!d.why_not.empty()) {
    PyErr_Format(PyExc_RuntimeError, "kernels native launch: %s", d.why_not.c_str());
    return nullptr;
  }
  c10::DeviceGuard guard(device);
  std::string why = ensure_context(d, plan.device);
  if (!why.empty()) {
    PyErr_Format(PyExc_RuntimeError, "kernels native launch: %s", why.c_str());
    return nullptr;
  }
  if (!out.defined()) out = at::empty({plan.m, plan.n}, at::TensorOptions().dtype(plan.out_dtype).device(device));
  auto address = [](const at::Tensor* t) { return t != nullptr ? reinterpret_cast<uint64_t>(t->data_ptr()) : 0; };
  uint64_t pointers[kOperands];
  pointers[kA] = address(&a);
  pointers[kB] = address(&b);
  pointers[kOut] = address(&out);
  pointers[kBias] = address(ops.bias);
  pointers[kScaleA] = address(ops.scale_a);
  pointers[kScaleB] = address(ops.scale_b);
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    auto& step = self->plan->steps[i];
    if (step.grid[0] == 0 || step.grid[1] == 0 || step.grid[2] == 0) continue;
    for (const auto& slot : step.operands) step.values[slot.param] = pointers[slot.operand];
    CUresult rc = d.launch(step.function, step.grid[0], step.grid[1], step.grid[2], step.block, 1, 1, step.shared,
                           stream, step.params.data(), nullptr);
    if (rc != kCudaSuccess) {
      PyErr_Format(PyExc_RuntimeError, "kernels native launch: cuLaunchKernel failed on launch %zu of %zu: %s", i + 1,
                   plan.steps.size(), cuda_error(d, rc).c_str());
      return nullptr;
    }
  }
  if (pout != nullptr && pout != Py_None) {
    Py_INCREF(pout);
    return pout;
  }
  return THPVariable_Wrap(std::move(out));
}

// native(a, b[, scale_a, scale_b][, bias], out=None): the tensors its plan takes (plan_signature)
PyObject* native_vectorcall(PyObject* callable, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  auto* self = reinterpret_cast<NativeLaunch*>(callable);
  const NativePlan& plan = *self->plan;
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t inputs = plan_inputs(plan);
  if (kwnames != nullptr || nargs < inputs || nargs > inputs + 1) {
    PyErr_Format(PyExc_TypeError, "NativeLaunch(%s) takes %zd or %zd positional arguments", plan_signature(plan),
                 inputs, inputs + 1);
    return nullptr;
  }
  PyObject* pout = nargs > inputs ? args[inputs] : nullptr;
  const bool scaled = plan.scaling != kNoScaling;
  PyObject* pscale_a = scaled ? args[2] : nullptr;
  PyObject* pscale_b = scaled ? args[3] : nullptr;
  PyObject* pbias = plan.bias ? args[inputs - 1] : nullptr;
  for (Py_ssize_t i = 0; i < inputs; ++i) {
    if (!THPVariable_Check(args[i])) {
      static const at::Tensor undefined;
      return call_fallback(self,
                           Operands{.a = undefined, .b = undefined, .pa = args[0], .pb = args[1],
                                    .pscale_a = pscale_a, .pscale_b = pscale_b, .pbias = pbias},
                           pout);
    }
  }
  auto tensor = [](PyObject* o) -> const at::Tensor* { return o != nullptr ? &THPVariable_Unpack(o) : nullptr; };
  const Operands ops{.a = THPVariable_Unpack(args[0]), .b = THPVariable_Unpack(args[1]), .scale_a = tensor(pscale_a),
                     .scale_b = tensor(pscale_b), .bias = tensor(pbias), .pa = args[0], .pb = args[1],
                     .pscale_a = pscale_a, .pscale_b = pscale_b, .pbias = pbias};
  return run_native(self, ops, pout);
  END_HANDLE_TH_ERRORS
}

void native_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<NativeLaunch*>(obj);
  PyObject_GC_UnTrack(obj);
  delete self->plan;
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->keepalive);
  Py_TYPE(obj)->tp_free(obj);
}

int native_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<NativeLaunch*>(obj);
  Py_VISIT(self->fallback);
  Py_VISIT(self->keepalive);
  return 0;
}

int native_clear(PyObject* obj) {
  auto* self = reinterpret_cast<NativeLaunch*>(obj);
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->keepalive);
  return 0;
}

PyObject* native_repr(PyObject* obj) {
  const NativePlan& plan = *reinterpret_cast<NativeLaunch*>(obj)->plan;
  const char* scales = plan.scaling == kNoScaling ? "" : plan.scaling == kRowScaling ? " row-scaled" : " tensor-scaled";
  return PyUnicode_FromFormat("<NativeLaunch %zd launch(es), %lldx%lld%s%s on cuda:%d>",
                              static_cast<Py_ssize_t>(plan.steps.size()), static_cast<long long>(plan.m),
                              static_cast<long long>(plan.n), scales, plan.bias ? " + bias" : "", plan.device);
}

PyTypeObject NativeLaunchType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "_kernels_fastpath.NativeLaunch";
  t.tp_basicsize = sizeof(NativeLaunch);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_vectorcall_offset = offsetof(NativeLaunch, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_dealloc = native_dealloc;
  t.tp_traverse = native_traverse;
  t.tp_clear = native_clear;
  t.tp_repr = native_repr;
  t.tp_doc = "A compiled Triton choice launched from C++: call(a, b[, scale_a, scale_b][, bias], out=None) -> out";
  return t;
}();

bool read_u64(PyObject* o, uint64_t& v) {
  v = PyLong_AsUnsignedLongLongMask(o);  // negative ints wrap; their low 32 bits are what an i32 slot holds
  return !PyErr_Occurred();
}

// One step: (function, gx, gy, gz, block_threads, shared_bytes, values, operands) with operands a sequence of
// (parameter index, operand code 0=a 1=b 2=out 3=bias 4=scale_a 5=scale_b).
bool read_step(PyObject* item, KernelStep& step) {
  if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 8) {
    PyErr_SetString(PyExc_TypeError, "native: each step is (function, gx, gy, gz, block, shared, values, operands)");
    return false;
  }
  uint64_t u[6];
  for (int i = 0; i < 6; ++i) {
    if (!read_u64(PyTuple_GET_ITEM(item, i), u[i])) return false;
  }
  step.function = reinterpret_cast<void*>(u[0]);
  for (int i = 0; i < 3; ++i) step.grid[i] = static_cast<unsigned>(u[1 + i]);
  step.block = static_cast<unsigned>(u[4]);
  step.shared = static_cast<unsigned>(u[5]);
  if (step.function == nullptr || step.block == 0 || step.block > 1024) {
    PyErr_SetString(PyExc_ValueError, "native: a step needs a loaded function and 1..1024 threads per block");
    return false;
  }
  PyObject* values = PySequence_Fast(PyTuple_GET_ITEM(item, 6), "native: values must be a sequence");
  if (values == nullptr) return false;
  Py_ssize_t nv = PySequence_Fast_GET_SIZE(values);
  step.values.resize(static_cast<size_t>(nv));
  for (Py_ssize_t i = 0; i < nv; ++i) {
    if (!read_u64(PySequence_Fast_GET_ITEM(values, i), step.values[i])) {
      Py_DECREF(values);
      return false;
    }
  }
  Py_DECREF(values);
  PyObject* ops = PySequence_Fast(PyTuple_GET_ITEM(item, 7), "native: operands must be a sequence");
  if (ops == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ops); ++i) {
    PyObject* pair = PySequence_Fast_GET_ITEM(ops, i);
    int64_t param = 0, operand = 0;
    if (!read_pair(pair, param, operand) || param < 0 || param >= nv || operand < 0 || operand >= kOperands) {
      Py_DECREF(ops);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "native: an operand is (parameter index, 0..5)");
      return false;
    }
    step.operands.push_back(OperandSlot{static_cast<size_t>(param), static_cast<int>(operand)});
  }
  Py_DECREF(ops);
  step.params.resize(step.values.size());
  for (size_t i = 0; i < step.values.size(); ++i) step.params[i] = &step.values[i];
  return true;
}

// Sets the plan's bias and scaling from what its steps take; false with an error set when the steps take scale
// pointers and `scaling` ("", "tensor" or "row") does not say how many elements they read, or the reverse.
bool read_epilogue(PyObject* scaling, NativePlan& plan) {
  bool bias = false, scales = false;
  for (const auto& step : plan.steps) {
    for (const auto& slot : step.operands) {
      bias = bias || slot.operand == kBias;
      scales = scales || slot.operand == kScaleA || slot.operand == kScaleB;
    }
  }
  plan.bias = bias;
  plan.scaling = scaling == nullptr ? kNoScaling : scaling_code(scaling);
  const bool named = scaling == nullptr || plan.scaling != kNoScaling ||
                     (PyUnicode_Check(scaling) && PyUnicode_GetLength(scaling) == 0);
  if (!named || scales != (plan.scaling != kNoScaling)) {
    PyErr_SetString(PyExc_ValueError, "native: scaling must be 'tensor' or 'row' exactly when the steps take scales");
    return false;
  }
  return true;
}

// native(device, stream, m, n, out_dtype, steps, fallback, keepalive[, scaling]) -> NativeLaunch
PyObject* make_native(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 8 && nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "native(device, stream, m, n, out_dtype, steps, fallback, keepalive[, scaling])");
    return nullptr;
  }
  if (!THPDtype_Check(args[4]) || !PyCallable_Check(args[6])) {
    PyErr_SetString(PyExc_TypeError, "native: out_dtype must be a torch.dtype and fallback callable");
    return nullptr;
  }
  auto plan = std::make_unique<NativePlan>();
  uint64_t stream = 0;
  plan->device = static_cast<int>(PyLong_AsLong(args[0]));
  read_u64(args[1], stream);
  plan->stream = reinterpret_cast<void*>(stream);
  plan->m = PyLong_AsLongLong(args[2]);
  plan->n = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  plan->out_dtype = reinterpret_cast<THPDtype*>(args[4])->scalar_type;
  PyObject* steps = PySequence_Fast(args[5], "native: steps must be a sequence");
  if (steps == nullptr) return nullptr;
  plan->steps.resize(static_cast<size_t>(PySequence_Fast_GET_SIZE(steps)));
  for (size_t i = 0; i < plan->steps.size(); ++i) {
    if (!read_step(PySequence_Fast_GET_ITEM(steps, i), plan->steps[i])) {
      Py_DECREF(steps);
      return nullptr;
    }
  }
  Py_DECREF(steps);
  if (!read_epilogue(nargs == 9 ? args[8] : nullptr, *plan)) return nullptr;
  auto* self = PyObject_GC_New(NativeLaunch, &NativeLaunchType);
  if (self == nullptr) return nullptr;
  self->vectorcall = native_vectorcall;
  self->plan = plan.release();
  Py_INCREF(args[6]);
  self->fallback = args[6];
  Py_INCREF(args[7]);
  self->keepalive = args[7];
  PyObject_GC_Track(reinterpret_cast<PyObject*>(self));
  return reinterpret_cast<PyObject*>(self);
  END_HANDLE_TH_ERRORS
}

PyObject* driver_status(PyObject*, PyObject*) { return PyUnicode_FromString(driver().why_not.c_str()); }

struct ReleaseGil {
  PyThreadState* state;
  ReleaseGil() : state(PyEval_SaveThread()) {}
  ~ReleaseGil() { PyEval_RestoreThread(state); }
};

// Which inputs of a call autograd records: 1 * a (or x) + 2 * b (or the weight) + 4 * the bias, each where it requires
// grad; 0 when grad mode is off.
int grad_pattern(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias) {
  const int pattern = (a.requires_grad() ? 1 : 0) + (b.requires_grad() ? 2 : 0) +
                      (bias != nullptr && bias->requires_grad() ? 4 : 0);
  return pattern != 0 && at::GradMode::is_enabled() ? pattern : 0;
}

// call(op, a, b) -> the product, or None when this table does not serve the call (the Python path then does).
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "call(op, a, b) takes 3 arguments");
    return nullptr;
  }
  PyObject *pa = args[1], *pb = args[2];
  if (!THPVariable_CheckExact(pa) || !THPVariable_CheckExact(pb)) Py_RETURN_NONE;  // subclasses: __torch_function__
  const at::Tensor& a = THPVariable_Unpack(pa);
  const at::Tensor& b = THPVariable_Unpack(pb);
  const int pattern = grad_pattern(a, b, nullptr);
  if (at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;  // torch.mm from Python must see the mode
  const int64_t op = PyLong_AsLongLong(args[0]);
  if (op != kOpMm && op != kOpIntMm) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  Key k;
  if (!key_from_tensors(pattern != 0 ? grad_op(op, pattern) : op, a, b, k)) Py_RETURN_NONE;
  auto& t = table();
  auto it = t.find(k);
  if (it == t.end()) Py_RETURN_NONE;
  ++g_hits;
  // a copy: the table may change while the GIL is released below, or from Python code a launch runs
  const Entry e = it->second;
  if (e.kind == kNative || e.kind == kPython) {
    Py_INCREF(e.launch);
    PyObject* result = e.kind == kNative ? run_native(reinterpret_cast<NativeLaunch*>(e.launch),
                                                      Operands{.a = a, .b = b, .pa = pa, .pb = pb}, nullptr)
                                         : PyObject_CallFunctionObjArgs(e.launch, pa, pb, nullptr);
    Py_DECREF(e.launch);
    return result;
  }
  auto run = [&] { return e.kind == kAtenMm ? at::mm(a, b) : at::_int_mm(a, b); };
  at::Tensor result;
  if (a.device().is_cpu()) {
    ReleaseGil no_gil;  // the product is computed inside the call: let other Python threads run meanwhile
    result = run();
  } else {
    // An asynchronous launch: the GIL stays held. Releasing and re-taking it costs ~300 ns, more than the whole
    // lookup, and other threads wait at most one launch (torch.mm's binding releases it; Triton's launcher too).
    c10::OptionalDeviceGuard guard(a.device());
    result = run();
  }
  return THPVariable_Wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

at::Tensor aten_linear(const at::Tensor& x2, const at::Tensor& wt, const at::Tensor* bias, int activation) {
  // backends/aten.py's epilogue_launch, step for step: addmm (cuBLASLt fuses the bias) or mm, then the activation
  // in place
  at::Tensor out = bias != nullptr ? at::addmm(*bias, x2, wt) : at::mm(x2, wt);
  if (activation == kActRelu) at::relu_(out);
  if (activation == kActGelu) at::gelu_(out, "tanh");
  if (activation == kActSilu) at::silu_(out);
  return out;
}

at::Tensor torch_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, int activation) {
  // api's grad route: F.linear, then the activation out of place (autograd saves the input it differentiates)
  at::Tensor out = at::linear(x, w, bias != nullptr ? std::optional<at::Tensor>(*bias) : std::nullopt);
  if (activation == kActRelu) return at::relu(out);
  if (activation == kActGelu) return at::gelu(out, "tanh");
  if (activation == kActSilu) return at::silu(out);
  return out;
}

// A launch's (M, N) result -> x.shape[:-1] + (N,). Steals `result` (a new reference); nullptr with an error set
// when the launch failed or returned something else than a tensor.
PyObject* unflatten(PyObject* result, const at::Tensor& x) {
  if (result == nullptr || x.dim() == 2) return result;
  if (!THPVariable_Check(result)) {
    Py_DECREF(result);
    PyErr_SetString(PyExc_TypeError, "kernels.linear: a launch returned something else than a tensor");
    return nullptr;
  }
  at::Tensor out = THPVariable_Unpack(result);
  Py_DECREF(result);
  at::DimVector shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out.size(1));
  return THPVariable_Wrap(out.view(shape));
}

// call_linear(x, weight, bias, activation) -> activation(x @ weight.T + bias) shaped x.shape[:-1] + (N,), or None
// when this table does not serve the call (api.linear's Python path then runs as without the table).
PyObject* call_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "call_linear(x, weight, bias, activation) takes 4 arguments");
    return nullptr;
  }
  PyObject *px = args[0], *pw = args[1], *pbias = args[2];
  const bool has_bias = pbias != Py_None;
  const int act = activation_code(args[3]);
  // subclasses go through __torch_function__ in Python (nn.Parameter counts as a plain tensor here, as in torch)
  if (act < 0 || !THPVariable_CheckExact(px) || !THPVariable_CheckExact(pw) ||
      (has_bias && !THPVariable_CheckExact(pbias))) {
    Py_RETURN_NONE;
  }
  if (at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;  // the launch's torch calls must see the mode
  const at::Tensor& x = THPVariable_Unpack(px);
  const at::Tensor& w = THPVariable_Unpack(pw);
  const at::Tensor* bias = has_bias ? &THPVariable_Unpack(pbias) : nullptr;
  const int pattern = grad_pattern(x, w, bias);
  if (x.scalar_type() == at::kFloat) Py_RETURN_NONE;  // fp32 depends on the matmul precision, read in Python
  Key k;
  try {
    const int64_t op = linear_op(has_bias, act);
    if (!key_from_linear(pattern != 0 ? grad_op(op, pattern) : op, x, w, k)) Py_RETURN_NONE;
    if (has_bias && !servable_bias(*bias, x.scalar_type(), x.device(), k[6])) Py_RETURN_NONE;
  } catch (const c10::Error&) {
    Py_RETURN_NONE;  // a tensor without strides or data (sparse, nested, batched): Python decides about it
  }
  auto& t = table();
  auto it = t.find(k);
  if (it == t.end()) Py_RETURN_NONE;
  ++g_hits;
  const int kind = it->second.kind;
  if (kind == kTorchLinear) {  // F.linear itself (its own flattening), then the activation: torch's autograd records
    c10::OptionalDeviceGuard guard(x.device());
    return THPVariable_Wrap(torch_linear(x, w, bias, act));
  }
  const at::Tensor x2 = x.dim() == 2 ? x : x.view({k[3], k[4]});
  const at::Tensor wt = w.t();
  if (kind == kNative || kind == kPython) {
    PyObject* launch = it->second.launch;
    Py_INCREF(launch);  // the launch may run Python code that clears the table
    PyObject* result = nullptr;
    if (kind == kNative) {
      result = run_native(reinterpret_cast<NativeLaunch*>(launch),
                          Operands{.a = x2, .b = wt, .bias = bias, .pa = x.dim() == 2 ? px : nullptr, .pbias = pbias},
                          nullptr);
    } else {
      PyObject* px2 = x.dim() == 2 ? (Py_INCREF(px), px) : THPVariable_Wrap(x2);
      PyObject* pwt = px2 != nullptr ? THPVariable_Wrap(wt) : nullptr;
      if (pwt != nullptr) {
        result = has_bias ? PyObject_CallFunctionObjArgs(launch, px2, pwt, pbias, nullptr)
                          : PyObject_CallFunctionObjArgs(launch, px2, pwt, nullptr);
      }
      Py_XDECREF(px2);
      Py_XDECREF(pwt);
    }
    Py_DECREF(launch);
    return unflatten(result, x);
  }
  at::Tensor result;
  if (x.device().is_cpu()) {
    ReleaseGil no_gil;
    result = aten_linear(x2, wt, bias, act);
  } else {
    c10::OptionalDeviceGuard guard(x.device());
    result = aten_linear(x2, wt, bias, act);
  }
  if (x.dim() != 2) {
    at::DimVector shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(k[6]);
    result = result.view(shape);
  }
  return THPVariable_Wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

at::Tensor aten_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const at::Tensor* bias, at::ScalarType out_dtype) {
  // torch._scaled_mm as backends/aten.scaled_mm_launch calls it: no result scale, no fast accumulation
  return at::_scaled_mm(a, b, scale_a, scale_b, bias != nullptr ? std::optional<at::Tensor>(*bias) : std::nullopt,
                        std::nullopt, out_dtype, false);
}

// call_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype) -> kernels.scaled_mm's product, or None when this table
// does not serve the call (kernels.dispatch.scaled's Python path then runs, and validates).
PyObject* call_scaled_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "call_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype) takes 6 arguments");
    return nullptr;
  }
  PyObject *pa = args[0], *pb = args[1], *pscale_a = args[2], *pscale_b = args[3], *pbias = args[4];
  const bool has_bias = pbias != Py_None;
  if (!THPVariable_CheckExact(pa) || !THPVariable_CheckExact(pb) || !THPVariable_CheckExact(pscale_a) ||
      !THPVariable_CheckExact(pscale_b) || (has_bias && !THPVariable_CheckExact(pbias)) || !THPDtype_Check(args[5])) {
    Py_RETURN_NONE;  // subclasses go through __torch_function__ in Python; anything else is Python's to reject
  }
  if (at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;  // the launch's torch calls must see the mode
  const int out_index = scaled_out_index(reinterpret_cast<THPDtype*>(args[5])->scalar_type);
  if (out_index < 0) Py_RETURN_NONE;
  const at::Tensor& a = THPVariable_Unpack(pa);
  const at::Tensor& b = THPVariable_Unpack(pb);
  const at::Tensor& scale_a = THPVariable_Unpack(pscale_a);
  const at::Tensor& scale_b = THPVariable_Unpack(pscale_b);
  const at::Tensor* bias = has_bias ? &THPVariable_Unpack(pbias) : nullptr;
  if (at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad() || scale_a.requires_grad() ||
                                     scale_b.requires_grad() || (has_bias && bias->requires_grad()))) {
    Py_RETURN_NONE;  // not differentiable: Python raises
  }
  Key k;
  try {
    if (!key_from_scaled(a, b, scale_a, scale_b, bias, out_index, k)) Py_RETURN_NONE;
  } catch (const c10::Error&) {
    Py_RETURN_NONE;  // a tensor without strides or data (sparse, nested, batched): Python decides about it
  }
  auto& t = table();
  auto it = t.find(k);
  if (it == t.end()) Py_RETURN_NONE;
  ++g_hits;
  const Entry e = it->second;  // a copy: a launch's Python code may change the table
  if (e.kind == kNative || e.kind == kPython) {
    Py_INCREF(e.launch);
    PyObject* result = nullptr;
    if (e.kind == kNative) {
      const Operands ops{.a = a, .b = b, .scale_a = &scale_a, .scale_b = &scale_b, .bias = bias, .pa = pa, .pb = pb,
                         .pscale_a = pscale_a, .pscale_b = pscale_b, .pbias = has_bias ? pbias : nullptr};
      result = run_native(reinterpret_cast<NativeLaunch*>(e.launch), ops, nullptr);
    } else {
      result = has_bias ? PyObject_CallFunctionObjArgs(e.launch, pa, pb, pscale_a, pscale_b, pbias, nullptr)
                        : PyObject_CallFunctionObjArgs(e.launch, pa, pb, pscale_a, pscale_b, nullptr);
    }
    Py_DECREF(e.launch);
    return result;
  }
  const at::ScalarType out_dtype = kScaledOut[out_index];
  at::Tensor result;
  if (a.device().is_cpu()) {
    ReleaseGil no_gil;
    result = aten_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype);
  } else {
    c10::OptionalDeviceGuard guard(a.device());
    result = aten_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype);
  }
  return THPVariable_Wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

// Whether an entry of this kind computes the op: an aten kind names the product it runs, a native launch takes the
// op's epilogue (scales of its scaling, a bias exactly when the op has one) and writes its out dtype.
bool kind_serves(long kind, int64_t op, PyObject* launch) {
  if (is_grad_op(op)) {  // grad routes: torch's own function, whose autograd records the call
    return (kind == kAtenMm && grad_base_op(op) == kOpMm) || (kind == kTorchLinear && is_linear_op(grad_base_op(op)));
  }
  switch (kind) {
    case kTorchLinear:
      return false;
    case kAtenMm:
      return op == kOpMm || op == linear_op(false, kActNone);
    case kAtenIntMm:
      return op == kOpIntMm;
    case kAtenAddmm:
      return is_linear_op(op);
    case kAtenScaledMm:
      return is_scaled_op(op);
    case kNative: {
      const NativePlan& plan = *reinterpret_cast<NativeLaunch*>(launch)->plan;
      if (is_scaled_op(op)) {
        return plan.scaling == scaled_op_scaling(op) && plan.bias == scaled_op_bias(op) &&
               plan.out_dtype == scaled_op_out(op);
      }
      return plan.scaling == kNoScaling && plan.bias == (is_linear_op(op) && linear_has_bias(op));
    }
    default:
      return true;
  }
}

// add(key, kind, launch) -> True when registered (False: a key this table does not serve).
PyObject* add(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "add(key, kind, launch) takes 3 arguments");
    return nullptr;
  }
  long kind = PyLong_AsLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (kind == kPython && Py_TYPE(args[2]) == &NativeLaunchType) kind = kNative;
  if (kind == kNative && Py_TYPE(args[2]) != &NativeLaunchType) {
    PyErr_SetString(PyExc_TypeError, "add: a native entry's launch must be a NativeLaunch");
    return nullptr;
  }
  if (kind < kAtenMm || kind > kTorchLinear) {
    PyErr_Format(PyExc_ValueError, "unknown entry kind %ld", kind);
    return nullptr;
  }
  if ((kind == kPython || kind == kNative) && !PyCallable_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "add: launch must be callable");
    return nullptr;
  }
  Key k;
  if (!key_from_python(args[0], k)) Py_RETURN_FALSE;
  if (!kind_serves(kind, k[0], args[2])) {
    PyErr_Format(PyExc_ValueError, "add: an entry of kind %ld cannot compute op %lld", kind,
                 static_cast<long long>(k[0]));
    return nullptr;
  }
  PyObject* launch = nullptr;
  if (kind == kPython || kind == kNative) {
    Py_INCREF(args[2]);
    launch = args[2];
  }
  auto& t = table();
  auto it = t.find(k);
  if (it != t.end()) {
    PyObject* old = it->second.launch;
    it->second = Entry{static_cast<int>(kind), launch};
    Py_XDECREF(old);
  } else {
    t.emplace(k, Entry{static_cast<int>(kind), launch});
  }
  Py_RETURN_TRUE;
}

PyObject* clear(PyObject*, PyObject*) {
  auto& t = table();
  std::vector<PyObject*> owned;
  for (auto& kv : t) owned.push_back(kv.second.launch);
  t.clear();
  for (PyObject* o : owned) Py_XDECREF(o);  // after the table is consistent: a destructor may call back into us
  Py_RETURN_NONE;
}

// discard(key) -> True when an entry was removed (kernels.scaled_mm drops its entries when it empties its own table).
PyObject* discard(PyObject*, PyObject* key) {
  Key k;
  if (!key_from_python(key, k)) Py_RETURN_FALSE;
  auto& t = table();
  auto it = t.find(k);
  if (it == t.end()) Py_RETURN_FALSE;
  PyObject* old = it->second.launch;
  t.erase(it);
  Py_XDECREF(old);  // after the table is consistent: a destructor may call back into us
  Py_RETURN_TRUE;
}

// -- The custom ops' dispatcher kernels ---------------------------------------------------------------------------
// kernels::mm / int_mm / linear are defined in Python (kernels.dispatch.ops, torch.library.custom_op), whose
// dispatcher kernels are Python: per call, the autograd layer (autograd_impl, forward_no_grad, redispatch) and the
// backend layer (backend_impl, wrapped_fn) before kernels' own product, ~50-70 us of host time against F.linear's
// ~4-15. A torch.compile'd graph calls the ops once per product, so on a host-bound step kernels.patch +
// torch.compile lost to torch.compile alone (0.76x against 1.61x eager at M=128, H100). register_ops adds C++ kernels
// at the Autograd<device> and <device> keys of CPU and CUDA, which take precedence over the Python ones registered
// at the alias keys (Autograd, CompositeExplicitAutograd); fake tensors still meet the Python fake implementation,
// below these keys.
//   Autograd<device>: no input needs grad (or grad mode is off) -> redispatch below autograd, in C++. Otherwise the
//     Python Function given for the op (the op's traced forward and backward, kernels.dispatch.ops): autograd,
//     AOTAutograd's joint trace and a double backward see what they saw with the Python kernel.
//   <device>: this table (call / call_linear), and on a miss the Python product given for the op (api's plain
//     product: Python warm table, then the cold path), whose errors come back as the Python exception.
namespace ops {

enum Op : int { kMm = 0, kIntMm = 1, kLinear = 2, kOps = 3 };
const char* const kNames[kOps] = {"mm", "int_mm", "linear"};
PyObject* g_plain[kOps] = {nullptr, nullptr, nullptr};  // owned: the product on a miss
PyObject* g_grad[kOps] = {nullptr, nullptr, nullptr};   // owned: the differentiable forward (None: not differentiable)
PyObject* g_op_code[2] = {nullptr, nullptr};           // the `call` op codes as Python ints
bool g_registered = false;

struct Gil {
  PyGILState_STATE state;
  Gil() : state(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state); }
};

[[noreturn]] void raise_python() {
  python_error e;
  e.persist();  // the Python exception travels inside the C++ one, restored where the call returns to Python
  throw e;
}

// The op's last n stack values as new Python references (n = the schema's arguments). Throws with the error set.
void to_python(const torch::jit::Stack& stack, size_t n, PyObject** out) {
  for (size_t i = 0; i < n; ++i) out[i] = nullptr;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = stack[stack.size() - n + i];
    if (v.isTensor()) {
      out[i] = THPVariable_Wrap(v.toTensor());
    } else if (v.isNone()) {
      Py_INCREF(Py_None);
      out[i] = Py_None;
    } else if (v.isString()) {
      const std::string& text = v.toStringRef();
      out[i] = PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
    } else {
      PyErr_Format(PyExc_TypeError, "kernels ops: argument %zu is of a type the op's schema does not have", i);
    }
    if (out[i] == nullptr) {
      for (size_t j = 0; j < i; ++j) Py_XDECREF(out[j]);
      raise_python();
    }
  }
}

// Replace the op's n arguments on the stack by `result` (a new reference to a tensor, or nullptr with an error set).
void finish(torch::jit::Stack* stack, size_t n, PyObject** args, PyObject* result) {
  for (size_t i = 0; i < n; ++i) Py_DECREF(args[i]);
  if (result == nullptr) raise_python();
  if (!THPVariable_Check(result)) {
    Py_DECREF(result);
    PyErr_SetString(PyExc_TypeError, "kernels ops: a product returned something else than a tensor");
    raise_python();
  }
  at::Tensor out = THPVariable_Unpack(result);
  Py_DECREF(result);
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, std::move(out));
}

template <int Which>
void backend_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  Gil gil;
  PyObject* args[4];
  to_python(*stack, n, args);
  PyObject* result = nullptr;
  if (Which == kLinear) {
    result = call_linear(nullptr, args, 4);
  } else {
    PyObject* call_args[3] = {g_op_code[Which], args[0], args[1]};
    result = call(nullptr, call_args, 3);
  }
  if (result == Py_None) {
    Py_DECREF(result);
    result = PyObject_Vectorcall(g_plain[Which], args, n, nullptr);
  }
  finish(stack, n, args, result);
}

template <int Which>
void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  bool needs_grad = false;
  if (at::GradMode::is_enabled()) {
    for (size_t i = stack->size() - n; i < stack->size(); ++i) {
      const c10::IValue& v = (*stack)[i];
      needs_grad = needs_grad || (v.isTensor() && v.toTensor().requires_grad());
    }
  }
  if (!needs_grad || g_grad[Which] == Py_None) {
    // as torch's autograd fallbacks do for a call autograd has nothing to record
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
    return;
  }
  Gil gil;
  PyObject* args[4];
  to_python(*stack, n, args);
  finish(stack, n, args, PyObject_Vectorcall(g_grad[Which], args, n, nullptr));
}

std::vector<std::unique_ptr<torch::Library>>& libraries() {
  static auto* libs = new std::vector<std::unique_ptr<torch::Library>>();  // kept: the registrations live with them
  return *libs;
}

void register_key(c10::DispatchKey key, bool autograd) {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "kernels", key, __FILE__, __LINE__);
  if (autograd) {
    lib->impl("mm", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<kMm>>());
    lib->impl("int_mm", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<kIntMm>>());
    lib->impl("linear", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<kLinear>>());
  } else {
    lib->impl("mm", torch::CppFunction::makeFromBoxedFunction<&backend_kernel<kMm>>());
    lib->impl("int_mm", torch::CppFunction::makeFromBoxedFunction<&backend_kernel<kIntMm>>());
    lib->impl("linear", torch::CppFunction::makeFromBoxedFunction<&backend_kernel<kLinear>>());
  }
  libraries().push_back(std::move(lib));
}

}  // namespace ops

// register_ops(plain, grad) -> True once registered (False: this copy of the library registered them already, and
// the given callables are not used). plain: {op name: the product on a miss}; grad: {op name: the differentiable
// forward, or None}. Call it after the ops are defined, with the GIL held; the registrations last for the process
// (a copy of this library loaded from another path, as the tests do, overrides them: the dispatcher warns).
PyObject* register_ops(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "register_ops(plain: dict, grad: dict) takes 2 dicts");
    return nullptr;
  }
  if (ops::g_registered) Py_RETURN_FALSE;
  PyObject* plain[ops::kOps];
  PyObject* grad[ops::kOps];
  for (int i = 0; i < ops::kOps; ++i) {
    plain[i] = PyDict_GetItemString(args[0], ops::kNames[i]);  // borrowed
    grad[i] = PyDict_GetItemString(args[1], ops::kNames[i]);
    if (plain[i] == nullptr || !PyCallable_Check(plain[i]) || grad[i] == nullptr ||
        (grad[i] != Py_None && !PyCallable_Check(grad[i]))) {
      PyErr_Format(PyExc_TypeError, "register_ops: op %s needs a callable product and a callable (or None) grad",
                   ops::kNames[i]);
      return nullptr;
    }
  }
  for (int i = 0; i < 2; ++i) {
    ops::g_op_code[i] = PyLong_FromLongLong(i == ops::kMm ? kOpMm : kOpIntMm);
    if (ops::g_op_code[i] == nullptr) return nullptr;
  }
  for (int i = 0; i < ops::kOps; ++i) {
    Py_INCREF(plain[i]);
    Py_INCREF(grad[i]);
    ops::g_plain[i] = plain[i];
    ops::g_grad[i] = grad[i];
  }
  ops::register_key(c10::DispatchKey::CPU, false);
  ops::register_key(c10::DispatchKey::CUDA, false);
  ops::register_key(c10::DispatchKey::AutogradCPU, true);
  ops::register_key(c10::DispatchKey::AutogradCUDA, true);
  ops::g_registered = true;
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* hits(PyObject*, PyObject*) { return PyLong_FromLongLong(g_hits); }

PyObject* kind_of(PyObject*, PyObject* key) {
  Key k;
  if (!key_from_python(key, k)) return PyLong_FromLong(-1);
  auto it = table().find(k);
  return PyLong_FromLong(it == table().end() ? -1 : it->second.kind);
}

PyObject* size(PyObject*, PyObject*) { return PyLong_FromSize_t(table().size()); }

PyMethodDef methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
     "call(op, a, b): the product for a registered problem, else None (op 0 = mm, 1 = int_mm)"},
    {"call_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_linear)), METH_FASTCALL,
     "call_linear(x, weight, bias, activation): kernels.linear for a registered problem, else None"},
    {"call_scaled_mm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_scaled_mm)), METH_FASTCALL,
     "call_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype): kernels.scaled_mm for a registered problem, else None"},
    {"add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add)), METH_FASTCALL,
     "add(key, kind, launch): register a warm entry under the Python dispatch key (kind 0 = at::mm, 1 = "
     "at::_int_mm, 2 = the launch, called from here, 4 = at::addmm / at::mm and the activation, for linear, "
     "5 = at::_scaled_mm, for scaled_mm)"},
    {"native", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(make_native)), METH_FASTCALL,
     "native(device, stream, m, n, out_dtype, steps, fallback, keepalive[, scaling]): a NativeLaunch"},
    {"register_ops", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(register_ops)), METH_FASTCALL,
     "register_ops(plain, grad): C++ dispatcher kernels for kernels::mm / int_mm / linear on CPU and CUDA"},
    {"driver_status", driver_status, METH_NOARGS, "'' when the CUDA driver's entry points resolved, else why not"},
    {"kind", kind_of, METH_O, "the table's entry kind for this key (-1: not registered)"},
    {"clear", clear, METH_NOARGS, "forget every entry"},
    {"discard", discard, METH_O, "forget this key's entry; True when there was one"},
    {"hits", hits, METH_NOARGS, "calls served since load"},
    {"size", size, METH_NOARGS, "entries registered"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_kernels_fastpath", "kernels warm-call dispatch", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__kernels_fastpath() {
  if (PyType_Ready(&NativeLaunchType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(&NativeLaunchType);
  if (PyModule_AddObject(module, "NativeLaunch", reinterpret_cast<PyObject*>(&NativeLaunchType)) < 0) {
    Py_DECREF(&NativeLaunchType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
