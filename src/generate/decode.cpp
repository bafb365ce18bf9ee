// The shared decoding loop and stop tokens (decode.h).
#include "generate/decode.h"

#include <chrono>
#include <filesystem>

#include "io/json_file.h"

namespace qt::gen {

DecodeResult decode(Decoder& dec, Sampler& sampler, std::span<const std::int32_t> prompt,
                    std::int64_t max_new_tokens, const std::set<std::int32_t>& stop, int allowed,
                    const std::function<void(std::int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  DecodeResult r;
  const auto t0 = Clock::now();
  const float* logits = dec.append(prompt);
  r.prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (;;) {
    const std::int32_t t = sampler.next(logits, allowed);
    if (stop.count(t)) {
      r.end = DecodeEnd::kStopToken;
      r.stop_token = t;
      return r;
    }
    on_token(t);
    if (++r.produced == max_new_tokens) {
      r.end = DecodeEnd::kMaxNewTokens;
      return r;
    }
    if (dec.length() == dec.capacity()) {
      r.end = DecodeEnd::kCapacity;
      return r;
    }
    logits = dec.append(std::span(&t, 1));
  }
}

std::vector<std::int32_t> json_ids(const nlohmann::json& e) {
  std::vector<std::int32_t> ids;
  if (e.is_number_integer()) ids.push_back(e.get<std::int32_t>());
  if (e.is_array())
    for (const nlohmann::json& v : e)
      if (v.is_number_integer()) ids.push_back(v.get<std::int32_t>());
  return ids;
}

std::vector<std::int32_t> eos_ids_of(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return {};
  const nlohmann::json j = io::read_json_file(path);
  return j.is_object() && j.contains("eos_token_id") ? json_ids(j["eos_token_id"])
                                                     : std::vector<std::int32_t>{};
}

std::set<std::int32_t> stop_tokens(const Tokenizer& tok, const std::string& model_dir,
                                   const std::string& tok_dir) {
  namespace fs = std::filesystem;
  std::set<std::int32_t> stop;
  for (const char* t : {"<|im_end|>", "<|endoftext|>"})
    if (auto id = tok.token_id(t)) stop.insert(*id);
  if (!tok.eos_token().empty())
    if (auto id = tok.token_id(tok.eos_token())) stop.insert(*id);
  std::vector<std::string> files;
  if (!model_dir.empty())
    for (const char* f : {"config.json", "generation_config.json"})
      files.push_back((fs::path(model_dir) / f).string());
  if (!tok_dir.empty()) files.push_back((fs::path(tok_dir) / "generation_config.json").string());
  for (const std::string& f : files)
    for (std::int32_t id : eos_ids_of(f)) stop.insert(id);
  return stop;
}

}  // namespace qt::gen
