// Test support: a call that must raise sparsetrain::Error whose message holds every fragment
// (the argument's name, what was expected, what came).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

#include "sparsetrain/error.h"

namespace sparsetrain::testing {

inline void expect_error(const std::function<void()>& call, std::initializer_list<std::string> fragments) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming " << *fragments.begin();
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const std::string& f : fragments) EXPECT_NE(m.find(f), std::string::npos) << "'" << f << "' not in: " << m;
  }
}

}  // namespace sparsetrain::testing
