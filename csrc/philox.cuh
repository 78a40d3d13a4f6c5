// Philox4x32-10 (Salmon et al., 2011), the counter-based generator every sampling kernel draws
// from: counter (offset, 0), key seed, as reference.sampling.philox4x32. One place, so the
// sample and rejection_sample draws cannot drift apart.
#pragma once

// Words 0 and 1 of one block.
__device__ __forceinline__ uint2 philox_words(unsigned long long seed, unsigned long long offset) {
  unsigned c0 = unsigned(offset), c1 = unsigned(offset >> 32), c2 = 0, c3 = 0;
  unsigned k0 = unsigned(seed), k1 = unsigned(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return make_uint2(c0, c1);
}
