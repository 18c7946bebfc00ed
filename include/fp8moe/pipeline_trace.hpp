// The timeline of one pipeline step as the executor ran it (Executor::executed()): each rank's
// busy, communication-wait and bubble time, the measured per-op costs that the simulator
// (pipeline::simulate) takes, and the Chrome/Perfetto trace of every op and its components.
//   fp8moe train --pp 4 --schedule dualpipe --grad-accum 8 --trace step.json   # step.rankN.json
#pragma once
#include <string>
#include <vector>

#include "fp8moe/pipeline_executor.hpp"

namespace fp8moe::pipeline {

struct RankSummary {
  double step = 0;    // seconds from the first op to the end of the last wait
  double busy = 0;    // compute ops, less the waits inside them
  double wait = 0;    // waiting for posted communication
  double bubble = 0;  // step - busy: idle or waiting
  // Measured seconds per op kind, summed, and how many ran (input-only B apart from full ones).
  double forward = 0, backward = 0, backward_input = 0, weight = 0, forward_backward = 0;
  int forwards = 0, backwards = 0, backward_inputs = 0, weights = 0, forward_backwards = 0;
  // The F&B chunks' components, summed by half: the forward's ("F ...") and the backward's ("B ...",
  // "W ..."). Each half's own device time when the chunks ran serial with device times
  // (Executor::set_device_times); the host's issue time in an overlapped chunk.
  double fb_forward_half = 0, fb_backward_half = 0;
};
RankSummary summarize(const std::vector<ExecutedOp>& ops);

// The mean measured cost of each op kind over ranks, as simulate() takes them: a kind that did
// not run is derived from the others (full B = input-only B + W; F&B = F + B).
OpCosts measured_costs(const std::vector<RankSummary>& ranks);

// Chrome trace event format ("X" events in microseconds): process = rank, thread 0 the compute
// ops with their components nested, thread 1 the posts of sends and receives.
std::string chrome_trace(const Schedule& schedule, int rank, const std::vector<ExecutedOp>& ops);

}  // namespace fp8moe::pipeline
