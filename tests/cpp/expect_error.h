// Test helper: EXPECT_ERROR_CONTAINS(statement, "a", "b", ...) expects the
// statement to throw a c10::Error whose message contains every string given.
#pragma once

#include <gtest/gtest.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>

namespace fastattn::testing {

inline ::testing::AssertionResult message_contains(const std::string& message,
                                                   std::initializer_list<const char*> parts) {
  for (const char* p : parts) {
    if (message.find(p) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks \"" << p << "\": " << message;
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace fastattn::testing

#define EXPECT_ERROR_CONTAINS(statement, ...)                                                \
  do {                                                                                       \
    bool thrown_ = false;                                                                    \
    try {                                                                                    \
      statement;                                                                             \
    } catch (const c10::Error& e_) {                                                         \
      thrown_ = true;                                                                        \
      EXPECT_TRUE(                                                                           \
          ::fastattn::testing::message_contains(e_.what_without_backtrace(), {__VA_ARGS__})) \
          << "from: " #statement;                                                            \
    }                                                                                        \
    EXPECT_TRUE(thrown_) << "expected a c10::Error from: " #statement;                       \
  } while (0)
