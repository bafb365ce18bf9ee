// Facts about this process for messages: its host and its rank in MPI_COMM_WORLD.
#pragma once

#include <string>

namespace qt {

std::string host_name();
// Rank in MPI_COMM_WORLD, or 0 before MPI_Init (messages can be printed at any time).
int world_rank_or_zero();

}  // namespace qt
