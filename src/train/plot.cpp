// SVG line charts (include/fp8moe/plot.hpp): axes with rounded ticks, one polyline per series,
// a legend. Non-finite points are skipped.
#include "fp8moe/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "fp8moe/error.hpp"

namespace fp8moe {

namespace {

// About `target` round tick values covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target) {
  double span = hi - lo;
  if (!(span > 0)) return {lo};
  double raw = span / target, mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push_back(std::fabs(t) < step * 1e-9 ? 0 : t);
  return ticks;
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

}  // namespace

std::string render_line_chart_svg(const std::vector<PlotSeries>& series, const PlotOptions& opt) {
  static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};
  auto ty = [&](double y) { return opt.log_y ? std::log10(y) : y; };
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (auto& s : series) {
    FP8MOE_CHECK(s.x.size() == s.y.size(), "plot: series '" << s.label << "' has " << s.x.size() << " x and " << s.y.size() << " y values");
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (opt.log_y && s.y[i] <= 0)) continue;
      x0 = std::min(x0, s.x[i]);
      x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, ty(s.y[i]));
      y1 = std::max(y1, ty(s.y[i]));
    }
  }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad;
  y1 += pad;
  const int L = 70, R = 20, T = 40, B = 50, W = opt.width, H = opt.height;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };

  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  os << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << escape(opt.title) << "</text>\n";
  for (double t : nice_ticks(x0, x1, 8)) {
    os << "<line x1=\"" << px(t) << "\" y1=\"" << T << "\" x2=\"" << px(t) << "\" y2=\"" << H - B << "\" stroke=\"#eee\"/>";
    os << "<text x=\"" << px(t) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">" << fmt(t) << "</text>\n";
  }
  for (double t : nice_ticks(y0, y1, 6)) {
    os << "<line x1=\"" << L << "\" y1=\"" << py(t) << "\" x2=\"" << W - R << "\" y2=\"" << py(t) << "\" stroke=\"#eee\"/>";
    os << "<text x=\"" << L - 6 << "\" y=\"" << py(t) + 4 << "\" text-anchor=\"end\">" << fmt(opt.log_y ? std::pow(10, t) : t)
       << "</text>\n";
  }
  os << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << H - T - B
     << "\" fill=\"none\" stroke=\"#444\"/>\n";
  os << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">" << escape(opt.x_label) << "</text>\n";
  os << "<text transform=\"translate(16," << (T + H - B) / 2 << ") rotate(-90)\" text-anchor=\"middle\">" << escape(opt.y_label)
     << "</text>\n";
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& s = series[k];
    const char* c = colors[k % 8];
    os << "<polyline fill=\"none\" stroke=\"" << c << "\" stroke-width=\"1.5\" points=\"";
    for (size_t i = 0; i < s.x.size(); ++i)
      if (std::isfinite(s.x[i]) && std::isfinite(s.y[i]) && !(opt.log_y && s.y[i] <= 0))
        os << px(s.x[i]) << "," << py(ty(s.y[i])) << " ";
    os << "\"/>\n";
    if (s.x.size() <= 60)  // sparse series (e.g. validation loss): mark the points
      for (size_t i = 0; i < s.x.size(); ++i)
        if (std::isfinite(s.x[i]) && std::isfinite(s.y[i]) && !(opt.log_y && s.y[i] <= 0))
          os << "<circle cx=\"" << px(s.x[i]) << "\" cy=\"" << py(ty(s.y[i])) << "\" r=\"3\" fill=\"" << c << "\"/>";
    const int ly = T + 16 + int(k) * 18;
    os << "<line x1=\"" << W - R - 170 << "\" y1=\"" << ly - 4 << "\" x2=\"" << W - R - 145 << "\" y2=\"" << ly - 4
       << "\" stroke=\"" << c << "\" stroke-width=\"2\"/><text x=\"" << W - R - 140 << "\" y=\"" << ly << "\">" << escape(s.label)
       << "</text>\n";
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace fp8moe
