// Helpers of the `qtrain generate` end-to-end tests (tests/generate/test_generate_cli.cpp on the
// CPU, tests/gpu/test_generate_cuda_cli.cpp on the GPU): the command run in process with its
// output captured, what it must print, and the random weights of their small models.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "generate/generate.h"
#include "generate/sampler.h"
#include "hf/export.h"
#include "hf/weights.h"
#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/mesh.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/tokenizer.h"
#include "support/random.h"

namespace qt::test {

inline std::shared_ptr<MpiComm> world_comm() {
  return std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
}

struct CliRun {
  int rc;
  std::string out, err;
};

// generate_main with `args` (after "generate"), stdout and stderr captured.
inline CliRun run_generate(std::vector<std::string> args) {
  args.insert(args.begin(), "generate");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int rc = generate_main(static_cast<int>(argv.size()), argv.data(), world_comm());
  std::string out = testing::internal::GetCapturedStdout();
  std::string err = testing::internal::GetCapturedStderr();
  return {rc, out, err};
}

// What the command must print: `dec` (a fresh decoder with room for the prompt and max_new
// tokens: gen::KvDecoder or gen::KvDecoderCuda) + gen::Sampler until a stop token or max_new,
// whole UTF-8 (a dangling tail as U+FFFD), then a newline.
template <class Decoder>
std::string expected_generation(Decoder& dec, const Tokenizer& tok, const std::string& prompt_text,
                                double temperature, double top_p, std::uint64_t seed,
                                int max_new) {
  const std::vector<std::int32_t> prompt = tok.encode(prompt_text);
  const std::set<std::int32_t> stop = {*tok.token_id("<|im_end|>"),
                                       *tok.token_id("<|endoftext|>")};
  gen::Sampler s(temperature, top_p, seed);
  const float* logits = dec.append(prompt);
  std::string bytes;
  for (int k = 0; k < max_new; ++k) {
    const std::int32_t t = s.next(logits, tok.vocab_size());
    if (stop.count(t)) break;
    bytes += tok.decode(std::span(&t, 1));
    if (k + 1 < max_new) logits = dec.append(std::span(&t, 1));
  }
  const std::size_t whole = gen::utf8_complete_prefix(bytes);
  return bytes.substr(0, whole) + (whole < bytes.size() ? "\xEF\xBF\xBD" : "") + "\n";
}

// Weights of N(0, 0.5), norm weights 1 + N(0, 0.1): logits spread enough that greedy choices
// are clear.
inline std::vector<float> generation_weights(const ModelConfig& c, std::mt19937_64& rng) {
  const ParamLayout layout(c);
  std::vector<float> p = random_vector<float>(layout.numel(), rng, 0.5);
  for (const ParamInfo& info : layout.params())
    if (info.shape.size() == 1)
      for (std::size_t i = 0; i < info.numel; ++i) p[info.offset + i] = 1.0f + 0.2f * p[info.offset + i];
  return p;
}

// A Hugging Face directory `dir` of the weights (bf16) with the named files of tok_dir (the
// tokenizer); params becomes what the directory holds (bf16-rounded).
inline void write_hf_model(const std::filesystem::path& dir, const ModelConfig& c,
                           std::vector<float>& params, const std::filesystem::path& tok_dir,
                           const std::vector<std::string>& tok_files) {
  std::filesystem::create_directories(dir);
  const ParamLayout layout(c);
  hf::write_model_dir(dir.string(), c, layout, params.data(), 5'000'000'000, hf::default_extras(c),
                      "");
  for (const std::string& f : tok_files) std::filesystem::copy_file(tok_dir / f, dir / f);
  hf::load_params(dir.string(), layout, hf::all_rows(layout, params.data()), c.tie_word_embeddings,
                  *world_comm());
}

// A whole-model qtrain checkpoint (fp32, zero moments) of params at `step`, written as training
// writes it into the checkpoint directory `dir`.
inline void write_model_checkpoint(const std::filesystem::path& dir, const ModelConfig& c,
                                   const std::vector<float>& params, std::int64_t step) {
  const ParamLayout layout(c);
  std::vector<float> zeros(layout.numel(), 0.0f);
  Mesh mesh(MeshShape{}, world_comm());
  TrainState st;
  st.step = step;
  checkpoint_write(checkpoint_path(dir.string(), step), mesh, layout, params.data(),
                   MomentShard{{0, layout.numel()}, zeros.data(), zeros.data()}, st, c, "");
}

}  // namespace qt::test
