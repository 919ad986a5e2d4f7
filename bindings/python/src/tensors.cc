// File: bindings/python/src/tensors.cc
// -----------------------------------------------------------------------------
// Tensors through DLPack, both ways: the tensor arguments of collectives, the scheduler and the
// checkpointer (ToTensor: numpy, torch, jax, zero-copy), and the tensors shardline.empty/zeros
// hand out in shardline's shareable host memory.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings/python/src/common.h"
#include "runtime/allocator.h"

namespace shardline::python {
namespace {

std::optional<DType> FromDlpack(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes != 1) return std::nullopt;
  const auto code = static_cast<Code>(t.code);
  if (code == Code::Float && t.bits == 32) return DType::kF32;
  if (code == Code::Float && t.bits == 64) return DType::kF64;
  if (code == Code::Float && t.bits == 16) return DType::kF16;
  if (code == Code::Bfloat && t.bits == 16) return DType::kBF16;
  if (code == Code::Int && t.bits == 8) return DType::kI8;
  if (code == Code::UInt && t.bits == 8) return DType::kU8;
  if (code == Code::Int && t.bits == 32) return DType::kI32;
  if (code == Code::Int && t.bits == 64) return DType::kI64;
  return std::nullopt;
}

nb::dlpack::dtype ToDlpack(DType dtype) {
  using Code = nb::dlpack::dtype_code;
  auto make = [](Code code, int bits) {
    nb::dlpack::dtype t;
    t.code = static_cast<uint8_t>(code);
    t.bits = static_cast<uint8_t>(bits);
    t.lanes = 1;
    return t;
  };
  switch (dtype) {
    case DType::kF32:
      return make(Code::Float, 32);
    case DType::kF64:
      return make(Code::Float, 64);
    case DType::kF16:
      return make(Code::Float, 16);
    case DType::kBF16:
      return make(Code::Bfloat, 16);
    case DType::kI8:
      return make(Code::Int, 8);
    case DType::kU8:
      return make(Code::UInt, 8);
    case DType::kI32:
      return make(Code::Int, 32);
    case DType::kI64:
      return make(Code::Int, 64);
  }
  return make(Code::Float, 32);
}

std::string DescribeDlpack(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = "code?";
  switch (static_cast<Code>(t.code)) {
    case Code::Int:
      kind = "int";
      break;
    case Code::UInt:
      kind = "uint";
      break;
    case Code::Float:
      kind = "float";
      break;
    case Code::Bfloat:
      kind = "bfloat";
      break;
    case Code::Complex:
      kind = "complex";
      break;
    case Code::Bool:
      kind = "bool";
      break;
    default:
      break;
  }
  return absl::StrCat(kind, static_cast<int>(t.bits),
                      t.lanes != 1 ? absl::StrCat("x", static_cast<int>(t.lanes)) : "");
}

Device DeviceOf(const nb::ndarray<nb::ro>& array) {
  if (array.device_type() == nb::device::cuda::value) return Device::Cuda(array.device_id());
  return Device::Host();
}

// ---- Registered memory ---------------------------------------------------------------------

// shardline's shareable host allocator: allocations of at least SHARDLINE_HOST_SHAREABLE_BYTES
// are blocks of the shareable arenas, which peers on the host map once and copy from directly.
// Never destroyed (its buffers may outlive any module teardown order).
Allocator& HostMemory() {
  static Allocator* allocator = CreateShareableHostAllocator(64, "python").release();
  return *allocator;
}

nb::object Empty(const std::vector<int64_t>& shape, const std::string& dtype_name,
                 const std::string& framework, bool zero) {
  const DType dtype = Unwrap(ParseDType(dtype_name));
  size_t numel = 1;
  std::vector<size_t> dims;
  for (int64_t d : shape) {
    if (d < 0) ThrowInvalid(absl::StrCat("empty: negative dimension ", d));
    numel *= static_cast<size_t>(d);
    dims.push_back(static_cast<size_t>(d));
  }
  if (framework != "numpy" && framework != "torch") {
    ThrowInvalid(absl::StrCat("empty: framework '", framework, "' is not 'numpy' or 'torch'"));
  }
  if (framework == "numpy" && dtype == DType::kBF16) {
    ThrowInvalid("empty: numpy has no bfloat16; use framework='torch'");
  }
  const size_t bytes = std::max<size_t>(numel * DTypeSize(dtype), 1);
  Buffer buffer = Unwrap(HostMemory().Allocate(bytes));
  if (zero) std::memset(buffer.data(), 0, bytes);
  void* data = buffer.data();
  auto* owned = new Buffer(std::move(buffer));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<Buffer*>(p); });
  if (framework == "torch") {
    return nb::ndarray<nb::pytorch>(data, dims.size(), dims.data(), owner, nullptr, ToDlpack(dtype),
                                    nb::device::cpu::value, 0)
        .cast();
  }
  return nb::ndarray<nb::numpy>(data, dims.size(), dims.data(), owner, nullptr, ToDlpack(dtype),
                                nb::device::cpu::value, 0)
      .cast();
}

}  // namespace

Tensor ToTensor(nb::handle obj, const char* what, bool writable, Device device) {
  // One DLPack import per tensor (each is a __dlpack__ call: about 3 us for a torch tensor): a
  // writable ndarray<> refuses read-only memory by itself; only when it fails does a read-only
  // import tell "read-only" from "not a tensor".
  nb::ndarray<nb::ro> array;
  bool imported = false;
  if (writable) {
    nb::ndarray<> rw;
    imported = nb::try_cast(obj, rw, /*convert=*/false);
    if (imported) array = nb::ndarray<nb::ro>(rw);
  }
  if (!imported && !nb::try_cast(obj, array, /*convert=*/false)) {
    // A tensor whose dtype DLPack cannot describe (numpy's float128, object arrays, ...).
    if (nb::hasattr(obj, "__dlpack__") && nb::hasattr(obj, "dtype")) {
      std::string dtype = "?";
      if (PyObject* dtype_obj = PyObject_GetAttrString(obj.ptr(), "dtype")) {
        if (PyObject* text = PyObject_Str(dtype_obj)) {
          if (const char* utf8 = PyUnicode_AsUTF8(text)) dtype = utf8;
          Py_DECREF(text);
        }
        Py_DECREF(dtype_obj);
      }
      PyErr_Clear();
      ThrowInvalid(absl::StrCat(what, " has dtype ", dtype,
                                ", which DLPack cannot export; shardline moves float32, float64, "
                                "float16, bfloat16, int8, uint8, int32 and int64"));
    }
    ThrowInvalid(absl::StrCat(what, " is a ", nb::type_name(obj.type()).c_str(),
                              ", not a tensor (numpy, torch, jax: anything with __dlpack__)"));
  }
  if (writable && !imported) {
    ThrowInvalid(absl::StrCat(what, " is read-only; the collective writes it"));
  }
  std::optional<DType> dtype = FromDlpack(array.dtype());
  if (!dtype.has_value()) {
    ThrowInvalid(absl::StrCat(what, " has dtype ", DescribeDlpack(array.dtype()),
                              "; shardline moves float32, float64, float16, bfloat16, int8, "
                              "uint8, int32 and int64"));
  }
  // C-contiguous: strides (in elements) are the suffix products of the shape; dimensions of size
  // 1 may have any stride. An empty tensor has no layout to check (numpy exports stride 0 for
  // it); count 0 is a legal collective.
  int64_t expected = 1;
  for (size_t i = array.size() == 0 ? 0 : array.ndim(); i-- > 0;) {
    if (array.shape(i) != 1 && array.stride(i) != expected) {
      ThrowInvalid(absl::StrCat(what, " is not C-contiguous (dimension ", i, " has stride ",
                                array.stride(i), ", expected ", expected,
                                "); pass a contiguous copy"));
    }
    expected *= static_cast<int64_t>(array.shape(i));
  }
  const Device where = DeviceOf(array);
  if (where != device) {
    ThrowInvalid(absl::StrCat(what, " is on ", where.ToString(), " but the communicator moves ",
                              device.ToString(), " memory"));
  }
  Tensor t;
  t.data = const_cast<void*>(array.data());
  t.numel = array.size();
  t.dtype = *dtype;
  t.device = where;
  t.owner = nb::borrow(obj);
  return t;
}

Device TensorDevice(nb::handle obj) {
  nb::ndarray<nb::ro> array;
  if (!nb::try_cast(obj, array, /*convert=*/false)) return Device::Host();
  return DeviceOf(array);
}

void RegisterTensors(nb::module_& m) {
  m.def("_empty", &Empty, nb::arg("shape"), nb::arg("dtype"), nb::arg("framework"),
        nb::arg("zero"));
  m.def("_host_memory_stats", [] {
    MemoryStats s = HostMemory().stats();
    return std::make_tuple(s.current_bytes, s.peak_bytes, s.live_allocations);
  });
}

}  // namespace shardline::python
