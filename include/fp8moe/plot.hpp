// Line charts as standalone SVG: loss curves for `fp8moe plot` and `fp8moe compare`, pipeline
// time lines elsewhere. No dependencies; the SVG opens in any browser.
#pragma once
#include <string>
#include <vector>

namespace fp8moe {

struct PlotSeries {
  std::string label;
  std::vector<double> x, y;
};

struct PlotOptions {
  std::string title, x_label = "step", y_label;
  int width = 900, height = 500;
  bool log_y = false;
};

std::string render_line_chart_svg(const std::vector<PlotSeries>& series, const PlotOptions& opt);

}  // namespace fp8moe
