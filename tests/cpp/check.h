// CHECK(cond) for the plan tests (tests/cpp/*.cpp, one executable each): prints the failed
// condition and counts it; main returns check_status("name"), 0 when every check passed.
#pragma once

#include <cstdio>

static int failures = 0;
#define CHECK(cond)                                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::printf("%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                         \
    }                                                                     \
  } while (0)

static int check_status(const char* name) {
  if (failures == 0) std::printf("%s: all checks passed\n", name);
  return failures == 0 ? 0 : 1;
}
