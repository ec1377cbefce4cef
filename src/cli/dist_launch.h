// `fastattn train --nproc N`: starts N local worker processes (this program
// again, without --nproc) with the torchrun variables RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT,
// waits for them, and when one fails gives the others a few seconds to report
// their own error, then kills them. docs/distributed.md.
#pragma once

#include <cstdint>

namespace fastattn::cli {

// Returns the exit code for the launcher: 0 when every worker exited 0, 130
// when all were interrupted, else the first failing worker's code (1 for a
// signal). Each worker gets --threads cores/N unless --threads was given.
int launch_local_workers(int64_t nproc);

}  // namespace fastattn::cli
