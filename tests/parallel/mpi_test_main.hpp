// The main of the tests that run under mpirun: one world communicator over MPI, and rank 0's seed
// (FP8MOE_SEED or fresh) on every rank, printed so that a failure can be replayed.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>

#include "fp8moe/comm.hpp"

namespace fp8moe::testing {

inline int mpi_test_main(int argc, char** argv, Comm*& world_out, uint64_t& seed_out) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<Comm> world = make_comm("mpi");
  world_out = world.get();
  uint64_t seed = 0;
  if (const char* s = std::getenv("FP8MOE_SEED")) seed = std::strtoull(s, nullptr, 10);
  else seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  const auto seeds = world->exchange(std::string(reinterpret_cast<const char*>(&seed), sizeof seed));
  std::memcpy(&seed_out, seeds[0].data(), sizeof seed);
  if (world->rank() == 0) std::cout << "[ seed     ] FP8MOE_SEED=" << seed_out << " on " << world->size() << " ranks\n";
  else GTEST_FLAG_SET(brief, true);
  const int rc = RUN_ALL_TESTS();
  world_out = nullptr;
  world.reset();
  return rc;
}

}  // namespace fp8moe::testing
