// `fp8moe export`: a training checkpoint as a Hugging Face DeepSeek-V3 model folder
// (include/fp8moe/export.hpp), FP8 with 128x128 weight_scale_inv blocks or BF16.
//   fp8moe export runs/default/checkpoint.safetensors -o runs/default/hf [--format fp8|bf16] [--ema]
#include <cstdio>

#include "commands.hpp"
#include "fp8moe/export.hpp"

namespace fp8moe {
namespace {

struct ExportArgs {
  std::string checkpoint, out, format = "fp8";
  bool ema = false, overwrite = false;
};

void add_export(CLI::App& app) {
  static ExportArgs args;
  auto* cmd = app.add_subcommand("export", "Export a checkpoint as a Hugging Face DeepSeek-V3 folder (FP8 or BF16)");
  cmd->add_option("checkpoint", args.checkpoint, "checkpoint.safetensors written by fp8moe train")->required();
  cmd->add_option("-o,--out", args.out, "output folder (model.safetensors, config.json, tokenizer.json, tokenizer_config.json)")->required();
  cmd->add_option("--format", args.format,
                  "fp8: the Linear weights in E4M3 with 128x128 weight_scale_inv blocks, the rest BF16; bf16: all BF16")
      ->capture_default_str();
  cmd->add_flag("--ema", args.ema, "export the parameters' EMA instead of the weights");
  cmd->add_flag("--overwrite", args.overwrite, "replace an export already in --out");
  cmd->callback([] {
    const ExportSummary s = export_checkpoint(args.checkpoint, args.out, args.format, args.ema, args.overwrite);
    std::printf("wrote %s/{model.safetensors, config.json, tokenizer.json, tokenizer_config.json}: %d tensors (%d in FP8 with their scales), %.1f MiB\n",
                args.out.c_str(), s.tensors, s.fp8_tensors, s.bytes / (1 << 20));
  });
}

const bool registered = cli::register_command(&add_export);

}  // namespace
}  // namespace fp8moe
