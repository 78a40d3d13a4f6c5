// The aarch64 check of csrc/cpu/ (tests/test_cpu_gemv_neon.py cross-compiles it with csrc/cpu/
// minus the pybind module and runs it under qemu-aarch64): the neon_dotprod path returns the
// portable path's bits for every tile format, activation width, M (row chunks and their
// remainder) and N (a partial last tile), with no NaN in the outputs and no write past N; and
// the ISA dispatch matches the CPU: `dotprod` expects the path run (and chosen by best_path),
// `no-dotprod` expects it reported unsupported, refused with an error (never SIGILL), and
// best_path the portable one.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../csrc/cpu/quant_gemv.h"
#include "host_check.h"

using namespace pagedkern_cpu;

namespace {

std::mt19937 rng(1234);

int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// A random fp16 d (sometimes subnormal) or, for the mins, a negative one; bits, not values.
uint16_t random_half(bool negative, bool allow_subnormal) {
  const int exp = allow_subnormal && uniform(0, 15) == 0 ? 0 : uniform(8, 14);
  return uint16_t((negative ? 0x8000 : 0) | exp << 10 | uniform(1, 0x3FF));
}

struct Packed {
  int format;
  std::vector<uint8_t> tiles;
  std::vector<float> scales;  // int8's per-channel scales
};

Packed pack(int format, int n, int k, int group) {
  Packed p{format, std::vector<uint8_t>(packed_bytes(format, n, k)), {}};
  if (format == kInt8) {
    std::vector<int8_t> q(size_t(n) * k);
    for (auto& v : q) v = int8_t(uniform(-127, 127));
    p.scales.resize(n);
    for (auto& s : p.scales) s = std::ldexp(float(uniform(1, 1 << 20)), -24);
    pack_int8(p.tiles.data(), q.data(), n, k);
    return p;
  }
  const bool sym = format == kInt4Sym;
  std::vector<uint8_t> q(size_t(n) * k / 2);
  for (auto& v : q) v = uint8_t(uniform(0, 255));
  if (format == kInt4K) {  // c any byte; d of 16 significant bits, dm negative
    std::vector<uint8_t> cs(size_t(n) * (k / kBlock)), cm(cs.size());
    for (size_t i = 0; i < cs.size(); ++i) cs[i] = uint8_t(uniform(0, 255)), cm[i] = uint8_t(uniform(0, 255));
    std::vector<float> d(size_t(n) * (k / kInt4KSuper)), dm(d.size());
    for (size_t i = 0; i < d.size(); ++i) {
      d[i] = std::ldexp(float(uniform(1, 1 << 16)), -28);
      dm[i] = -std::ldexp(float(uniform(0, 1 << 16)), -26);
    }
    pack_int4_k(p.tiles.data(), q.data(), cs.data(), cm.data(), d.data(), dm.data(), n, k);
    return p;
  }
  std::vector<uint16_t> d(size_t(n) * (k / group)), m(d.size());
  for (size_t i = 0; i < d.size(); ++i) {
    d[i] = random_half(false, !sym);
    // int4_sym: m = -8 d exactly (the exponent + 3, the sign set)
    m[i] = sym ? uint16_t(0x8000 | (d[i] + (3 << 10))) : random_half(true, true);
  }
  CHECK(int4_symmetric(d.data(), m.data(), int64_t(d.size())) == sym, "format %d", format);
  pack_int4(p.tiles.data(), q.data(), d.data(), m.data(), n, k, group, format);
  return p;
}

std::vector<float> random_x(int m, int k) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(size_t(m) * k);
  for (auto& v : x) v = normal(rng);
  if (m > 1) std::fill(x.begin() + k, x.begin() + k + kBlock, 0.f);  // a zero block: dx = 0
  x[0] = -8.f;  // a block's extreme: q = -Q
  return x;
}

// y with a row stride past N, poisoned with NaN: the columns past N stay NaN
std::vector<float> run(const Packed& p, const std::vector<float>& x, int m, int n, int k,
                       int path, int bits, int threads) {
  const int stride = n + 5;
  std::vector<float> y(size_t(m) * stride, std::nanf(""));
  gemv(p.format, y.data(), stride, x.data(), k, p.tiles.data(), p.scales.data(), m, n, k, threads,
       path, bits);
  return y;
}

void check_same_bits(int format, int group, int n, int k) {
  const Packed p = pack(format, n, k, group);
  for (int m : {1, 3, 5, 17})
    for (int bits : {8, 16}) {
      const std::vector<float> x = random_x(m, k);
      const std::vector<float> want = run(p, x, m, n, k, kPortable, bits, 1);
      bool finite = true, pad_nan = true;
      for (int r = 0; r < m; ++r)
        for (int c = 0; c < n + 5; ++c) {
          const float v = want[size_t(r) * (n + 5) + c];
          if (c < n) finite = finite && std::isfinite(v);
          else pad_nan = pad_nan && std::isnan(v);
        }
      CHECK(finite && pad_nan, "portable %s m %d n %d k %d bits %d", format_name(format), m, n, k,
            bits);
      for (int threads : {1, 2}) {
        const std::vector<float> got = run(p, x, m, n, k, kNeonDotprod, bits, threads);
        CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0,
              "neon_dotprod != portable: %s G %d m %d n %d k %d bits %d threads %d",
              format_name(format), group, m, n, k, bits, threads);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "dotprod" && mode != "no-dotprod") {
    std::printf("usage: %s dotprod|no-dotprod\n", argv[0]);
    return 2;
  }
  const bool dotprod = mode == "dotprod";
  std::printf("neon_dotprod supported: %d, best path: %s\n", int(path_supported(kNeonDotprod)),
              path_name(best_path()));
  CHECK(std::string(path_name(kNeonDotprod)) == "neon_dotprod", "%s", path_name(kNeonDotprod));
  CHECK(path_supported(kNeonDotprod) == dotprod, "expected %s", mode.c_str());
  CHECK(best_path() == (dotprod ? kNeonDotprod : kPortable), "best %s", path_name(best_path()));
  for (int path : {kAvx2, kAvxVnni, kAvx512Vnni}) CHECK(!path_supported(path), "%d", path);
  if (!dotprod) {
    const Packed p = pack(kInt4, 16, 64, 32);
    const std::vector<float> x = random_x(1, 64);
    bool refused = false;
    try {
      run(p, x, 1, 16, 64, kNeonDotprod, 16, 1);
    } catch (const std::runtime_error& e) {
      refused = std::string(e.what()).find("neon_dotprod") != std::string::npos;
    }
    CHECK(refused, "the neon_dotprod path was not refused");
    const std::vector<float> best = run(p, x, 1, 16, 64, -1, 16, 1);
    const std::vector<float> portable = run(p, x, 1, 16, 64, kPortable, 16, 1);
    CHECK(std::memcmp(best.data(), portable.data(), best.size() * sizeof(float)) == 0, "best");
    return check_report();
  }
  for (int n : {40, 1000}) {
    check_same_bits(kInt4, 32, n, n == 40 ? 96 : 256);
    check_same_bits(kInt4, 128, n, n == 40 ? 128 : 384);
    check_same_bits(kInt4Sym, 32, n, n == 40 ? 96 : 256);
    check_same_bits(kInt4Sym, 128, n, n == 40 ? 128 : 384);
    check_same_bits(kInt8, 0, n, n == 40 ? 96 : 256);
    check_same_bits(kInt4K, 32, n, n == 40 ? 256 : 512);
  }
  return check_report();
}
