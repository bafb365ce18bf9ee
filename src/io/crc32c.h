// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TensorBoard's event
// files (and TFRecords), and the masked form those files store.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qt {

// The CRC-32C of `n` bytes: crc32c("123456789") = 0xE3069283.
std::uint32_t crc32c(const void* data, std::size_t n);

// TFRecord's mask, so that a CRC of data that itself holds CRCs does not look like one:
// rotate right by 15, add 0xa282ead8.
inline std::uint32_t crc32c_mask(std::uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace qt
