// `qtrain plan` (plan_cmd.h, docs/plan.md): the command line, the deck, and the table.
#include "plan/plan_cmd.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "config/ini_lines.h"
#include "plan/layouts.h"
#include "plan/memory_plan.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/params.h"

namespace qt {

namespace {


constexpr const char* kUsage =
    "usage: qtrain plan DECK --gpus N --gpu-mem GB [options] [--section.key=value ...]\n"
    "\n"
    "Lists every layout of the deck's model (model.preset, [model] keys or model.init's\n"
    "config.json) on N GPUs of the CUDA back end: each mesh dp x tp x pp = N that the model\n"
    "and the hosts allow, and on it each optim.zero_stage (0-3), optim.offload (none, cpu;\n"
    "cpu needs ZeRO-2 or 3) and train.recompute; for each the peak GPU memory of one rank\n"
    "(parameters, gradients, optimizer state, activations, workspace), whether it fits, and a\n"
    "predicted step time; then recommends the fastest that fits, with its deck keys.\n"
    "train.micro_batch, train.seq_len and train.global_batch are the deck's.\n"
    "\n"
    "  --gpus N            GPUs of the whole job (one rank each): dp x tp x pp = N\n"
    "  --gpu-mem GB        memory of one GPU in GiB (2^30 bytes), as the card is sold: 80 for\n"
    "                      an H100 80GB; a margin of 4.5 GiB is kept for the CUDA context\n"
    "                      and cuBLASLt, and NCCL's communicators are counted (column nccl)\n"
    "  --gpus-per-host G   GPUs of one host (topology.gpus_per_host, default 8); tp stays inside\n"
    "                      a host\n"
    "  --tp LIST, --pp LIST  only these tensor / pipeline sizes, e.g. --tp 4,8 (default: all)\n"
    "  --ep LIST           Qwen3-MoE: only these expert-parallel sizes (default: every divisor\n"
    "                      of dp that divides model.num_experts)\n"
    "  --sequence-parallel plan tp > 1 with sequence parallelism (as the deck's\n"
    "                      mesh.sequence_parallel = true does)\n"
    "  --all               list the layouts that do not fit too\n"
    "  --section.key=value overrides a deck key, as for training (e.g. --train.micro_batch=2,\n"
    "                      --mesh.pp_schedule=zb-h1, --topology.inter_host_gbps=40)\n"
    "  --help              this text\n"
    "\n"
    "Memory mirrors the CUDA back end's allocations buffer by buffer (tp and pp > 1: what it\n"
    "will allocate by the same rules; the 'built' column says which). Times come from measured\n"
    "GEMM, attention and AdamW rates and the topology.* link bandwidths. docs/plan.md explains\n"
    "every term.\n";

struct Options {
  std::string deck;
  int gpus = 0;
  double gpu_mem_gib = 0;
  std::vector<int> tp, pp, ep;         // --tp, --pp, --ep: allowed sizes (empty: any)
  bool sequence_parallel = false;      // --sequence-parallel
  bool all = false;                    // --all
  std::string pp_schedule, pp_chunks;  // --mesh.pp_schedule, --mesh.pp_chunks (or the deck's)
  std::vector<std::string> overrides;  // "--section.key=value", passed to the deck
  bool help = false;
};

int parse_count(const std::string& s, const char* what, int most) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 1 || v > most)
    fail_user("{} {}: expected a whole number from 1 to {}", what, s.empty() ? "''" : s, most);
  return v;
}

int parse_gpus(const std::string& s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 1 || v > 1'000'000)
    fail_user("--gpus {}: expected a whole number of GPUs from 1 to 1000000", s.empty() ? "''" : s);
  return v;
}

// "1,2,4" -> {1, 2, 4}
std::vector<int> parse_list(const std::string& s, const char* what) {
  std::vector<int> out;
  std::size_t begin = 0;
  while (true) {
    const std::size_t comma = s.find(',', begin);
    const std::string item = s.substr(begin, comma - begin);
    int v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || end != item.data() + item.size() || v < 1 || v > 1'000'000)
      fail_user("{} {}: expected a comma list of whole numbers from 1 to 1000000 (e.g. 1,2,4)",
                what, s.empty() ? "''" : s);
    out.push_back(v);
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
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
  std::vector<std::string> positional, seen;
  auto once = [&seen](const std::string& key) {
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      fail_user("{} is given twice", key);
    seen.push_back(key);
  };
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
    if (key == "--sequence-parallel" || key == "--all") {
      if (eq != std::string::npos) fail_user("{} takes no value", key);
      once(key);
      (key == "--all" ? o.all : o.sequence_parallel) = true;
    } else if (key == "--gpus" || key == "--gpu-mem" || key == "--gpus-per-host" ||
               key == "--tp" || key == "--pp" || key == "--ep") {
      std::string value;
      if (eq != std::string::npos)
        value = a.substr(eq + 1);
      else if (i + 1 < argc)
        value = argv[++i];
      else
        fail_user("{} needs a value", key);
      once(key);
      if (key == "--gpus") o.gpus = parse_gpus(value);
      if (key == "--gpu-mem") o.gpu_mem_gib = parse_gpu_mem(value);
      if (key == "--gpus-per-host")
        o.overrides.push_back(fmt::format("--topology.gpus_per_host={}",
                                          parse_count(value, "--gpus-per-host", 1'000'000)));
      if (key == "--tp") o.tp = parse_list(value, "--tp");
      if (key == "--pp") o.pp = parse_list(value, "--pp");
      if (key == "--ep") o.ep = parse_list(value, "--ep");
    } else if (key.rfind("--", 0) == 0 && key.find('.') != std::string::npos) {
      if (eq == std::string::npos) fail_user("{} has no value; write {}=value", a, a);
      if (key == "--mesh.dp") fail_user("--mesh.dp: the plan's data-parallel size is --gpus");
      if (key == "--mesh.tp" || key == "--mesh.pp")
        fail_user("{}: the plan tries every size; pin them with --tp and --pp", key);
      if (key == "--mesh.ep")
        fail_user("--mesh.ep: the plan tries every size; pin them with --ep");
      if (key == "--mesh.pp_layers")
        fail_user("--mesh.pp_layers: the plan balances each pipeline's layers by cost");
      if (key == "--mesh.pp_schedule") {
        once(key);
        o.pp_schedule = a.substr(eq + 1);
      } else if (key == "--mesh.pp_chunks") {
        once(key);
        o.pp_chunks = a.substr(eq + 1);
      } else {
        o.overrides.push_back(a);
      }
    } else {
      fail_user("unknown option {} (qtrain plan --help lists the options)", key);
    }
  }
  if (positional.size() != 1)
    fail_user("expected one DECK, got {}{}{}; usage: qtrain plan DECK --gpus N --gpu-mem GB",
              positional.size(), positional.empty() ? "" : ": ", fmt::join(positional, " "));
  o.deck = positional[0];
  if (o.gpus == 0) fail_user("--gpus N is required (the GPUs of the whole job)");
  if (o.gpu_mem_gib == 0) fail_user("--gpu-mem GB is required (the memory of one GPU in GiB, e.g. 80)");
  return o;
}

// The deck, read as a training run on one rank would read it: the model and the batch as given.
// The mesh is the plan's own: the deck's mesh.dp, tp, pp and pp_layers are not used (the plan
// tries every size), its pp_schedule and pp_chunks (or --mesh.* overrides) are the pipeline rows'.
// Data and checkpoint keys do not change memory, so a deck whose token file or checkpoint lives
// on another machine is planned too.
struct PlanDeck {
  Deck deck;
  std::string pp_schedule = "1f1b";
  int pp_chunks = 1;
};

PlanDeck read_deck(const Options& o) {
  std::vector<std::string> args = {"qtrain"};
  auto given = [&o](const std::string& key) {
    for (const std::string& a : o.overrides)
      if (a.rfind("--" + key + "=", 0) == 0) return true;
    return false;
  };
  args.insert(args.end(), o.overrides.begin(), o.overrides.end());
  for (const char* kv : {"mesh.dp=1", "mesh.tp=1", "mesh.pp=1", "mesh.ep=1", "mesh.pp_chunks=1",
                         "mesh.pp_schedule=1f1b", "mesh.pp_layers="})
    args.push_back(std::string("--") + kv);
  for (const char* kv :
       {"data.source=synthetic", "data.packing=concat", "checkpoint.resume=none"}) {
    const std::string s = kv;
    if (!given(s.substr(0, s.find('=')))) args.push_back("--" + s);
  }
  args.push_back(o.deck);
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  PlanDeck p;
  p.deck = parse_deck(static_cast<int>(argv.size()), argv.data(), 1);
  if (p.deck.lora.enabled())
    fail_user(
        "lora.r = {}: the plan covers training the whole model, not LoRA adapters yet; "
        "--lora.r=0 gives the whole model's numbers",
        p.deck.lora.r);
  // The deck file's pipeline schedule, unless the command line gives one.
  std::string schedule = o.pp_schedule, chunks = o.pp_chunks;
  std::string schedule_at = "(command line)", chunks_at = "(command line)";
  std::ifstream in(o.deck, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  for (const ini::Entry& e : ini::scan(text.str(), o.deck).entries) {
    const std::string at = fmt::format("{}:{}", o.deck, e.line);
    if (e.key == "mesh.pp_schedule" && o.pp_schedule.empty()) schedule = e.value, schedule_at = at;
    if (e.key == "mesh.pp_chunks" && o.pp_chunks.empty()) chunks = e.value, chunks_at = at;
  }
  if (!schedule.empty()) {
    if (schedule != "1f1b" && schedule != "zb-h1")
      fail_user("{}: mesh.pp_schedule = {} must be 1f1b or zb-h1", schedule_at, schedule);
    p.pp_schedule = schedule;
  }
  if (!chunks.empty())
    p.pp_chunks = parse_count(chunks, (chunks_at + ": mesh.pp_chunks =").c_str(), 1'000'000);
  return p;
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

// "dp  tp  pp zero offload recompute" of a row ("dp  tp  pp  ep ..." for Qwen3-MoE).
std::string mesh_cells(const plan::Layout& r) {
  const MeshShape& m = r.in.mesh;
  const std::string ep = r.in.model.is_moe() ? fmt::format(" {:>3}", m.ep) : std::string();
  return fmt::format("{:>4} {:>3} {:>3}{} {:>4} {:<7} {:<9}", m.dp, m.tp, m.pp, ep,
                     r.in.zero_stage, plan::offload_name(r.in.offload),
                     r.in.recompute ? "yes" : "no");
}

std::string report(const Options& o, const PlanDeck& pd) {
  const Deck& d = pd.deck;
  const ModelConfig& m = d.model;
  const plan::ParamUnits u = plan::param_units(m);
  const std::uint64_t card = static_cast<std::uint64_t>(o.gpu_mem_gib * (1 << 30));
  const std::uint64_t usable = card - plan::kGpuMarginBytes;  // > 0: parse_gpu_mem
  const TopologyConfig& topo = d.topology;
  std::string out = fmt::format("qtrain plan: deck {}\n", d.path);
  const std::string name = !m.preset.empty()       ? m.preset
                           : !d.model_init.empty() ? d.model_init + "/config.json"
                                                   : std::string("[model] keys");
  if (!m.is_moe()) {
    out += fmt::format(
        "model    {}: {} parameters ({}); units: embedding {}, {} layers of {}, final norm{} {}\n",
        name, grouped(u.total()), short_count(u.total()), grouped(u.embed), u.layers,
        grouped(u.layer), m.tie_word_embeddings ? " (lm head tied)" : " + lm head",
        grouped(u.last));
  } else {
    const std::uint64_t total = ParamLayout(m).numel();
    const double experts = 3.0 * m.num_experts * m.hidden_size * m.moe_intermediate_size;
    out += fmt::format(
        "model    {}: {} parameters ({}), {:.2f}B active a token; {} of {} layers sparse, each "
        "with {} experts of width {} ({} a layer), {} a token\n",
        name, grouped(total), short_count(total), m.active_params_f64() * 1e-9,
        m.num_moe_layers(), m.num_layers, m.num_experts, m.moe_intermediate_size,
        short_count(static_cast<std::uint64_t>(experts)), m.num_experts_per_tok);
  }
  out += fmt::format(
      "batch    train.micro_batch {} x train.seq_len {} tokens, train.global_batch {} sequences "
      "a step, optim.grad_reduce = {}\n",
      d.train.micro_batch, d.train.seq_len, d.train.global_batch, d.optim.grad_reduce);
  const int hosts = (o.gpus + topo.gpus_per_host - 1) / topo.gpus_per_host;
  out += fmt::format(
      "GPUs     {} ({} host{} of {}) of {:.2f} GiB: {:.2f} GiB usable each (a {:.1f} GiB margin "
      "for the CUDA context and cuBLASLt; NCCL's communicators are column nccl)\n",
      o.gpus, hosts, hosts == 1 ? "" : "s", topo.gpus_per_host, o.gpu_mem_gib, gib(usable),
      gib(plan::kGpuMarginBytes));
  out += fmt::format(
      "links    topology.intra_host_gbps = {:g}, topology.inter_host_gbps = {:g} (GB/s bus "
      "bandwidth per GPU)\n",
      topo.intra_host_gbps, topo.inter_host_gbps);
  // --sequence-parallel, or the deck's mesh.sequence_parallel.
  const bool sequence_parallel = o.sequence_parallel || d.mesh.sequence_parallel;
  out += fmt::format(
      "pipeline mesh.pp_schedule = {}, mesh.pp_chunks = {} (rows with pp > 1); sequence "
      "parallelism {}\n",
      pd.pp_schedule, pd.pp_chunks, sequence_parallel ? "on (rows with tp > 1)" : "off");

  plan::LayoutSearch search;
  search.model = m;
  search.micro_batch = d.train.micro_batch;
  search.seq_len = d.train.seq_len;
  search.global_batch = d.train.global_batch;
  search.grad_reduce_bf16 = d.optim.grad_reduce == "bf16";
  search.sequence_parallel = sequence_parallel;
  search.pp_schedule = pd.pp_schedule;
  search.pp_chunks = pd.pp_chunks;
  search.gpus = o.gpus;
  search.tp = o.tp;
  search.pp = o.pp;
  search.ep = o.ep;
  search.topology = topo;
  search.usable = usable;
  const plan::Layouts all = plan::enumerate_layouts(search);

  std::string meshes;
  std::set<std::tuple<int, int, int>> meshes_run;  // (Qwen3-MoE: each mesh once, whatever ep)
  for (const plan::Layout& r : all.rows)
    meshes_run.insert({r.in.mesh.dp, r.in.mesh.tp, r.in.mesh.pp});
  const int runnable = static_cast<int>(meshes_run.size());
  out += fmt::format("meshes   dp x tp x pp = {}: {} can run the model{}{}\n", o.gpus, runnable,
                     all.excluded.empty() ? "" : fmt::format(", {} cannot:", all.excluded.size()),
                     o.tp.empty() && o.pp.empty() ? "" : " (--tp/--pp given)");
  for (const plan::Excluded& e : all.excluded)
    out += fmt::format("           dp {} x tp {} x pp {}{}: {}\n", e.dp, e.tp, e.pp,
                       m.is_moe() ? fmt::format(" x ep {}", e.ep) : std::string(), e.why);
  if (all.settings_skipped > 0)
    out += fmt::format("         ({} settings left out: mesh.pp_schedule = zb-h1 needs "
                       "train.recompute = false, and optim.zero_stage 0 or 1 at dp > 1)\n",
                       all.settings_skipped);

  // GiB, or MiB when every layout needs less than 1 GiB (small test models).
  std::uint64_t largest = 0;
  for (const plan::Layout& r : all.rows)
    largest = std::max({largest, r.memory.device(), r.memory.host + r.memory.host_pinned});
  const bool mib = largest < (std::uint64_t{1} << 30);
  const char* unit = mib ? "MiB" : "GiB";
  auto in_unit = [mib](std::uint64_t b) {
    return static_cast<double>(b) / (mib ? 1 << 20 : 1 << 30);
  };
  int fitting = 0;
  for (const plan::Layout& r : all.rows) fitting += r.fits;
  out += fmt::format(
      "\nLayouts{}, fastest first: peak memory of one rank in {} (the pipeline "
      "stage that needs most), predicted step time\n",
      o.all ? " (those that fit first)" : " that fit", unit);
  out += std::string(m.is_moe() ? "  dp  tp  pp  ep" : "  dp  tp  pp") +
         " zero offload recompute   params    grads optimizer activations workspace"
         "     nccl    total fits   step s tokens/s/GPU   MFU bubble  host built\n";
  int listed = 0;
  for (const plan::Layout& r : all.rows) {
    if (!r.fits && !o.all) continue;
    ++listed;
    const plan::MemoryPlan& p = r.memory;
    out += mesh_cells(r) + fmt::format(
        " {:>8.2f} {:>8.2f} {:>9.2f} {:>11.2f} {:>9.2f} {:>8.2f} {:>8.2f} {:<4} {:>8.3f} "
        "{:>12.0f} {:>4.1f}% {:>5.1f}% {:>5.1f} {}\n",
        in_unit(p.params), in_unit(p.grads), in_unit(p.optimizer), in_unit(p.activations),
        in_unit(p.workspace), in_unit(p.nccl), in_unit(p.device()), r.fits ? "yes" : "no",
        r.time.total,
        r.time.tokens_per_s_per_gpu, 100 * r.time.mfu, 100 * r.time.bubble_fraction,
        in_unit(p.host + p.host_pinned), p.built ? "yes" : "no");
  }
  if (listed == 0) out += "  (none)\n";
  if (!o.all && fitting < static_cast<int>(all.rows.size())) {
    const plan::Layout* least = nullptr;
    for (const plan::Layout& r : all.rows)
      if (!r.fits && (!least || r.memory.device() < least->memory.device())) least = &r;
    out += fmt::format("  ... and {} that do not fit (the least needs {:.2f} {}: dp {} x tp {} x "
                       "pp {}{}, ZeRO-{}, offload {}); --all lists them\n",
                       all.rows.size() - fitting, in_unit(least->memory.device()), unit,
                       least->in.mesh.dp, least->in.mesh.tp, least->in.mesh.pp,
                       m.is_moe() ? fmt::format(" x ep {}", least->in.mesh.ep) : std::string(),
                       least->in.zero_stage, plan::offload_name(least->in.offload));
  }
  out += fmt::format(
      "\nhost: the rank's trained state in host memory (pageable and offload's pinned staging), "
      "{}; built: the CUDA back end\nruns this layout today (no: a prediction of a path not built yet: pp > 1 at dp > 1 with "
      "ZeRO-2 or 3; docs/plan.md). Step times are predictions (docs/plan.md).\n",
      unit);
  if (m.is_moe())
    out += "Qwen3-MoE: the CUDA back end runs the sparse block at any dp, tp, ep and ZeRO "
           "stage: experts E / ep a rank\n(each its tp share of the width) sharded over "
           "dp / ep, the dispatch buffers sized for the most rows a\nrank can receive, "
           "all-to-alls timed over the links (docs/plan.md); pp > 1 with a set of the\n"
           "routing and expert activations (and at ep > 1 the exchange maps) per micro-batch in "
           "flight.\n";

  const plan::Layout* best = plan::recommended(all);
  if (best) {
    const plan::StepTime& t = best->time;
    out += fmt::format(
        "recommended: dp {} x tp {} x pp {}, ZeRO-{}, offload {}, recompute {}: {:.2f} of {:.2f} "
        "{}, {:.3f} s a step, {:.0f} tokens/s per GPU, {:.1f}% MFU (predicted)\n",
        best->in.mesh.dp, best->in.mesh.tp,
        m.is_moe() ? fmt::format("{} x ep {}", best->in.mesh.pp, best->in.mesh.ep)
                   : std::to_string(best->in.mesh.pp),
        best->in.zero_stage,
        plan::offload_name(best->in.offload), best->in.recompute ? "on" : "off",
        in_unit(best->memory.device()), in_unit(usable), unit, t.total, t.tokens_per_s_per_gpu,
        100 * t.mfu);
    out += fmt::format(
        "  step: compute {:.3f} s, tp {:.3f}, pipeline sends {:.3f}, bubble {:.3f}, dp exposed "
        "{:.3f}, optimizer {:.3f}\n",
        t.compute, t.tp_comm, t.pp_comm, t.bubble, t.dp_exposed, t.optimizer);
    if (m.is_moe()) out += fmt::format("  ep all-to-all {:.3f} s\n", t.ep_comm);
    std::vector<std::string> keys = plan::deck_keys(*best);
    if (d.optim.grad_reduce == "bf16" && best->in.zero_stage >= 2)
      keys.push_back("optim.grad_reduce = fp32");
    std::string line;
    for (const std::string& k : keys) {
      const std::size_t eq = k.find(" = ");
      line += fmt::format(" --{}={}", k.substr(0, eq), k.substr(eq + 3));
    }
    out += "  deck keys:" + line + "\n";
    if (!best->memory.built) {
      // Only a pipeline layout at dp > 1 with ZeRO-2 or 3 can be unbuilt (dense or MoE).
      out += "  note: the CUDA back end does not run this layout yet (a pipeline at dp > 1 with "
             "ZeRO-2 or 3): its numbers predict that path\n";
      if (const plan::Layout* now = plan::recommended(all, /*built_only=*/true)) {
        std::string now_keys;
        for (const std::string& k : plan::deck_keys(*now)) {
          const std::size_t eq = k.find(" = ");
          now_keys += fmt::format(" --{}={}", k.substr(0, eq), k.substr(eq + 3));
        }
        out += fmt::format(
            "recommended among the layouts it runs today: dp {} x tp {} x pp {}, ZeRO-{}, offload "
            "{}, recompute {}: {:.2f} {}, {:.3f} s a step, {:.1f}% MFU (predicted)\n  its deck keys:{}\n",
            now->in.mesh.dp, now->in.mesh.tp,
            m.is_moe() ? fmt::format("{} x ep {}", now->in.mesh.pp, now->in.mesh.ep)
                       : std::to_string(now->in.mesh.pp),
            now->in.zero_stage,
            plan::offload_name(now->in.offload), now->in.recompute ? "on" : "off",
            in_unit(now->memory.device()), unit, now->time.total, 100 * now->time.mfu, now_keys);
      }
    }
  } else {
    out += fmt::format(
        "nothing fits {} GPU{} of {:.2f} GiB: lower train.micro_batch or train.seq_len, or use "
        "more GPUs\n",
        o.gpus, o.gpus == 1 ? "" : "s", o.gpu_mem_gib);
  }
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
    const PlanDeck d = read_deck(o);
    const std::string out = report(o, d);
    if (root) std::printf("%s", out.c_str());
    return 0;
  } catch (const UserError& e) {
    if (root) std::fprintf(stderr, "qtrain plan: error: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace qt
