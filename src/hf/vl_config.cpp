#include "hf/vl_config.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "hf/config.h"
#include "io/json_file.h"
#include "qtrain/error.h"

namespace qt::hf {

namespace {

using json = nlohmann::json;

const json& object_at(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) fail_user("{}: key \"{}\" is missing", where, key);
  if (!j[key].is_object()) fail_user("{}: \"{}\" is {}, expected an object", where, key, j[key].dump());
  return j[key];
}

VisionConfig parse_vision(const json& v, const std::string& where, int text_hidden) {
  VisionConfig c;
  if (present(v, "hidden_act") && v["hidden_act"] != "gelu_pytorch_tanh")
    fail_user("{}: \"hidden_act\" is {}; the Qwen3-VL vision blocks use gelu_pytorch_tanh", where,
              v["hidden_act"].dump());
  c.depth = get_int(v, "depth", where, std::nullopt);
  c.hidden_size = get_int(v, "hidden_size", where, std::nullopt);
  c.intermediate_size = get_int(v, "intermediate_size", where, std::nullopt);
  c.num_heads = get_int(v, "num_heads", where, std::nullopt);
  c.out_hidden_size = get_int(v, "out_hidden_size", where, std::nullopt);
  c.patch_size = get_int(v, "patch_size", where, 16);
  c.temporal_patch_size = get_int(v, "temporal_patch_size", where, 2);
  c.spatial_merge_size = get_int(v, "spatial_merge_size", where, 2);
  c.in_channels = get_int(v, "in_channels", where, 3);
  c.num_position_embeddings = get_int(v, "num_position_embeddings", where, 2304);
  if (!present(v, "deepstack_visual_indexes"))
    fail_user("{}: key \"deepstack_visual_indexes\" is missing", where);
  const json& ds = v["deepstack_visual_indexes"];
  if (!ds.is_array()) fail_user("{}: \"deepstack_visual_indexes\" is {}, expected a list", where, ds.dump());
  c.deepstack_visual_indexes.clear();
  for (const json& x : ds) {
    if (!x.is_number_integer() || x.get<std::int64_t>() < 0 || x.get<std::int64_t>() >= c.depth ||
        (!c.deepstack_visual_indexes.empty() &&
         x.get<std::int64_t>() <= c.deepstack_visual_indexes.back()))
      fail_user("{}: \"deepstack_visual_indexes\" is {}, expected ascending block indices of 0 .. "
                "{}, each once", where, ds.dump(), c.depth - 1);
    c.deepstack_visual_indexes.push_back(x.get<int>());
  }
  if (c.hidden_size % c.num_heads != 0 || c.head_dim() % 4 != 0)
    fail_user("{}: hidden_size {} over num_heads {} is not a head width that is a multiple of 4 "
              "(2-D RoPE turns quarters)", where, c.hidden_size, c.num_heads);
  const int side = static_cast<int>(std::lround(std::sqrt(c.num_position_embeddings)));
  if (side * side != c.num_position_embeddings)
    fail_user("{}: \"num_position_embeddings\" is {}, expected a square (a side x side table)",
              where, c.num_position_embeddings);
  if (c.out_hidden_size != text_hidden)
    fail_user("{}: \"out_hidden_size\" is {}, but the language model's hidden_size is {}", where,
              c.out_hidden_size, text_hidden);
  return c;
}

}  // namespace

bool is_vl_config_text(const std::string& text, const std::string& where) {
  const json j = io::parse_json(text, where);
  return j.is_object() && present(j, "model_type") &&
         (j["model_type"] == "qwen3_vl" || j["model_type"] == "qwen3_vl_moe");
}

VlConfig parse_vl_config(const std::string& text, const std::string& where) {
  const json j = io::parse_json(text, where);
  if (!j.is_object()) fail_user("{}: not a JSON object", where);
  const std::string kWant =
      "expected a Qwen3-VL model: model_type \"qwen3_vl\" (Qwen3VLForConditionalGeneration) or "
      "\"qwen3_vl_moe\" (Qwen3VLMoeForConditionalGeneration)";
  if (!present(j, "model_type")) fail_user("{}: key \"model_type\" is missing; {}", where, kWant);
  const bool moe = j["model_type"] == "qwen3_vl_moe";
  if (!moe && j["model_type"] != "qwen3_vl")
    fail_user("{}: model_type is {}; {}", where, j["model_type"].dump(), kWant);
  if (present(j, "architectures")) {
    const char* arch = moe ? "Qwen3VLMoeForConditionalGeneration" : "Qwen3VLForConditionalGeneration";
    const json& a = j["architectures"];
    bool ok = a.is_array() && !a.empty();
    for (const json& x : a) ok = ok && x == arch;
    if (!ok) fail_user("{}: architectures is {}; {}", where, a.dump(), kWant);
  }
  VlConfig c;
  const json& tj = object_at(j, "text_config", where);
  c.text = parse_text_config(tj, where + " text_config", {moe, true, &c.mrope_section});
  if (moe) c.text.norm_topk_prob = true;  // Qwen3VLMoeTextTopKRouter always renormalises
  // tie_word_embeddings: at the top (transformers reads it there) and perhaps in text_config.
  const bool tie_top = get_bool(j, "tie_word_embeddings", where, false);
  const bool tie_text = get_bool(tj, "tie_word_embeddings", where, false);
  if (present(j, "tie_word_embeddings") && present(tj, "tie_word_embeddings") && tie_top != tie_text)
    fail_user("{}: tie_word_embeddings is {} at the top but {} in text_config", where, tie_top,
              tie_text);
  c.text.tie_word_embeddings = present(j, "tie_word_embeddings") ? tie_top : tie_text;
  const int half = c.text.head_dim / 2;
  if (c.mrope_section[0] + c.mrope_section[1] + c.mrope_section[2] != half)
    fail_user("{}: text_config's mrope_section [{}, {}, {}] does not add up to head_dim / 2 = {} "
              "frequency slots", where, c.mrope_section[0], c.mrope_section[1],
              c.mrope_section[2], half);
  c.vision = parse_vision(object_at(j, "vision_config", where), where + " vision_config",
                          c.text.hidden_size);
  if (static_cast<int>(c.vision.deepstack_visual_indexes.size()) > c.text.num_layers)
    fail_user("{}: {} deepstack features are added to the first language layers, but there are "
              "only {}", where, c.vision.deepstack_visual_indexes.size(), c.text.num_layers);
  c.image_token_id = get_int(j, "image_token_id", where, c.image_token_id);
  c.video_token_id = get_int(j, "video_token_id", where, c.video_token_id);
  c.vision_start_token_id = get_int(j, "vision_start_token_id", where, c.vision_start_token_id);
  c.vision_end_token_id = get_int(j, "vision_end_token_id", where, c.vision_end_token_id);
  for (const auto& [name, id] : {std::pair{"image_token_id", c.image_token_id},
                                 std::pair{"video_token_id", c.video_token_id},
                                 std::pair{"vision_start_token_id", c.vision_start_token_id},
                                 std::pair{"vision_end_token_id", c.vision_end_token_id}})
    if (id >= c.text.vocab_size)
      fail_user("{}: {} {} is outside the vocabulary (vocab_size {})", where, name, id,
                c.text.vocab_size);
  return c;
}

VlConfig read_vl_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  return parse_vl_config(io::read_text_file(path), path);
}

}  // namespace qt::hf
