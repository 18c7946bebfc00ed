// `fp8moe eplb`: the placement of redundant experts (include/fp8moe/placement.hpp) for per-layer
// expert loads, and the balance of tokens over the GPUs before (one copy of each expert, in order)
// and after.
//   fp8moe eplb --loads loads.json --slots 16 --nodes 2 --gpus 8 --groups 4
// --loads takes a JSON [[...], ...], fp8moe train's metrics.jsonl (its expert_loads summed) or
// text, one layer a line. --json prints the maps and the balance as one JSON object.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/placement.hpp"

namespace fp8moe {
namespace {

struct EplbArgs {
  std::string loads;
  PlacementShape shape;
  std::string policy = "auto";
  bool json = false;
};

PlacementPolicy parse_policy(const std::string& s) {
  if (s == "auto") return PlacementPolicy::automatic;
  if (s == "hierarchical") return PlacementPolicy::hierarchical;
  if (s == "global") return PlacementPolicy::global;
  FP8MOE_CHECK(false, "--policy: unknown '" << s << "' (expected auto, hierarchical or global)");
  return PlacementPolicy::automatic;
}

nlohmann::json balance_json(const PlacementBalance& b) {
  nlohmann::json per = nlohmann::json::array();
  for (size_t l = 0; l < b.max.size(); ++l)
    per.push_back({{"max", b.max[l]}, {"mean", b.mean[l]}, {"ratio", b.ratio(int64_t(l))}});
  return {{"per_layer", per}, {"overall", b.overall()}};
}

void eplb_command(const EplbArgs& a) {
  const ExpertLoads loads = read_expert_loads(a.loads);
  const ExpertPlacement p = place_experts(loads, a.shape, parse_policy(a.policy));
  const PlacementBalance before =
      placement_balance(loads, identity_placement(p.layers, p.experts, a.shape.nodes, a.shape.gpus));
  const PlacementBalance after = placement_balance(loads, p);
  if (a.json) {
    const nlohmann::json j{{"layers", p.layers},          {"experts", p.experts},
                           {"slots", a.shape.slots},      {"nodes", a.shape.nodes},
                           {"gpus", a.shape.gpus},        {"groups", a.shape.groups},
                           {"policy", p.hierarchical ? "hierarchical" : "global"},
                           {"phy_to_log", p.phy_to_log},  {"log_to_phy", p.log_to_phy},
                           {"replicas", p.replicas},      {"before", balance_json(before)},
                           {"after", balance_json(after)}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%lld layers, %lld experts -> %lld slots on %lld nodes x %lld GPUs (%lld slots each), %s policy\n",
              (long long)p.layers, (long long)p.experts, (long long)a.shape.slots, (long long)a.shape.nodes,
              (long long)(a.shape.gpus / a.shape.nodes), (long long)p.slots_per_gpu(),
              p.hierarchical ? "hierarchical" : "global");
  for (int64_t l = 0; l < p.layers; ++l) {
    std::printf("layer %lld physical-to-logical:", (long long)l);
    for (int64_t s = 0; s < a.shape.slots; ++s)
      std::printf("%s%d", s % p.slots_per_gpu() == 0 && s > 0 ? " |" : " ", p.phy_to_log[size_t(l)][size_t(s)]);
    std::printf("\nlayer %lld replicas:", (long long)l);
    for (int32_t c : p.replicas[size_t(l)]) std::printf(" %d", c);
    std::printf("\n");
  }
  std::printf("\nmax / mean tokens per GPU\n%-8s %10s %10s\n", "layer", "before", "after");
  for (int64_t l = 0; l < p.layers; ++l)
    std::printf("%-8lld %10.4f %10.4f\n", (long long)l, before.ratio(l), after.ratio(l));
  std::printf("%-8s %10.4f %10.4f\n", "overall", before.overall(), after.overall());
}

void add_eplb(CLI::App& app) {
  auto* cmd = app.add_subcommand("eplb", "place redundant experts for per-layer expert loads (EPLB) and print the balance");
  auto args = std::make_shared<EplbArgs>();
  cmd->add_option("--loads", args->loads, "expert loads: JSON [[...]], metrics.jsonl (expert_loads) or text rows")
      ->required();
  cmd->add_option("--slots", args->shape.slots, "physical expert slots over all GPUs")->required();
  cmd->add_option("--nodes", args->shape.nodes, "nodes")->capture_default_str();
  cmd->add_option("--gpus", args->shape.gpus, "GPUs over all nodes")->required();
  cmd->add_option("--groups", args->shape.groups, "expert groups of the router (n_group)")->capture_default_str();
  cmd->add_option("--policy", args->policy, "auto (hierarchical when the groups divide by the nodes) | hierarchical | global")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "print the placement and balance as JSON");
  cmd->callback([args] { eplb_command(*args); });
}

const bool registered = cli::register_command(&add_eplb);

}  // namespace
}  // namespace fp8moe
