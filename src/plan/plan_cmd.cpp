// `qtrain plan` (plan_cmd.h, docs/plan.md): the command line, the deck, and the table.
#include "plan/plan_cmd.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "plan/memory_plan.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"

namespace qt {

namespace {

using plan::MemoryPlan;
using plan::Offload;

constexpr const char* kUsage =
    "usage: qtrain plan DECK --gpus N --gpu-mem GB [--section.key=value ...]\n"
    "\n"
    "Predicts the peak GPU memory of one rank of the CUDA back end for the deck's model\n"
    "(model.preset, [model] keys or model.init's config.json), train.micro_batch,\n"
    "train.seq_len and train.recompute, split into parameters, gradients, optimizer state,\n"
    "activations and workspace, for every optim.zero_stage (0-3) and optim.offload (none, cpu;\n"
    "cpu needs ZeRO-2 or 3) on N data-parallel GPUs; says whether each fits and which is the\n"
    "cheapest that does.\n"
    "\n"
    "  --gpus N         data-parallel GPUs (mesh.dp = N; one rank each)\n"
    "  --gpu-mem GB     memory of one GPU in GiB (2^30 bytes), as the card is sold: 80 for an\n"
    "                   H100 80GB; a margin of 4.5 GiB is kept for the CUDA context, NCCL and\n"
    "                   cuBLASLt\n"
    "  --section.key=value   overrides a deck key, as for training (e.g. --train.micro_batch=2)\n"
    "  --help           this text\n"
    "\n"
    "Every number mirrors the CUDA back end's allocations, buffer by buffer. Only the model,\n"
    "micro-batch, recompute and optim.grad_reduce keys matter (bf16 applies to ZeRO 0 and 1;\n"
    "ZeRO 2 and 3 reduce in fp32); data and checkpoint keys are not checked. docs/plan.md\n"
    "explains every term.\n";

struct Options {
  std::string deck;
  int gpus = 0;
  double gpu_mem_gib = 0;
  std::vector<std::string> overrides;  // "--section.key=value"
  bool help = false;
};

int parse_gpus(const std::string& s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 1 || v > 1'000'000)
    fail_user("--gpus {}: expected a whole number of GPUs from 1 to 1000000", s.empty() ? "''" : s);
  return v;
}

double parse_gpu_mem(const std::string& s) {
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || !std::isfinite(v) || v <= 0 || v > 1e6)
    fail_user("--gpu-mem {}: expected the GPU's memory in GiB, a number > 0 (e.g. 80)",
              s.empty() ? "''" : s);
  const double margin = static_cast<double>(plan::kGpuMarginBytes) / (1 << 30);
  if (v <= margin)
    fail_user(
        "--gpu-mem {}: a GPU needs more than the {} GiB kept for the CUDA context, NCCL and "
        "cuBLASLt",
        s, margin);
  return v;
}

Options parse_options(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  bool gpus = false, mem = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      o.help = true;
      return o;
    }
    if (a.size() < 2 || a[0] != '-') {
      positional.push_back(a);
      continue;
    }
    const std::size_t eq = a.find('=');
    const std::string key = a.substr(0, eq);
    if (key == "--gpus" || key == "--gpu-mem") {
      std::string value;
      if (eq != std::string::npos)
        value = a.substr(eq + 1);
      else if (i + 1 < argc)
        value = argv[++i];
      else
        fail_user("{} needs a value", key);
      if (key == "--gpus") {
        if (gpus) fail_user("--gpus is given twice");
        o.gpus = parse_gpus(value);
        gpus = true;
      } else {
        if (mem) fail_user("--gpu-mem is given twice");
        o.gpu_mem_gib = parse_gpu_mem(value);
        mem = true;
      }
    } else if (key.rfind("--", 0) == 0 && key.find('.') != std::string::npos) {
      if (eq == std::string::npos) fail_user("{} has no value; write {}=value", a, a);
      if (key == "--mesh.dp") fail_user("--mesh.dp: the plan's data-parallel size is --gpus");
      o.overrides.push_back(a);
    } else {
      fail_user("unknown option {} (qtrain plan --help lists the options)", key);
    }
  }
  if (positional.size() != 1)
    fail_user("expected one DECK, got {}{}{}; usage: qtrain plan DECK --gpus N --gpu-mem GB",
              positional.size(), positional.empty() ? "" : ": ", fmt::join(positional, " "));
  o.deck = positional[0];
  if (!gpus) fail_user("--gpus N is required (the number of data-parallel GPUs)");
  if (!mem) fail_user("--gpu-mem GB is required (the memory of one GPU in GiB, e.g. 80)");
  return o;
}

// The deck, read as a training run on one rank would read it: the model and the batch as given.
// mesh.dp is the plan's own (--gpus); data and checkpoint keys do not change memory, so a deck
// whose token file or checkpoint lives on another machine is planned too.
Deck read_deck(const Options& o) {
  std::vector<std::string> args = {"qtrain"};
  auto given = [&o](const std::string& key) {
    for (const std::string& a : o.overrides)
      if (a.rfind("--" + key + "=", 0) == 0) return true;
    return false;
  };
  args.insert(args.end(), o.overrides.begin(), o.overrides.end());
  args.push_back("--mesh.dp=1");
  for (const char* kv :
       {"data.source=synthetic", "data.packing=concat", "checkpoint.resume=none"}) {
    const std::string s = kv;
    if (!given(s.substr(0, s.find('=')))) args.push_back("--" + s);
  }
  args.push_back(o.deck);
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  Deck d = parse_deck(static_cast<int>(argv.size()), argv.data(), 1);
  if (d.lora.enabled())
    fail_user(
        "lora.r = {}: the plan covers training the whole model, not LoRA adapters yet; "
        "--lora.r=0 gives the whole model's numbers",
        d.lora.r);
  return d;
}

double gib(std::uint64_t b) { return static_cast<double>(b) / (1 << 30); }

// "8.19B", "596M", "115K" parameters.
std::string short_count(std::uint64_t n) {
  const double v = static_cast<double>(n);
  if (v >= 1e9) return fmt::format("{:.2f}B", v * 1e-9);
  if (v >= 1e6) return fmt::format("{:.0f}M", v * 1e-6);
  return fmt::format("{:.0f}K", v * 1e-3);
}

// "8,190,735,360"
std::string grouped(std::uint64_t v) {
  const std::string digits = std::to_string(v);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

// A setting the CUDA back end can run: offload needs ZeRO-2 or 3 (the deck refuses it below).
bool available(int stage, Offload off) { return off == Offload::kNone || stage >= 2; }

struct Row {
  int stage;
  Offload offload;
  MemoryPlan plan;  // when available(stage, offload)
  bool fits;
};

// What the CUDA back end cannot run at all, whatever the memory (checked in its kernels).
std::vector<std::string> cuda_limits(const ModelConfig& m) {
  std::vector<std::string> out;
  if (m.head_dim != 64 && m.head_dim != 128)
    out.push_back(
        fmt::format("model.head_dim = {}: the CUDA attention kernels handle 64 and 128 "
                    "only, so train.device = cuda refuses this model",
                    m.head_dim));
  if (m.hidden_size % 8 != 0 || m.hidden_size > 8192)
    out.push_back(
        fmt::format("model.hidden_size = {}: the CUDA RMSNorm needs a multiple of 8 up "
                    "to 8192, so train.device = cuda cannot run this model",
                    m.hidden_size));
  return out;
}

std::string report(const Options& o, const Deck& d) {
  const ModelConfig& m = d.model;
  const plan::ParamUnits u = plan::param_units(m);
  const std::uint64_t card = static_cast<std::uint64_t>(o.gpu_mem_gib * (1 << 30));
  const std::uint64_t usable = card - plan::kGpuMarginBytes;  // > 0: parse_gpu_mem
  std::string out = fmt::format("qtrain plan: deck {}\n", d.path);
  const std::string name = !m.preset.empty()       ? m.preset
                           : !d.model_init.empty() ? d.model_init + "/config.json"
                                                   : std::string("[model] keys");
  out += fmt::format(
      "model    {}: {} parameters ({}); ZeRO-2/3 units: embedding {}, {} layers of {}, final "
      "norm{} {}\n",
      name, grouped(u.total()), short_count(u.total()), grouped(u.embed), u.layers,
      grouped(u.layer), m.tie_word_embeddings ? " (lm head tied)" : " + lm head", grouped(u.last));
  out += fmt::format(
      "batch    train.micro_batch {} x train.seq_len {} tokens, train.recompute = {}, "
      "optim.grad_reduce = {}\n",
      d.train.micro_batch, d.train.seq_len, d.train.recompute ? "true" : "false",
      d.optim.grad_reduce);
  out += fmt::format(
      "GPUs     {} data-parallel (dp = {}) of {:.2f} GiB: {:.2f} GiB usable each (a "
      "{:.1f} GiB margin for the CUDA context, NCCL and cuBLASLt)\n\n",
      o.gpus, o.gpus, o.gpu_mem_gib, gib(usable), gib(plan::kGpuMarginBytes));

  const bool wire_bf16 = d.optim.grad_reduce == "bf16";
  plan::MemoryPlanInput base;  // the deck's model and batch on o.gpus data-parallel GPUs
  base.model = m;
  base.micro_batch = d.train.micro_batch;
  base.seq_len = d.train.seq_len;
  base.recompute = d.train.recompute;
  base.mesh.dp = o.gpus;
  base.grad_reduce_bf16 = wire_bf16;
  std::vector<Row> rows;
  for (Offload off : {Offload::kNone, Offload::kCpu})
    for (int stage = 0; stage <= 3; ++stage) {
      if (!available(stage, off)) {
        rows.push_back({stage, off, MemoryPlan{}, false});
        continue;
      }
      plan::MemoryPlanInput in = base;
      in.zero_stage = stage;
      in.offload = off;
      in.grad_reduce_bf16 = wire_bf16 && stage <= 1;  // ZeRO 2 and 3 reduce in fp32
      const MemoryPlan p = plan::memory_plan(in);
      rows.push_back({stage, off, p, p.gpu() <= usable});
    }

  // GiB, or MiB when every setting needs less than 1 GiB (small test models).
  std::uint64_t largest = 0;
  for (const Row& r : rows)
    largest = std::max({largest, r.plan.gpu(), r.plan.host, r.plan.host_pinned});
  const bool mib = largest < (std::uint64_t{1} << 30);
  const char* unit = mib ? "MiB" : "GiB";
  auto in_unit = [mib](std::uint64_t b) {
    return static_cast<double>(b) / (mib ? 1 << 20 : 1 << 30);
  };
  out += fmt::format(
      "Peak GPU memory of one rank, {0}; host: the rank's trained state in host memory, {0}\n",
      unit);
  out +=
      " zero offload   params    grads optimizer activations workspace    total fits      host  "
      " pinned\n";
  for (const Row& r : rows) {
    const bool mine =
        r.stage == d.optim.zero_stage && plan::offload_name(r.offload) == d.optim.offload;
    const std::string head =
        fmt::format("{:>4}{} {:<7}", r.stage, mine ? '*' : ' ', plan::offload_name(r.offload));
    if (!available(r.stage, r.offload)) {
      out += head + " not available: the CUDA back end offloads at ZeRO-2 and 3 only\n";
      continue;
    }
    const MemoryPlan& p = r.plan;
    out += head + fmt::format(
                      " {:>8.2f} {:>8.2f} {:>9.2f} {:>11.2f} {:>9.2f} {:>8.2f} {:<4} {:>9.2f} "
                      "{:>8.2f}\n",
                      in_unit(p.params), in_unit(p.grads), in_unit(p.optimizer),
                      in_unit(p.activations), in_unit(p.workspace), in_unit(p.gpu()),
                      r.fits ? "yes" : "no", in_unit(p.host), in_unit(p.host_pinned));
  }
  out += fmt::format(
      "\n*: the deck's setting (optim.zero_stage = {}, optim.offload = {}). host: master weights "
      "and moments in pageable\nmemory (copies for start-up and checkpoints; with offload the "
      "live state, updated on the host); pinned:\noffload's staging.{}\n",
      d.optim.zero_stage, d.optim.offload,
      wire_bf16 ? " ZeRO 2 and 3 reduce gradients in fp32 (optim.grad_reduce = bf16 is for ZeRO 0 "
                  "and 1)."
                : "");

  // The first setting, in plan::settings_by_preference's order, that fits.
  const Row* best = nullptr;
  for (const plan::Setting& st : plan::settings_by_preference(base))
    for (const Row& r : rows)
      if (!best && r.fits && r.stage == st.zero_stage && r.offload == st.offload) best = &r;
  if (best)
    out += fmt::format(
        "cheapest that fits: optim.zero_stage = {}, optim.offload = {}{} ({:.2f} of {:.2f} {})\n",
        best->stage, plan::offload_name(best->offload),
        wire_bf16 && best->stage >= 2 ? ", optim.grad_reduce = fp32" : "",
        in_unit(best->plan.gpu()), in_unit(usable), unit);
  else
    out += fmt::format(
        "nothing fits {} GPU{} of {:.2f} GiB: lower train.micro_batch or "
        "train.seq_len{}, or use more GPUs\n",
        o.gpus, o.gpus == 1 ? "" : "s", o.gpu_mem_gib,
        d.train.recompute ? "" : ", set train.recompute = true");
  const long long per_step = static_cast<long long>(d.train.micro_batch) * o.gpus;
  if (d.train.global_batch % per_step != 0)
    out += fmt::format(
        "note: train.global_batch = {} is not a multiple of train.micro_batch x {} "
        "GPUs = {}, which a run on {} GPUs needs\n",
        d.train.global_batch, o.gpus, per_step, o.gpus);
  for (const std::string& s : cuda_limits(m)) out += "note: " + s + "\n";
  return out;
}

}  // namespace

int plan_main(int argc, char** argv, const MpiComm& world) {
  const bool root = world.rank() == 0;
  try {
    const Options o = parse_options(argc, argv);
    if (o.help) {
      if (root) std::printf("%s", kUsage);
      return 0;
    }
    const Deck d = read_deck(o);
    const std::string out = report(o, d);
    if (root) std::printf("%s", out.c_str());
    return 0;
  } catch (const UserError& e) {
    if (root) std::fprintf(stderr, "qtrain plan: error: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace qt
