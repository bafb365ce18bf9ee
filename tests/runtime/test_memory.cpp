// Host memory: what /proc/meminfo and the cgroup say is available, the byte formatting of the
// messages, and the check that refuses what cannot be allocated (issue 15, case 6).
#include <gtest/gtest.h>

#include <string>

#include "qtrain/error.h"
#include "runtime/memory.h"

namespace qt {
namespace {

TEST(HostMemory, AvailableIsKnownAndPlausible) {
  const auto avail = available_host_bytes();
  ASSERT_TRUE(avail.has_value()) << "Linux has /proc/meminfo";
  EXPECT_GT(*avail, std::uint64_t{1} << 20);
  EXPECT_LT(*avail, std::uint64_t{1} << 50);  // below a PiB
}

TEST(HostMemory, FormatBytes) {
  EXPECT_EQ(format_bytes(17), "17 B");
  EXPECT_EQ(format_bytes(4096), "4.00 KiB");
  EXPECT_EQ(format_bytes(312.0 * (1 << 20)), "312 MiB");
  EXPECT_EQ(format_bytes(1.5 * (1 << 30)), "1.50 GiB");
  EXPECT_EQ(format_bytes(24.6 * (1ull << 40)), "24.6 TiB");
  EXPECT_EQ(format_bytes(1e30), "8.67e+11 EiB");
}

TEST(HostMemory, CheckRefusesWhatCannotBeAllocated) {
  HostMemoryNeed need{1e18, "the parameters", "model.hidden_size"};
  try {
    check_host_memory_local(need, "the model");
    FAIL() << "1e18 bytes accepted";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the model needs about 888 PiB of host memory on this machine (the "
                     "parameters), but this machine has"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("change model.hidden_size"), std::string::npos) << m;
  }
  need.bytes = 1e22;  // beyond any machine, whatever it reports
  EXPECT_THROW(check_host_memory_local(need, "x"), UserError);
  need.bytes = 4096;
  EXPECT_NO_THROW(check_host_memory_local(need, "x"));
}

}  // namespace
}  // namespace qt
