// Expert placement (include/fp8moe/placement.hpp): EPLB's three greedy steps per layer.
//   1. pack the expert groups onto the nodes, heaviest first, each to the lightest node that has
//      room (every node gets groups / nodes of them);
//   2. inside each node, give the next copy to the expert with the most tokens per copy until the
//      node's slots are used;
//   3. pack the node's copies (each carrying its expert's tokens / copies) onto the node's GPUs
//      the same way as step 1.
// Ties go to the lowest index everywhere (stable sort, first minimum, first maximum), so the
// result is deterministic and matches the reference on its README example.
#include "fp8moe/placement.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "fp8moe/error.hpp"

namespace fp8moe {

namespace {

// Items of weight w into packs of w.size() / packs items each: pack[i], and the item's position
// in its pack. A single item per pack keeps the items' order (nothing to balance).
void balanced_packing(const std::vector<double>& w, int64_t packs, std::vector<int64_t>& pack,
                      std::vector<int64_t>& rank) {
  const int64_t n = int64_t(w.size()), per = n / packs;
  pack.assign(size_t(n), 0);
  rank.assign(size_t(n), 0);
  if (per == 1) {
    std::iota(pack.begin(), pack.end(), 0);
    return;
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return w[size_t(a)] > w[size_t(b)]; });
  std::vector<double> load(size_t(packs), 0.0);
  std::vector<int64_t> items(size_t(packs), 0);
  for (int64_t i : order) {
    int64_t best = -1;
    for (int64_t p = 0; p < packs; ++p)
      if (items[size_t(p)] < per && (best < 0 || load[size_t(p)] < load[size_t(best)])) best = p;
    pack[size_t(i)] = best;
    rank[size_t(i)] = items[size_t(best)]++;
    load[size_t(best)] += w[size_t(i)];
  }
}

// `total` copies of w.size() experts: one each, then the next to the most tokens per copy.
void replicate(const std::vector<double>& w, int64_t total, std::vector<int64_t>& phy_to_log,
               std::vector<int64_t>& phy_rank, std::vector<int64_t>& count) {
  const int64_t n = int64_t(w.size());
  phy_to_log.resize(size_t(total));
  phy_rank.assign(size_t(total), 0);
  count.assign(size_t(n), 1);
  std::iota(phy_to_log.begin(), phy_to_log.begin() + n, 0);
  for (int64_t s = n; s < total; ++s) {
    int64_t best = 0;
    for (int64_t e = 1; e < n; ++e)
      if (w[size_t(e)] / double(count[size_t(e)]) > w[size_t(best)] / double(count[size_t(best)])) best = e;
    phy_to_log[size_t(s)] = best;
    phy_rank[size_t(s)] = count[size_t(best)]++;
  }
}

// One layer by the hierarchical steps on `nodes` nodes of `groups` groups; the global policy is
// this with one node and one group.
void place_layer(const std::vector<double>& w, int64_t slots, int64_t groups, int64_t nodes, int64_t gpus,
                 std::vector<int32_t>& out_log, std::vector<int32_t>& out_rep) {
  const int64_t E = int64_t(w.size()), group_size = E / groups, groups_per_node = groups / nodes;
  const int64_t per_node = E / nodes, slots_per_node = slots / nodes, gpus_per_node = gpus / nodes;
  const int64_t slots_per_gpu = slots / gpus;
  // Step 1: groups onto nodes; mlog (the expert's index in node-major order) -> logical.
  std::vector<double> group_w(size_t(groups), 0.0);
  for (int64_t e = 0; e < E; ++e) group_w[size_t(e / group_size)] += w[size_t(e)];
  std::vector<int64_t> gpack, grank;
  balanced_packing(group_w, nodes, gpack, grank);
  std::vector<int64_t> mlog_to_log(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t g = e / group_size;
    mlog_to_log[size_t((gpack[size_t(g)] * groups_per_node + grank[size_t(g)]) * group_size + e % group_size)] = e;
  }
  out_log.assign(size_t(slots), -1);
  out_rep.assign(size_t(slots), 0);
  for (int64_t node = 0; node < nodes; ++node) {
    // Step 2: copies inside the node.
    std::vector<double> nw(static_cast<size_t>(per_node));
    for (int64_t j = 0; j < per_node; ++j) nw[size_t(j)] = w[size_t(mlog_to_log[size_t(node * per_node + j)])];
    std::vector<int64_t> phy_to_mlog, phy_rank, count;
    replicate(nw, slots_per_node, phy_to_mlog, phy_rank, count);
    // Step 3: copies onto the node's GPUs.
    std::vector<double> copy_w(static_cast<size_t>(slots_per_node));
    for (int64_t p = 0; p < slots_per_node; ++p) {
      const int64_t j = phy_to_mlog[size_t(p)];
      copy_w[size_t(p)] = nw[size_t(j)] / double(count[size_t(j)]);
    }
    std::vector<int64_t> pack, rank;
    balanced_packing(copy_w, gpus_per_node, pack, rank);
    for (int64_t p = 0; p < slots_per_node; ++p) {
      const int64_t slot = node * slots_per_node + pack[size_t(p)] * slots_per_gpu + rank[size_t(p)];
      out_log[size_t(slot)] = int32_t(mlog_to_log[size_t(node * per_node + phy_to_mlog[size_t(p)])]);
      out_rep[size_t(slot)] = int32_t(phy_rank[size_t(p)]);
    }
  }
}

// The inverse maps of phy_to_log / phy_replica.
void fill_inverse(ExpertPlacement& p) {
  p.log_to_phy.assign(size_t(p.layers), {});
  p.replicas.assign(size_t(p.layers), std::vector<int32_t>(size_t(p.experts), 0));
  for (int64_t l = 0; l < p.layers; ++l) {
    auto& inv = p.log_to_phy[size_t(l)];
    inv.assign(size_t(p.experts), {});
    for (int64_t s = 0; s < p.shape.slots; ++s) ++p.replicas[size_t(l)][size_t(p.phy_to_log[size_t(l)][size_t(s)])];
    for (int64_t e = 0; e < p.experts; ++e) inv[size_t(e)].assign(size_t(p.replicas[size_t(l)][size_t(e)]), -1);
    for (int64_t s = 0; s < p.shape.slots; ++s)
      inv[size_t(p.phy_to_log[size_t(l)][size_t(s)])][size_t(p.phy_replica[size_t(l)][size_t(s)])] = int32_t(s);
  }
}

}  // namespace

ExpertPlacement place_experts(const ExpertLoads& loads, const PlacementShape& shape, PlacementPolicy policy) {
  FP8MOE_CHECK(!loads.empty() && !loads[0].empty(), "expert placement: no loads (expected [layers][experts])");
  const int64_t E = int64_t(loads[0].size());
  for (size_t l = 0; l < loads.size(); ++l) {
    FP8MOE_CHECK(int64_t(loads[l].size()) == E, "expert placement: loads of layer " << l << " have " << loads[l].size()
                                                                                     << " experts, layer 0 has " << E);
    for (size_t e = 0; e < loads[l].size(); ++e)
      FP8MOE_CHECK(std::isfinite(loads[l][e]) && loads[l][e] >= 0,
                   "expert placement: load " << loads[l][e] << " of layer " << l << " expert " << e
                                             << " (expected a finite count >= 0)");
  }
  const PlacementShape& s = shape;
  FP8MOE_CHECK(s.nodes >= 1 && s.gpus >= 1 && s.groups >= 1,
               "expert placement: nodes, gpus and groups must be >= 1, got " << s.nodes << ", " << s.gpus << ", "
                                                                             << s.groups);
  FP8MOE_CHECK(s.slots >= E, "expert placement: " << s.slots << " slots for " << E
                                                  << " experts (every expert needs at least one slot)");
  FP8MOE_CHECK(s.slots % s.gpus == 0,
               "expert placement: " << s.slots << " slots are not divisible by " << s.gpus << " GPUs");
  FP8MOE_CHECK(s.gpus % s.nodes == 0, "expert placement: " << s.gpus << " GPUs are not divisible by " << s.nodes
                                                           << " nodes");
  FP8MOE_CHECK(E % s.groups == 0, "expert placement: " << E << " experts are not divisible by " << s.groups
                                                       << " groups");
  const bool divides = s.groups % s.nodes == 0;
  FP8MOE_CHECK(policy != PlacementPolicy::hierarchical || divides,
               "expert placement: the hierarchical policy needs the " << s.groups << " groups divisible by the "
                                                                      << s.nodes << " nodes");
  ExpertPlacement p;
  p.layers = int64_t(loads.size());
  p.experts = E;
  p.shape = s;
  p.hierarchical = policy == PlacementPolicy::hierarchical || (policy == PlacementPolicy::automatic && divides);
  p.phy_to_log.resize(size_t(p.layers));
  p.phy_replica.resize(size_t(p.layers));
  for (int64_t l = 0; l < p.layers; ++l) {
    if (p.hierarchical)
      place_layer(loads[size_t(l)], s.slots, s.groups, s.nodes, s.gpus, p.phy_to_log[size_t(l)], p.phy_replica[size_t(l)]);
    else
      place_layer(loads[size_t(l)], s.slots, 1, 1, s.gpus, p.phy_to_log[size_t(l)], p.phy_replica[size_t(l)]);
  }
  fill_inverse(p);
  return p;
}

ExpertPlacement identity_placement(int64_t layers, int64_t experts, int64_t nodes, int64_t gpus) {
  FP8MOE_CHECK(layers >= 1 && experts >= 1 && nodes >= 1 && gpus >= 1,
               "identity placement: layers, experts, nodes and gpus must be >= 1");
  ExpertPlacement p;
  p.layers = layers;
  p.experts = experts;
  p.shape = {experts, nodes, gpus, 1};
  p.phy_to_log.assign(size_t(layers), std::vector<int32_t>(size_t(experts)));
  for (auto& row : p.phy_to_log) std::iota(row.begin(), row.end(), 0);
  p.phy_replica.assign(size_t(layers), std::vector<int32_t>(size_t(experts), 0));
  fill_inverse(p);
  return p;
}

double PlacementBalance::ratio(int64_t layer) const {
  const double m = mean[size_t(layer)];
  return m > 0 ? max[size_t(layer)] / m : 1.0;
}

double PlacementBalance::overall() const {
  const double mx = std::accumulate(max.begin(), max.end(), 0.0), mn = std::accumulate(mean.begin(), mean.end(), 0.0);
  return mn > 0 ? mx / mn : 1.0;
}

PlacementBalance placement_balance(const ExpertLoads& loads, const ExpertPlacement& p) {
  FP8MOE_CHECK(int64_t(loads.size()) == p.layers, "placement balance: loads of " << loads.size()
                                                                                 << " layers for a placement of "
                                                                                 << p.layers);
  const int64_t G = p.shape.gpus, S = p.shape.slots;
  PlacementBalance b;
  for (int64_t l = 0; l < p.layers; ++l) {
    FP8MOE_CHECK(int64_t(loads[size_t(l)].size()) == p.experts,
                 "placement balance: layer " << l << " has " << loads[size_t(l)].size() << " experts, the placement "
                                             << p.experts);
    std::vector<double> gpu(size_t(G), 0.0);
    // Slot s on GPU s * G / S: the slots spread as evenly as they divide (the identity placement
    // of 12 experts on 8 GPUs puts 1 or 2 on each).
    for (int64_t s = 0; s < S; ++s) {
      const int32_t e = p.phy_to_log[size_t(l)][size_t(s)];
      gpu[size_t(s * G / S)] += loads[size_t(l)][size_t(e)] / double(p.replicas[size_t(l)][size_t(e)]);
    }
    b.max.push_back(*std::max_element(gpu.begin(), gpu.end()));
    b.mean.push_back(std::accumulate(gpu.begin(), gpu.end(), 0.0) / double(G));
    b.gpu_tokens.push_back(std::move(gpu));
  }
  return b;
}

namespace {
std::vector<double> json_row(const nlohmann::json& j, const std::string& where) {
  FP8MOE_CHECK(j.is_array(), where << ": expected an array of numbers per layer");
  std::vector<double> r;
  for (const auto& v : j) {
    FP8MOE_CHECK(v.is_number(), where << ": " << v.dump() << " is not a number");
    r.push_back(v.get<double>());
  }
  return r;
}
}  // namespace

ExpertLoads read_expert_loads(const std::string& path) {
  std::ifstream in(path);
  FP8MOE_CHECK(in, "loads: cannot open '" << path << "'");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const size_t first = text.find_first_not_of(" \t\r\n");
  FP8MOE_CHECK(first != std::string::npos, "loads: '" << path << "' is empty");
  ExpertLoads loads;
  if (text[first] == '[') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      FP8MOE_CHECK(false, "loads: '" << path << "' is not JSON: " << e.what());
    }
    FP8MOE_CHECK(j.is_array(), "loads: '" << path << "': expected [[...], ...] (layers of experts)");
    for (size_t l = 0; l < j.size(); ++l) loads.push_back(json_row(j[l], path + " layer " + std::to_string(l)));
  } else if (text[first] == '{') {  // JSON lines, each with "expert_loads": summed
    std::istringstream lines(text);
    std::string line;
    int64_t n = 0, used = 0;
    while (std::getline(lines, line)) {
      ++n;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        FP8MOE_CHECK(false, "loads: '" << path << "' line " << n << " is not JSON: " << e.what());
      }
      if (!j.contains("expert_loads")) continue;
      const auto& el = j["expert_loads"];
      FP8MOE_CHECK(el.is_array(), "loads: '" << path << "' line " << n << ": expert_loads is not an array");
      if (loads.empty()) loads.resize(el.size());
      FP8MOE_CHECK(el.size() == loads.size(), "loads: '" << path << "' line " << n << " has " << el.size()
                                                         << " layers, the first line " << loads.size());
      for (size_t l = 0; l < el.size(); ++l) {
        const auto row = json_row(el[l], path + " line " + std::to_string(n));
        if (loads[l].empty()) loads[l].assign(row.size(), 0.0);
        FP8MOE_CHECK(row.size() == loads[l].size(), "loads: '" << path << "' line " << n << " layer " << l << " has "
                                                               << row.size() << " experts, earlier lines "
                                                               << loads[l].size());
        for (size_t e = 0; e < row.size(); ++e) loads[l][e] += row[e];
      }
      ++used;
    }
    FP8MOE_CHECK(used > 0, "loads: '" << path << "' has no line with \"expert_loads\"");
  } else {
    std::istringstream lines(text);
    std::string line;
    int64_t n = 0;
    while (std::getline(lines, line)) {
      ++n;
      std::replace(line.begin(), line.end(), ',', ' ');
      std::istringstream row(line);
      std::vector<double> r;
      std::string tok;
      while (row >> tok) {
        size_t used = 0;
        double v = 0;
        try {
          v = std::stod(tok, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        FP8MOE_CHECK(used == tok.size(), "loads: '" << path << "' line " << n << ": '" << tok << "' is not a number");
        r.push_back(v);
      }
      if (!r.empty()) loads.push_back(std::move(r));
    }
  }
  FP8MOE_CHECK(!loads.empty(), "loads: '" << path << "' holds no layers");
  return loads;
}

}  // namespace fp8moe
