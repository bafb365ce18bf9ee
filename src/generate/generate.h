// `qtrain generate <model> --prompt TEXT`: text from a qtrain checkpoint or a Hugging Face Qwen3
// directory, with a key/value cache, on the CPU (KvDecoder, fp32) or with --device cuda on one
// GPU (KvDecoderCuda, bf16; a CPU-only build refuses it with exit 2) (docs/generate.md). Greedy
// or top-p sampling; --chat renders the prompt with Qwen3's chat template; the text is streamed
// to stdout as it is decoded. One process: under mpirun with more than one rank it refuses (exit
// 2 on every rank).
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

namespace qt {

class MpiComm;

// argv[0] is "generate"; then the model path and options (--help lists them). Returns the exit
// code: 0, or 2 (kExitBadInput) after rank 0 printed "qtrain generate: error: ...".
int generate_main(int argc, char** argv, std::shared_ptr<MpiComm> world);

namespace gen {

// How many leading bytes of `bytes` can be printed now: all, except a trailing UTF-8 sequence
// that is still incomplete (a lead byte followed by fewer continuation bytes than it announces,
// at most 3 bytes held back). Invalid bytes are not held back.
std::size_t utf8_complete_prefix(std::string_view bytes);

}  // namespace gen
}  // namespace qt
