// `qtrain generate` (generate.h, docs/generate.md): options, loading the model and the tokenizer,
// and the decoding loop over KvDecoder and Sampler.
#include "generate/generate.h"

#include <boost/program_options.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "generate/decode.h"
#include "generate/kv_decoder.h"
#include "generate/sampler.h"
#ifdef QTRAIN_HAVE_CUDA
#include "generate/kv_decoder_cuda.h"  // no CUDA header in it
#endif
#include "hf/config.h"
#include "hf/export.h"
#include "hf/lora_export.h"
#include "hf/weights.h"
#include "prep/chat.h"
#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
#include "qtrain/tokenizer.h"
#include "runtime/memory.h"

namespace qt {

namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string model, prompt, system, tokenizer, base, device = "cpu";
  bool chat = false, no_think = false, help = false;
  std::int64_t max_new_tokens = 128;
  double temperature = 0, top_p = 1;
  std::uint64_t seed = 0;
};

po::options_description option_table(Options& o) {
  po::options_description d(
      "qtrain generate MODEL --prompt TEXT [options]\n"
      "  MODEL: a qtrain checkpoint (.h5), a checkpoint directory (its newest step_*.h5) or a\n"
      "  Hugging Face Qwen3 directory (config.json + safetensors). One process, on the CPU or one "
      "GPU");
  auto add = d.add_options();
  add("help,h", po::bool_switch(&o.help), "print this help");
  add("prompt,p", po::value(&o.prompt),
      "the prompt text (special tokens such as <|im_start|> are parsed)");
  add("chat", po::bool_switch(&o.chat),
      "render the prompt as a user message with Qwen3's chat template and the generation prompt "
      "(<|im_start|>assistant\\n)");
  add("system", po::value(&o.system), "with --chat: a system message before the user message");
  add("no-think", po::bool_switch(&o.no_think),
      "with --chat: an empty <think></think> block after the generation prompt, as the template "
      "writes it with enable_thinking=False (the model answers without reasoning)");
  add("tokenizer,t", po::value(&o.tokenizer),
      "tokenizer directory (default: MODEL when it is an HF directory with tokenizer.json, or a "
      "checkpoint's model.init directory)");
  add("base", po::value(&o.base),
      "a checkpoint's model.init directory (a LoRA run's base, the default tokenizer) where it is "
      "now, if it moved (default: its absolute path, then the path as given)");
  add("max-new-tokens,n", po::value(&o.max_new_tokens)->default_value(128),
      "stop after this many new tokens");
  add("temperature", po::value(&o.temperature)->default_value(0.0),
      "0 = greedy (argmax); > 0 samples from softmax(logits / temperature)");
  add("top-p", po::value(&o.top_p)->default_value(1.0),
      "sample only from the smallest set of tokens whose probabilities sum to >= top-p");
  add("seed", po::value(&o.seed)->default_value(0), "seed of the sampling draws");
  add("device", po::value(&o.device)->default_value("cpu"),
      "cpu (fp32) or cuda (GPU 0, bf16; needs a qtrain built with the CUDA back end)");
  return d;
}

Options parse_options(int argc, char** argv) {
  Options o;
  po::options_description d = option_table(o);
  po::options_description all;
  all.add(d).add_options()("model", po::value<std::vector<std::string>>());
  po::positional_options_description pos;
  pos.add("model", -1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(all).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    fail_user("{} (qtrain generate --help lists the options)", e.what());
  }
  if (o.help) return o;
  const auto models =
      vm.count("model") ? vm["model"].as<std::vector<std::string>>() : std::vector<std::string>{};
  if (models.size() != 1)
    fail_user("expected one MODEL (a checkpoint or a Hugging Face directory), got {}",
              models.size());
  o.model = models[0];
  if (!vm.count("prompt")) fail_user("--prompt is required");
  if (o.device == "gpu") o.device = "cuda";
  if (o.device != "cpu" && o.device != "cuda")
    fail_user("--device {}: expected cpu or cuda", o.device);
#ifndef QTRAIN_HAVE_CUDA
  if (o.device == "cuda")
    fail_user(
        "--device cuda needs a CUDA build: this qtrain was built without the CUDA back end; build "
        "it with `cmake --preset cuda` (needs CUDA 13 and NCCL), or use --device cpu");
#endif
  if (o.max_new_tokens < 1) fail_user("--max-new-tokens must be >= 1, got {}", o.max_new_tokens);
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    fail_user("--temperature must be >= 0 (0 = greedy), got {}", o.temperature);
  if (!(o.top_p > 0 && o.top_p <= 1)) fail_user("--top-p must be in (0, 1], got {}", o.top_p);
  if (!o.chat && (o.no_think || vm.count("system")))
    fail_user("{} needs --chat", o.no_think ? "--no-think" : "--system");
  if (!o.chat && o.prompt.empty()) fail_user("--prompt is empty");
  return o;
}

bool has_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// Where the weights, the tokenizer and generation_config.json come from.
struct ModelSource {
  bool hf = false;   // a Hugging Face directory, else a qtrain checkpoint
  std::string path;  // the directory or the checkpoint file
  ModelConfig cfg;
  hf::CheckpointModel ckpt;  // a checkpoint's model (checkpoint only); ckpt.lora: a LoRA run's
  std::string side_dir;      // default tokenizer and generation_config.json ("" = none)
  std::string describe;
};

// base: --base, a checkpoint's model.init directory where it is now.
ModelSource resolve_model(const std::string& model, const std::string& base, Comm& world) {
  std::error_code ec;
  ModelSource s;
  if (!fs::exists(model, ec))
    fail_user(
        "model {}: no such file or directory (give a qtrain checkpoint .h5, a checkpoint "
        "directory or a Hugging Face model directory)",
        model);
  if (fs::is_directory(model, ec) && has_file(fs::path(model) / "config.json")) {
    if (!base.empty())
      fail_user("--base {}: {} is a Hugging Face directory, which has no base; --base is for "
                "checkpoints",
                base, model);
    s.hf = true;
    s.path = model;
    s.cfg = hf::read_config(model);
    s.side_dir = model;
    s.describe = fmt::format("Hugging Face directory {}", model);
    return s;
  }
  s.path = model;
  if (fs::is_directory(model, ec)) {
    const std::vector<std::string> found = checkpoint_list(model, world);
    if (found.empty())
      fail_user(
          "model {}: a directory with neither config.json (Hugging Face) nor complete "
          "step_*.h5 checkpoints",
          model);
    s.path = found.front();
  }
  s.ckpt = hf::read_checkpoint_model(s.path);
  s.ckpt.init_found = hf::find_init_dir(s.ckpt, base);
  s.cfg = s.ckpt.cfg;
  s.side_dir = s.ckpt.init_found.dir;
  s.describe = fmt::format("checkpoint {} (step {}{})", s.path, s.ckpt.step,
                           s.ckpt.lora ? ", LoRA adapters merged into their base" : "");
  return s;
}

std::vector<float> load_weights(const ModelSource& s, const ParamLayout& layout,
                                std::shared_ptr<MpiComm> world) {
  std::vector<float> params(layout.numel());
  if (s.hf) {
    hf::load_params(s.path, layout, hf::all_rows(layout, params.data()), s.cfg.tie_word_embeddings,
                    *world);
  } else if (s.ckpt.lora) {  // the base with W + scale * B A, as `qtrain export --merge` writes it
    hf::lora_merged_params(s.path, s.ckpt, layout, params.data(), world);
  } else {
    MeshShape shape;
    Mesh mesh(shape, world);
    float dummy = 0;
    checkpoint_read(s.path, mesh, layout, params.data(), MomentShard{{0, 0}, &dummy, &dummy},
                    s.cfg);
  }
  return params;
}

// What generate holds in host memory, before it allocates any of it: the fp32 weights (with a
// LoRA checkpoint's adapters) and a row of logits; on the CPU also the key/value cache of `cap`
// positions, the RoPE tables and the scratch of a prefill of `prompt` tokens. On the GPU the
// host keeps the weights until they are copied.
HostMemoryNeed host_need(const ModelSource& s, bool cuda, std::size_t prompt, int cap) {
  hf::CheckpointModel m = s.ckpt;
  m.cfg = s.cfg;  // an HF directory's, where there is no checkpoint
  HostMemoryNeed need = hf::weights_memory_need(m);
  const ModelConfig& c = s.cfg;
  double floats = c.vocab_size;
  if (!cuda) {
    const double n = prompt, H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim();
    floats += 2.0 * c.num_layers * cap * KV + double(cap) * c.head_dim +
              n * (3 * H + 3 * Q + KV + 3.0 * c.intermediate_size +
                   std::max(c.num_heads, c.num_kv_heads));
  }
  need.bytes += 4 * floats;
  need.what += cuda ? " before the copy to the GPU"
                    : fmt::format(", a key/value cache of {} positions", cap);
  need.keys = "--max-new-tokens (the cache holds the prompt and the new tokens), or use a smaller "
              "model";
  return need;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int run(const Options& o, std::shared_ptr<MpiComm> world) {
  if (world->size() != 1)
    fail_user(
        "qtrain generate runs on one process (there is no multi-rank inference); it was "
        "started on {} MPI ranks: run it without mpirun, or with mpirun -np 1",
        world->size());
  const auto t_load = Clock::now();
  const ModelSource src = resolve_model(o.model, o.base, *world);
#ifdef QTRAIN_HAVE_CUDA
  if (o.device == "cuda") gen::KvDecoderCuda::check_supported(src.cfg);  // before any GPU work
#endif

  // The tokenizer, the prompt and the stop tokens, before the (possibly large) weights.
  std::string tok_dir = o.tokenizer;
  if (tok_dir.empty()) {
    const hf::InitDirSearch& init = src.ckpt.init_found;
    if (src.side_dir.empty() || !has_file(fs::path(src.side_dir) / "tokenizer.json")) {
      const std::string why =
          src.hf ? fmt::format("{} has no tokenizer.json", src.path)
          : !init.tried.empty()
              ? fmt::format("its model.init directory is not found (tried {}); pass --base DIR "
                            "where it is now, or --tokenizer DIR",
                            hf::tried_text(init))
          : src.side_dir.empty()
              ? std::string("the checkpoint's run had no model.init directory")
              : fmt::format("its model.init directory {} has no tokenizer.json", src.side_dir);
      fail_user("no tokenizer for {}: {}{}", o.model, why,
                init.tried.empty() ? "; pass --tokenizer DIR (scripts/get-tokenizer.sh fetches "
                                     "Qwen3's)"
                                   : "");
    }
    tok_dir = src.side_dir;
  }
  const Tokenizer tok = Tokenizer::from_dir(tok_dir);
  std::string text = o.prompt;
  if (o.chat) {
    std::vector<prep::ChatMessage> msgs;
    if (!o.system.empty()) msgs.push_back({"system", tok.normalize(o.system), std::nullopt});
    msgs.push_back({"user", tok.normalize(o.prompt), std::nullopt});
    text = prep::render_qwen3_generation_prompt(msgs, !o.no_think);
  }
  const std::vector<std::int32_t> prompt = tok.encode(text);
  const ModelConfig& cfg = src.cfg;
  for (std::int32_t id : prompt)
    if (id >= cfg.vocab_size)
      fail_user(
          "the prompt has token id {} ({}), outside the model's vocabulary of {}: tokenizer "
          "{} does not belong to this model",
          id, tok.decode(std::span(&id, 1)), cfg.vocab_size, tok_dir);
  if (static_cast<std::int64_t>(prompt.size()) >= cfg.max_position_embeddings)
    fail_user("the prompt has {} tokens; the model allows {} positions (max_position_embeddings)",
              prompt.size(), cfg.max_position_embeddings);
  const std::set<std::int32_t> stop = gen::stop_tokens(tok, src.side_dir, tok_dir);
  std::string stop_text;
  for (std::int32_t id : stop)
    if (id >= 0 && id < tok.vocab_size())
      stop_text += (stop_text.empty() ? "" : " ") + tok.decode(std::span(&id, 1));

  // The weights, the cache: room for the prompt and the new tokens, at most the model's positions.
  const std::int64_t room = cfg.max_position_embeddings - static_cast<std::int64_t>(prompt.size());
  const int cap = static_cast<int>(prompt.size() + std::min(room, o.max_new_tokens));
  check_host_memory_local(host_need(src, o.device == "cuda", prompt.size(), cap), "the model");
  const ParamLayout layout(cfg);
  std::vector<float> params = load_weights(src, layout, world);
  std::unique_ptr<gen::Decoder> dec_ptr;
  std::string where = "on the CPU, fp32";
#ifdef QTRAIN_HAVE_CUDA
  if (o.device == "cuda") {
    auto gpu = std::make_unique<gen::KvDecoderCuda>(cfg, params.data(), cap);
    // Warm-up, so that the timings below leave out one-time costs (kernel loading, cuBLASLt
    // set-up): a prefill and a decode step of one token, then the cache is forgotten.
    gpu->append(std::span(prompt.data(), 1));
    if (cap >= 2) gpu->append(std::span(prompt.data(), 1));
    gpu->reset();
    where = fmt::format("on {}, bf16, {:.2f} GiB of device memory", gpu->device_description(),
                        gpu->device_bytes() / double(1 << 30));
    dec_ptr = std::move(gpu);
    std::vector<float>().swap(params);  // the GPU holds its own bf16 copy
  }
#endif
  if (!dec_ptr) dec_ptr = std::make_unique<gen::KvDecoder>(cfg, params.data(), cap);
  gen::Decoder& dec = *dec_ptr;
  // Ids past the tokenizer's (the padding rows of Qwen3's 151936-row embedding) are never drawn.
  const int allowed = std::min(cfg.vocab_size, tok.vocab_size());
  std::fprintf(
      stderr,
      "qtrain generate: %s: %d layers, hidden %d, vocab %d, %.1fM parameters; loaded in "
      "%.1f s %s\nqtrain generate: tokenizer %s; prompt %zu tokens; %s; stops at %s or "
      "after %lld new tokens\n",
      src.describe.c_str(), cfg.num_layers, cfg.hidden_size, cfg.vocab_size, layout.numel() / 1e6,
      seconds_since(t_load), where.c_str(), tok_dir.c_str(), prompt.size(),
      o.temperature == 0
          ? "greedy"
          : fmt::format("temperature {} top-p {} seed {}", o.temperature, o.top_p, o.seed).c_str(),
      stop_text.empty() ? "(no stop token)" : stop_text.c_str(),
      static_cast<long long>(o.max_new_tokens));
  std::fflush(stderr);

  // Prefill in one pass, then one token at a time; text goes out as soon as it is whole UTF-8.
  gen::Sampler sampler(o.temperature, o.top_p, o.seed);
  const auto t0 = Clock::now();
  std::string pending;
  const gen::DecodeResult r =
      gen::decode(dec, sampler, prompt, o.max_new_tokens, stop, allowed, [&](std::int32_t t) {
        pending += tok.decode(std::span(&t, 1));
        const std::size_t n = gen::utf8_complete_prefix(pending);
        std::fwrite(pending.data(), 1, n, stdout);
        std::fflush(stdout);
        pending.erase(0, n);
      });
  const double t_prefill = r.prefill_s;
  const std::int64_t produced = r.produced;
  const std::string why =
      r.end == gen::DecodeEnd::kStopToken
          ? fmt::format("stopped at {}", tok.decode(std::span(&r.stop_token, 1)))
      : r.end == gen::DecodeEnd::kMaxNewTokens
          ? fmt::format("stopped after --max-new-tokens {}", o.max_new_tokens)
          : fmt::format("stopped at the model's {} positions", cfg.max_position_embeddings);
  if (!pending.empty()) std::fputs("\xEF\xBF\xBD", stdout);  // an unfinished UTF-8 sequence
  std::fputs("\n", stdout);
  std::fflush(stdout);
  const double t_all = seconds_since(t0);
  // Decode speed: the steps after the prefill (each a forward of one token, the draw and the
  // printing of its text), i.e. the new tokens past the first.
  std::fprintf(stderr,
               "qtrain generate: %lld new tokens, %s; prefill %zu tokens in %.3f s (%.1f "
               "tokens/s), decode %.1f tokens/s\n",
               static_cast<long long>(produced), why.c_str(), prompt.size(), t_prefill,
               prompt.size() / std::max(t_prefill, 1e-9),
               produced > 1 ? (produced - 1) / std::max(t_all - t_prefill, 1e-9) : 0.0);
  return 0;
}

}  // namespace

namespace gen {

std::size_t utf8_complete_prefix(std::string_view s) {
  const std::size_t n = s.size();
  for (std::size_t back = 1; back <= 4 && back <= n; ++back) {
    const auto b = static_cast<unsigned char>(s[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const std::size_t need = b < 0x80             ? 1
                             : (b & 0xE0) == 0xC0 ? 2
                             : (b & 0xF0) == 0xE0 ? 3
                             : (b & 0xF8) == 0xF0 ? 4
                                                  : 1;  // invalid lead
    return back < need ? n - back : n;
  }
  return n;  // only continuation bytes at the end: invalid, print them
}

}  // namespace gen

int generate_main(int argc, char** argv, std::shared_ptr<MpiComm> world) {
  const bool root = world->rank() == 0;
  try {
    const Options o = parse_options(argc, argv);
    if (o.help) {
      if (root) {
        Options dummy;
        std::ostringstream ss;
        ss << option_table(dummy);
        std::printf(
            "%s\nThe generated text goes to stdout as it is decoded; model and timing lines go to "
            "stderr.\nOne process, not several MPI ranks; --device cuda needs a CUDA build. "
            "docs/generate.md.\n",
            ss.str().c_str());
      }
      return 0;
    }
    return run(o, world);
  } catch (const UserError& e) {
    if (root) std::fprintf(stderr, "qtrain generate: error: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace qt
