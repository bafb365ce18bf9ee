// `qtrain prep` (prep.h, docs/prep.md). The input files, concatenated, are cut into one byte
// range per rank; a line belongs to the rank whose range holds its first byte (with --format
// plain, a record: the lines between two separator lines, by the byte where it starts). Each rank
// encodes its records in order and the token file is written by all ranks (prep/output.h), rank
// r's documents after those of ranks < r, so the file does not depend on the number of ranks.
#include "prep/prep.h"

#include <glob.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <boost/program_options.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "prep/chat.h"
#include "prep/output.h"
#include "prep/records.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"
#include "qtrain/tokenizer.h"

namespace qt {

namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;
using prep::Format;
using prep::Skip;

constexpr int kSkipKinds = static_cast<int>(Skip::kCount);
constexpr std::size_t kExamplesPerRank = 8;  // first problems reported with file:line
constexpr std::size_t kExamplesShown = 8;

struct Options {
  std::string tokenizer, output, eos = "<|endoftext|>", format = "auto", separator;
  std::int64_t max_tokens = 0;
  bool truncate = false, help = false;
  double progress_s = 10.0;
  std::vector<std::string> inputs;
};

po::options_description option_table(Options& o) {
  po::options_description d(
      "usage: qtrain prep --tokenizer DIR --output FILE.h5 [options] FILE... (JSONL, or plain text "
      "with --format plain)");
  d.add_options()("help,h", po::bool_switch(&o.help), "print this help")(
      "tokenizer,t", po::value(&o.tokenizer),
      "tokenizer directory (tokenizer.json [+ tokenizer_config.json]) or tokenizer.json")(
      "output,o", po::value(&o.output), "token file to write (HDF5, docs/data.md)")(
      "format,f", po::value(&o.format)->default_value("auto"),
      "record form: auto | text | chat | instruction (JSONL), or plain: plain-text files, a "
      "record = the lines between --separator lines")(
      "separator", po::value(&o.separator)->default_value(""),
      "with --format plain: the line that separates records, e.g. % (default: an empty line)")(
      "max-tokens", po::value(&o.max_tokens)->default_value(0),
      "records with more tokens are skipped (or cut with --truncate); 0 = no limit")(
      "truncate", po::bool_switch(&o.truncate), "cut records longer than --max-tokens")(
      "eos", po::value(&o.eos)->default_value("<|endoftext|>"), "token that ends each text record")(
      "progress", po::value(&o.progress_s)->default_value(10.0),
      "seconds between progress lines (rank 0); 0 = none");
  return d;
}

Options parse_options(int argc, char** argv) {
  Options o;
  po::options_description d = option_table(o);
  po::options_description all;
  all.add(d).add_options()("input", po::value(&o.inputs));
  po::positional_options_description pos;
  pos.add("input", -1);
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(all).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    fail_user("{} (qtrain prep --help lists the options)", e.what());
  }
  if (o.help) return o;
  if (o.tokenizer.empty()) fail_user("--tokenizer is required");
  if (o.output.empty()) fail_user("--output is required");
  if (o.inputs.empty()) fail_user("no input file given");
  if (o.max_tokens < 0) fail_user("--max-tokens must be >= 0, got {}", o.max_tokens);
  if (o.truncate && o.max_tokens == 0) fail_user("--truncate needs --max-tokens");
  if (o.format != "plain" && !o.separator.empty()) fail_user("--separator needs --format plain");
  if (o.separator.find_first_of("\r\n") != std::string::npos)
    fail_user("--separator must be one line (no line break)");
  return o;
}

Format parse_format(const std::string& s) {
  if (s == "auto") return Format::kAuto;
  if (s == "text") return Format::kText;
  if (s == "chat") return Format::kChat;
  if (s == "instruction") return Format::kInstruction;
  if (s == "plain") return Format::kText;  // the records of plain-text files are texts
  fail_user("--format {}: expected auto, text, chat, instruction or plain", s);
}

// Input paths in order; a path that does not exist but holds a wildcard is expanded (sorted).
std::vector<std::string> expand_inputs(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const std::string& a : args) {
    if (!fs::exists(a, ec) && a.find_first_of("*?[") != std::string::npos) {
      glob_t g{};
      const int rc = glob(a.c_str(), 0, nullptr, &g);
      if (rc == 0)
        for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
      globfree(&g);
      if (rc != 0) fail_user("input {}: no file matches", a);
      continue;
    }
    if (!fs::exists(a, ec)) fail_user("input file {}: no such file", a);
    if (fs::is_directory(a, ec)) fail_user("input file {}: is a directory", a);
    out.push_back(a);
  }
  return out;
}

struct Example {
  int file = 0;
  std::int64_t line = 0;  // index among this rank's lines of that file
  Skip reason = Skip::kNone;
  std::string detail;
};

// What one rank made of its share.
struct Local {
  std::vector<std::int32_t> tokens;
  std::vector<std::uint8_t> mask;
  std::vector<std::int64_t> doc_len;
  std::array<std::int64_t, kSkipKinds> counts{};  // by Skip; kNone = documents
  std::int64_t truncated = 0, trained = 0, repaired = 0;  // documents cut, tokens, UTF-8 fixed
  std::vector<std::int64_t> lines;  // lines owned, per file
  std::vector<Example> examples;
};

// Progress lines of rank 0 (its own share; the other ranks work alike).
class Progress {
 public:
  Progress(bool on, double every_s, std::int64_t share_bytes, int ranks)
      : on_(on && every_s > 0), every_(every_s), share_(share_bytes), ranks_(ranks) {}
  void tick(std::int64_t bytes_done, const Local& l) {
    if (!on_ || ++calls_ % 64 != 0) return;
    const double t = seconds();
    if (t - last_ < every_) return;
    last_ = t;
    const std::int64_t recs = std::accumulate(l.counts.begin(), l.counts.end(), std::int64_t{0});
    std::printf(
        "qtrain prep: rank 0 %.0f%% of its %.1f MB, %lld records, %lld tokens; %.0f records/s, "
        "%.0f tokens/s per rank (%d ranks)\n",
        share_ > 0 ? 100.0 * bytes_done / share_ : 100.0, share_ / 1e6,
        static_cast<long long>(recs), static_cast<long long>(l.tokens.size()), recs / t,
        l.tokens.size() / t, ranks_);
    std::fflush(stdout);
  }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  bool on_;
  double every_;
  std::int64_t share_;
  int ranks_;
  std::int64_t calls_ = 0;
  double last_ = 0;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// Encodes the lines of `path` that start in [lo, hi).
void encode_range(const std::string& path, int file, std::int64_t lo, std::int64_t hi,
                  prep::RecordEncoder& enc, Local& l, Progress& progress, std::int64_t& done) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_user("input file {}: cannot open it for reading", path);
  std::int64_t pos = lo;
  std::string line;
  if (lo > 0) {  // the line running through lo belongs to the previous range unless it starts there
    in.seekg(lo - 1);
    char c = 0;
    in.get(c);
    if (c != '\n') {
      std::getline(in, line);
      pos += static_cast<std::int64_t>(line.size()) + 1;
    }
  }
  while (pos < hi && std::getline(in, line)) {
    const std::int64_t start = pos;
    pos += static_cast<std::int64_t>(line.size()) + 1;
    const std::size_t before = l.tokens.size();
    const prep::RecordResult r = enc.add(line, l.tokens, l.mask);
    ++l.counts[static_cast<int>(r.skip)];
    if (r.skip == Skip::kNone) {
      l.doc_len.push_back(static_cast<std::int64_t>(l.tokens.size() - before));
      l.truncated += r.truncated ? 1 : 0;
      l.repaired += r.repaired ? 1 : 0;
      for (std::size_t k = before; k < l.mask.size(); ++k) l.trained += l.mask[k];
    } else if (r.skip != Skip::kEmpty && r.skip != Skip::kTooLong &&
               l.examples.size() < kExamplesPerRank) {
      l.examples.push_back({file, l.lines[file], r.skip, r.detail});
    }
    ++l.lines[file];
    done += pos - start;
    progress.tick(done, l);
  }
  if (in.bad()) fail_user("input file {}: read error ({})", path, std::strerror(errno));
}

// Plain text: is the line that ends just before byte `at` (at > 0, byte at - 1 is '\n') the
// separator (a trailing '\r' ignored)?
bool line_before_is_separator(std::ifstream& in, std::int64_t at, const std::string& sep) {
  const std::int64_t end = at - 1;  // the '\n' ending that line
  const std::int64_t from =
      std::max<std::int64_t>(0, end - static_cast<std::int64_t>(sep.size()) - 2);
  std::string buf(static_cast<std::size_t>(end - from), '\0');
  in.clear();
  in.seekg(from);
  in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
  const std::size_t nl = buf.rfind('\n');
  if (nl == std::string::npos && from > 0) return false;  // longer than the separator
  std::string line = nl == std::string::npos ? buf : buf.substr(nl + 1);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return line == sep;
}

// Plain text: encodes the records of `path` that start in [lo, hi). A record is a run of one or
// more lines between separator lines (or the file's ends), joined by '\n' without a final one,
// trailing '\r's dropped; it starts at byte 0 or just after a separator line. A record of blank
// lines only is counted as empty.
void encode_plain_range(const std::string& path, std::int64_t lo, std::int64_t hi,
                        const std::string& sep, prep::RecordEncoder& enc, Local& l,
                        Progress& progress, std::int64_t& done) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_user("input file {}: cannot open it for reading", path);
  // The first line start at or after lo, and whether a record starts there.
  std::int64_t pos = lo;
  std::string line;
  if (lo > 0) {
    in.seekg(lo - 1);
    char c = 0;
    in.get(c);
    if (c != '\n') {
      std::getline(in, line);
      pos += static_cast<std::int64_t>(line.size()) + 1;
    }
  }
  bool mine = pos < hi && (pos == 0 || line_before_is_separator(in, pos, sep));
  in.clear();
  in.seekg(pos);
  std::string text;
  std::int64_t lines = 0;  // lines of the current record
  auto finish = [&]() {
    if (mine && lines > 0) {
      const std::size_t before = l.tokens.size();
      const prep::RecordResult r = text.find_first_not_of(" \t\n\r\f\v") == std::string::npos
                                       ? prep::RecordResult{Skip::kEmpty, "blank record", false}
                                       : enc.add_text(text, l.tokens, l.mask);
      ++l.counts[static_cast<int>(r.skip)];
      if (r.skip == Skip::kNone) {
        l.doc_len.push_back(static_cast<std::int64_t>(l.tokens.size() - before));
        l.truncated += r.truncated ? 1 : 0;
        l.repaired += r.repaired ? 1 : 0;
        l.trained += static_cast<std::int64_t>(l.tokens.size() - before);
      }
      progress.tick(done, l);
    }
    text.clear();
    lines = 0;
  };
  while (std::getline(in, line)) {
    const std::int64_t start = pos;
    pos += static_cast<std::int64_t>(line.size()) + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (mine) done += pos - start;
    if (line == sep) {
      finish();
      mine = pos < hi;  // the next record starts at pos: ours when before hi
      if (!mine) break;
      continue;
    }
    if (mine) {
      if (lines++ > 0) text += '\n';
      text += line;
    }
  }
  if (in.bad()) fail_user("input file {}: read error ({})", path, std::strerror(errno));
  finish();
}

// 1234567 -> "1.23M"; bytes -> "5.2 MB".
std::string human(std::int64_t n) {
  if (n >= 1'000'000) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 10'000) return fmt::format("{:.1f}k", n / 1e3);
  return std::to_string(n);
}
std::string human_bytes(std::int64_t n) {
  if (n >= 1'000'000'000) return fmt::format("{:.2f} GB", n / 1e9);
  if (n >= 1'000'000) return fmt::format("{:.1f} MB", n / 1e6);
  if (n >= 1'000) return fmt::format("{:.1f} kB", n / 1e3);
  return fmt::format("{} bytes", n);
}

int run(const Options& o, MpiComm& world, PrepStats* stats) {
  const bool root = world.rank() == 0;
  const Format format = parse_format(o.format);
  const bool plain = o.format == "plain";
  const std::vector<std::string> files = expand_inputs(o.inputs);
  agree(world, root ? prep::output_problem(o.output, files, o.tokenizer) : "");
  std::error_code ec;

  const Tokenizer tok = Tokenizer::from_dir(o.tokenizer);
  if (root && format != Format::kText && !tok.chat_template().empty() &&
      !prep::is_qwen3_chat_template(tok.chat_template()))
    std::printf(
        "qtrain prep: warning: the chat template of %s is not Qwen3's; chat records are "
        "rendered with Qwen3's ChatML template (docs/prep.md)\n",
        o.tokenizer.c_str());
  prep::RecordEncoder enc(tok, format, o.max_tokens, o.truncate, o.eos);

  // This rank's byte range of the concatenated inputs.
  std::vector<std::int64_t> size(files.size()), base(files.size() + 1, 0);
  for (std::size_t f = 0; f < files.size(); ++f) {
    size[f] = static_cast<std::int64_t>(fs::file_size(files[f], ec));
    if (ec) fail_user("input file {}: cannot read its size ({})", files[f], ec.message());
    base[f + 1] = base[f] + size[f];
  }
  const std::int64_t S = base.back(), P = world.size(), me = world.rank();
  const std::int64_t lo = S / P * me + std::min(S % P, me);
  const std::int64_t hi = S / P * (me + 1) + std::min(S % P, me + 1);

  Local l;
  l.lines.assign(files.size(), 0);
  Progress progress(root, o.progress_s, hi - lo, static_cast<int>(P));
  std::int64_t done = 0;
  // A file that only some ranks read may fail on those alone (unreadable, an I/O error): every
  // rank learns of it before the next collective.
  std::string read_error;
  try {
    for (std::size_t f = 0; f < files.size(); ++f) {
      const std::int64_t a = std::max(lo, base[f]), b = std::min(hi, base[f + 1]);
      if (a < b && plain)
        encode_plain_range(files[f], a - base[f], b - base[f], o.separator, enc, l, progress,
                           done);
      else if (a < b)
        encode_range(files[f], static_cast<int>(f), a - base[f], b - base[f], enc, l, progress,
                     done);
    }
  } catch (const UserError& e) {
    read_error = e.what();
  }
  agree(world, read_error);

  // Totals (records by Skip, then the counts below), and the line numbers of the first problems.
  enum { kTruncated = kSkipKinds, kTrained, kTokens, kRepaired, kTotals };
  std::vector<std::int64_t> totals(l.counts.begin(), l.counts.end());
  totals.resize(kTotals);
  totals[kTruncated] = l.truncated;
  totals[kTrained] = l.trained;
  totals[kTokens] = static_cast<std::int64_t>(l.tokens.size());
  totals[kRepaired] = l.repaired;
  world.all_reduce(totals.data(), totals.size(), DType::kI64, ReduceOp::kSum);
  const std::size_t F = files.size();
  std::vector<std::int64_t> lines(F * P);
  std::copy(l.lines.begin(), l.lines.end(), lines.begin() + static_cast<std::ptrdiff_t>(F * me));
  world.all_gather(lines.data() + F * me, lines.data(), F, DType::kI64);
  std::string mine;
  for (const Example& e : l.examples) {
    std::int64_t line = e.line + 1;
    for (std::int64_t r = 0; r < me; ++r) line += lines[F * r + e.file];
    mine +=
        fmt::format("{}:{}: {}: {}\n", files[e.file], line, prep::skip_name(e.reason), e.detail);
  }
  const std::vector<std::string> examples = gather_strings(mine, world);

  const std::int64_t docs = totals[0], tokens = totals[kTokens];
  std::int64_t records = 0;
  for (int k = 0; k < kSkipKinds; ++k) records += totals[k];
  std::vector<std::string> shown;
  if (root) {
    std::string skipped;
    for (int k = 1; k < kSkipKinds; ++k)
      if (totals[k] > 0)
        skipped += fmt::format("{}{} {}", skipped.empty() ? "" : ", ", totals[k],
                               prep::skip_name(static_cast<Skip>(k)));
    std::printf(
        "qtrain prep: %zu file(s), %s, %s records -> %s documents, %s tokens (%s in the loss)\n",
        files.size(), human_bytes(S).c_str(), human(records).c_str(), human(docs).c_str(),
        human(tokens).c_str(), human(totals[kTrained]).c_str());
    if (!skipped.empty())
      std::printf("qtrain prep: skipped %lld record(s): %s%s\n",
                  static_cast<long long>(records - docs), skipped.c_str(),
                  totals[static_cast<int>(Skip::kTooLong)] > 0
                      ? fmt::format(" (more than {} tokens)", o.max_tokens).c_str()
                      : "");
    if (totals[kTruncated] > 0)
      std::printf("qtrain prep: truncated %lld record(s) to %lld tokens\n",
                  static_cast<long long>(totals[kTruncated]), static_cast<long long>(o.max_tokens));
    if (totals[kRepaired] > 0)
      std::printf("qtrain prep: replaced invalid UTF-8 by U+FFFD in %lld record(s)\n",
                  static_cast<long long>(totals[kRepaired]));
    for (const std::string& s : examples) {
      for (std::size_t p = 0; p < s.size() && shown.size() < kExamplesShown;) {
        const std::size_t q = s.find('\n', p);
        shown.push_back(s.substr(p, q - p));
        std::printf("  %s\n", shown.back().c_str());
        p = q + 1;
      }
    }
    std::fflush(stdout);
  }
  if (stats != nullptr) {
    *stats = PrepStats{records,
                       docs,
                       tokens,
                       totals[kTrained],
                       totals[kTruncated],
                       totals[kRepaired],
                       std::vector<std::int64_t>(totals.begin(), totals.begin() + kSkipKinds),
                       shown};
    stats->skipped[0] = 0;
  }
  if (docs == 0)
    fail_user("nothing usable: none of the {} record(s) in {} file(s) became a document", records,
              files.size());
  prep::write_token_file_parallel(o.output, {l.tokens, l.mask, l.doc_len}, tok.vocab_size(), world);
  if (root) {
    const double t = progress.seconds();
    std::printf(
        "qtrain prep: wrote %s (vocab_size %d) in %.1f s: %.0f tokens/s, %.1f MB/s on %lld "
        "rank(s)\n",
        o.output.c_str(), tok.vocab_size(), t, tokens / t, S / 1e6 / t, static_cast<long long>(P));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int prep_main(int argc, char** argv, MpiComm& world, PrepStats* stats) {
  const bool root = world.rank() == 0;
  try {
    const Options o = parse_options(argc, argv);
    if (o.help) {
      Options dummy;
      if (root) {
        std::ostringstream ss;
        ss << option_table(dummy);
        std::printf(
            "%s\nRecords (JSONL, one per line): {\"text\": ...} | {\"messages\": [{\"role\", "
            "\"content\"}, ...]} | {\"instruction\", \"input\", \"output\"}; or, with --format "
            "plain,\nplain text split at --separator lines. docs/prep.md.\n",
            ss.str().c_str());
      }
      return 0;
    }
    return run(o, world, stats);
  } catch (const UserError& e) {
    if (root) std::fprintf(stderr, "qtrain prep: error: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace qt
