// File: tests/common/sanitizers.h
// Whether the test binary runs under a sanitizer (AddressSanitizer + UndefinedBehaviorSanitizer
// or ThreadSanitizer), for the tests that do less there or skip what a sanitizer's allocator or
// address-space reservation cannot do. Asked at run time, not with __SANITIZE_ADDRESS__: under
// AddressSanitizer the test code itself is not instrumented, only the libraries it links
// (tests/CMakeLists.txt), so the compiler's macro says nothing about the binary. The runtimes'
// own interface does.

#ifndef SHARDLINE_TESTS_COMMON_SANITIZERS_H_
#define SHARDLINE_TESTS_COMMON_SANITIZERS_H_

extern "C" {
// Defined by every sanitizer runtime (sanitizer/common_interface_defs.h): weak, so that it is
// null in a binary linked without one.
void __sanitizer_print_stack_trace() __attribute__((weak));
}

namespace shardline::testing {

inline bool UnderSanitizer() { return __sanitizer_print_stack_trace != nullptr; }

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_SANITIZERS_H_
