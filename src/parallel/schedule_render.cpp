// Drawings of a simulated schedule, like Figure 5 of the report: one row per rank, time to the
// right. Text for the terminal (optionally with ANSI colours) and SVG. Upper-case labels are
// micro-batches of direction 0 (DualPipe) or of the way down (DualPipeV); lower-case ones the other
// direction or the way back up. An overlapped F&B pair is one box holding both labels; an
// input-only backward is narrower than a full one by the W it leaves for later.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "schedule_build.hpp"

namespace fp8moe::pipeline {

namespace {

struct Colour {
  const char* ansi;   // background colour code
  const char* fill0;  // SVG fill, lane 0
  const char* fill1;  // SVG fill, lane 1 (lighter)
};

Colour colour_of(const Op& op) {
  switch (op.kind) {
    case OpKind::Forward: return {"43", "#f4a261", "#f9d0a9"};
    case OpKind::Backward:
      return op.defers_weights ? Colour{"46", "#2a9d8f", "#8fd3ca"} : Colour{"42", "#57a773", "#a9d6b7"};
    case OpKind::Weight: return {"44", "#4c78c8", "#a7bfe8"};
    case OpKind::ForwardBackward: return {"45", "#b07cc6", "#d9bfe4"};
    default: return {"0", "#ffffff", "#ffffff"};
  }
}

int max_label_width(const Schedule& s) {
  int widest_id = 0;
  for (int mb = 0; mb < s.num_micro_batches; ++mb)
    widest_id = std::max(widest_id, detail::pass_display_id(s, {mb, 0}));
  return 1 + int(std::to_string(widest_id).size());
}

std::string escape_xml(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else out += c;
  }
  return out;
}

}  // namespace

std::string render_timeline_text(const Schedule& s, const Simulation& sim, const OpCosts& costs,
                                 const TextTimelineOptions& options) {
  // A forward gets as many columns as the longest "F<id>" label, unless told otherwise.
  const double columns_per_unit =
      options.columns_per_unit > 0 ? options.columns_per_unit : max_label_width(s) / costs.forward;
  auto column = [&](double t) { return int(std::lround(t * columns_per_unit)); };
  const int width = column(sim.makespan);
  std::ostringstream os;
  os << method_name(s.method) << ": " << s.num_ranks << " ranks, " << s.num_stages << " stages, "
     << s.num_micro_batches << " micro-batches; makespan " << sim.makespan << ", bubble " << sim.bubble
     << ", peak activations " << sim.peak_activations << "\n";
  for (int r = 0; r < s.num_ranks; ++r) {
    std::string cells(size_t(width), '.');
    std::vector<std::pair<int, int>> spans;  // [begin, end) columns of each op, for colouring
    for (const TimedOp& t : sim.ranks[r].compute) {
      const Op& op = s.rank_ops[r][size_t(t.op_index)];
      const int begin = column(t.start), end = std::max(column(t.end), begin + 1);
      std::string label = op_label(s, op);
      label.resize(size_t(end - begin), ' ');
      cells.replace(size_t(begin), size_t(end - begin), label);
      spans.push_back({begin, end});
    }
    char prefix[32];
    std::snprintf(prefix, sizeof prefix, "rank %2d |", r);
    os << prefix;
    if (!options.color) {
      os << cells << "|\n";
      continue;
    }
    int at = 0;
    for (size_t i = 0; i < spans.size(); ++i) {
      const auto [begin, end] = spans[i];
      os << cells.substr(size_t(at), size_t(begin - at));
      const Op& op = s.rank_ops[r][size_t(sim.ranks[r].compute[i].op_index)];
      os << "\033[30;" << colour_of(op).ansi << "m" << cells.substr(size_t(begin), size_t(end - begin)) << "\033[0m";
      at = end;
    }
    os << cells.substr(size_t(at)) << "|\n";
  }
  os << "F forward, B backward (narrow: input only, its W later), W backward for weights, X+y an "
        "overlapped F&B pair;\n"
     << (s.method == Method::DualPipe    ? "upper case: micro-batches fed at rank 0, lower case: fed at the last rank\n"
         : s.method == Method::DualPipeV ? "upper case: stages on the way down, lower case: on the way back up\n"
                                         : "");
  return os.str();
}

std::string render_timeline_svg(const Schedule& s, const Simulation& sim, const OpCosts& costs) {
  const double unit_px = 24.0 / costs.forward, row_px = 26, left_px = 70, top_px = 30;
  const double width = left_px + sim.makespan * unit_px + 10, height = top_px + s.num_ranks * row_px + 30;
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
     << "\" font-family=\"monospace\" font-size=\"10\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << left_px << "\" y=\"18\" font-size=\"13\">" << method_name(s.method) << ": "
     << s.num_ranks << " ranks, " << s.num_micro_batches << " micro-batches, bubble " << sim.bubble
     << ", peak activations " << sim.peak_activations << "</text>\n";
  for (int r = 0; r < s.num_ranks; ++r) {
    const double y = top_px + r * row_px;
    os << "<text x=\"4\" y=\"" << y + row_px * 0.65 << "\">rank " << r << "</text>\n";
    for (const TimedOp& t : sim.ranks[r].compute) {
      const Op& op = s.rank_ops[r][size_t(t.op_index)];
      const double x = left_px + t.start * unit_px, w = (t.end - t.start) * unit_px, h = row_px - 4;
      auto box = [&](double bx, double bw, const Op& part, const Pass& p, const std::string& label) {
        const Colour c = colour_of(part);
        os << "<rect x=\"" << bx << "\" y=\"" << y + 2 << "\" width=\"" << bw << "\" height=\"" << h
           << "\" fill=\"" << (detail::pass_lane(s, p) == 0 ? c.fill0 : c.fill1)
           << "\" stroke=\"#555\" stroke-width=\"0.5\"/>\n"
           << "<text x=\"" << bx + bw / 2 << "\" y=\"" << y + row_px * 0.65 << "\" text-anchor=\"middle\">"
           << escape_xml(label) << "</text>\n";
      };
      if (op.kind == OpKind::ForwardBackward) {
        // Two cells sharing one black border, as in Figure 5: the forward and the backward half.
        const double forward_share = costs.forward / (costs.forward + costs.backward);
        Op forward = op, backward = op;
        forward.kind = OpKind::Forward;
        backward.kind = OpKind::Backward;
        backward.pass = op.backward_pass;
        box(x, w * forward_share, forward, op.pass, op_label(s, forward));
        box(x + w * forward_share, w * (1 - forward_share), backward, op.backward_pass, op_label(s, backward));
        os << "<rect x=\"" << x << "\" y=\"" << y + 2 << "\" width=\"" << w << "\" height=\"" << h
           << "\" fill=\"none\" stroke=\"black\" stroke-width=\"1.5\"/>\n";
      } else {
        box(x, w, op, op.pass, op_label(s, op));
      }
    }
  }
  const double legend_y = top_px + s.num_ranks * row_px + 18;
  os << "<text x=\"" << left_px << "\" y=\"" << legend_y
     << "\">F forward (orange), B full backward (green), B input-only (teal), W weights (blue); "
        "boxed pairs: overlapped F&amp;B; light colours: "
     << (s.method == Method::DualPipeV ? "way back up" : "reverse direction") << "</text>\n</svg>\n";
  return os.str();
}

}  // namespace fp8moe::pipeline
