// The main of a gtest binary run under mpirun: one world communicator (the MPI engine) for the
// tests, made before they run and closed after; ranks other than 0 print briefly.
#pragma once
#include <gtest/gtest.h>

#include <memory>

#include "fp8moe/comm.hpp"

namespace fp8moe::testing {

inline int mpi_test_main(int argc, char** argv, Comm*& world) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<Comm> comm = make_comm("mpi");
  world = comm.get();
  if (comm->rank() != 0) GTEST_FLAG_SET(brief, true);
  const int rc = RUN_ALL_TESTS();
  world = nullptr;
  return rc;
}

}  // namespace fp8moe::testing
