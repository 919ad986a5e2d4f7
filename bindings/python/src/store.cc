// File: bindings/python/src/store.cc
// -----------------------------------------------------------------------------
// shardline._core.init_with_store: a communicator whose rendezvous goes through a store that
// lives in Python, such as the torch.distributed Store (a PrefixStore per process group) that
// torch hands a c10d backend's creator. shardline then never opens a store of its own: no second
// MASTER_PORT.
//
// PythonStore adapts the Python object to shardline::Store. Every call takes the GIL, so it must
// never be made from a thread that holds a lock the GIL's holder may wait on. Who calls it: the
// communicator's creation (CreateCommunicator, on the thread that called init_with_store) and
// subgroup creation (Split/Dup: Communicator.split/dup, Mesh, Scheduler), each synchronous on a
// Python thread that released the GIL first. No thread of the ucx backend touches the store after
// creation returns (its progress thread never does). The communicator and every subgroup hold the
// adapter (a shared_ptr), and the adapter holds the Python store, so the store outlives them.

#include <nanobind/nanobind.h>
#include <nanobind/stl/chrono.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "bindings/python/src/common.h"
#include "collectives/bootstrap.h"
#include "runtime/config.h"
#include "runtime/status.h"

namespace shardline::python {
namespace {

// The methods of torch.distributed.Store that the adapter calls.
constexpr const char* kStoreMethods[] = {"set",  "get",   "add",        "compare_set",
                                         "wait", "check", "delete_key", "num_keys"};

class PythonStore final : public Store {
 public:
  explicit PythonStore(nb::object store) : store_(std::move(store)) {}

  ~PythonStore() override {
    // The last holder may be a communicator freed on any thread; after the interpreter is gone
    // the reference is left behind (nothing could free it).
    if (!nb::is_alive()) {
      store_.release();
      return;
    }
    nb::gil_scoped_acquire gil;
    store_.reset();
  }

 protected:
  absl::Status DoSet(absl::string_view key, absl::string_view value) override {
    nb::gil_scoped_acquire gil;
    try {
      store_.attr("set")(Key(key), nb::bytes(value.data(), value.size()));
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return Failed("set", PrintableKey(key), e, std::nullopt);
    }
  }

  absl::StatusOr<std::string> DoGet(absl::string_view key, absl::Time deadline) override {
    std::string k(key);
    SL_RETURN_IF_ERROR(DoWait({&k, 1}, deadline));
    nb::gil_scoped_acquire gil;
    try {
      return Bytes(store_.attr("get")(Key(key)));
    } catch (const std::exception& e) {
      return Failed("get", PrintableKey(key), e, deadline);
    }
  }

  absl::StatusOr<int64_t> DoAdd(absl::string_view key, int64_t delta) override {
    nb::gil_scoped_acquire gil;
    try {
      return nb::cast<int64_t>(store_.attr("add")(Key(key), delta));
    } catch (const std::exception& e) {
      return Failed("add", PrintableKey(key), e, std::nullopt);
    }
  }

  absl::StatusOr<std::string> DoCompareSet(absl::string_view key, absl::string_view expected,
                                           absl::string_view desired) override {
    nb::gil_scoped_acquire gil;
    try {
      std::string now =
          Bytes(store_.attr("compare_set")(Key(key), nb::bytes(expected.data(), expected.size()),
                                           nb::bytes(desired.data(), desired.size())));
      // torch's stores answer a missing key with `expected` when it is not empty (and set
      // nothing); shardline's contract says "" then. Only a missing key can give back
      // `expected` != `desired` (a present key equal to it would have been swapped).
      if (!expected.empty() && now == expected) {
        if (expected != desired) return std::string();
        nb::list keys;
        keys.append(Key(key));
        if (!nb::cast<bool>(store_.attr("check")(keys))) return std::string();
      }
      return now;
    } catch (const std::exception& e) {
      return Failed("compare_set", PrintableKey(key), e, std::nullopt);
    }
  }

  absl::Status DoWait(absl::Span<const std::string> keys, absl::Time deadline) override {
    if (keys.empty()) return absl::OkStatus();
    const absl::Duration left = deadline - absl::Now();
    nb::gil_scoped_acquire gil;
    nb::list list;
    for (const std::string& k : keys) list.append(Key(k));
    try {
      if (left <= absl::ZeroDuration()) {
        // torch reads a zero timeout as "the store's default": ask instead of waiting.
        if (nb::cast<bool>(store_.attr("check")(list))) return absl::OkStatus();
        return absl::DeadlineExceededError(
            absl::StrCat("torch store: ", PrintableKeys(keys), " not set by the deadline"));
      }
      // Whole milliseconds, at least one, at most a year (an infinite deadline).
      const int64_t ms = std::clamp<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1,
                                             int64_t{365} * 24 * 3600 * 1000);
      store_.attr("wait")(list, std::chrono::milliseconds(ms));
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return Failed("wait", PrintableKeys(keys), e, deadline);
    }
  }

  absl::StatusOr<bool> DoCheck(absl::Span<const std::string> keys) override {
    nb::gil_scoped_acquire gil;
    nb::list list;
    for (const std::string& k : keys) list.append(Key(k));
    try {
      return nb::cast<bool>(store_.attr("check")(list));
    } catch (const std::exception& e) {
      return Failed("check", PrintableKeys(keys), e, std::nullopt);
    }
  }

  absl::StatusOr<bool> DoDelete(absl::string_view key) override {
    nb::gil_scoped_acquire gil;
    try {
      return nb::cast<bool>(store_.attr("delete_key")(Key(key)));
    } catch (const std::exception& e) {
      return Failed("delete_key", PrintableKey(key), e, std::nullopt);
    }
  }

  absl::StatusOr<int64_t> DoNumKeys() override {
    nb::gil_scoped_acquire gil;
    try {
      return nb::cast<int64_t>(store_.attr("num_keys")());
    } catch (const std::exception& e) {
      return Failed("num_keys", "", e, std::nullopt);
    }
  }

 private:
  // Keys are text in torch's API; shardline's keys are ASCII.
  static nb::str Key(absl::string_view key) { return nb::str(key.data(), key.size()); }

  static std::string Bytes(nb::handle value) {
    if (nb::isinstance<nb::bytes>(value)) {
      nb::bytes b = nb::borrow<nb::bytes>(value);
      return std::string(b.c_str(), b.size());
    }
    return nb::cast<std::string>(value);
  }

  // The Status for an exception from the Python store (GIL held): DeadlineExceeded for a timeout
  // (a waiting call past `deadline`, or an error that says it timed out), Unavailable for a
  // broken connection, Unknown otherwise; the text names the call, the keys and the exception.
  absl::Status Failed(const char* method, absl::string_view keys, const std::exception& e,
                      std::optional<absl::Time> deadline) const {
    std::string type = "error";
    std::string text = e.what();
    if (const auto* py = dynamic_cast<const nb::python_error*>(&e)) {
      type = nb::type_name(py->type()).c_str();
      text = nb::str(py->value()).c_str();
    }
    const std::string what =
        absl::StrCat("torch store ", method, keys.empty() ? "" : absl::StrCat(" of ", keys), ": ",
                     type, ": ", text);
    const std::string lower = absl::AsciiStrToLower(absl::StrCat(type, " ", text));
    if ((deadline.has_value() && absl::Now() >= *deadline) || absl::StrContains(lower, "timeout") ||
        absl::StrContains(lower, "timed out")) {
      return absl::DeadlineExceededError(what);
    }
    if (absl::StrContains(type, "DistNetworkError") || absl::StrContains(type, "Connection")) {
      return absl::UnavailableError(what);
    }
    return absl::UnknownError(what);
  }

  nb::object store_;
};

PyComm InitWithStore(nb::object store, int rank, int size, const std::string& backend,
                     std::optional<double> timeout_s, const std::string& name,
                     std::optional<std::string> device) {
  for (const char* method : kStoreMethods) {
    if (!nb::hasattr(store, method)) {
      ThrowInvalid(absl::StrCat("init_with_store: the store (a ",
                                nb::type_name(store.type()).c_str(), ") has no method '", method,
                                "'; pass a torch.distributed.Store or an object with its methods"));
    }
  }
  if (size < 1 || rank < 0 || rank >= size) {
    ThrowInvalid(absl::StrCat("init_with_store: rank ", rank, " is not in a world of ", size));
  }
  CommunicatorOptions options;
  options.backend = backend;
  options.rank = rank;
  options.size = size;
  options.name = name;
  if (device.has_value()) {
    options.device = Unwrap(Device::Parse(*device));
  } else if (backend == "nccl") {
    // As InitProcessGroup: cuda:LOCAL_RANK (the launcher's), else cuda:rank.
    absl::StatusOr<LaunchInfo> launch = ReadLaunchEnvironment();
    options.device = Device::Cuda(launch.ok() ? launch->local_rank : rank);
  }
  if (timeout_s.has_value()) {
    if (!(*timeout_s > 0)) {
      ThrowInvalid(absl::StrCat("init_with_store: timeout ", *timeout_s, " s is not > 0"));
    }
    options.timeout = absl::Seconds(*timeout_s);
  }
  ThrowIfError(ValidateAllParams());
  auto adapter = std::make_shared<PythonStore>(std::move(store));
  options.store = adapter;
  absl::StatusOr<std::shared_ptr<Communicator>> comm;
  {
    nb::gil_scoped_release release;
    comm = CreateCommunicator(options);
  }
  return PyComm(Unwrap(std::move(comm)), std::move(adapter));
}

}  // namespace

void RegisterStore(nb::module_& m) {
  m.def("init_with_store", &InitWithStore, nb::arg("store"), nb::arg("rank"), nb::arg("size"),
        nb::arg("backend") = "ucx", nb::arg("timeout") = nb::none(), nb::arg("name") = "world",
        nb::arg("device") = nb::none(),
        "A communicator of `size` ranks whose rendezvous goes through `store`, an object with "
        "torch.distributed.Store's methods (set, get, add, compare_set, wait, check, delete_key, "
        "num_keys), e.g. the prefix store torch gives a c10d backend. Collective over the ranks; "
        "keys go under `name`. timeout: seconds bounding the rendezvous and every collective "
        "(default SHARDLINE_TIMEOUT_S). device: the memory it moves ('host', 'cuda:N'); None: "
        "host for ucx, cuda:LOCAL_RANK for nccl. ucx with 'cuda:N' stages CUDA memory through "
        "pinned host memory (ranks that share a GPU).");
}

}  // namespace shardline::python
