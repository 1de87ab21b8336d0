#include "schemas/float16.h"

#include <cstring>

namespace dc {

uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t FloatToF16(float value) {
  const _Float16 half = static_cast<_Float16>(value);  // IEEE round to nearest even
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

float F16ToFloat(uint16_t bits) {
  _Float16 half;
  std::memcpy(&half, &bits, sizeof(half));
  return static_cast<float>(half);
}

}  // namespace dc
