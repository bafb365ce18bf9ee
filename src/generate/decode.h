// The decoding loop that `qtrain generate` (generate.cpp) and the evaluation's samples
// (train/evaluation.cpp) share: the prompt in one pass (prefill), then one token at a time until
// a stop token, max_new_tokens new tokens, or a full cache. Also the stop tokens of a model.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "generate/kv_decoder.h"
#include "generate/sampler.h"
#include "qtrain/tokenizer.h"

namespace qt::gen {

enum class DecodeEnd { kStopToken, kMaxNewTokens, kCapacity };

struct DecodeResult {
  std::int64_t produced = 0;  // new tokens passed to on_token (a stop token is not one)
  DecodeEnd end = DecodeEnd::kMaxNewTokens;
  std::int32_t stop_token = -1;  // kStopToken: the token drawn
  double prefill_s = 0;          // seconds of the prompt's pass
};

// Appends `prompt` (>= 1 token) to `dec` (empty or not), then draws with `sampler` among the
// first `allowed` logits: a token in `stop` ends; any other goes to on_token and, unless it is
// the max_new_tokens-th or the cache is full, is appended for the next draw.
DecodeResult decode(Decoder& dec, Sampler& sampler, std::span<const std::int32_t> prompt,
                    std::int64_t max_new_tokens, const std::set<std::int32_t>& stop, int allowed,
                    const std::function<void(std::int32_t)>& on_token);

// The ids of a token-id field of a JSON file: an integer or a list of them (null or absent: none).
std::vector<std::int32_t> json_ids(const nlohmann::json& e);

// The eos_token_id ids of the JSON file `path` (none when it does not exist); UserError when it
// is not JSON.
std::vector<std::int32_t> eos_ids_of(const std::string& path);

// Where generation stops, for `qtrain generate` and the trainer's samples alike (one rule): the
// tokenizer's <|im_end|>, <|endoftext|> and eos token, the eos_token_id of config.json in
// `model_dir` (a Hugging Face model directory, or a checkpoint's model.init), and the eos ids of
// generation_config.json in `model_dir` and `tok_dir` (a "" directory is skipped).
std::set<std::int32_t> stop_tokens(const Tokenizer& tok, const std::string& model_dir,
                                   const std::string& tok_dir);

}  // namespace qt::gen
