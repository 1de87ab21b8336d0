#include "schemas/float16.h"

#include <cmath>
#include <cstring>

namespace dc {
namespace {

[[maybe_unused]] uint32_t BitsOf(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof(w));
  return w;
}

[[maybe_unused]] float FloatOf(uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

}  // namespace

uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t FloatToF16(float value) {
#ifdef __FLT16_MAX__
  const _Float16 half = static_cast<_Float16>(value);  // IEEE round to nearest even
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
#else
  // Compilers without _Float16 on this target (clang before 15 on x86: the fuzz build): the same
  // rounding in integer and float steps (Maratyszcza's FP16 library); a NaN becomes the quiet NaN
  // 0x7e00 with its sign.
  constexpr float kScaleToInf = 0x1.0p+112f, kScaleToZero = 0x1.0p-110f;
  float base = (std::fabs(value) * kScaleToInf) * kScaleToZero;
  const uint32_t w = BitsOf(value);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = FloatOf((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = BitsOf(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
#endif
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

float F16ToFloat(uint16_t bits) {
#ifdef __FLT16_MAX__
  _Float16 half;
  std::memcpy(&half, &bits, sizeof(half));
  return static_cast<float>(half);
#else
  // Exact in float steps (Maratyszcza's FP16 library), for compilers without _Float16.
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  constexpr uint32_t kExpOffset = 0xE0u << 23;
  const float normalized = FloatOf((two_w >> 4) + kExpOffset) * 0x1.0p-112f;
  constexpr uint32_t kMagic = 126u << 23;
  const float denormalized = FloatOf((two_w >> 17) | kMagic) - 0.5f;
  constexpr uint32_t kDenormalCutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < kDenormalCutoff ? BitsOf(denormalized) : BitsOf(normalized));
  return FloatOf(result);
#endif
}

}  // namespace dc
