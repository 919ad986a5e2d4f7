// File: tests/common/scoped_env.h
// Sets (or unsets) environment variables for the life of a scope and restores them afterwards.

#ifndef SHARDLINE_TESTS_COMMON_SCOPED_ENV_H_
#define SHARDLINE_TESTS_COMMON_SCOPED_ENV_H_

#include <stdlib.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardline::testing {

class ScopedEnv {
 public:
  // nullptr unsets the variable.
  ScopedEnv(const char* name, const char* value) { Set(name, value); }
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) Set(name, value);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second.has_value()) {
        setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        unsetenv(it->first.c_str());
      }
    }
  }

 private:
  void Set(const char* name, const char* value) {
    const char* old = getenv(name);
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_SCOPED_ENV_H_
