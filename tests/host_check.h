// The counters and CHECK macro of the host-side layout checks (tests/*_layouts.cu): every check
// counted, the first ten failures printed with their condition and a message.
#pragma once

#include <cstdio>

static int failures = 0;
static long checks = 0;
#define CHECK(cond, ...)                                            \
  do {                                                              \
    ++checks;                                                       \
    if (!(cond)) {                                                  \
      if (failures++ < 10) {                                        \
        std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                                   \
        std::printf("\n");                                          \
      }                                                             \
    }                                                               \
  } while (0)

// main's end: "ok (N checks)" and 0, or the failure count and 1.
inline int check_report() {
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok (%ld checks)\n", checks);
  return 0;
}
