// Shared helpers of the FFI handlers: error propagation, buffer checks with readable messages, exported symbols.
//
// Handlers never throw: an exception escaping a handler reaches Python only as "UNKNOWN: XLA FFI call failed", while a
// returned ffi::Error keeps its code and message. Every check returns an InvalidArgument error that names the buffer,
// the expected shape and dtype and the actual ones: "gcmoe_moe: w13_scale: expected [8, 512, 4] int32, got [8, 512, 5]
// int32".

#ifndef GCMOE_JAX_CSRC_COMMON_H_
#define GCMOE_JAX_CSRC_COMMON_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

// Symbols that Python looks up with ctypes; everything else is hidden (-fvisibility=hidden).
#define GCMOE_EXPORT extern "C" __attribute__((visibility("default")))

// Returns `expr` (an ffi::Error) from the enclosing function when it is a failure.
#define GCMOE_RETURN_IF_ERROR(expr)                    \
  do {                                                 \
    ::xla::ffi::Error gcmoe_error_ = (expr);           \
    if (gcmoe_error_.failure()) return gcmoe_error_;   \
  } while (0)

namespace gcmoe {

namespace ffi = ::xla::ffi;

// The numpy name of an FFI element type, as Python users know it.
inline const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F4E2M1FN: return "float4_e2m1fn";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    default: return "other";
  }
}

template <typename Dims>
std::string ShapeString(const Dims& dims) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : dims) {
    if (!first) s += ", ";
    s += std::to_string(d);
    first = false;
  }
  return s + "]";
}

// Checks one buffer against its expected shape and dtype; `op` and `name` prefix the message.
inline ffi::Error CheckBuffer(const char* op, const char* name, const ffi::AnyBuffer& buffer,
                              ffi::DataType dtype, const std::vector<int64_t>& shape) {
  const auto dims = buffer.dimensions();
  bool ok = buffer.element_type() == dtype && dims.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = dims[i] == shape[i];
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + ": expected " + ShapeString(shape) + " " +
                                     DtypeName(dtype) + ", got " + ShapeString(dims) + " " +
                                     DtypeName(buffer.element_type()));
}

// For the ctypes entry points: copies `why` into the caller's `error` buffer of `error_size` bytes (truncated,
// NUL-terminated) and returns -1, their failure code.
inline int FailWith(const std::string& why, char* error, int error_size) {
  if (error != nullptr && error_size > 0) {
    const size_t room = static_cast<size_t>(error_size - 1);
    const size_t n = why.size() < room ? why.size() : room;
    why.copy(error, n);
    error[n] = '\0';
  }
  return -1;
}

// Checks an attribute; `requirement` completes "requires <name> <requirement>".
inline ffi::Error CheckAttr(const char* op, bool ok, const char* name, const char* requirement, double value) {
  if (ok) return ffi::Error::Success();
  std::string v = std::to_string(value);
  if (value == static_cast<double>(static_cast<int64_t>(value))) v = std::to_string(static_cast<int64_t>(value));
  return ffi::Error::InvalidArgument(std::string(op) + " requires attribute " + name + " " + requirement + ", got " +
                                     v);
}

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_COMMON_H_
