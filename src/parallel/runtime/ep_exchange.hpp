// The exchanges of the expert-parallel layer over a communicator (all_to_all_v): FP8 rows out to
// the ranks that hold the experts, rows back to their sources. Used by expert_parallel.cpp and
// tested on their own with rows that name their source rank and token
// (tests/parallel/test_parallel_mpi.cpp).
#pragma once
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/comm.hpp"

namespace fp8moe::ep {

// recv_counts[q] = the send_counts[me] of rank q (host exchange of the counts).
std::vector<int64_t> transposed_counts(Comm& comm, const std::vector<int64_t>& send_counts);

// The rows send_token [n] i32 of x [T, D] f32 (D % 128 == 0), rank-major as send_counts says,
// quantized to 1x128 E4M3 tiles with `mode` scales (one quantization per token, the values and the
// per-token scales travel), exchanged; returns what arrived, dequantized: [sum recv_counts, D] f32,
// source-major (exact: codes times the scales).
Tensor dispatch_fp8(Backend& be, Comm& comm, const Tensor& x, const Tensor& send_token,
                    const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts, ScaleMode mode);

// rows [sum send_counts, C] f32 converted to `dtype` (bf16: the combine; f32) and exchanged;
// returns [sum recv_counts, C] of `dtype`, source-major.
Tensor exchange_rows(Backend& be, Comm& comm, const Tensor& rows, const std::vector<int64_t>& send_counts,
                     const std::vector<int64_t>& recv_counts, DType dtype);

// n rows of `cols` (allocated with at least one row: an empty exchange still has a buffer).
Tensor rows_tensor(Backend& be, DType dt, int64_t n, int64_t cols);
int64_t total(const std::vector<int64_t>& counts);

}  // namespace fp8moe::ep
