// bf16 and fp16 to and from fp32 on the host. To the narrow types: round to nearest even, as the
// cuda device's __float2bfloat16_rn and __float2half_rn do (a NaN stays a quiet NaN), so host
// casts hold what the device's would. To fp32: exact.
#pragma once

#include <cstdint>

namespace dc {

uint16_t FloatToBf16(float value);
uint16_t FloatToF16(float value);
float Bf16ToFloat(uint16_t bits);
float F16ToFloat(uint16_t bits);

}  // namespace dc
