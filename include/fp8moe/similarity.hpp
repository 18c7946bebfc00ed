// How close two results are, the measures every check and benchmark of fp8moe prints:
//   calc_diff(x, y) = 1 - 2 sum(xy) / sum(x^2 + y^2)   (DeepGEMM's; 0 when identical, scale-free)
//   rel_error(x, y) = ||x - y|| / ||y||                (y the reference)
#pragma once
#include <cmath>
#include <vector>

namespace fp8moe {

inline double calc_diff(const std::vector<double>& x, const std::vector<double>& y) {
  double xy = 0, xx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    xy += x[i] * y[i];
    xx += x[i] * x[i] + y[i] * y[i];
  }
  return xx == 0 ? 0.0 : 1.0 - 2.0 * xy / xx;
}

inline double rel_error(const std::vector<double>& x, const std::vector<double>& y) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace fp8moe
