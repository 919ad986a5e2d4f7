// Callback streams, events and allocators (runtime/callback_stream.h): another runtime's queue,
// event and pool behind shardline's Stream, Event and Allocator.

#include "runtime/callback_stream.h"

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/clock.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {
namespace {

// " (origin)", or nothing without one.
std::string Origin(const std::string& origin) {
  return origin.empty() ? std::string() : absl::StrCat(" (", origin, ")");
}

// The base class holds each freed block until every stream that used it is done, so `free`
// gets memory that is idle.
class CallbackAllocator final : public Allocator {
 public:
  CallbackAllocator(AllocatorCallbacks callbacks, Device device, std::string name)
      : Allocator(device, std::move(name)), callbacks_(std::move(callbacks)) {}
  ~CallbackAllocator() override { DrainPending(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* first_user) override {
    void* ptr = nullptr;
    void* stream = first_user != nullptr ? first_user->native_handle() : nullptr;
    const int rc = callbacks_.alloc(callbacks_.user, bytes, stream, &ptr);
    if (rc != 0 || ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the framework's allocator returned ", rc, " (pointer ", ptr == nullptr ? "NULL" : "set",
          ") for ", bytes, " bytes", Origin(callbacks_.origin)));
    }
    if (reinterpret_cast<uintptr_t>(ptr) % kCallbackAllocatorAlignment != 0) {
      callbacks_.free(callbacks_.user, ptr, bytes, nullptr);
      return absl::InvalidArgumentError(absl::StrCat(
          "the framework's allocator returned 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
          " for ", bytes, " bytes: not aligned to ", kCallbackAllocatorAlignment, " bytes",
          Origin(callbacks_.origin)));
    }
    return ptr;
  }
  void DeallocateRaw(void* data, size_t bytes) override {
    callbacks_.free(callbacks_.user, data, bytes, nullptr);
  }

 private:
  const AllocatorCallbacks callbacks_;
};

// Waits go through the notify callback (no polling), Query through the query callback.
class CallbackEvent final : public Event {
 public:
  explicit CallbackEvent(EventCallbacks callbacks)
      : callbacks_(std::move(callbacks)),
        what_(absl::StrCat("a framework's event", Origin(callbacks_.origin))) {}
  ~CallbackEvent() override {
    if (callbacks_.release != nullptr) callbacks_.release(callbacks_.user);
  }

  Device device() const override { return Device::Host(); }
  absl::Status Record(Stream& stream) override {
    return absl::InvalidArgumentError(absl::StrCat(what_, " cannot be recorded on stream '",
                                                   stream.name(), "': the framework records it"));
  }
  absl::StatusOr<bool> Query() override {
    const int q = callbacks_.query(callbacks_.user);
    if (q < 0) return Failed(q);
    return q > 0;
  }
  absl::Status Synchronize(absl::Time deadline) override {
    // std::mutex, not absl::Mutex: ThreadSanitizer sees only the former (stream_internal.h).
    struct Waiter {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
      absl::Status status;
    };
    auto waiter = std::make_shared<Waiter>();
    OnComplete([waiter](absl::Status status) {
      std::lock_guard<std::mutex> lock(waiter->mu);
      waiter->done = true;
      waiter->status = std::move(status);
      waiter->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(waiter->mu);
    if (!WallClock().WaitUntil(waiter->cv, lock, deadline, [&] { return waiter->done; })) {
      return absl::DeadlineExceededError(absl::StrCat(what_, " did not complete by the deadline"));
    }
    return waiter->status;
  }
  void OnComplete(EventCallback callback) override {
    auto* ctx = new Completion{std::move(callback), what_};
    callbacks_.notify(
        callbacks_.user,
        [](void* c, int failed) {
          std::unique_ptr<Completion> completion(static_cast<Completion*>(c));
          std::move(completion->callback)(failed != 0 ? Failed(completion->what, failed)
                                                      : absl::OkStatus());
        },
        ctx);
  }

 private:
  struct Completion {
    EventCallback callback;
    std::string what;
  };
  static absl::Status Failed(const std::string& what, int code) {
    return absl::InternalError(absl::StrCat(what, " reported failure ", code));
  }
  absl::Status Failed(int code) const { return Failed(what_, code); }

  const EventCallbacks callbacks_;
  const std::string what_;  // "a framework's event (origin)", for messages
};

// The CallbackStream whose fn this thread is running, if any (Synchronize from inside one would
// wait for itself).
thread_local const void* running_callback_stream = nullptr;

// Every op, event record and wait becomes one fn(ctx) that the other runtime runs in its
// stream's order. What the fns touch is shared with them, so one that runs after the stream is
// gone frees nothing twice and touches nothing freed.
class CallbackStream final : public Stream, public stream_internal::HostCaptureRecorder {
 public:
  CallbackStream(std::string name, StreamCallbacks callbacks, absl::Duration wait_timeout)
      : callbacks_(std::move(callbacks)), state_(std::make_shared<State>()) {
    state_->name = std::move(name);
    state_->origin = Origin(callbacks_.origin);
    state_->wait_timeout = wait_timeout;
  }

  // Lets the enqueued fns run (at most wait_timeout), then hands the stream back.
  ~CallbackStream() override {
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      const uint64_t target = state_->enqueued;
      if (!WallClock().WaitUntil(state_->cv, lock, absl::Now() + state_->wait_timeout,
                                 [&] { return state_->finished >= target; })) {
        SL_LOG(WARN, STREAM) << "stream '" << state_->name << "': destroyed with "
                             << target - state_->finished
                             << " enqueued fn(s) the framework has not run";
      }
    }
    if (callbacks_.release != nullptr) callbacks_.release(callbacks_.user);
  }

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return state_->name; }

  absl::Status Submit(StreamOp op) override {
    Item item;
    item.op = std::move(op);
    return Push(std::move(item));
  }

  absl::Status WaitEvent(Event& event) override {
    // Stream order covers this stream's own events.
    if (event.recorded_stream_id() == id()) return status();
    // The wait is for the capture of the event's latest Record() as of now.
    auto latch = std::make_shared<stream_internal::HostCapture>(*this);
    event.OnComplete([latch](absl::Status status) { latch->Complete(std::move(status)); });
    absl::Status done;
    if (latch->done(&done) && done.ok()) return status();
    Item item;
    item.wait = std::move(latch);
    auto* host = dynamic_cast<stream_internal::HostEvent*>(&event);
    const std::shared_ptr<stream_internal::HostCapture> capture =
        host != nullptr ? host->current() : nullptr;
    item.source = capture != nullptr
                      ? absl::StrCat("an event of stream '", capture->stream_name(), "'")
                      : absl::StrCat("an event of ", event.device().ToString());
    return Push(std::move(item));
  }

  absl::Status Synchronize(absl::Time deadline) override {
    if (running_callback_stream == state_.get()) {
      return absl::FailedPreconditionError(
          absl::StrCat("stream '", state_->name,
                       "': Synchronize called from the stream's own work would "
                       "wait forever"));
    }
    std::unique_lock<std::mutex> lock(state_->mu);
    const uint64_t target = state_->enqueued;
    if (!WallClock().WaitUntil(state_->cv, lock, deadline,
                               [&] { return state_->finished >= target; })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "stream '", state_->name, "': Synchronize timed out with ", target - state_->finished,
          " enqueued fn(s) the framework has not run", state_->origin));
    }
    return state_->status;
  }

  absl::Status status() const override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->status;
  }

  std::shared_ptr<Event> CreateEvent() override { return CreateHostEvent(); }

  absl::Status RecordHostCapture(std::shared_ptr<stream_internal::HostCapture> capture) override {
    Item item;
    item.record = std::move(capture);
    return Push(std::move(item));
  }

 private:
  struct State {
    std::string name;
    std::string origin;  // " (origin)" or empty, for messages
    absl::Duration wait_timeout;
    std::mutex mu;
    std::condition_variable cv;  // Synchronize and the destructor wait for `finished`
    absl::Status status;         // the poison
    uint64_t enqueued = 0;
    uint64_t finished = 0;
  };
  // One fn's work: an op, an event's capture to complete, or a capture to wait for.
  struct Item {
    StreamOp op;
    std::shared_ptr<stream_internal::HostCapture> record;
    std::shared_ptr<stream_internal::HostCapture> wait;
    std::string source;  // of `wait`, for its error
  };
  struct Task {
    std::shared_ptr<State> state;
    Item item;
  };

  absl::Status Push(Item item) {
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      if (!state_->status.ok()) {
        absl::Status poison = state_->status;
        lock.unlock();
        if (item.record != nullptr) item.record->Complete(poison);
        return poison;
      }
      ++state_->enqueued;
    }
    auto task = std::make_unique<Task>(Task{state_, std::move(item)});
    const int rc = callbacks_.enqueue(callbacks_.user, &RunTask, task.get());
    if (rc == 0) {
      task.release();  // the other runtime's fn owns it now
      return absl::OkStatus();
    }
    // Refused: nothing of it runs (an op's run and cancel neither), and the stream fails.
    absl::Status error = absl::InternalError(
        absl::StrCat("stream '", state_->name, "': the framework's enqueue returned ", rc));
    if (task->item.record != nullptr) task->item.record->Complete(error);
    task.reset();
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->status.ok()) state_->status = error;
    ++state_->finished;
    state_->cv.notify_all();
    return error;
  }

  // The fn the other runtime runs: the item, or (on a poisoned stream) its cancellation.
  static void RunTask(void* ctx) {
    std::unique_ptr<Task> task(static_cast<Task*>(ctx));
    State& state = *task->state;
    absl::Status poison;
    {
      std::lock_guard<std::mutex> lock(state.mu);
      poison = state.status;
    }
    const void* const outer = running_callback_stream;
    running_callback_stream = &state;
    Item& item = task->item;
    absl::Status result;
    if (item.record != nullptr) {
      item.record->Complete(poison);
    } else if (item.wait != nullptr) {
      if (poison.ok()) {
        result = item.wait->Wait(absl::Now() + state.wait_timeout, "");
        if (absl::IsDeadlineExceeded(result)) {
          result = absl::DeadlineExceededError(
              absl::StrCat("stream '", state.name, "': waited its wait_timeout (",
                           absl::FormatDuration(state.wait_timeout), ") for ", item.source,
                           ", which did not complete", state.origin));
        }
      }
    } else if (poison.ok()) {
      result = std::move(item.op.run)();
      if (!result.ok()) result = Annotate(result, absl::StrCat("stream '", state.name, "'"));
    } else if (item.op.cancel != nullptr) {
      std::move(item.op.cancel)(poison);
    }
    item = Item();  // its closures go before Synchronize can report the fn done
    running_callback_stream = outer;
    std::lock_guard<std::mutex> lock(state.mu);
    if (!result.ok() && state.status.ok()) state.status = std::move(result);
    ++state.finished;
    state.cv.notify_all();
  }

  const StreamCallbacks callbacks_;
  const std::shared_ptr<State> state_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Stream>> CreateCallbackStream(StreamCallbacks callbacks,
                                                             StreamOptions options) {
  if (callbacks.enqueue == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("callback stream '", options.name,
                                                   "': enqueue is null", Origin(callbacks.origin)));
  }
  if (options.clock != nullptr && options.clock != &WallClock()) {
    return absl::InvalidArgumentError(absl::StrCat("callback stream '", options.name,
                                                   "': its clock is the wall clock, not ",
                                                   options.clock->name()));
  }
  if (options.trace != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("callback stream '", options.name, "': callback streams write no spans"));
  }
  SL_ASSIGN_OR_RETURN(absl::Duration wait_timeout, stream_internal::ResolveWaitTimeout(options));
  return std::make_unique<CallbackStream>(std::move(options.name), std::move(callbacks),
                                          wait_timeout);
}

absl::StatusOr<std::shared_ptr<Event>> CreateCallbackEvent(EventCallbacks callbacks) {
  if (callbacks.query == nullptr || callbacks.notify == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "callback event: query and notify must both be set", Origin(callbacks.origin)));
  }
  return std::make_shared<CallbackEvent>(std::move(callbacks));
}

absl::StatusOr<std::unique_ptr<Allocator>> CreateCallbackAllocator(AllocatorCallbacks callbacks,
                                                                   Device device,
                                                                   std::string name) {
  if (callbacks.alloc == nullptr || callbacks.free == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("callback allocator '", name,
                                                   "': alloc and free must both be set",
                                                   Origin(callbacks.origin)));
  }
  return std::make_unique<CallbackAllocator>(std::move(callbacks), device, std::move(name));
}

}  // namespace shardline
