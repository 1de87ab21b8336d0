// Counter-based randomness for data and initialization: every value is a pure function of
// (seed, stream, counter), so any rank can make any element without replaying a generator.
// Shared by the builder (models/) and the run-time data and initializer (executor/data.cc).
#pragma once

#include <cstdint>
#include <string_view>

namespace dc::random {

// splitmix64's finalizer: a bijective 64-bit mix.
inline uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Hash of a key and a counter; chain it for several counters.
inline uint64_t Combine(uint64_t key, uint64_t counter) { return Mix64(key ^ Mix64(counter)); }

// 64-bit FNV-1a of a string (stable across platforms and runs, unlike std::hash).
inline uint64_t HashName(std::string_view name) {
  constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ULL;
  constexpr uint64_t kPrime = 0x100000001b3ULL;
  uint64_t h = kOffsetBasis;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= kPrime;
  }
  return h;
}

// Uniform in [0, 1) from the top 53 bits.
inline double UnitInterval(uint64_t bits) {
  constexpr double kTwoToMinus53 = 1.0 / 9007199254740992.0;
  return static_cast<double>(bits >> 11) * kTwoToMinus53;
}

}  // namespace dc::random
