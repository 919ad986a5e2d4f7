// File: bindings/python/src/errors.cc
// -----------------------------------------------------------------------------
// shardline.Error and its subclasses: a failed Status reaches Python as the exception class that
// follows its code, with the Status text as the message, .code and .peer_error.

#include <nanobind/nanobind.h>

#include <exception>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bindings/python/src/common.h"
#include "collectives/communicator.h"

namespace shardline::python {
namespace {

struct ErrorTypes {
  PyObject* base = nullptr;               // shardline.Error(Exception)
  PyObject* invalid_argument = nullptr;   // (Error, ValueError)
  PyObject* deadline_exceeded = nullptr;  // (Error, TimeoutError)
  PyObject* remote = nullptr;             // RemoteError(Error)
  PyObject* failed_precondition = nullptr;
  PyObject* not_found = nullptr;           // (Error, LookupError)
  PyObject* resource_exhausted = nullptr;  // (Error, MemoryError)
  PyObject* unimplemented = nullptr;       // (Error, NotImplementedError)
  PyObject* data_loss = nullptr;           // DataLossError(Error)
  PyObject* already_exists = nullptr;      // (Error, FileExistsError)
};
ErrorTypes errors;

PyObject* NewError(nb::module_& m, const char* name, PyObject* base, PyObject* builtin,
                   const char* doc) {
  std::string qualified = absl::StrCat("shardline.", name);
  PyObject* bases = builtin != nullptr ? PyTuple_Pack(2, base, builtin) : PyTuple_Pack(1, base);
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  Py_DECREF(bases);
  if (type == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;
}

PyObject* ErrorTypeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return IsPeerError(status) ? errors.remote : errors.invalid_argument;
    case absl::StatusCode::kDeadlineExceeded:
      return errors.deadline_exceeded;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
      return errors.remote;
    case absl::StatusCode::kFailedPrecondition:
      return IsPeerError(status) ? errors.remote : errors.failed_precondition;
    case absl::StatusCode::kNotFound:
      return errors.not_found;
    case absl::StatusCode::kResourceExhausted:
      return errors.resource_exhausted;
    case absl::StatusCode::kUnimplemented:
      return errors.unimplemented;
    case absl::StatusCode::kDataLoss:
      return IsPeerError(status) ? errors.remote : errors.data_loss;
    case absl::StatusCode::kAlreadyExists:
      return IsPeerError(status) ? errors.remote : errors.already_exists;
    default:
      return IsPeerError(status) ? errors.remote : errors.base;
  }
}

void RaiseStatus(const absl::Status& status, const std::string& text) {
  PyObject* value = MakeException(status, text);
  if (value == nullptr) return;  // the failure to build the exception is the error now
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(value)), value);
  Py_DECREF(value);
}
}  // namespace

// A new exception object for `status` (its class per ErrorTypeFor, .code, .peer_error), or null
// with the Python error set if even that failed. `text` need not be UTF-8 (a manifest's bytes, a
// Latin-1 name): invalid bytes become U+FFFD, so the message and the class survive.
PyObject* MakeException(const absl::Status& status, const std::string& text) {
  PyObject* type = ErrorTypeFor(status);
  PyObject* message =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
  PyObject* value = message != nullptr ? PyObject_CallOneArg(type, message) : nullptr;
  Py_XDECREF(message);
  if (value == nullptr) return nullptr;
  std::string code(absl::StatusCodeToString(status.code()));
  PyObject* code_text = PyUnicode_FromString(code.c_str());
  if (code_text == nullptr || PyObject_SetAttrString(value, "code", code_text) != 0 ||
      PyObject_SetAttrString(value, "peer_error", IsPeerError(status) ? Py_True : Py_False) != 0) {
    Py_XDECREF(code_text);
    Py_DECREF(value);
    return nullptr;
  }
  Py_DECREF(code_text);
  return value;
}

void ThrowInvalid(std::string message) {
  throw StatusError(absl::InvalidArgumentError(std::move(message)));
}

void RegisterErrors(nb::module_& m) {
  errors.base = NewError(m, "Error", PyExc_Exception, nullptr,
                         "Base of shardline's errors: the message is the Status text; .code is "
                         "the Status code's name, .peer_error whether a peer caused it.");
  errors.invalid_argument = NewError(m, "InvalidArgumentError", errors.base, PyExc_ValueError,
                                     "A bad argument (Status InvalidArgument or OutOfRange).");
  errors.deadline_exceeded = NewError(m, "DeadlineExceededError", errors.base, PyExc_TimeoutError,
                                      "A wait passed its deadline (Status DeadlineExceeded).");
  errors.remote = NewError(m, "RemoteError", errors.base, nullptr,
                           "A dead, aborted or disagreeing peer (Unavailable, Aborted, or an error "
                           "a peer caused).");
  errors.failed_precondition =
      NewError(m, "FailedPreconditionError", errors.base, PyExc_RuntimeError,
               "A call out of order (Status FailedPrecondition).");
  errors.not_found = NewError(m, "NotFoundError", errors.base, PyExc_LookupError,
                              "Something named was not found (Status NotFound).");
  errors.resource_exhausted =
      NewError(m, "ResourceExhaustedError", errors.base, PyExc_MemoryError,
               "Memory or another resource ran out (Status ResourceExhausted).");
  errors.unimplemented = NewError(m, "UnimplementedError", errors.base, PyExc_NotImplementedError,
                                  "Not supported here (Status Unimplemented).");
  errors.data_loss = NewError(m, "DataLossError", errors.base, nullptr,
                              "Stored data is damaged: a truncated file, a checksum mismatch "
                              "(Status DataLoss).");
  errors.already_exists = NewError(m, "AlreadyExistsError", errors.base, PyExc_FileExistsError,
                                   "What the call would create exists (Status AlreadyExists).");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      RaiseStatus(e.status(), e.text());
    }
  });
}

}  // namespace shardline::python
